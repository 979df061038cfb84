"""The loop shell every trainer shares (PPO, reward model, DPO), written once: resume, validation
before training, the step loop with its validation / checkpoint cadence, the metrics logger, the
HF export at the end; the checkpointed trainer state (step, data position, the task's extras).

A trainer subclasses `Loop`, calls `Loop.__init__(self, cfg, checkpoints=...)` (sets cfg,
checkpoints, rank, world, total_steps, step_count = 0, first_step = 0 and the MetricsLogger) and
sets `self.loader` (a PromptLoader or PairLoader: state_dict / load_state_dict / seek). The shell
reads nothing else of the subclass: everything else goes through the hooks.

What `fit()` calls, in this order (`t` is cfg.trainer, `step` is self.step_count):

    resume()                         checkpoints.resolve(t.resume_mode, t.resume_from_path);
                                     none (or no manager): logger.start_fresh(); else
                                     load_state_dict(checkpoints.load(path, workers(),
                                     rng_seed=t.seed)), logger.truncate_after(step)
    start()                          hook (after resume, before any validation)
    validate()                       only if t.val_before_train and t.test_freq > 0 and step == 0;
                                     logged at step 0
    first_step = step                the step this process started from (0, or the resumed one)
    while step < total_steps:
        batch = next_batch()
        faults.set_step(step + 1)    (engine/faults.py: injected faults match this step)
        metrics = train_step(batch)  under torch's profiler for the global_profiler.steps
                                     (engine/profiler.py)
        step += 1
        if after_step(metrics):      the step is refused (a guard tripped):
            logger.log(metrics, step); rollback(); continue   (no validation, no save)
        if t.due("test_freq", step, total_steps): metrics.update(validate())
        logger.log(metrics, step)
        if t.due("save_freq", step, total_steps): save()
    if t.save_hf: export_hf()
    logger.close()
    shutdown()
    return step

save() (the shell's; when there is a checkpoint manager): inside `with checkpoint_phase():`,
checkpoints.save(step, workers(), state_dict(), contents=actor.checkpoint.save_contents).

The hooks (required ones raise NotImplementedError here):

    next_batch() -> batch            required. The next step's input (the loader's batch), drawn
                                     outside train_step so a step's faults know their step.
    train_step(batch) -> dict        required. One update; returns this step's metrics (a fresh
                                     dict: the shell adds `val/*` to it and logs it).
    validate() -> dict               required. Held-out metrics (`val/*`), the same on every
                                     rank; {} when there is nothing to validate. Collective.
    workers() -> {name: worker}      required. The checkpointed models (their directory names):
                                     save, resume and restore_latest pass exactly these.
    export_hf()                      required when trainer.save_hf: the HF model at the end.
    start()                          after resume (e.g. write the checkpoint's hf_config).
    after_step(metrics) -> bool      after every step, before validation / logging / saving:
                                     True refuses the step (the shell logs its metrics, then
                                     calls rollback()); may pop private keys from metrics.
    rollback()                       required if after_step can return True. restore_latest()
                                     is the shared part (last good checkpoint, logger).
    checkpoint_phase() -> context    a context manager around a save and restore_latest()'s
                                     load (PPO: ctx.phase("save_checkpoint"), the states a
                                     checkpoint reads or writes on the device); default none;
                                     not entered by resume().
    loader_state() -> dict           the data position saved as state["loader"]; default
                                     self.loader.state_dict().
    extra_state() -> dict            the task's trainer state, merged into state_dict() after
                                     "step" and "loader" (computed on every rank: may be a
                                     collective); default {}.
    load_extra_state(state)          restores it; called only when the checkpoint holds trainer
                                     state (saved with 'extra' in save_contents).
    shutdown()                       last (comm timers off, a rollout pool's client stopped).

state_dict() -> {"step", "loader", **extra_state()} (rank 0's is written; no RNG: the manager
keeps every rank's own). load_state_dict(state) sets step_count; a checkpoint saved without
'extra' has no "loader": the loader seeks to the step and the RNG is reseeded from
(trainer.seed, rank, step), nothing else is restored; else loader.load_state_dict(state["loader"])
then load_extra_state(state).

Tests: tests/test_loop.py, tests/test_offline_trainers.py
"""
import contextlib
import dataclasses

import torch.distributed as dist

from engine import faults
from engine.metrics import MetricsLogger
from engine.profiler import StepProfiler


