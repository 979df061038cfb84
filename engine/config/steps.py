"""Steps: how many a run trains (trainer.total_training_steps, the optimizers' schedules) and
what every step does, decided once from the config (`StepFlags`, `Derived.step`): which passes
run and what they keep. The trainer reads these flags; it never recomputes them.

Tests: tests/test_derive_parts.py, tests/test_config.py, tests/test_kl_registry.py
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.algorithms.kl import KL_KINDS
from engine.algorithms.correction import plan_of
from engine.config.checks import fail
from engine.config.schema import TridentConfig

__all__ = ["StepFlags", "step_flags", "needs_old_log_probs", "uses_reference", "total_training_steps",
           "fill_steps"]


@dataclass(frozen=True)
class StepFlags:
    """What a PPO step does, the same on every rank (a skipped pass has collectives)."""
    # the experience needs the old log-probs before the advantages (truncated IS weighs them
    # with pi_old / mu; replayed groups make the batch more than one mini-batch)
    needs_old_log_probs: bool
    # on-policy (one epoch of one mini-batch, no in-reward KL, no off-policy pool, nothing above):
    # the update's own forward gives the old log-probs, so their pass is skipped
    reuse_old_log_prob: bool
    # the exact KL (KL_KINDS[kind].exact) in the reward / in the actor's loss
    full_kl_in_reward: bool
    full_kl_in_loss: bool
    # a KL term (loss or in-reward) reads the reference log-probs (implicit rewards use it too)
    kl_uses_ref: bool
    # the reference pass keeps its hidden states for the exact KL; in the reward it runs before
    # the old-log-prob pass, which computes the KL from them
    keep_ref_hidden: bool


def needs_old_log_probs(cfg: TridentConfig) -> bool:
    """Whether the step's experience needs its own old-log-prob pass (see StepFlags)."""
    replay = cfg.algorithm.replay
    return plan_of(cfg.algorithm.rollout_correction).active or (replay.enable and replay.ratio > 0)


def step_flags(cfg: TridentConfig, actor_plan) -> StepFlags:
    """The flags of a resolved config (`Derived.config`) whose actor splits by `actor_plan`."""
    actor, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    needs = needs_old_log_probs(cfg)
    in_reward = alg.use_kl_in_reward and KL_KINDS[alg.kl_penalty].exact
    in_loss = actor.use_kl_loss and KL_KINDS[actor.kl_loss_type].exact
    return StepFlags(
        needs_old_log_probs=needs,
        reuse_old_log_prob=(actor.on_policy_old_log_prob and actor_plan.ppo_epochs == 1
                            and actor_plan.mini_batches_per_epoch == 1 and not alg.use_kl_in_reward
                            and cfg.trainer.off_policy_steps == 0 and not needs),
        full_kl_in_reward=in_reward, full_kl_in_loss=in_loss,
        kl_uses_ref=actor.use_kl_loss or alg.use_kl_in_reward,
        keep_ref_hidden=in_reward or in_loss)


def uses_reference(cfg: TridentConfig) -> bool:
    """A KL term, or DPO's implicit token reward (its log-ratio to the reference), needs the
    reference model."""
    return (cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
            or cfg.reward_model.token_level == "implicit")


def total_training_steps(cfg: TridentConfig, dataset_len: int) -> int:
    """trainer.total_training_steps if set, else epochs x full batches (the last partial one is dropped)."""
    if cfg.trainer.total_training_steps is not None:
        return cfg.trainer.total_training_steps
    batch = cfg.data.train_batch_size
    steps = (dataset_len // batch) * cfg.trainer.total_epochs
    if steps < 1:
        fail("data.train_batch_size", batch, f"the training set has only {dataset_len} prompts, fewer than one "
             f"batch; lower data.train_batch_size to at most {dataset_len}")
    return steps


def fill_steps(out: TridentConfig, dataset_len) -> None:
    """trainer.total_training_steps and each optimizer's schedule (its total, the warmup from
    lr_warmup_steps_ratio) on `out`, when the count is known (set, or `dataset_len` given)."""
    trainer = out.trainer
    if dataset_len is None and trainer.total_training_steps is None:
        return
    steps = total_training_steps(out, dataset_len if dataset_len is not None else 0)
    trainer.total_training_steps = steps
    for prefix, optim in (("actor_rollout_ref.actor.optim", out.actor_rollout_ref.actor.optim),
                          ("critic.optim", out.critic.optim)):
        if optim.total_training_steps not in (None, steps):
            fail(f"{prefix}.total_training_steps", optim.total_training_steps,
                 f"is derived ({steps} steps); set trainer.total_training_steps instead and leave this null")
        optim.total_training_steps = steps
        if optim.lr_warmup_steps < 0:
            optim.lr_warmup_steps = int(optim.lr_warmup_steps_ratio * steps)
