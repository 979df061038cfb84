"""Advantage estimators: GAE, GRPO, RLOO, REINFORCE++ (with and without baseline), ReMax.

Shapes: token tensors are (batch, response_len); `response_mask` is 1 on response tokens that
count and 0 on padding (or on tokens to skip, such as tool output in multi-turn responses).
Every estimator returns `(advantages, returns)`, both (batch, response_len) and zero where the
mask is 0, and runs under `torch.no_grad()` (advantages are targets, not part of the graph).

Outcome estimators (GRPO, RLOO, REINFORCE++-baseline) take `group_index`: one hashable id per
row, rows sharing an id are responses to the same prompt. A group of one response has no
baseline, so its advantage is its raw score, never NaN.

Whitening (GAE, REINFORCE++, REINFORCE++-baseline) is over the GLOBAL batch: under data
parallelism each rank holds a shard, and `batch_sum` (a callable summing a tensor of local
statistics over every shard, i.e. the trainer's all-reduce over the DP group; None when this
batch is the whole batch) turns the shard's sums into the batch's, so the advantages do not
depend on the DP size. It is called the same number of times on every rank (collective).

`compute_advantage(name, **fields)` dispatches by the config name
(`algorithm.adv_estimator`) to `ADVANTAGE_ESTIMATORS[name]`, passing only the fields that
estimator takes. Each estimator registers itself (`register_advantage`) with what the config
needs to know: whether it compares the n responses of a prompt (rollout.n >= 2) and whether it
needs a critic's values.

Tests: tests/test_advantages.py, tests/test_replay_dynamic.py, tests/test_config_keys.py
"""
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "masked_mean", "masked_var", "masked_whiten",
    "compute_gae", "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_advantage", "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage", "ADVANTAGE_ESTIMATORS", "compute_advantage", "register_advantage",
]


@dataclass(frozen=True)
class Estimator:
    fn: Callable
    group: bool = False   # compares the responses to one prompt: needs rollout.n >= 2
    critic: bool = False  # needs the critic's values


ADVANTAGE_ESTIMATORS: dict = {}  # algorithm.adv_estimator -> Estimator


def register_advantage(name, group=False, critic=False):
    def add(fn):
        ADVANTAGE_ESTIMATORS[name] = Estimator(fn, group, critic)
        return fn
    return add


# ---------------------------------------------------------------------------------------------
# masked statistics
# ---------------------------------------------------------------------------------------------

def masked_mean(values, mask, dim=None):
    """Mean of `values` where `mask` is 1, over `dim` (all elements when None).

    An empty mask (nothing selected) gives 0, not NaN.
    """
    mask = mask.to(values.dtype)
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp_min(1)


def _batch_mean_var(values, mask, unbiased=True, batch_sum=None):
    """(mean, variance) in float64 over the elements where `mask` is 1 of the whole batch: this
    shard's sums, summed over the shards by `batch_sum` when given (see the module doc).

    Two passes, the mean first, then the mean squared deviation from it: the one-process
    formula (no E[x^2] - E[x]^2 cancellation). Bessel's correction n / (n - 1) when
    `unbiased` and n > 1; with n <= 1 the variance is 0, not NaN.
    """
    keep = mask > 0
    zero = torch.zeros((), dtype=torch.float64, device=values.device)
    sums = torch.stack([torch.where(keep, values.double(), zero).sum(), keep.sum().double()])
    if batch_sum is not None:
        sums = batch_sum(sums)
    total, count = sums
    mean = total / count.clamp_min(1)
    square_dev = torch.where(keep, (values.double() - mean) ** 2, zero).sum().reshape(1)
    if batch_sum is not None:
        square_dev = batch_sum(square_dev)
    var = square_dev[0] / count.clamp_min(1)
    if unbiased and count > 1:
        var = var * count / (count - 1)
    return mean, var


def masked_var(values, mask, unbiased=True, batch_sum=None):
    """Variance of `values` over all elements where `mask` is 1 (of every shard of the batch
    when `batch_sum` is given). `unbiased` applies Bessel's correction n / (n - 1) when n > 1;
    with n <= 1 the variance is 0 (a single value has no spread), not NaN.
    """
    return _batch_mean_var(values, mask, unbiased, batch_sum)[1].to(values.dtype)


