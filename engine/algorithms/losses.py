"""PPO losses: policy (clip, dual-clip, clip-higher, GSPO), value (clipped), entropy, KL.

Split invariance. A mini-batch is cut into micro-batches (and across DP ranks, PP/CP layouts)
in whatever way memory allows; the update must not depend on that cut. So every loss here is

    loss(micro-batch) = SUM of this micro-batch's per-token / per-sequence terms
                        / GLOBAL normaliser of the whole mini-batch,

and summing the micro-batch losses over micro-batches and DP ranks (what gradient
accumulation plus the DP all-reduce-sum do) gives exactly the full mini-batch loss, values and
gradients. The caller computes the global counts ONCE per mini-batch: sum
`LossNormaliser.from_mask(mask)` over its micro-batches, all-reduce-sum the counts over DP
ranks, and pass the result to every micro-batch's loss. Without a normaliser the local counts
are used, which is right only when the batch is the whole mini-batch.

Metrics (`actor/pg_clipfrac`, `actor/ppo_kl`, ...) are returned as detached 0-dim tensors and are
token means computed the same way (sum / global token count), so they too add up across
micro-batches and ranks to the mini-batch value.

Shapes: token tensors are (batch, response_len); `response_mask` is 1 on tokens that count.

Tests: tests/test_losses.py, tests/test_full_kl_actor.py, tests/test_cp_workers.py
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = [
    "LOSS_AGG_MODES", "POLICY_LOSSES", "LossNormaliser", "agg_loss", "policy_loss",
    "policy_loss_gspo", "value_loss", "entropy_bonus", "kl_loss", "apply_kl_penalty",
    "policy_token_losses", "token_weights", "register_policy_loss",
]

# loss_agg_mode -> a row's loss from (its token sum, its token count, the response length), or
# None for token-mean (one sum over every token); the seq-* modes then average over sequences
LOSS_AGG_MODES: dict = {
    "token-mean": None,
    "seq-mean-token-sum": lambda sums, counts, length: sums,
    "seq-mean-token-mean": lambda sums, counts, length: sums / counts.clamp_min(1),
    "seq-mean-token-sum-norm": lambda sums, counts, length: sums / length,
}


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss: `loss(log_prob, old, adv, mask, cfg, loss_agg_mode, normaliser)` ->
    (pg_loss, metrics); `token_terms(lp, old_lp, adv, cfg)` when it is a weighted sum of
    per-token terms (each token's term depends on its own log-prob only), which lets the actor
    fuse it into the log-prob kernel (kernels.logprob.linear_token_loss)."""
    loss: Callable
    token_terms: Optional[Callable] = None


POLICY_LOSSES: dict = {}  # actor.policy_loss -> PolicyLoss


def register_policy_loss(name, token_terms=None):
    """Decorator: `actor_rollout_ref.actor.policy_loss=<name>` selects this loss."""
    def add(fn):
        POLICY_LOSSES[name] = PolicyLoss(fn, token_terms)
        return fn
    return add


def _agg_mode(loss_agg_mode):
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; use one of {tuple(LOSS_AGG_MODES)}")
    return LOSS_AGG_MODES[loss_agg_mode]

# exp() of a log-ratio beyond this overflows or dominates the batch; clamp before exp
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossNormaliser:
    """The global counts a micro-batch loss is divided by.

    global_token_count: valid tokens in the whole mini-batch (all micro-batches, all DP ranks).
    global_seq_count:   sequences with at least one valid token, counted the same way.
    max_response_len:   constant length for `seq-mean-token-sum-norm` (the configured
                        response length), so it does not depend on a micro-batch's padding.
    """
    global_token_count: float
    global_seq_count: float
    max_response_len: Optional[int] = None

    @classmethod
    def from_mask(cls, response_mask, max_response_len=None):
        """Local counts of one (micro-)batch; add them up and all-reduce to get global ones."""
        tokens = float(response_mask.sum())
        seqs = float((response_mask.sum(dim=-1) > 0).sum())
        return cls(tokens, seqs, max_response_len)

    def __add__(self, other):
        if self.max_response_len != other.max_response_len:
            raise ValueError(f"cannot add LossNormalisers with max_response_len "
                             f"{self.max_response_len} and {other.max_response_len}")
        return LossNormaliser(self.global_token_count + other.global_token_count,
                              self.global_seq_count + other.global_seq_count,
                              self.max_response_len)

    def as_kwargs(self):
        return dict(global_token_count=self.global_token_count,
                    global_seq_count=self.global_seq_count,
                    max_response_len=self.max_response_len)


