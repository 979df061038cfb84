"""Batch arithmetic: how a PPO step's batch splits over the data-parallel ranks, into
mini-batches (one optimizer step each) and micro-batches (`BatchPlan` per trained model), and
how each forward-only pass cuts its rows (engine.batch.Split). Every count is checked here, with
the key to change and the values that work.

Tests: tests/test_config.py, tests/test_derive_parts.py
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from engine.batch import Split, forward_split, update_split
from engine.config.checks import divisor_choices, fail
from engine.config.schema import TridentConfig

__all__ = ["BatchPlan", "batch_plan", "plan_batches"]


@dataclass(frozen=True)
class BatchPlan:
    """How one trained model (actor or critic) splits a PPO step's batch."""
    mini_batch_size: int  # sequences per optimizer step over all DP ranks (= prompts x rollout.n)
    mini_batch_size_per_rank: int
    micro_batch_size_per_rank: Optional[int]  # None with use_dynamic_bsz (split by tokens)
    grad_accum_steps: Optional[int]  # micro-batches per mini-batch per rank; None with dynamic bsz
    mini_batches_per_epoch: int
    ppo_epochs: int
    update: Split = Split()  # micro-batches of an optimizer step


def plan_batches(cfg: TridentConfig, dp: int) -> dict:
    """The batch fields of Derived for a resolved config at `dp` data-parallel ranks:
    rollout_batch_size (+ _per_rank), the actor's and critic's BatchPlans, the forward splits."""
    data, arr = cfg.data, cfg.actor_rollout_ref
    rollout = arr.rollout
    rollout_batch = data.train_batch_size * rollout.n
    # generation hands each DP replica whole prompts (a prompt's n responses train on one
    # replica: engine/rollout/topology.route_plan), so the prompts, not the sequences, must split
    if data.train_batch_size % dp:
        up = -(-data.train_batch_size // dp) * dp
        fail("data.train_batch_size", data.train_batch_size,
             f"x rollout.n {rollout.n} = {rollout_batch} sequences, but each of the {dp} data-parallel "
             f"ranks trains whole prompts (all n responses of a prompt) and {data.train_batch_size} prompts "
             f"do not split over {dp} data-parallel ranks; make data.train_batch_size a multiple of "
             f"{dp} (e.g. {up})")
    if data.gen_batch_size is not None and data.gen_batch_size % dp:  # groups go to replicas in turn
        fail("data.gen_batch_size", data.gen_batch_size, f"does not split over {dp} data-parallel ranks; "
             f"make it a multiple of {dp} (e.g. {-(-data.gen_batch_size // dp) * dp})")
    critic = cfg.critic
    return dict(
        rollout_batch_size=rollout_batch, rollout_batch_size_per_rank=rollout_batch // dp,
        actor=batch_plan(arr.actor, "actor_rollout_ref.actor", cfg, dp),
        critic=batch_plan(critic, "critic", cfg, dp) if critic.enable else None,
        # forward-only passes by model: actor (old log-probs) and critic (values) follow the
        # rollout section's log_prob_* keys, ref its own, reward_model its micro_batch_size_per_gpu
        forward={"actor": forward_split(rollout), "critic": forward_split(rollout), "ref": forward_split(arr.ref),
                 "reward_model": Split(micro_batch_size=cfg.reward_model.micro_batch_size_per_gpu)})


def batch_plan(section: Any, p: str, cfg: TridentConfig, dp: int) -> BatchPlan:
    """The BatchPlan of the trained model whose section (key prefix `p`) is `section`."""
    n = cfg.actor_rollout_ref.rollout.n
    mini = section.ppo_mini_batch_size * n
    if mini % dp:
        fail(f"{p}.ppo_mini_batch_size", section.ppo_mini_batch_size,
             f"x rollout.n {n} = {mini} sequences do not split over {dp} data-parallel ranks; make "
             f"ppo_mini_batch_size x rollout.n a multiple of {dp}")
    per_rank = mini // dp
    micro = None if section.use_dynamic_bsz else section.ppo_micro_batch_size_per_gpu
    if not section.use_dynamic_bsz and micro is None:
        fail(f"{p}.ppo_micro_batch_size_per_gpu", None,
             f"set the per-rank micro-batch (sequences), or set {p}.use_dynamic_bsz=true")
    if micro is not None and per_rank % micro:
        fail(f"{p}.ppo_micro_batch_size_per_gpu", micro,
             f"does not divide the per-rank mini-batch ({section.ppo_mini_batch_size} prompts x rollout.n {n} / "
             f"{dp} DP ranks = {per_rank} sequences); use {divisor_choices(per_rank)}")
    return BatchPlan(mini_batch_size=mini, mini_batch_size_per_rank=per_rank, micro_batch_size_per_rank=micro,
                     grad_accum_steps=None if micro is None else per_rank // micro,
                     mini_batches_per_epoch=cfg.data.train_batch_size // section.ppo_mini_batch_size,
                     ppo_epochs=section.ppo_epochs, update=update_split(section))
