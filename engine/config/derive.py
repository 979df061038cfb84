"""Derived values, computed once from a validated config and read everywhere: `derive()` and
the `Derived` it returns. Its four jobs live beside it, one module each:

    devices.py    the training ranks, device and rollout backend, Layout, rollout topology
                  (and phases.py: the memory schedule of those devices)
    inherit.py    null-means-auto keys filled from the keys they inherit
    steps.py      total steps and the optimizers' schedules; what every step does (StepFlags)
    batches.py    batch arithmetic: BatchPlan per trained model, the forward passes' splits

derive() validates, copies the config, and runs them in that order (so a bad recipe's first
mistake is reported first, the same on every rank).

Tests: tests/test_config.py, tests/test_derive_parts.py, tests/test_offline_config.py,
tests/test_phases.py, tests/test_rollout_topology.py
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from engine.config.batches import BatchPlan, plan_batches
from engine.config.devices import layout_of, resolve_devices, rollout_topology_of, training_world
from engine.config.inherit import fill_inherited
from engine.config.layout_check import validate_layout
from engine.config.phases import phase_schedule
from engine.config.schema import TridentConfig
from engine.config.steps import StepFlags, fill_steps, step_flags, total_training_steps, uses_reference
from engine.config.validate import validate
from parallel.mesh import Layout

__all__ = ["Derived", "derive", "BatchPlan", "StepFlags", "Layout", "total_training_steps"]


@dataclass(frozen=True)
class Derived:
    config: TridentConfig  # a copy with every null-means-auto key filled in
    layout: Layout
    rollout_batch_size: int  # sequences per PPO step (train_batch_size x rollout.n)
    rollout_batch_size_per_rank: int
    use_critic: bool
    use_reference: bool  # a KL term (loss or in-reward) or implicit rewards need reference log-probs
    actor: BatchPlan
    critic: Optional[BatchPlan]
    # forward-only passes by model (engine.batch.Split): actor (old log-probs) and critic
    # (values) follow the rollout section's log_prob_* keys, ref its own, reward_model its
    # micro_batch_size_per_gpu
    forward: dict = dataclasses.field(default_factory=dict)
    rollout_topology: Any = None  # engine.rollout.topology.RolloutTopology: engines, leaders, GPUs
    phases: Any = None  # engine.config.phases.PhaseSchedule: what is on the device in each phase
    step: Optional[StepFlags] = None  # what every step does (engine/config/steps.py)


def derive(cfg: TridentConfig, world_size: Optional[int] = None, dataset_len: Optional[int] = None,
           cuda_available: Optional[bool] = None) -> Derived:
    """Validate the layout for `world_size` and compute every derived value.

    world_size: the launched rank count (default trainer.nnodes x n_gpus_per_node; must match it).
    dataset_len: training prompts; needed for total steps unless trainer.total_training_steps is set.
    cuda_available: resolves trainer.device='auto' (default: ask torch).
    """
    world_size = training_world(cfg, world_size)
    validate(cfg)
    validate_layout(cfg, world_size)
    out = copy.deepcopy(cfg)
    resolve_devices(out, cuda_available)
    fill_inherited(out)
    fill_steps(out, dataset_len)
    layout = layout_of(out, world_size)
    batches = plan_batches(out, layout.dp)
    use_critic, use_reference = out.critic.enable, uses_reference(out)
    return Derived(config=out, layout=layout, use_critic=use_critic, use_reference=use_reference, **batches,
                   rollout_topology=rollout_topology_of(out, world_size),
                   phases=phase_schedule(out, use_critic, use_reference),
                   step=step_flags(out, batches["actor"]))