def _normaliser_kwargs(normaliser):
    return {} if normaliser is None else normaliser.as_kwargs()


def agg_loss(loss_mat, mask, loss_agg_mode, global_token_count=None, global_seq_count=None,
             max_response_len=None):
    """Aggregate a (batch, response_len) loss matrix into a scalar.

    token-mean:              sum over valid tokens / global_token_count
    seq-mean-token-sum:      sum_i (sum_t l_it) / global_seq_count
    seq-mean-token-mean:     sum_i (sum_t l_it / n_i) / global_seq_count    (n_i: row's tokens)
    seq-mean-token-sum-norm: sum_i (sum_t l_it / max_response_len) / global_seq_count

    Global counts cover the whole mini-batch across micro-batches and DP ranks (see the module
    doc); None means "use this batch's own count". `max_response_len` None means
    loss_mat.shape[-1]. A zero count divides by 1 (the sum is 0 then anyway).
    """
    mask = mask.bool()
    # where, not multiply: padding may hold inf/NaN (e.g. -inf log-probs) and inf * 0 is NaN
    token_sums = torch.where(mask, loss_mat, torch.zeros_like(loss_mat)).sum(dim=-1)
    row_loss = _agg_mode(loss_agg_mode)
    if row_loss is None:
        count = mask.sum() if global_token_count is None else global_token_count
        return token_sums.sum() / _at_least_one(count)
    token_counts = mask.sum(dim=-1).to(loss_mat.dtype)
    seq_losses = row_loss(token_sums, token_counts,
                          loss_mat.shape[-1] if max_response_len is None else max_response_len)
    count = (token_counts > 0).sum() if global_seq_count is None else global_seq_count
    return seq_losses.sum() / _at_least_one(count)


def _at_least_one(count):
    return count.clamp_min(1) if isinstance(count, torch.Tensor) else max(count, 1)


def _token_mean_metric(values, mask, normaliser):
    """A detached token-mean metric that sums across micro-batches like the losses."""
    return agg_loss(values.detach().to(torch.float32), mask, "token-mean",
                    **_normaliser_kwargs(normaliser))


def _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high):
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    for name, value in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        if value is None or value < 0:
            raise ValueError(f"{name}={value} must be a number >= 0 "
                             f"(actor_rollout_ref.actor.{name})")
    return low, high


def policy_token_losses(log_prob, old_log_prob, advantages, clip_ratio=0.2, clip_ratio_low=None,
                        clip_ratio_high=None, clip_ratio_c=3.0):
    """The per-token terms of `policy_loss` (any shape): (losses, clip_active, lower_active,
    log_ratio). Each token's loss depends on its own log-prob only, which is what lets the
    actor fuse it into the log-prob kernel (kernels.logprob.linear_token_loss)."""
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1.0 for dual-clip "
                         f"(actor_rollout_ref.actor.clip_ratio_c), or None to disable it")
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    losses = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    lower_active = torch.zeros_like(clip_active)
    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c
        negative = advantages < 0
        lower_active = negative & (losses > dual_bound)
        losses = torch.where(negative, torch.minimum(losses, dual_bound), losses)

    return losses, clip_active, lower_active, log_ratio


def token_weights(response_mask, loss_agg_mode, global_token_count=None, global_seq_count=None,
                  max_response_len=None):
    """Per-token weights w with agg_loss(l, mask, mode, ...) == sum(where(mask, l, 0) * w):
    every aggregation mode is a weighted token sum once the counts are fixed (0 off the mask)."""
    mask = response_mask.bool()
    ones = mask.to(torch.float32)
    row_loss = _agg_mode(loss_agg_mode)
    if row_loss is None:
        count = mask.sum() if global_token_count is None else global_token_count
        return ones / _at_least_one(count)
    token_counts = ones.sum(dim=-1, keepdim=True)
    per_seq = row_loss(ones, token_counts, ones.shape[-1] if max_response_len is None else max_response_len)
    count = (token_counts > 0).sum() if global_seq_count is None else global_seq_count
    return per_seq / _at_least_one(count)