def masked_whiten(values, mask, shift_mean=True, eps=1e-8, batch_sum=None):
    """(values - mean) / sqrt(var + eps) with mean and unbiased variance over masked elements
    only (of every shard of the batch when `batch_sum` is given).

    With `shift_mean=False` the mean is added back (scale only). Masked-out positions are
    returned as 0 so padding never carries a value.
    """
    mean, var = _batch_mean_var(values, mask, True, batch_sum)
    whitened = (values.double() - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask > 0, whitened, torch.zeros_like(whitened)).to(values.dtype)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _check_token_shapes(response_mask, **tensors):
    for name, tensor in tensors.items():
        if tensor.shape != response_mask.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but response_mask has "
                             f"{tuple(response_mask.shape)}; pass both as (batch, response_len)")


def _group_ids(group_index, batch_size, device):
    """Map any per-row group ids (tensor, numpy array or list of hashables) to 0..G-1."""
    if len(group_index) != batch_size:
        raise ValueError(f"group_index has {len(group_index)} entries but the batch has "
                         f"{batch_size} rows; pass one prompt id (uid) per response")
    if isinstance(group_index, torch.Tensor):
        return torch.unique(group_index, return_inverse=True)[1].to(device)
    dense = {}
    ids = [dense.setdefault(g.item() if hasattr(g, "item") else g, len(dense)) for g in group_index]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _group_stats(scores, ids):
    """Per-row group mean, unbiased group std and group size (each broadcast back to rows)."""
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, ids, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, ids, scores)
    mean = (total / count)[ids]
    sq_dev = torch.zeros_like(count).index_add_(0, ids, (scores - mean) ** 2)
    std = (sq_dev / (count - 1).clamp_min(1)).sqrt()[ids]
    return mean, std, count[ids]


def _sequence_scores(token_level_rewards, response_mask):
    return (token_level_rewards * response_mask).sum(dim=-1)


# ---------------------------------------------------------------------------------------------
# estimators
# ---------------------------------------------------------------------------------------------

@register_advantage("gae", critic=True)
@torch.no_grad()
def compute_gae(token_level_rewards, values, response_mask, gamma, lam, batch_sum=None):
    """Generalised advantage estimation (Schulman et al. 2016).

    Going backwards over valid tokens t (masked tokens are skipped: they neither add a TD error
    nor interrupt the recursion, and the value after the last valid token is 0):
        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
    returns = A + V (before whitening); advantages are whitened over the valid tokens of the
    whole batch (`batch_sum`: see the module doc).
    """
    _check_token_shapes(response_mask, token_level_rewards=token_level_rewards, values=values)
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage_t
        # a masked token passes the later token's value and advantage through unchanged
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        next_advantage = torch.where(mask[:, t] > 0, advantage_t, next_advantage)
    returns = (advantages + values) * mask
    return masked_whiten(advantages, mask, batch_sum=batch_sum), returns


@register_advantage("grpo", group=True)
@torch.no_grad()
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, group_index,
                                   norm_adv_by_std_in_grpo=True, epsilon=1e-6):
    """GRPO (Shao et al. 2024): score = sum of the row's rewards, normalised within its group.

        A_i = (score_i - mean_group) / (std_group + epsilon)   (std: unbiased)
        A_i =  score_i - mean_group                            (norm_adv_by_std_in_grpo=False)
    broadcast to every valid token. A group of one gets A_i = score_i.
    """
    _check_token_shapes(response_mask, token_level_rewards=token_level_rewards)
    scores = _sequence_scores(token_level_rewards, response_mask)
    ids = _group_ids(group_index, scores.shape[0], scores.device)
    mean, std, count = _group_stats(scores, ids)
    advantage = scores - mean
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std + epsilon)
    advantage = torch.where(count < 2, scores, advantage)
    advantages = advantage[:, None] * response_mask
    return advantages, advantages


