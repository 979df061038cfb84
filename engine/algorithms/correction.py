"""Off-policy corrections of the policy gradient, pure torch.

Truncated importance sampling (verl's `algorithm.rollout_correction`): responses drawn from a
behaviour policy mu (the rollout engine, a logged dataset, a replayed batch) and trained
with PPO against pi_old (the current weights, recomputed) get the weight

    token:     w_t = min(pi_old(y_t) / mu(y_t), C)
    sequence:  w_t = min(prod_t pi_old(y_t) / mu(y_t), C)      (the same for every token of a row)

on their policy-gradient term. The weight is positive and detached, and PPO's clipped term is
positively homogeneous in the advantage (max(-A w r, -A w clip(r)) = w max(-A r, -A clip(r)),
likewise the dual clip), so weighting the advantages weights the policy loss exactly, whatever
the aggregation, without touching the loss kernels.

PF-PPO's reweighting (engine/experience/replay.py) is the same kind of weight: `score_weights`.

Tests: tests/test_experience_parts.py, tests/test_gpu_check.py
"""
import torch

MAX_LOG_RATIO = 20.0  # as engine/algorithms/losses.py: exp() beyond this overflows or dominates


@torch.no_grad()
def rollout_is_weights(old_log_probs, rollout_log_probs, response_mask, level="token", threshold=2.0):
    """(weights [B, L] zero off the mask, local sums for the metrics).

    The sums (over this rank's tokens for `token`, its sequences for `sequence`) add up over
    ranks: `ratio` (untruncated pi_old / mu), `weight` (the truncated weight), `clipped` (ratios
    above the threshold) and `count`; `correction_metrics` turns global sums into means."""
    if level not in ("token", "sequence"):
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r}: use 'token' or 'sequence'")
    if not threshold > 0:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold={threshold!r} must be > 0")
    mask = response_mask.bool()
    log_ratio = torch.where(mask, old_log_probs.double() - rollout_log_probs.double(),
                            torch.zeros((), dtype=torch.float64))
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True)
        counted = mask.any(-1, keepdim=True)
    else:
        counted = mask
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    weight = ratio.clamp(max=threshold)
    sums = {"ratio": float(ratio[counted].sum()), "weight": float(weight[counted].sum()),
            "clipped": float((ratio[counted] > threshold).sum()), "count": float(counted.sum())}
    weights = torch.where(mask, weight.expand_as(mask), torch.zeros((), dtype=torch.float64))
    return weights.to(old_log_probs.dtype), sums


def correction_metrics(sums):
    """verl's metric names from global sums."""
    count = max(sums["count"], 1.0)
    return {"rollout_corr/ratio_mean": sums["ratio"] / count,
            "rollout_corr/rollout_is_mean": sums["weight"] / count,
            "rollout_corr/rollout_is_ratio_fraction_high": sums["clipped"] / count}


@torch.no_grad()
def score_weights(scores, power, global_sum=None, global_count=None):
    """PF-PPO's reweighting of responses by their scores: w_i = |s_i|^power, scaled to mean 1
    over the whole batch (`global_sum` / `global_count`: the sum of |s|^power and the number of
    responses over every rank; default this batch's), so the update's size does not change."""
    raw = scores.double().abs().pow(power)
    total = float(raw.sum()) if global_sum is None else global_sum
    count = float(raw.numel()) if global_count is None else global_count
    if total <= 0:  # every score 0: nothing to prefer, leave the batch as it is
        return torch.ones_like(raw)
    return raw * (count / total)


@torch.no_grad()
def probs_diff_sums(old_log_probs, rollout_log_probs, response_mask):
    """How far the rollout engine's probabilities of its own tokens are from the trainer's, on
    the same weights (verl's training/rollout_probs_diff_*): |exp(pi_old) - exp(mu)| per response
    token. Returns (max, sum, count) over the masked tokens, to combine over ranks."""
    mask = response_mask.bool()
    diff = (old_log_probs.double().exp() - rollout_log_probs.double().exp()).abs()[mask]
    return (float(diff.max()) if diff.numel() else 0.0), float(diff.sum()), float(diff.numel())
