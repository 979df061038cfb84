"""The checkpoint manager (`CheckpointManager`): save, load, resolve which checkpoint to resume
from, and verify on the way. It saves and resumes everything a run needs: model weights,
optimizer, LR scheduler, trainer state (step, data loader position, KL controller ...) and every
rank's RNG states.

Layout of `root_dir`:

    global_step_{N}/
        {worker}/                  Megatron dist_checkpointing directory per worker ("actor", ...):
                                   model chunks, optimizer state, LR scheduler
        rng/rank_{r}.pt            python / numpy / torch (+ CUDA) / Megatron-tracker RNG states
        trainer_state.pt           the trainer's dict (rank 0)
        meta.json                  step, world size, layout, workers, what was saved
        manifest.json              size + CRC-32 of every other file (written last)
    latest_checkpointed_iteration.txt   the newest step (verl's name), replaced atomically

Verified (files.py): before the manifest is written every file is fsynced
(each node syncs what it wrote); the checksums are computed by all ranks, each a share of the
files. Loading checks the manifest: sizes always, checksums unless verify="size". resume_mode
auto takes the newest checkpoint that passes and falls back, with a warning, past a damaged
or incomplete one. Nothing is unpickled beyond torch.load(weights_only=True): numpy values
(numpy's RNG state, in the trainer state too) are stored as tensors and restored as numpy.
A model or optimizer holding NaN / Inf is never saved (NonFiniteError, nothing written).

Atomicity: everything is written into `.tmp-step_{N}` and renamed to `global_step_{N}` by rank 0
only after every rank finished writing and the manifest is on disk. A crash at any point (even
SIGKILL) leaves earlier checkpoints untouched; a directory is a checkpoint only under its final
name, and a leftover `.tmp-*` is ignored by `latest()` and removed by the next `save()`.
All ranks must see the same filesystem (as dist_checkpointing itself requires).

Resharding: model weights load at any TP/PP/DP layout (dist_checkpointing stores global
tensors; tested TP=2 -> TP=1). The distributed optimizer is saved in Megatron's
`dp_reshardable` form: by Megatron's contract it resumes at another DP size (not exercised by
the 2-rank tests) but needs the same TP/PP. To change TP/PP, load with `load_optimizer=False`
(weights only; Adam restarts). megatron-core 0.16's other forms do not work here:
`fully_sharded_model_space` fails to build ("flattened_range is not supported") and
`fully_reshardable` fails to load into torch Adam (KeyError 'step').

What a worker and a rank contribute (model / optimizer state, RNG) and the checks on them are in
state.py; the files' integrity (manifest, fsync, safe pickles) and the collective helpers in files.py.

Tests: tests/test_checkpoint.py, tests/test_checkpoint_verify.py, tests/test_resume_rng.py,
tests/test_lora.py, tests/test_config_acts.py, tests/test_bad_inputs.py
"""
import json
import logging
import os
import re
import shutil
from typing import Dict, Optional

import torch
import torch.distributed as dist

from engine.checkpoint.files import (MANIFEST_FILE, META_FILE, TMP_PREFIX, VERIFY_LEVELS,
                                     CheckpointError, barrier, fsync_dir, load_safe, make_durable,
                                     manifest_entries, on_rank0_then_share, resume_path_problem,
                                     save_safe, verify_checkpoint, world, write_atomic,
                                     write_manifest)
from engine.checkpoint.state import (adam_step, check_finite, check_worker_matches,
                                     create_optimizer_state, has_optimizer_state, lora_of,
                                     model_keys, model_sharded_state_dict, optim_metadata,
                                     parallel_layout, reseed_rng, restore_adam_steps, rng_state,
                                     set_rng_state)
from parallel import fsdp

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)

