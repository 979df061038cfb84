"""One rank of a large layout, built inside this process on the meta device: shapes, no memory.

torch's fake process group answers every collective at once without talking to anyone, so
megatron's `initialize_model_parallel` lays out world size N (8, 256, 2048 ...) in a single
process, and a model builder then sees exactly the parallel_state that rank `rank` would see.
Parameters are created on the meta device (no allocation, no initialisation).

torch.distributed initialises once per process: build one (layout, rank) per process, e.g. in
a `subprocess`. Model-agnostic: the model comes from a `build_fn(config_overrides) -> chunks`
callable (the engine's builder, bound to a model config), so `parallel/` stays below `engine/`.

Tests: tests/test_recipes.py
"""
import math
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from parallel.mesh import Layout, init_mesh
from parallel.shards import local_shards

# TransformerConfig settings for a meta build: megatron's CPU-initialisation path creates
# parameters without an explicit device, so `torch.device('meta')` applies (its GPU path asks
# for `torch.cuda.current_device()` explicitly). Initialisation stays on: on meta tensors it
# costs nothing, and megatron sets the TP split attributes (`tensor_model_parallel`,
# `partition_dim`) that parallel.shards reads only inside its initialisation functions.
META_CONFIG_OVERRIDES = dict(use_cpu_initialization=True)


def init_fake_mesh(layout: Layout, world_size: int, rank: int = 0) -> None:
    """Megatron's parallel_state for `rank` of `world_size` over a fake (no-op) process group."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; build each "
                           "(layout, rank) in a fresh process (see parallel.meta's docstring)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    layout.check(world_size)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    init_mesh(layout)


def meta_build(build_fn: Callable[[dict], List[torch.nn.Module]], layout: Layout,
               world_size: int, rank: int = 0) -> Tuple[List[torch.nn.Module], dict]:
    """(model chunks of `rank` on the meta device, info about the rank and its parameters).

    build_fn(config_overrides) must pass the overrides on to the TransformerConfig.
    """
    from megatron.core import parallel_state as ps

    init_fake_mesh(layout, world_size, rank)
    with torch.device("meta"):
        chunks = build_fn(dict(META_CONFIG_OVERRIDES))
    real = [n for c in chunks for n, p in c.named_parameters() if p.device.type != "meta"]
    if real:
        raise RuntimeError(f"the meta build allocated real parameters, e.g. {real[:3]}; the builder "
                           "must create them without an explicit device")
    info = dict(
        rank=rank, world_size=world_size,
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(), etp_rank=ps.get_expert_tensor_parallel_rank(),
        dp=ps.get_data_parallel_world_size(), expert_dp=ps.get_expert_data_parallel_world_size(),
        params=count_params(chunks), shards=shard_counts(chunks))
    return chunks, info


def count_params(chunks) -> int:
    """Elements of this rank's parameters (a parameter shared between chunks counts once)."""
    seen: Dict[int, int] = {}
    for chunk in chunks:
        for p in chunk.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def shard_counts(chunks) -> Dict[str, dict]:
    """global name -> {local, full, pieces, expert}: element counts of this rank's parameters.

    `local x pieces == full` for every parameter split over (expert-)TP; a replicated one has
    one piece. The last stage's copy of a tied embedding has the embedding's global name.
    """
    out = {}
    for param, shard in local_shards(chunks):
        out[shard.global_name] = dict(local=param.numel(), full=math.prod(shard.global_shape),
                                      pieces=shard.count, expert=shard.expert)
    return out
