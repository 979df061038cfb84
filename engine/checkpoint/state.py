"""What of a worker (model, optimizer, scheduler) and of a rank (RNG) a checkpoint holds, and
the checks on them: finite values before saving, the model's shape before loading, the
optimizer state Megatron needs created before it can load into it. The manager (manager.py)
calls these; `check_model_matches` also serves tools/convert_checkpoint.py, `reseed_rng` the
trainers.

Tests: tests/test_checkpoint.py, tests/test_checkpoint_verify.py, tests/test_resume_rng.py,
tests/test_lora.py, tests/test_config_acts.py, tests/test_bad_inputs.py
"""
import hashlib
import logging
import random

import numpy as np
import torch
import torch.distributed as dist

from engine.checkpoint.files import CheckpointError, NonFiniteError, raise_if_any, world
from engine.checkpoint.files import rank as this_rank
from parallel.fsdp import local

logger = logging.getLogger(__name__)


# -- finite values -------------------------------------------------------------------------
def _non_finite(worker):
    """Names of the worker's non-finite tensors: model parameters, then the optimizer's main
    parameters and float state (one host sync per device, not one per tensor)."""
    named = [(f"parameter {n!r}", local(p)) for m in worker.models for n, p in m.named_parameters()]
    if worker.optimizer is not None:
        k = 0
        for opt in torch_optimizers(worker):
            for group in opt.param_groups:
                for p in group["params"]:
                    named.append((f"optimizer main parameter #{k}", local(p)))
                    for key, v in opt.state.get(p, {}).items():
                        if torch.is_tensor(v) and v.is_floating_point():
                            named.append((f"optimizer state {key!r} of main parameter #{k}", local(v)))
                    k += 1
    by_device = {}
    for i, (_, t) in enumerate(named):
        if t.numel():
            by_device.setdefault(t.device, []).append(i)
    bad = []
    with torch.no_grad():
        for indices in by_device.values():
            ok = torch.stack([torch.isfinite(named[i][1]).all() for i in indices]).cpu().tolist()
            bad += [named[i][0] for i, good in zip(indices, ok) if not good]
    return bad


def check_finite(workers, step):
    problem = None
    for name in sorted(workers):
        bad = _non_finite(workers[name])
        if bad:
            problem = (f"refusing to save step {step}: worker {name!r} has NaN/Inf in {bad[0]}"
                       f"{f' and {len(bad) - 1} more tensors' if len(bad) > 1 else ''} (rank "
                       f"{this_rank()}); a checkpoint must hold a usable model. Roll back to the last "
                       "good checkpoint (or lower the learning rate / skip the batch) and go on")
            break
    raise_if_any(problem, NonFiniteError)


# -- RNG --------------------------------------------------------------------------------------
def rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    state = dict(python=random.getstate(), numpy=np.random.get_state(),
                 torch=torch.get_rng_state(), tracker=get_cuda_rng_tracker().get_states())
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def reseed_rng(seed: int, rank: int, step: int):
    """Seed python / numpy / torch (CPU and every CUDA device) from (seed, rank, step): where no
    saved state fits (another world size), a deterministic start of its own per rank, never
    rank 0's state copied."""
    digest = hashlib.sha256(f"trident-rng/{seed}/{rank}/{step}".encode()).digest()
    value = int.from_bytes(digest[:8], "little") >> 1
    random.seed(value)
    np.random.seed(value % (2 ** 32))
    torch.manual_seed(value)


def set_rng_state(state: dict):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        get_cuda_rng_tracker().set_states(state["tracker"])


# -- what a worker contributes ----------------------------------------------------------------
def model_keys(worker):
    """Megatron's nesting: one chunk -> "model", virtual stages -> "model0", "model1", ..."""
    n = len(worker.models)
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def model_sharded_state_dict(worker) -> dict:
    """A LoRA worker's model part is its adapters only: the base comes from model.path (or the
    seeded initialisation of an inline-config model) and is frozen."""
    from engine.models.lora import adapter_only
    lora = getattr(worker, "lora", None) is not None
    return {key: adapter_only(m.sharded_state_dict()) if lora else m.sharded_state_dict()
            for key, m in zip(model_keys(worker), worker.models)}


def lora_of(worker):
    """The LoRA settings recorded in meta.json (None: a full model)."""
    spec = getattr(worker, "lora", None)
    return None if spec is None else spec.as_dict()


def torch_optimizers(worker):
    opt = worker.optimizer
    return [getattr(o, "optimizer", o) for o in getattr(opt, "chained_optimizers", [opt])]