def _vanilla_token_terms(lp, old_lp, adv, cfg):
    return policy_token_losses(lp, old_lp, adv, cfg.clip_ratio, cfg.clip_ratio_low, cfg.clip_ratio_high,
                               cfg.clip_ratio_c)[0]


@register_policy_loss("vanilla", token_terms=_vanilla_token_terms)
def _vanilla(log_prob, old, adv, mask, cfg, loss_agg_mode, normaliser):
    """PPO clip with clip-higher (clip_ratio_low / high) and dual-clip (clip_ratio_c)."""
    return policy_loss(log_prob, old, adv, mask, clip_ratio=cfg.clip_ratio, clip_ratio_low=cfg.clip_ratio_low,
                       clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
                       loss_agg_mode=loss_agg_mode, normaliser=normaliser)


@register_policy_loss("gspo")  # a sequence-level ratio: not a sum of per-token terms
def _gspo(log_prob, old, adv, mask, cfg, loss_agg_mode, normaliser):
    return policy_loss_gspo(log_prob, old, adv, mask, clip_ratio_low=cfg.clip_ratio_low,
                            clip_ratio_high=cfg.clip_ratio_high, loss_agg_mode=loss_agg_mode,
                            normaliser=normaliser)


def policy_loss(log_prob, old_log_prob, advantages, response_mask, clip_ratio=0.2,
                clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                loss_agg_mode="token-mean", normaliser=None):
    """PPO clipped surrogate with clip-higher and dual-clip.

        r_t   = exp(clamp(logp_t - old_logp_t, -20, 20))
        l_t   = max(-A_t r_t, -A_t clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high))
        l_t   = min(l_t, -A_t clip_ratio_c)   where A_t < 0   (dual-clip, Ye et al. 2020)

    clip_ratio_low / clip_ratio_high default to clip_ratio (clip-higher, DAPO, sets high > low).
    clip_ratio_c=None turns dual-clip off; otherwise it must be > 1.
    Returns (pg_loss, metrics) with metrics `actor/pg_clipfrac` (the clip bound was active),
    `actor/pg_clipfrac_lower` (the dual-clip bound was active), `actor/ppo_kl`
    (mean of old_logp - logp).
    """
    losses, clip_active, lower_active, log_ratio = policy_token_losses(
        log_prob, old_log_prob, advantages, clip_ratio, clip_ratio_low, clip_ratio_high,
        clip_ratio_c)
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode, **_normaliser_kwargs(normaliser))
    metrics = {
        "actor/pg_clipfrac": _token_mean_metric(clip_active, response_mask, normaliser),
        "actor/pg_clipfrac_lower": _token_mean_metric(lower_active, response_mask, normaliser),
        "actor/ppo_kl": _token_mean_metric(-log_ratio, response_mask, normaliser),
    }
    return pg_loss, metrics


