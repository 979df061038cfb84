"""Fully sharded data parallel: verl's `strategy: fsdp` / `fsdp2` on Megatron-core.

Megatron-core's `TorchFullyShardedDataParallel` puts torch's FSDP2 (`fully_shard`) under the
interface Megatron's schedules, optimizer and `dist_checkpointing` already drive: each
parameter becomes a DTensor whose dim 0 is split over the data-parallel (x CP) group, so the
parameters, their gradients and the optimizer state built on them are all sharded; each
transformer layer is all-gathered just before its forward / backward and freed after.

What Trident adds around it:
- the units: transformer layers, the embedding and RoPE (Megatron's default set also names
  ColumnParallelLinear, which under Megatron's local spec sits inside every layer and would be
  wrapped twice); the output layer and value head join the root unit;
- gradients are summed over DP, not averaged: Trident's losses are already normalised over the
  global batch (the model config sets `calculate_per_token_loss`, as under Megatron's DDP), and
  sum-only collectives run on gloo and NCCL alike;
- DP replicas start identical (broadcast before sharding, as DDP's `broadcast_params`);
- `gathered(chunks)`: the full (TP-local) value of every parameter for a while — a weight
  sync, an export — read through `value(param)`; `write(param, full)` stores a full value
  into the shards (loading a checkpoint or HF weights).

Tests: tests/test_fsdp.py, tests/test_delivery.py, tests/gpu/test_fsdp_gpu.py
"""
import contextlib
import warnings
from typing import Dict

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch without DTensor: nothing is ever sharded
    DTensor = distribute_tensor = None

_FULL: Dict[int, torch.Tensor] = {}  # id(sharded parameter) -> its full value, inside gathered()


def is_sharded(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (the tensor itself otherwise): what it stores."""
    return t._local_tensor if is_sharded(t) else t


def value(param: torch.Tensor) -> torch.Tensor:
    """The full value of `param`: its gathered copy inside `gathered()`, else the tensor itself
    (a sharded parameter read outside `gathered()` is refused: each read would be a collective
    that every DP rank must make in the same order)."""
    if not is_sharded(param):
        return param
    full = _FULL.get(id(param))
    if full is None:
        raise RuntimeError("a fully sharded parameter was read outside parallel.fsdp.gathered(); "
                           "wrap the read in it (collective over the data-parallel group)")
    return full


def for_compute(param: torch.Tensor) -> torch.Tensor:
    """A sharded parameter gathered for use outside its unit's forward (the output layer's
    weight in the log-prob kernels), differentiably: its gradient is summed over DP and
    scattered into the parameter's sharded gradient, as FSDP does for its own units."""
    if not is_sharded(param):
        return param
    from torch.distributed.tensor import Partial, Replicate
    whole = param.redistribute(param.device_mesh, [Replicate()] * param.device_mesh.ndim)
    return whole.to_local(grad_placements=[Partial()] * param.device_mesh.ndim)


@torch.no_grad()
def write(param: torch.Tensor, full: torch.Tensor) -> None:
    """Store `full` (the whole TP-local value, the same on every DP rank) into `param`."""
    if not is_sharded(param):
        param.copy_(full)
        return
    # each rank cuts its own shard from the full value it holds: no communication
    mine = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                             src_data_rank=None)
    param._local_tensor.copy_(mine._local_tensor)
    if id(param) in _FULL:
        _FULL[id(param)].copy_(full)


@contextlib.contextmanager
def gathered(chunks):
    """Every sharded parameter of `chunks` all-gathered for the duration (collective over the
    data-parallel group, in parameter order on every rank); a no-op for unsharded models.
    The extra memory is the model's TP-local size (as FSDP's full-parameter context)."""
    params = [p for c in chunks for p in c.parameters() if is_sharded(p) and id(p) not in _FULL]
    with torch.no_grad():
        for p in params:
            _FULL[id(p)] = p.full_tensor()
    try:
        yield
    finally:
        for p in params:
            _FULL.pop(id(p), None)


@contextlib.contextmanager
def checkpoint_mapping():
    """Megatron's optimizer checkpoint pairs each optimizer parameter with the model's checkpoint
    piece by the identity of its `to_local()` (megatron/core/dist_checkpointing/optimizer.py);
    torch >= 2.12 returns a fresh Parameter from a Parameter(DTensor)'s `to_local()`, so nothing
    pairs. For the call, the pairs are made by the stored local tensor, which is what the
    model's pieces hold."""
    from megatron.core.optimizer import optimizer as megatron_optimizer
    original = megatron_optimizer.get_param_id_to_sharded_param_map

    def by_local_tensor(model_sharded_state_dict, params):
        return original(model_sharded_state_dict, [local(p) for p in params])
    megatron_optimizer.get_param_id_to_sharded_param_map = by_local_tensor
    try:
        yield
    finally:
        megatron_optimizer.get_param_id_to_sharded_param_map = original