def stepped(opt) -> bool:
    """Whether a torch optimizer has taken a step: its state holds something to save. (The
    moments engine/workers/fused_adam.py init_adam_state makes up front have a step count of 0.)"""
    return any(float(s.get("step", 0)) > 0 for s in opt.state.values())


def has_optimizer_state(worker) -> bool:
    """Megatron's optimizer state has values only after the first step (then on every rank)."""
    if worker.optimizer is None:
        return False
    inner = torch_optimizers(worker)
    flag = torch.tensor([int(all(stepped(o) for o in inner))])
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@torch.no_grad()
def create_optimizer_state(worker):
    """A fresh optimizer has no state to load into (and Megatron's distributed optimizer cannot
    describe itself without it), or only the moments init_adam_state made up front with a step
    count of 0, which Megatron's sharded state dict leaves out (`if step:`): one step on zero
    gradients creates it; the load overwrites every value it creates, including the parameters."""
    for opt in torch_optimizers(worker):
        if stepped(opt):
            continue
        params = [p for group in opt.param_groups for p in group["params"] if p.numel() > 0]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p in params:
            p.grad = None


def adam_step(worker):
    """Adam's step count (the same for every parameter), saved beside Megatron's state."""
    for opt in torch_optimizers(worker):
        for state in opt.state.values():
            if "step" in state:
                return float(state["step"])
    return None


def restore_adam_steps(worker, step):
    """megatron-core 0.16's distributed optimizer (torch Adam path, without TE/Apex) does not
    round-trip Adam's step count through its dp_reshardable state (it comes back as the one
    zero-gradient step taken to create the state), and loads one `step` tensor shared by every
    parameter, which torch Adam would increment once per parameter. Each parameter gets its own
    tensor holding the saved count, so the next step's bias correction is the uninterrupted one."""
    for opt in torch_optimizers(worker):
        for state in opt.state.values():
            if torch.is_tensor(state.get("step")):
                value = state["step"] if step is None else torch.tensor(step)
                state["step"] = value.clone().to(state["step"].dtype)


def optim_metadata(sharding):
    return {"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": True}


def parallel_layout():
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():  # trainer state only
        return dict(world_size=world())
    return dict(tp=ps.get_tensor_model_parallel_world_size(),
                pp=ps.get_pipeline_model_parallel_world_size(),
                vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
                cp=ps.get_context_parallel_world_size(),
                ep=ps.get_expert_model_parallel_world_size(),
                dp=ps.get_data_parallel_world_size(), world_size=world())


def check_model_matches(chunks, directory, fix=None):
    """CheckpointError (on every rank) unless the Megatron dist checkpoint `directory` holds
    exactly the model tensors of `chunks` with their global shapes (tools/convert_checkpoint)."""
    from types import SimpleNamespace
    check_worker_matches("model", SimpleNamespace(models=chunks), directory, fix)


def check_worker_matches(name, worker, directory, fix=None):
    """Clear error (on every rank) when the checkpoint's model tensors are not this model's."""
    fix = fix or "build the model the checkpoint was saved from (same HF config) or start without resuming"
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    saved = {k: tuple(v.global_shape)
             for k, v in dist_checkpointing.load_tensors_metadata(directory).items()}
    wanted = model_sharded_state_dict(worker)
    apply_factories(wanted)  # a throwaway copy: only the keys and global shapes are read
    problem = None
    keys = set()
    for t in nested_values(wanted):
        if not isinstance(t, ShardedTensor):
            continue
        keys.add(t.key)
        if t.key not in saved:
            problem = (f"worker {name!r}: the checkpoint {directory!r} has no tensor {t.key!r}; "
                       f"it was saved from a different model architecture: {fix}")
            break
        if saved[t.key] != tuple(t.global_shape):
            problem = (f"worker {name!r}: tensor {t.key!r} has shape {saved[t.key]} in the "
                       f"checkpoint {directory!r} but {tuple(t.global_shape)} in this model; it "
                       f"was saved from a different model size: {fix}")
            break
    raise_if_any(problem)
    # tensors no rank asks for (e.g. a value head the model lacks) mean another architecture
    all_keys = [keys]
    if dist.is_initialized():
        all_keys = [None] * world()
        dist.all_gather_object(all_keys, keys)
    model_saved = {k for k in saved if not k.startswith("optimizer.")}
    unexpected = sorted(model_saved - set().union(*all_keys))
    if unexpected:
        raise CheckpointError(
            f"worker {name!r}: the checkpoint {directory!r} has tensors this model does not: "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}; it was saved from a "
            f"different model architecture: {fix}")