class Loop:
    def __init__(self, cfg, *, checkpoints=None):
        """cfg: the validated TridentConfig (derived.config); checkpoints: a CheckpointManager
        or None (no saves, no resume)."""
        self.cfg = cfg
        self.checkpoints = checkpoints
        ready = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if ready else 1
        self.rank = dist.get_rank() if ready else 0
        self.total_steps = cfg.trainer.total_training_steps
        self.step_count = 0
        self.first_step = 0
        t = cfg.trainer
        self.logger = MetricsLogger(t.log_dir, t.logger, project=t.project_name,
                                    experiment=t.experiment_name, total_steps=self.total_steps,
                                    rank=self.rank, config=dataclasses.asdict(cfg))
        self.profiler = StepProfiler(cfg.global_profiler, self.rank)

    # -- required hooks ------------------------------------------------------------------------
    def next_batch(self):
        raise NotImplementedError

    def train_step(self, batch):
        raise NotImplementedError

    def validate(self):
        raise NotImplementedError

    def workers(self):
        raise NotImplementedError

    def export_hf(self):
        raise NotImplementedError(f"{type(self).__name__} has no HF export (trainer.save_hf)")

    # -- optional hooks ------------------------------------------------------------------------
    def start(self):
        pass

    def after_step(self, metrics):
        return False

    def rollback(self):
        raise NotImplementedError(f"{type(self).__name__}.after_step refused a step but the "
                                  "trainer has no rollback")

    def checkpoint_phase(self):
        return contextlib.nullcontext()

    def loader_state(self):
        return self.loader.state_dict()

    def extra_state(self):
        return {}

    def load_extra_state(self, state):
        pass

    def shutdown(self):
        pass

    # -- the shell -----------------------------------------------------------------------------
    def fit(self):
        t = self.cfg.trainer
        self.resume()
        self.start()
        if t.val_before_train and t.test_freq > 0 and self.step_count == 0:
            self.logger.log(self.validate(), self.step_count)
        self.first_step = self.step_count
        while self.step_count < self.total_steps:
            batch = self.next_batch()
            faults.set_step(self.step_count + 1)
            with self.profiler.step(self.step_count + 1):
                metrics = self.train_step(batch)
            self.step_count += 1
            if self.after_step(metrics):
                self.logger.log(metrics, self.step_count)
                self.rollback()
                continue
            if t.due("test_freq", self.step_count, self.total_steps):
                metrics.update(self.validate())
            self.logger.log(metrics, self.step_count)
            if t.due("save_freq", self.step_count, self.total_steps):
                self.save()
        if t.save_hf:
            self.export_hf()
        self.logger.close()
        self.shutdown()
        return self.step_count

    # -- trainer state and checkpoints ---------------------------------------------------------
    def state_dict(self):
        state = {"step": self.step_count, "loader": self.loader_state()}
        state.update(self.extra_state())
        return state

    def load_state_dict(self, state):
        self.step_count = int(state["step"])
        if "loader" not in state:  # saved without 'extra' (actor.checkpoint.save_contents)
            from engine.checkpoint import reseed_rng
            if self.rank == 0:
                print(f"checkpoint of step {self.step_count} holds no trainer state (save_contents "
                      "without 'extra'): the data position follows from the step, the task's state "
                      "and the RNG start afresh", flush=True)
            self.loader.seek(self.step_count)
            reseed_rng(self.cfg.trainer.seed, self.rank, self.step_count)
            return
        self.loader.load_state_dict(state["loader"])
        self.load_extra_state(state)

    def save(self):
        if self.checkpoints is None:
            return
        with self.checkpoint_phase():
            self.checkpoints.save(self.step_count, self.workers(), self.state_dict(),
                                  contents=self.cfg.actor_rollout_ref.actor.checkpoint.save_contents)

    def _restore(self, path):
        state = self.checkpoints.load(path, self.workers(), rng_seed=self.cfg.trainer.seed)
        self.load_state_dict(state)
        self.logger.truncate_after(self.step_count)

    def resume(self):
        t = self.cfg.trainer
        path = None
        if self.checkpoints is not None:
            path = self.checkpoints.resolve(t.resume_mode, t.resume_from_path)
        if path is None:
            self.logger.start_fresh()
            return
        self._restore(path)
        if self.rank == 0:
            print(f"resumed from {path} at step {self.step_count}", flush=True)

    def restore_latest(self):
        """Back to the newest checkpoint that verifies (weights, optimizer, data position, RNG,
        trainer state; the metrics log cut after its step): its path, or None (no checkpoint:
        nothing changes). For rollback()."""
        path = self.checkpoints.resolve("auto") if self.checkpoints is not None else None
        if path is not None:
            with self.checkpoint_phase():
                self._restore(path)
        return path