STEP_PREFIX = "global_step_"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
TRAINER_STATE_FILE = "trainer_state.pt"
RNG_DIR = "rng"
FORMAT_VERSION = 2  # 2: CRC-32 manifest, weights_only-safe pickles
RESUME_MODES = ("auto", "disable", "resume_path")
OPTIM_SHARDING = "dp_reshardable"
_WORKER_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def _in_process_write_results():
    """megatron's torch_dist writer returns each save's results through a queue it makes, once per
    process, from a *spawned* multiprocessing Manager: a fresh interpreter that re-imports
    __main__ (engine.train: torch, transformers; ~3.5 s CPU per rank, every run that saves). Our
    saves are synchronous (Strategy.save -> execute_sync): the results are put and read in this
    process, so a plain queue carries them."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if getattr(filesystem_async, "_results_queue", ()) is None:
        filesystem_async._results_queue = queue.Queue()


# -- the manager ------------------------------------------------------------------------------
class CheckpointManager:
    """Checkpoints under `root_dir`; collective: every rank calls `save` / `load` together.

    keep_last: keep this many newest checkpoints (None: all); older ones are deleted only
    after a new one is complete.
    verify: what loading checks against the manifest: "checksum" (sizes and checksums) or
    "size" (sizes only: for huge checkpoints on slow storage).
    """

    def __init__(self, root_dir: str, keep_last: Optional[int] = None, rank: Optional[int] = None,
                 verify: str = "checksum"):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last!r}: keep at least 1 checkpoint, or None for all "
                             "(trainer.max_actor_ckpt_to_keep)")
        if verify not in VERIFY_LEVELS:
            raise ValueError(f"trainer.checkpoint_verify={verify!r}: use one of {VERIFY_LEVELS} "
                             "(checksum reads every file; size only compares lengths)")
        self.root_dir = os.path.abspath(root_dir)
        self.keep_last = keep_last
        self.verify = verify
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self._verified = {}  # path -> level, by resolve(), so load() does not read it all again

    def _level(self, verify):
        if verify is None:
            return self.verify
        if isinstance(verify, bool):  # the older boolean form: sizes are always checked
            return "checksum" if verify else "size"
        if verify not in VERIFY_LEVELS:
            raise ValueError(f"verify={verify!r}: use one of {VERIFY_LEVELS}")
        return verify

    def _check(self, path, level, just_verified_ok=False) -> Optional[str]:
        """Collective: the problem with the checkpoint at `path`, or None. A pass is remembered
        for the next load() only (resolve() then load() reads the files once); any other call
        verifies afresh."""
        if just_verified_ok and self._verified.pop(path, None) in (level, "checksum"):
            return None
        self._verified.pop(path, None)
        problem = verify_checkpoint(path, level)
        if problem is None:
            self._verified[path] = level
        return problem

    # -- finding checkpoints ------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return os.path.join(self.root_dir, f"{STEP_PREFIX}{step}")

    def complete_steps(self):
        """Steps of complete checkpoints (final name + manifest), ascending; not verified."""
        return self._step_dirs()[0]

    def latest(self) -> Optional[str]:
        """The newest complete checkpoint, or None. Directory listing, not the tracker file, is
        the truth: a crash between the rename and the tracker update loses nothing."""
        steps = self.complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    def _step_dirs(self):
        """(complete steps, names of final-named directories without a manifest)."""
        steps, incomplete = [], []
        if os.path.isdir(self.root_dir):
            for name in sorted(os.listdir(self.root_dir)):
                if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit():
                    if os.path.exists(os.path.join(self.root_dir, name, MANIFEST_FILE)):
                        steps.append(int(name[len(STEP_PREFIX):]))
                    else:
                        incomplete.append(name)
        return sorted(steps), incomplete

    def resolve(self, resume_mode: str, resume_from_path: Optional[str] = None,
                verify=None) -> Optional[str]:
        """`trainer.resume_mode`: auto -> the newest checkpoint that passes verification, past
        damaged or incomplete ones with a warning (None for a fresh run; CheckpointError when
        there are checkpoints but none is usable); disable -> None; resume_path ->
        `resume_from_path`, which must be a complete, undamaged checkpoint. Collective when
        torch.distributed is initialised (the verification is spread over the ranks)."""
        if resume_mode not in RESUME_MODES:
            raise ValueError(f"trainer.resume_mode={resume_mode!r}; use one of {RESUME_MODES}")
        if resume_mode == "disable":
            return None
        level = self._level(verify)
        if resume_mode == "auto":
            return self._newest_usable(level)
        if not resume_from_path:
            raise ValueError("trainer.resume_from_path is empty but trainer.resume_mode="
                             "'resume_path'; give the global_step_N directory to resume from")
        path = os.path.abspath(resume_from_path)
        problem = resume_path_problem(path)
        if problem:
            raise CheckpointError(f"trainer.resume_from_path={resume_from_path!r}: {problem}")
        problem = self._check(path, level)
        if problem:
            raise CheckpointError(f"trainer.resume_from_path={resume_from_path!r}: {problem}")
        return path

    def _newest_usable(self, level):
        steps, incomplete = on_rank0_then_share(self._step_dirs)
        if incomplete and self.rank == 0:
            logger.warning("checkpoint(s) %s under %s have no %s: incomplete saves, ignored",
                           incomplete, self.root_dir, MANIFEST_FILE)
        problems = []
        for step in reversed(steps):
            path = self.step_dir(step)
            problem = self._check(path, level)
            if problem is None:
                if problems and self.rank == 0:
                    logger.warning("resuming from %s, the newest usable checkpoint", path)
                return path
            problems.append(problem)
            if self.rank == 0:
                logger.warning("checkpoint %s is unusable, falling back to the previous one: %s",
                               path, problem)
        if problems or incomplete:
            first = problems[0] if problems else f"{incomplete} are incomplete"
            raise CheckpointError(f"no usable checkpoint under {self.root_dir!r} ({first}); "
                                  "restore or remove the damaged global_step_N directories, or set "
                                  "trainer.resume_mode=disable to start from scratch")
        return None

    # -- saving -------------------------------------------------------------------------------
    def save(self, step: int, workers: Dict[str, object], trainer_state: dict,
             contents=("model", "optimizer", "extra")) -> str:
        """Save every worker, this rank's RNG and (rank 0) `trainer_state`; return the final
        directory. Collective over all ranks. Raises NonFiniteError, writing nothing, when a
        worker's weights or optimizer state hold NaN / Inf; CheckpointError, writing nothing,
        when `trainer_state` holds a value weights_only loading could not restore.

        `contents` (actor.checkpoint.save_contents): 'model' always; without 'optimizer' no
        optimizer / LR-scheduler state is written (a resume starts them afresh); without
        'extra' neither the trainer state nor the RNG states are (a resume derives what it can
        from the step)."""
        from megatron.core import dist_checkpointing

        if "model" not in contents:
            raise ValueError(f"actor_rollout_ref.actor.checkpoint.save_contents={list(contents)}: a "
                             "checkpoint holds the model; add 'model'")
        with_extra = "extra" in contents
        for name in workers:
            if not _WORKER_NAME.match(name) or name == RNG_DIR:
                raise ValueError(f"worker name {name!r}: use letters, digits and '_' (not {RNG_DIR!r})")
        check_finite(workers, step)
        tmp = os.path.join(self.root_dir, f"{TMP_PREFIX}step_{step}")
        names = sorted(workers)

        def prepare():
            os.makedirs(self.root_dir, exist_ok=True)
            self._remove_leftovers()
            for name in names:
                os.makedirs(os.path.join(tmp, name))
            os.makedirs(os.path.join(tmp, RNG_DIR))
            if with_extra:
                save_safe(trainer_state, os.path.join(tmp, TRAINER_STATE_FILE), "trainer_state")
        on_rank0_then_share(prepare)

        saved = {}
        for name in names:
            worker = workers[name]
            state = model_sharded_state_dict(worker)
            with_optim = "optimizer" in contents and has_optimizer_state(worker)
            if with_optim:
                with fsdp.checkpoint_mapping():
                    state["optimizer"] = worker.optimizer.sharded_state_dict(
                        dict(state), metadata=optim_metadata(OPTIM_SHARDING))
            with_scheduler = worker.scheduler is not None and "optimizer" in contents
            if with_scheduler:
                state["scheduler"] = worker.scheduler.state_dict()
            _in_process_write_results()
            dist_checkpointing.save(state, os.path.join(tmp, name))
            saved[name] = dict(optimizer=with_optim, scheduler=with_scheduler,
                               chunks=len(worker.models), adam_step=adam_step(worker),
                               lora=lora_of(worker), sharded=bool(getattr(worker, "sharded", False)))
        if with_extra:
            save_safe(rng_state(), os.path.join(tmp, RNG_DIR, f"rank_{self.rank}.pt"),
                      f"the RNG state of rank {self.rank}")
        layout = parallel_layout()

        def write_meta():
            meta = dict(version=FORMAT_VERSION, step=step, layout=layout, workers=saved,
                        optim_sharding=OPTIM_SHARDING, contents=sorted(contents))
            with open(os.path.join(tmp, META_FILE), "w") as f:
                json.dump(meta, f, indent=1)
        on_rank0_then_share(write_meta)
        barrier()  # every rank's files are written
        files = make_durable(tmp)
        entries = manifest_entries(tmp, files)

        def publish():
            write_manifest(tmp, entries)  # the last file: its presence marks the checkpoint complete
            final = self.step_dir(step)
            if os.path.exists(final):  # re-saving a step: move the old one aside first
                os.rename(final, os.path.join(self.root_dir, f"{TMP_PREFIX}old-step_{step}"))
            os.rename(tmp, final)
            fsync_dir(self.root_dir)
            write_atomic(os.path.join(self.root_dir, TRACKER_FILE), f"{step}\n".encode())
            self._prune()
            self._remove_leftovers()
            return final
        self._verified.clear()  # what resolve() checked may have been replaced or pruned
        return on_rank0_then_share(publish)  # every rank waits for the rename

    def _remove_leftovers(self):
        for name in os.listdir(self.root_dir):
            path = os.path.join(self.root_dir, name)
            if name.startswith(TMP_PREFIX):
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.remove(path)

    def _prune(self):
        if self.keep_last is None:
            return
        for step in self.complete_steps()[:-self.keep_last]:
            # rename first, so a crash mid-delete never leaves a half-deleted "complete" dir
            doomed = os.path.join(self.root_dir, f"{TMP_PREFIX}delete-step_{step}")
            os.rename(self.step_dir(step), doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    # -- loading ------------------------------------------------------------------------------
    def load(self, path: str, workers: Dict[str, object], *, load_optimizer: bool = True,
             verify=None, rng_seed: Optional[int] = None) -> dict:
        """Restore `workers` (models, optimizers, schedulers) and this rank's RNG from `path`;
        return the trainer state. Collective over all ranks. `path` is verified first (verify:
        None = the manager's level, "checksum", "size"; True / False = checksum / size) unless
        resolve() just verified it.

        RNG: every rank restores its own saved state (rng/rank_{r}.pt). A checkpoint saved on
        another number of ranks has no state for this layout: a warning, and with `rng_seed`
        every rank reseeds from (rng_seed, rank, step) (`reseed_rng`)."""
        from megatron.core import dist_checkpointing

        path = os.path.abspath(path)

        def exists():
            if not os.path.isdir(path):
                raise CheckpointError(f"checkpoint {path!r} does not exist")
        on_rank0_then_share(exists)
        problem = self._check(path, self._level(verify), just_verified_ok=True)
        self._verified.pop(path, None)  # a later load checks again
        if problem:
            raise CheckpointError(problem)

        def read_meta():
            with open(os.path.join(path, META_FILE)) as f:
                return json.load(f)
        meta = on_rank0_then_share(read_meta)

        if load_optimizer and workers and any(w["optimizer"] for w in meta["workers"].values()):
            here = parallel_layout()
            differ = {k: (meta["layout"].get(k), here[k]) for k in ("tp", "pp", "vpp", "ep")
                      if meta["layout"].get(k) != here[k]}
            if differ:
                raise CheckpointError(
                    f"checkpoint {path!r}: its optimizer state was saved at another model-parallel "
                    f"layout ({', '.join(f'{k}={a} there, {b} here' for k, (a, b) in differ.items())}"
                    "); it resumes only at the same TP/PP/VPP/EP. Use that layout, or load with "
                    "load_optimizer=False to take the weights only")
        for name in sorted(workers):
            worker, directory = workers[name], os.path.join(path, name)
            if name not in meta["workers"]:
                raise CheckpointError(f"checkpoint {path!r} has no worker {name!r} (it has "
                                      f"{sorted(meta['workers'])})")
            info = meta["workers"][name]
            if info.get("lora") != lora_of(worker):
                raise CheckpointError(
                    f"checkpoint {path!r}: worker {name!r} was saved with LoRA {info.get('lora')}, "
                    f"this run has {lora_of(worker)}; set actor_rollout_ref.model.lora_rank / "
                    "lora_alpha / target_modules as in that run, or start without resuming")
            check_worker_matches(name, worker, directory)
            state = model_sharded_state_dict(worker)
            with_optim = load_optimizer and worker.optimizer is not None and info["optimizer"]
            sharded = bool(getattr(worker, "sharded", False))
            if with_optim and info.get("sharded", False) != sharded:
                # the weights are global tensors either way; Megatron's distributed optimizer and the
                # fully sharded strategies' per-parameter optimizer store their state differently
                was, now = ("fsdp / fsdp2", "megatron") if not sharded else ("megatron", "fsdp / fsdp2")
                raise CheckpointError(
                    f"checkpoint {path!r}: worker {name!r} was saved with strategy {was}, this run uses "
                    f"{now}, and their optimizer states are stored differently; resume with the strategy "
                    "it was saved with (its weights load under either: start a new run from them with "
                    "tools/convert_checkpoint.py to HF and model.path, or load with load_optimizer=False)")
            if with_optim:
                create_optimizer_state(worker)
                with fsdp.checkpoint_mapping():
                    state["optimizer"] = worker.optimizer.sharded_state_dict(
                        dict(state), is_loading=True, metadata=optim_metadata(meta["optim_sharding"]))
            loaded = dist_checkpointing.load(state, directory)
            for key, model in zip(model_keys(worker), worker.models):
                if getattr(worker, "sharded", False):  # strategy fsdp / fsdp2
                    fsdp.load_model_state(model, loaded[key])
                elif lora_of(worker) is None:
                    model.load_state_dict(loaded[key], strict=True)
                else:
                    from engine.models.lora import load_adapter_state
                    load_adapter_state(model, loaded[key])
            if with_optim:
                with torch.no_grad():  # fp32 main params are views of the model's parameters
                    worker.optimizer.load_state_dict(
                        fsdp.optimizer_state_to_layout(worker.optimizer, loaded["optimizer"]))
                fsdp.restore_optimizer_state(worker.optimizer)
                restore_adam_steps(worker, info.get("adam_step"))
            if load_optimizer and worker.scheduler is not None and "scheduler" in loaded:
                worker.scheduler.load_state_dict(loaded["scheduler"])

        if "extra" not in meta.get("contents", ["extra"]):
            barrier()
            return {"step": meta["step"]}  # saved without 'extra': the trainer derives the rest
        rng_file = os.path.join(path, RNG_DIR, f"rank_{self.rank}.pt")
        if meta["layout"]["world_size"] == world() and os.path.exists(rng_file):
            set_rng_state(load_safe(rng_file))
        else:
            then = "reseeded from (seed, rank, step)" if rng_seed is not None else "left as they are"
            logger.warning("checkpoint %s was saved on %s ranks, this run has %s: the saved RNG "
                           "states do not apply; every rank's RNG is %s", path,
                           meta["layout"]["world_size"], world(), then)
            if rng_seed is not None:
                reseed_rng(rng_seed, self.rank, int(meta["step"]))
        trainer_state = load_safe(os.path.join(path, TRAINER_STATE_FILE))
        barrier()
        return trainer_state