@register_advantage("rloo", group=True)
@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, group_index):
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline within the group.

        A_i = score_i - (sum_group - score_i) / (n - 1)
    broadcast to every valid token. A group of one (n = 1) gets A_i = score_i.
    """
    _check_token_shapes(response_mask, token_level_rewards=token_level_rewards)
    scores = _sequence_scores(token_level_rewards, response_mask)
    ids = _group_ids(group_index, scores.shape[0], scores.device)
    mean, _, count = _group_stats(scores, ids)
    # for a group of one the numerator is 0, so the baseline is 0 and A_i = score_i
    others_mean = (mean * count - scores) / (count - 1).clamp_min(1)
    advantage = scores - others_mean
    advantages = advantage[:, None] * response_mask
    return advantages, advantages


def _discounted_returns(token_level_rewards, response_mask, gamma):
    """G_t = sum over valid k >= t of gamma^(number of valid tokens between t and k) * r_k."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        updated = token_level_rewards[:, t] + gamma * running
        running = torch.where(mask[:, t] > 0, updated, running)
        returns[:, t] = running
    return returns * mask


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_advantage(token_level_rewards, response_mask, gamma,
                                          batch_sum=None):
    """REINFORCE++ (Hu 2025): discounted token returns, whitened over the whole batch.

        G_t = r_t + gamma * G_(t+1)   over valid tokens;   A = whiten(G)
    """
    _check_token_shapes(response_mask, token_level_rewards=token_level_rewards)
    returns = _discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask, batch_sum=batch_sum), returns


@register_advantage("reinforce_plus_plus_baseline", group=True)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantage(token_level_rewards, response_mask,
                                                   group_index, batch_sum=None):
    """REINFORCE++ with a group-mean baseline: A_i = score_i - mean_group, broadcast to valid
    tokens, then whitened over all valid tokens of the batch. A group of one keeps its score.
    """
    _check_token_shapes(response_mask, token_level_rewards=token_level_rewards)
    scores = _sequence_scores(token_level_rewards, response_mask)
    ids = _group_ids(group_index, scores.shape[0], scores.device)
    mean, _, count = _group_stats(scores, ids)
    advantage = torch.where(count < 2, scores, scores - mean)
    advantages = masked_whiten(advantage[:, None] * response_mask, response_mask,
                               batch_sum=batch_sum)
    return advantages, advantages


@register_advantage("remax")
@torch.no_grad()
def compute_remax_advantage(token_level_rewards, reward_baselines, response_mask):
    """ReMax (Li et al. 2023): undiscounted return-to-go minus the greedy response's reward.

        G_t = sum_{k >= t} r_k (valid k);   A_t = G_t - baseline_i
    `reward_baselines` is (batch,): the reward of each prompt's greedy response.
    """
    _check_token_shapes(response_mask, token_level_rewards=token_level_rewards)
    if reward_baselines.shape != response_mask.shape[:1]:
        raise ValueError(f"reward_baselines has shape {tuple(reward_baselines.shape)}; pass one "
                         f"baseline per row, shape ({response_mask.shape[0]},)")
    returns = _discounted_returns(token_level_rewards, response_mask, 1.0)
    advantages = (returns - reward_baselines[:, None]) * response_mask
    return advantages, returns




def compute_advantage(name, **fields):
    """Run the estimator registered as `name` (config `algorithm.adv_estimator`).

    `fields` may hold more than the estimator needs (token_level_rewards, values,
    response_mask, group_index, reward_baselines, gamma, lam, ...); only the ones it takes are
    passed. Returns (advantages, returns).
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; set algorithm.adv_estimator to "
                         f"one of {sorted(ADVANTAGE_ESTIMATORS)}")
    estimator = ADVANTAGE_ESTIMATORS[name].fn
    params = inspect.signature(estimator).parameters
    missing = [p for p, spec in params.items()
               if spec.default is inspect.Parameter.empty and p not in fields]
    if missing:
        raise ValueError(f"advantage estimator {name!r} needs {missing}; pass them to "
                         f"compute_advantage")
    return estimator(**{p: fields[p] for p in params if p in fields})