@torch.no_grad()
def load_model_state(model, state: dict) -> None:
    """`model.load_state_dict(state, strict=True)` where a checkpoint load handed back each
    sharded parameter as this rank's local piece (or, for one saved whole, the full value)."""
    params = dict(model.named_parameters())
    rest = {}
    for key, value in state.items():
        param = params.get(key)
        if param is None or not is_sharded(param):
            rest[key] = value
        elif tuple(value.shape) == tuple(param._local_tensor.shape):
            param._local_tensor.copy_(value)
        else:
            write(param, value)  # raises if it is neither piece nor whole
    missing, unexpected = model.load_state_dict(rest, strict=False)
    missing = [k for k in missing if k not in state]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint and model disagree: missing {missing[:3]}, unexpected {unexpected[:3]}")


def _like(current, saved):
    if is_sharded(current) and torch.is_tensor(saved) and not is_sharded(saved):
        return DTensor.from_local(saved, current.device_mesh, current.placements,
                                  shape=current.shape, stride=current.stride())
    return saved


def optimizer_state_to_layout(optimizer, state: dict) -> dict:
    """A loaded optimizer checkpoint's fp32 main parameters (Megatron's Float16Optimizer copies
    them into its own, DTensor to DTensor) in the layout of the ones they replace."""
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [state] if len(inners) == 1 else [state[i] for i in range(len(inners))]
    for inner, sd in zip(inners, states):
        groups = getattr(inner, "fp32_from_float16_groups", None)
        if groups is not None and "fp32_from_fp16_params" in sd:
            sd["fp32_from_fp16_params"] = [[_like(c, v) for c, v in zip(cur, saved)]
                                           for cur, saved in zip(groups, sd["fp32_from_fp16_params"])]
    return state