def policy_loss_gspo(log_prob, old_log_prob, advantages, response_mask, clip_ratio_low=3e-4,
                     clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean",
                     normaliser=None):
    """GSPO (Zheng et al. 2025): clip a sequence-level importance ratio.

        log s_i  = mean over the row's valid tokens of (logp_t - old_logp_t)
        s_it     = sg(s_i) * exp(logp_t - sg(logp_t))     (value s_i, gradient s_i * dlogp_t)
        l_it     = max(-A_it s_it, -A_it clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))

    With seq-mean-token-mean (the default) the gradient of a row is s_i times the mean of its
    token gradients, GSPO's sequence-level objective. The log-ratio is clamped to +-20.
    Returns (pg_loss, metrics) like `policy_loss` (`actor/pg_clipfrac_lower` is always 0).
    """
    low, high = _clip_bounds(None, clip_ratio_low, clip_ratio_high)
    mask = response_mask.bool()
    token_log_ratio = log_prob - old_log_prob
    seq_log_ratio = (torch.where(mask, token_log_ratio, torch.zeros_like(token_log_ratio)).sum(-1)
                     / mask.sum(-1).clamp_min(1))
    log_ratio = seq_log_ratio.detach()[:, None] + log_prob - log_prob.detach()
    ratio = torch.exp(torch.clamp(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    losses = torch.maximum(unclipped, clipped)

    pg_loss = agg_loss(losses, response_mask, loss_agg_mode, **_normaliser_kwargs(normaliser))
    metrics = {
        "actor/pg_clipfrac": _token_mean_metric(clipped > unclipped, response_mask, normaliser),
        "actor/pg_clipfrac_lower": _token_mean_metric(torch.zeros_like(log_prob), response_mask,
                                                      normaliser),
        "actor/ppo_kl": _token_mean_metric(-token_log_ratio, response_mask, normaliser),
    }
    return pg_loss, metrics


def value_loss(values, old_values, returns, response_mask, cliprange_value,
               loss_agg_mode="token-mean", normaliser=None):
    """Clipped value loss: 0.5 * max((V - R)^2, (V_clip - R)^2),
    V_clip = clip(V, old_V - cliprange_value, old_V + cliprange_value).

    cliprange_value=None disables clipping. Returns (vf_loss, vf_clipfrac) where vf_clipfrac
    is the token mean of "the clipped term was larger".

    V itself is clamped (not old_V + clamp(V - old_V)): inside the range V_clip is then V
    bit for bit, so a token is counted as clipped only where the bound binds; in floating
    point old_V + (V - old_V) is not always V and would count unclipped tokens.
    """
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        losses, clip_active = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        if cliprange_value < 0:
            raise ValueError(f"cliprange_value={cliprange_value} must be >= 0 "
                             f"(critic.cliprange_value)")
        clipped_values = torch.clamp(values, old_values - cliprange_value,
                                     old_values + cliprange_value)
        clipped = (clipped_values - returns) ** 2
        losses, clip_active = torch.maximum(unclipped, clipped), clipped > unclipped
    vf_loss = 0.5 * agg_loss(losses, response_mask, loss_agg_mode,
                             **_normaliser_kwargs(normaliser))
    return vf_loss, _token_mean_metric(clip_active, response_mask, normaliser)


def entropy_bonus(entropy, response_mask, loss_agg_mode="token-mean", normaliser=None):
    """Aggregated token entropy; the actor subtracts `entropy_coeff * entropy_bonus(...)`."""
    return agg_loss(entropy, response_mask, loss_agg_mode, **_normaliser_kwargs(normaliser))


def kl_loss(log_prob, ref_log_prob, response_mask, kl_loss_type="low_var_kl",
            loss_agg_mode="token-mean", normaliser=None, full_kl=None):
    """KL to the reference policy as a loss term (actor_rollout_ref.actor.use_kl_loss):
    agg(kl_penalty(logp, ref_logp, kl_loss_type)). The actor adds `kl_loss_coef * kl_loss`.
    full / full+ take the exact per-token KL as `full_kl` (kernels.kl.linear_full_kl)."""
    from engine.algorithms.kl import kl_penalty  # sibling module, written separately

    kld = kl_penalty(log_prob, ref_log_prob, kl_loss_type, full_kl=full_kl)
    return agg_loss(kld, response_mask, loss_agg_mode, **_normaliser_kwargs(normaliser))


@torch.no_grad()
def apply_kl_penalty(token_level_scores, old_log_prob, ref_log_prob, response_mask, kl_coef,
                     kl_penalty_kind="kl", full_kl=None):
    """KL in the reward (algorithm.use_kl_in_reward):
        rewards_t = scores_t - kl_coef * kl_penalty(old_logp_t, ref_logp_t) * mask_t

    full / full+ (the same here: a reward has no gradient) take the exact per-token
    KL(pi_old || ref) as `full_kl`.

    Returns (token_level_rewards, metrics): `actor/reward_kl_penalty` is the batch mean of
    each row's token-mean KL (what the adaptive KL controller is updated with) and
    `actor/reward_kl_penalty_coeff` is kl_coef.
    """
    from engine.algorithms.kl import kl_penalty  # sibling module, written separately

    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_kind, full_kl=full_kl)
    kld = torch.where(mask > 0, kld, torch.zeros_like(kld))  # padding may hold inf
    rewards = token_level_scores - kl_coef * kld
    row_kl = kld.sum(-1) / mask.sum(-1).clamp_min(1)
    metrics = {
        "actor/reward_kl_penalty": row_kl.mean() if row_kl.numel() else row_kl.new_zeros(()),
        "actor/reward_kl_penalty_coeff": torch.tensor(float(kl_coef)),
    }
    return rewards, metrics
