"""Validation of restarting a separate rollout pool's ranks (trainer.rollout_pool_max_restarts:
engine.launch_ray replaces a dead pool rank, which rejoins over engine/rollout/bridge.py). One
ConfigError naming key, value and fix each.

Tests: tests/test_launch_ray.py
"""
from __future__ import annotations

from typing import Optional

from engine.config.checks import check_range, fail
from engine.config.schema import TridentConfig

KEY = "trainer.rollout_pool_max_restarts"


def restart_refusal(cfg: TridentConfig, backend: str) -> Optional[str]:
    """Why a pool rank on rollout backend `backend` ('auto' while the device is not known)
    could not be replaced, or None: a replacement rebuilds one single-rank engine from the
    weights re-sent over the bridge, serving its requests in order."""
    t, r = cfg.trainer, cfg.actor_rollout_ref.rollout
    if t.rollout_pool != "separate":
        return "only a separate pool's ranks are restarted: set trainer.rollout_pool=separate, or set it to 0"
    if t.partial_rollout:
        return ("not with trainer.partial_rollout yet (a sync is read ahead of the generation it pauses, "
                "which a replacement could not rebuild); remove one of them")
    d = cfg.data
    if cfg.algorithm.filter_groups.enable or (d.gen_batch_size or d.train_batch_size) > d.train_batch_size:
        return ("not with streaming groups yet (data.gen_batch_size > data.train_batch_size or "
                "algorithm.filter_groups: a replacement's regenerated chunks are not tested); remove one of them")
    if r.tensor_model_parallel_size != 1:
        return (f"a replacement rejoins single-rank engines only, not actor_rollout_ref.rollout."
                f"tensor_model_parallel_size={r.tensor_model_parallel_size} (its group's other ranks "
                "would have to rejoin too); use 1, or set it to 0")
    if backend in ("sglang", "vllm"):
        return (f"not with rollout backend {backend!r} (its engines take the weights over an update "
                "group or as SPMD ranks, which a replacement cannot rejoin); use rollout.name=cpu, or set it to 0")
    return None


def validate_pool(cfg: TridentConfig) -> None:
    t = cfg.trainer
    check_range(t, "trainer", "rollout_pool_max_restarts", ge=0)
    if t.rollout_pool_max_restarts:
        from engine.rollout.registry import rollout_backend
        name = cfg.actor_rollout_ref.rollout.name
        try:
            name = rollout_backend(name, t.device)
        except ValueError:  # a backend the device cannot run: refused by the devices check
            pass
        why = restart_refusal(cfg, name)
        if why:
            fail(KEY, t.rollout_pool_max_restarts, why)
