"""Devices: the ranks a run trains on, the device and the rollout backend it runs, the parallel
layout, the rollout topology (which GPUs each engine is built on). The memory schedule of those
devices is engine/config/phases.py's; derive() computes every one of them once.

Tests: tests/test_config.py, tests/test_derive_parts.py, tests/test_rollout_topology.py,
tests/test_mesh_layout.py
"""
from __future__ import annotations

from typing import Optional

from engine.config.checks import fail
from engine.config.inherit import resolve_megatron
from engine.config.schema import ConfigError, TridentConfig
from engine.rollout.registry import rollout_backend
from parallel.mesh import Layout

__all__ = ["training_world", "resolve_devices", "layout_of", "rollout_topology_of"]


def training_world(cfg: TridentConfig, world_size: Optional[int]) -> int:
    """The ranks that train: trainer.nnodes x n_gpus_per_node less a separate pool's; a launched
    `world_size` (None: that number) must match it."""
    pool = cfg.trainer.rollout_pool_ranks if cfg.trainer.rollout_pool == "separate" else 0
    expected = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node - pool
    world_size = expected if world_size is None else world_size
    if world_size != expected:
        fail("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node,
             f"trainer.nnodes x n_gpus_per_node = {expected + pool}{f' less {pool} pool ranks' if pool else ''} "
             f"but {world_size} ranks were launched{' to train' if pool else ''}; "
             f"launch {expected + pool} ranks or set nnodes/n_gpus_per_node to match")
    return world_size


def resolve_devices(out: TridentConfig, cuda_available: Optional[bool] = None) -> None:
    """trainer.device='auto' (cuda_available: default ask torch) and rollout.name='auto' resolved
    on `out`; a backend the device cannot run is refused."""
    trainer, rollout = out.trainer, out.actor_rollout_ref.rollout
    if trainer.device == "auto":
        if cuda_available is None:
            import torch  # only here: the schema itself needs no torch
            cuda_available = torch.cuda.is_available()
        trainer.device = "cuda" if cuda_available else "cpu"
    try:  # 'auto' resolved and a backend the device cannot run refused: engine/rollout/registry.py
        rollout.name = rollout_backend(rollout.name, trainer.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def layout_of(cfg: TridentConfig, world_size) -> Layout:
    """The run's Layout: the actor's Megatron sizes (every model shares them) at `world_size`."""
    m = resolve_megatron(cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.actor.megatron)
    return Layout(world_size=world_size, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                  vpp=m.virtual_pipeline_model_parallel_size, cp=m.context_parallel_size,
                  ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size,
                  sequence_parallel=bool(m.sequence_parallel))


def rollout_topology_of(cfg: TridentConfig, world_size: int, num_attention_heads: Optional[int] = None):
    """The rollout groups of `cfg` at `world_size` training ranks (engine/rollout/topology.py):
    over those ranks when colocated, over the pool's ranks when separate."""
    from engine.rollout.topology import TopologyError, rollout_topology
    if cfg.trainer.rollout_pool == "separate":
        world_size = cfg.trainer.rollout_pool_ranks
    try:
        return rollout_topology(world_size, cfg.trainer.n_gpus_per_node,
                                cfg.actor_rollout_ref.rollout.tensor_model_parallel_size,
                                num_attention_heads=num_attention_heads)
    except TopologyError as e:
        raise ConfigError(str(e)) from None
