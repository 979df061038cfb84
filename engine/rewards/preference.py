"""Preference pairs and reward models -> token-level rewards.

Two documented schemes for offline preference distillation, both on right-padded [B, L] tensors:

* `margin_token_rewards` (Bradley-Terry target): the chosen response earns +margin and the
  rejected one -margin, spread evenly over their valid tokens, so each sequence's reward sums to
  +-margin whatever its length.
* `implicit_token_rewards` (DPO implicit reward): r_t = beta * (log pi(y_t) - log pi_ref(y_t)) on
  valid tokens; summed over a response it is DPO's implicit sequence reward.
  `pair_preference_probability` turns the two sums into Bradley-Terry's P(chosen > rejected).

A reward model (a Megatron model with a scalar head, implemented in engine/workers) plugs in
through `RewardModelScorer`; the RewardManager adds its scores to the rule scores.

Tests: tests/test_rewards.py, tests/test_token_rewards.py
"""
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RewardModelScorer(Protocol):
    def score(self, batch) -> torch.Tensor:
        """One scalar score per sequence, shape [B]."""
        ...


def _check_mask(name, mask, like=None):
    if mask.dim() != 2:
        raise ValueError(f"{name} must be [B, L], got shape {tuple(mask.shape)}")
    if like is not None and mask.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(like.shape)}")


def margin_token_rewards(chosen_mask, rejected_mask, margin=1.0):
    """(chosen_rewards, rejected_rewards), each [B, L]: +-margin spread over the valid tokens."""
    _check_mask("chosen_mask", chosen_mask)
    _check_mask("rejected_mask", rejected_mask)
    if chosen_mask.shape[0] != rejected_mask.shape[0]:
        raise ValueError(f"chosen batch {chosen_mask.shape[0]} != rejected batch {rejected_mask.shape[0]}")

    def spread(mask, total):
        mask = mask.float()
        return total * mask / mask.sum(-1, keepdim=True).clamp(min=1.0)

    return spread(chosen_mask, margin), spread(rejected_mask, -margin)


def implicit_token_rewards(policy_logprobs, ref_logprobs, response_mask, beta=0.1):
    """[B, L] per-token DPO implicit reward beta * (logp_policy - logp_ref), zero off the mask."""
    _check_mask("response_mask", response_mask, like=policy_logprobs)
    _check_mask("ref_logprobs", ref_logprobs, like=policy_logprobs)
    return beta * (policy_logprobs - ref_logprobs) * response_mask.to(policy_logprobs.dtype)


def pair_preference_probability(chosen_token_rewards, rejected_token_rewards):
    """[B] Bradley-Terry P(chosen preferred) = sigmoid(sum r_chosen - sum r_rejected)."""
    return torch.sigmoid(chosen_token_rewards.sum(-1) - rejected_token_rewards.sum(-1))
