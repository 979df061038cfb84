"""Bounded staleness (trainer.off_policy_steps = k): the policy version of every response token,
the refusal of samples too old to train on, and the staleness metrics.

A policy version is the number of updates the weights had applied (a resumed run counts on from
its step): the separate pool stamps each token it generates with the version of the weights that
produced it (engine/rollout/pool.py, batches.with_versions), and the batch carries them as
`rollout_versions` [rows, L] beside `rollout_log_probs` (-1 on padding). Training step s runs on
policy version s - 1, so a token of version v is `s - 1 - v` versions behind.

    refuse_stale(batch, current, k) zeroes the response_mask of every sample whose oldest trained
                                    token is more than k versions behind (no loss, no gradient);
                                    returns how many samples it refused
    staleness_metrics(...)          over the global batch's trained tokens: rollout/staleness/
                                    {min,mean,max} versions behind, rollout/staleness/hist/<j>
                                    (the fraction of tokens j = 0..k versions behind) and
                                    rollout/stale_samples (refused)

Tests: tests/test_staleness.py, tests/test_rollout_pool.py
"""
import torch
import torch.distributed as dist

from engine.rollout.batches import VERSIONS


def versions_behind(batch, current):
    """[rows, L] versions behind the policy `current` of every response token (0 on padding)."""
    return (current - batch[VERSIONS]).clamp(min=0) * (batch[VERSIONS] >= 0)


def refuse_stale(batch, current, k):
    """Samples with a trained token more than `k` versions behind `current` are not trained on:
    their response_mask is zeroed in place. Returns the number refused (this rank's)."""
    mask = batch["response_mask"]
    oldest = (versions_behind(batch, current) * mask).amax(dim=-1)
    stale = oldest > k
    if bool(stale.any()):
        batch["response_mask"] = mask * (~stale).unsqueeze(-1).to(mask.dtype)
    return int(stale.sum())


def staleness_metrics(batch, current, k, refused, group=None):
    """The global batch's staleness: over the tokens trained on (response_mask after refusal),
    the min / mean / max versions behind and the fraction 0..k behind; the refused samples summed.
    Collective over `group` (the DP group: every replica's shard)."""
    mask = batch["response_mask"].bool()
    behind = versions_behind(batch, current)[mask].double()
    counts = torch.bincount(behind.long(), minlength=k + 1)[:k + 1].double()
    ages = versions_behind(batch, current).masked_fill(~mask, -1)  # partial rollouts: tokens of several versions
    spans = float(((ages.amax(-1) > ages.masked_fill(~mask, 1 << 30).amin(-1)) & mask.any(-1)).sum())
    sums = torch.cat([torch.tensor([behind.sum(), float(behind.numel()), float(refused), spans],
                                   dtype=torch.float64), counts])
    low = torch.tensor([behind.min() if behind.numel() else float("inf")], dtype=torch.float64)
    high = torch.tensor([behind.max() if behind.numel() else float("-inf")], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sums, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    tokens = float(sums[1])
    out = {"rollout/staleness/min": float(low) if tokens else 0.0,
           "rollout/staleness/mean": float(sums[0]) / tokens if tokens else 0.0,
           "rollout/staleness/max": float(high) if tokens else 0.0,
           "rollout/stale_samples": float(sums[2]), "rollout/partial_samples": float(sums[3])}
    out.update({f"rollout/staleness/hist/{j}": float(sums[4 + j]) / tokens if tokens else 0.0
                for j in range(k + 1)})
    return out