@torch.no_grad()
def restore_optimizer_state(optimizer) -> None:
    """After a checkpoint load: Megatron hands the optimizer each sharded state as this rank's
    local tensor; put it back into the parameter's layout (a DTensor like the parameter)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", inner)
        for group in torch_opt.param_groups:
            for p in group["params"]:
                if not is_sharded(p):
                    continue
                state = torch_opt.state.get(p, {})
                for key, v in state.items():
                    if torch.is_tensor(v) and not is_sharded(v) and v.shape == p._local_tensor.shape \
                            and v.dim() > 0:
                        state[key] = DTensor.from_local(v, p.device_mesh, p.placements,
                                                        shape=p.shape, stride=p.stride())


def _units():
    from megatron.core.models.common.embeddings.language_model_embedding import \
        LanguageModelEmbedding
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer
    return {TransformerLayer, LanguageModelEmbedding, RotaryEmbedding}


def check_layout(lora) -> None:
    """What the fully sharded strategies run with (engine/config/validate.py says it to the user
    first; this guards direct construction)."""
    from megatron.core import parallel_state as ps
    if ps.get_pipeline_model_parallel_world_size() > 1 or ps.get_expert_model_parallel_world_size() > 1:
        raise ValueError("strategy fsdp/fsdp2 runs with pipeline_model_parallel_size=1 and "
                         "expert_model_parallel_size=1; use strategy: megatron for PP / EP")
    if lora:
        raise ValueError("strategy fsdp/fsdp2 with LoRA is not supported; use strategy: megatron")


def check_divisible(chunk, dp: int) -> None:
    """Megatron's checkpoint shards of an FSDP parameter are dim-0 pieces of equal size
    (megatron/core/utils.py make_*sharded_tensor_for_checkpoint); a gated fc1's must not straddle
    its gate and up halves (fix_checkpoint_offsets)."""
    if dp > 1 and dp % 2 and getattr(getattr(chunk, "config", None), "gated_linear_unit", False):
        raise ValueError(f"strategy fsdp2 with a gated MLP (SwiGLU) shards over an even number of "
                         f"data-parallel ranks; this layout has {dp}: change the number of GPUs or "
                         "tensor_model_parallel_size, or use strategy: megatron")
    for name, p in chunk.named_parameters():
        if name.startswith(_ROW_HEADS):
            continue  # split along dim 1 (_shard_row_heads)
        rows = p.shape[0] if p.dim() else 1
        if rows % dp:
            raise ValueError(f"strategy fsdp2: parameter {name} has {rows} rows, not divisible by "
                             f"the {dp} data-parallel ranks it is sharded over (Megatron's checkpoint "
                             f"shards are equal); use a data-parallel size dividing {rows}, or "
                             "strategy: megatron")


# one-row heads (a critic's or reward model's value head, [1, hidden]): FSDP's dim-0 split would
# leave every rank but the first empty; they are split along hidden instead
_ROW_HEADS = ("value_head.",)


def _shard_row_heads(model, group, reshard_after_forward):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    head = getattr(model, "value_head", None)
    if head is None:
        return
    mesh = DeviceMesh.from_group(group, "cuda" if torch.cuda.is_available() else "cpu")
    fully_shard(head, mesh=mesh, reshard_after_forward=reshard_after_forward,
                shard_placement_fn=lambda param: Shard(param.dim() - 1))


def fix_checkpoint_offsets(sharded_state_dict, model, prefix=""):
    """Where Megatron's checkpoint pieces (megatron/core/utils.py, transformer/mlp.py) assume a
    parameter split along dim 0 into equal whole-row pieces of the *TP* layout, say where this
    rank's FSDP shard sits instead (in place, on `model.sharded_state_dict()`'s result):
    - row heads, split along their last dim;
    - a gated fc1 ([gate; up] rows): Megatron's factory cuts the local rows in two halves, but
      an FSDP shard lies wholly in the gate or the up half (DP even: `check_divisible`), so it
      is one piece of the same global tensor at a finer fragmentation."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, p in model.named_parameters():
        key = prefix + name
        if not is_sharded(p) or key not in sharded_state_dict:
            continue
        mesh = p.device_mesh
        dp_rank, dp = mesh.get_local_rank(), mesh.size()
        old = sharded_state_dict[key]
        if name.startswith(_ROW_HEADS):
            sharded_state_dict[key] = ShardedTensor.from_rank_offsets(
                old.key, p._local_tensor, (p.dim() - 1, dp_rank, dp), replica_id=(0, tp_rank, 0))
        elif isinstance(old, ShardedTensorFactory) and dp > 1:
            gate = old.build()[0]  # Megatron's piece: its layer-axis offsets are what we keep
            k = gate.prepend_axis_num
            layer_axes = [(ax, gate.global_offset[ax], gate.axis_fragmentations[ax]) for ax in range(k)]
            half, piece = divmod(dp_rank, dp // 2)
            index = half * tp * (dp // 2) + tp_rank * (dp // 2) + piece
            sharded_state_dict[key] = ShardedTensor.from_rank_offsets(
                old.key, p._local_tensor, *layer_axes, (k, index, tp * dp),
                replica_id=old.replica_id, prepend_axis_num=k)


@torch.no_grad()
def broadcast_replicas(chunk, group) -> None:
    """DP replicas start identical: every parameter from the group's first rank."""
    src = dist.get_global_rank(group, 0)
    for p in chunk.parameters():
        dist.broadcast(p.data, src=src, group=group)


def _wrapper_class():
    from megatron.core.distributed.torch_fully_sharded_data_parallel import \
        TorchFullyShardedDataParallel

    class FullyShardedChunk(TorchFullyShardedDataParallel):
        """megatron-core 0.16's finalize_model_grads calls `finish_grad_sync(force_all_reduce=)`,
        a keyword its data_parallel_base.py does not take; FSDP2 has already reduce-scattered
        every gradient in the backward (nothing is left to finish)."""

        def finish_grad_sync(self, force_all_reduce: bool = False):
            pass
    return FullyShardedChunk


def wrap(chunk, *, reshard_after_forward: bool = True, forward_prefetch: bool = False):
    """`chunk` (a Megatron GPT model) fully sharded over the data-parallel (x CP) group."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from torch.distributed.fsdp import FSDPModule

    # torch warns that a unit's output is a view an in-place op could detach from its backward
    # hook; Megatron's layers do not modify their outputs in place (tests/test_fsdp.py compares
    # every gradient with the megatron strategy's)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    group = ps.get_data_parallel_group(with_context_parallel=True)
    check_divisible(chunk, dist.get_world_size(group))
    broadcast_replicas(chunk, group)
    _shard_row_heads(chunk, group, reshard_after_forward)
    ddp_cfg = DistributedDataParallelConfig()
    # Megatron's wrapper reads it with getattr (no field of the config in megatron-core 0.16)
    ddp_cfg.reshard_after_forward = reshard_after_forward
    wrapped = _wrapper_class()(chunk.config, ddp_cfg, chunk, sub_modules_to_wrap=_units(),
                               process_group=group)
    units = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # a sum (see the module docstring)
        unit.set_force_sum_reduction_for_comms(True)
    if forward_prefetch:  # each layer's all-gather issued while the previous layer computes
        layers = [u for u in units if u is not wrapped.module and hasattr(u, "layer_number")]
        for this, after in zip(layers, layers[1:]):
            this.set_modules_to_forward_prefetch([after])
    return wrapped
