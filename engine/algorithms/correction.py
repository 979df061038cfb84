"""Off-policy corrections of the policy gradient, and the rollout / training mismatch metrics.

Rollout correction (verl's `algorithm.rollout_correction`): responses drawn from a behaviour
policy mu (the rollout engine, a logged dataset, a replayed batch) and trained with PPO against
pi_old (the current weights, recomputed). With the per-token log-ratio l_t = log pi_old(y_t) -
log mu(y_t) on the response tokens, a level L gives each token the log-ratio

    token:      l_t
    sequence:   sum_s l_s                  (log of the product of the ratios; the same for the row)
    geometric:  (1 / n) sum_s l_s          (log of their geometric mean; n: the row's tokens)

and rho^L = exp(that) (bounded to exp(+-20) where it is exponentiated). Then

    truncated IS (rollout_is=L):  w_t = clamp(rho^L, rollout_is_threshold_lower, rollout_is_threshold)
                                  (no lower bound when null); rollout_is_batch_normalize divides w
                                  by its mean over the DP batch's tokens (token) or rows (sequence,
                                  geometric);
    rejection (rollout_rs=L):     a token is kept iff rollout_rs_threshold_lower <= rho^L <=
                                  rollout_rs_threshold (the whole row at sequence / geometric);
    veto:                         a row with any token ratio exp(l_t) < rollout_token_veto_threshold
                                  is dropped whole.

IcePop (token-level masked IS) is rollout_is=token with rollout_rs=token and an IS threshold at
or above the rejection's upper bound: w_t = rho_t on [lower, upper], the token masked outside.

Bypass mode (bypass_mode=true, verl's name): PPO's ratio is pi / mu, the rollout policy's
log-probs standing for the old ones in the policy loss, so its clip bounds how far the update
moves each token from the policy that sampled it, staleness included (a separate pool at
trainer.off_policy_steps=k: a token the k updates since its rollout already pushed past 1 + eps
gets no more gradient). The old-log-prob pass still runs: pi_old gives the mismatch metrics, the
rejection and veto ratios (which act as above) and the in-reward KL. Truncated IS is refused
with it: pi / mu already weighs each token by the whole mismatch.

The weight multiplies the advantages: it is positive and detached, and PPO's clipped term is
positively homogeneous in the advantage (max(-A w r, -A w clip(r)) = w max(-A r, -A clip(r)),
likewise the dual clip), so weighting the advantages weights the policy loss exactly, whatever
the aggregation. A rejected token leaves the policy update altogether (`loss_batch`: its policy,
KL and entropy terms and its place in the token / sequence counts), as verl's modified
response_mask; the critic and the step's data metrics keep every token.

Metrics, all over the DP batch (sums all-reduced, never means of means):
    mismatch_metrics (every step with rollout log-probs and an old-log-prob pass):
      training/rollout_probs_diff_{max,mean,std}: |exp(log pi_old) - exp(log mu)| per token
                                                  (std with n - 1, as torch.std)
      rollout_corr/mismatch_kl:    mean over tokens of log mu - log pi_old, the k1 estimator of
                                   KL(mu || pi_old) from mu's samples (verl's mismatch_kl /
                                   rollout_corr/kl); exactly 0 for equal log-probs
      rollout_corr/mismatch_k3_kl: mean of rho - 1 - log rho (k3, >= 0 per token)
    rollout_correction (the same steps, whether or not a correction is configured):
      rollout_corr/rollout_rs_masked_fraction      tokens left out (rejection and veto) / tokens
      rollout_corr/rollout_rs_seq_masked_fraction  rows with a token left out / rows
      rollout_corr/rollout_token_veto_fraction     rows vetoed / rows
      with rollout_is: rollout_corr/ratio_mean (rho^L before truncation), rollout_is_mean (after,
      before batch normalisation), rollout_is_ratio_fraction_high / _low (beyond the thresholds;
      per token at token level, per row otherwise), rollout_is_batch_norm_factor.

PF-PPO's reweighting (engine/experience/replay.py) is the same kind of weight: `score_weights`.

Tests: tests/test_rollout_correction.py, tests/test_experience_parts.py, tests/test_offline_ppo.py,
tests/test_gpu_check.py
"""
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from engine.batch import Batch

MAX_LOG_RATIO = 20.0  # as engine/algorithms/losses.py: exp() beyond this overflows or dominates
LEVELS = ("token", "sequence", "geometric")
# rollout_rs names: ours (verl 0.6's) and verl's newest k1 criteria, which bound the ratio itself
RS_LEVELS = {"token": "token", "sequence": "sequence", "geometric": "geometric",
             "token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}
PREFIX = "algorithm.rollout_correction"


@dataclass(frozen=True)
class CorrectionPlan:
    """The resolved keys of algorithm.rollout_correction (`plan_of`)."""
    is_level: Optional[str] = None
    is_upper: float = 2.0
    is_lower: Optional[float] = None
    batch_normalize: bool = False
    rs_level: Optional[str] = None
    rs_lower: float = 0.0
    rs_upper: float = math.inf
    veto: Optional[float] = None
    bypass: bool = False

    @property
    def masks(self) -> bool:
        return self.rs_level is not None or self.veto is not None

    @property
    def active(self) -> bool:
        """It needs the rollout's log-probs and an old-log-prob pass."""
        return self.is_level is not None or self.masks or self.bypass


def _bad(key, value, fix):
    return ValueError(f"{PREFIX}.{key}={value!r}: {fix}")


def _number(key, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(key, value, "expected a finite number")
    return float(value)


def _rs_bounds(rc):
    """(lower, upper) of rejection sampling: rollout_rs_threshold is the upper bound, or verl's
    'lower_upper' string; the lower bound is rollout_rs_threshold_lower, else 1 / upper."""
    value, lower = rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower
    if value is None:
        raise _bad("rollout_rs_threshold", None, f"rollout_rs={rc.rollout_rs!r} needs bounds; set the upper "
                   "bound (e.g. 2.0) or verl's 'lower_upper' (e.g. 0.5_2.0)")
    if isinstance(value, str):
        parts = value.split("_")
        try:
            numbers = [float(p) for p in parts]
        except ValueError:
            numbers = []
        if len(numbers) not in (1, 2) or len(parts) != len(numbers):
            raise _bad("rollout_rs_threshold", value, "expected a number or 'lower_upper' such as 0.5_2.0")
        if len(numbers) == 2:
            if lower is not None:
                raise _bad("rollout_rs_threshold_lower", lower, f"rollout_rs_threshold={value!r} "
                           "already gives the lower bound; remove one of them")
            lower = numbers[0]
        upper = numbers[-1]
    else:
        upper = _number("rollout_rs_threshold", value)
    lower = 1.0 / upper if lower is None and upper > 0 else lower
    if not (upper >= 1.0 and lower is not None and 0.0 <= lower <= 1.0):
        raise _bad("rollout_rs_threshold", value, f"the bounds [{lower}, {upper}] must keep a ratio of 1 "
                   "(no mismatch): lower in [0, 1], upper >= 1 (write 'lower_upper' with decimal points, "
                   "e.g. 0.5_2.0: YAML reads 0.5_2 as the number 0.52)")
    return float(lower), float(upper)


def plan_of(rc) -> CorrectionPlan:
    """The plan of a RolloutCorrectionConfig; ValueError 'key=value: fix' for a key that cannot act."""
    is_level, rs_name, veto = rc.rollout_is, rc.rollout_rs, rc.rollout_token_veto_threshold
    if is_level is not None and is_level not in LEVELS:
        raise _bad("rollout_is", is_level, f"use one of {', '.join(LEVELS)}, or null")
    if rc.bypass_mode and is_level is not None:
        raise _bad("rollout_is", is_level, "bypass_mode=true takes PPO's ratio against the rollout policy "
                   "(pi / mu), which already weighs each token by the whole mismatch: remove rollout_is "
                   "(rejection and the veto still act) or set bypass_mode=false")
    if is_level is None:
        for key, default in (("rollout_is_threshold", 2.0), ("rollout_is_threshold_lower", None),
                             ("rollout_is_batch_normalize", False)):
            if getattr(rc, key) != default:
                raise _bad(key, getattr(rc, key), "read only with rollout_is set (token, sequence or "
                           "geometric); set it or remove this key")
    upper = _number("rollout_is_threshold", rc.rollout_is_threshold)
    if upper < 1.0:
        raise _bad("rollout_is_threshold", rc.rollout_is_threshold,
                   "must be >= 1 (a ratio of 1, no mismatch, keeps its weight); set a value in that range")
    lower = rc.rollout_is_threshold_lower
    if lower is not None and not 0.0 < _number("rollout_is_threshold_lower", lower) <= 1.0:
        raise _bad("rollout_is_threshold_lower", lower, "must be in (0, 1]; or null for no lower bound")
    rs_level = None
    if rs_name is None:
        for key in ("rollout_rs_threshold", "rollout_rs_threshold_lower"):
            if getattr(rc, key) is not None:
                raise _bad(key, getattr(rc, key), "read only with rollout_rs set (token, sequence or "
                           "geometric); set it or remove this key")
        rs_lower, rs_upper = 0.0, math.inf
    else:
        rs_level = RS_LEVELS.get(rs_name)
        if rs_level is None:
            raise _bad("rollout_rs", rs_name, "use token, sequence or geometric (verl's token_k1, seq_sum_k1, "
                       "seq_mean_k1 too); verl's divergence criteria (k2, k3, seq_max) and lists are not here")
        rs_lower, rs_upper = _rs_bounds(rc)
    if veto is not None and not 0.0 < _number("rollout_token_veto_threshold", veto) < 1.0:
        raise _bad("rollout_token_veto_threshold", veto, "must be in (0, 1) (e.g. 1e-4); or null for no veto")
    return CorrectionPlan(is_level, upper, None if lower is None else float(lower),
                          bool(rc.rollout_is_batch_normalize), rs_level, rs_lower, rs_upper,
                          None if veto is None else float(veto), rc.bypass_mode)


def _identity(t):
    return t


def _level_log_ratio(log_ratio, mask, level):
    """[B, L] (token) or [B, 1] (sequence, geometric) log-ratios of a level."""
    if level == "token":
        return log_ratio
    total = log_ratio.sum(-1, keepdim=True)
    return total if level == "sequence" else total / mask.sum(-1, keepdim=True).clamp(min=1)


@torch.no_grad()
def rollout_correction(old_log_probs, rollout_log_probs, response_mask, plan: CorrectionPlan,
                       reduce: Callable = _identity):
    """(weights [B, L] or None without rollout_is, keep [B, L] bool, metrics).

    `reduce(t)` sums a float64 tensor over the DP ranks (default: this batch alone); the batch
    normalisation and the metrics are over the whole DP batch."""
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float64)
    log_ratio = torch.where(mask, old_log_probs.double() - rollout_log_probs.double(), zero)
    rows = mask.any(-1, keepdim=True)
    keep = mask.clone()
    if plan.rs_level is not None:
        level = _level_log_ratio(log_ratio, mask, plan.rs_level)
        inside = (level >= math.log(plan.rs_lower) if plan.rs_lower > 0 else torch.ones_like(level, dtype=torch.bool))
        keep &= inside & (level <= math.log(plan.rs_upper))
    vetoed = torch.zeros_like(rows)
    if plan.veto is not None:
        vetoed = ((log_ratio < math.log(plan.veto)) & mask).any(-1, keepdim=True)
        keep &= ~vetoed
    dropped = mask & ~keep
    sums = [mask.sum(), rows.sum(), dropped.sum(), dropped.any(-1).sum(), (vetoed & rows).sum()]
    weights = None
    if plan.is_level is not None:
        level = _level_log_ratio(log_ratio, mask, plan.is_level)
        counted = mask if plan.is_level == "token" else rows
        ratio = torch.exp(level.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        weight = ratio.clamp(min=plan.is_lower, max=plan.is_upper)
        lower = 0.0 if plan.is_lower is None else plan.is_lower
        sums += [counted.sum(), ratio.expand_as(counted)[counted].sum(), weight.expand_as(counted)[counted].sum(),
                 (ratio > plan.is_upper).expand_as(counted)[counted].sum(),
                 (ratio < lower).expand_as(counted)[counted].sum()]
        weights = torch.where(mask, weight.expand_as(mask), zero)
    total = reduce(torch.stack([torch.as_tensor(s, dtype=torch.float64) for s in sums]))
    tokens, seqs = max(float(total[0]), 1.0), max(float(total[1]), 1.0)
    metrics = {"rollout_corr/rollout_rs_masked_fraction": float(total[2]) / tokens,
               "rollout_corr/rollout_rs_seq_masked_fraction": float(total[3]) / seqs,
               "rollout_corr/rollout_token_veto_fraction": float(total[4]) / seqs}
    if weights is not None:
        count = max(float(total[5]), 1.0)
        mean = float(total[7]) / count
        metrics.update({"rollout_corr/ratio_mean": float(total[6]) / count, "rollout_corr/rollout_is_mean": mean,
                        "rollout_corr/rollout_is_ratio_fraction_high": float(total[8]) / count,
                        "rollout_corr/rollout_is_ratio_fraction_low": float(total[9]) / count})
        if plan.batch_normalize:  # mean 1 over the DP batch's tokens / rows (the unit of the level)
            factor = mean if mean > 0 else 1.0
            weights = weights / factor
            metrics["rollout_corr/rollout_is_batch_norm_factor"] = factor
        weights = weights.to(old_log_probs.dtype)
    return weights, keep, metrics


def dp_sum(group):
    """A `reduce` for rollout_correction: the sum over `group`'s ranks."""
    def reduce(t):
        dist.all_reduce(t, group=group)
        return t
    return reduce


def loss_batch(batch: Batch, keep) -> Batch:
    """The batch the policy update trains on: response_mask narrowed to the kept tokens (the
    same fields otherwise; `batch` itself is left as it is)."""
    out = Batch(batch.tensors, batch.non_tensors, batch.meta)
    out["response_mask"] = batch["response_mask"] * keep.to(batch["response_mask"].dtype)
    return out


@torch.no_grad()
def mismatch_sums(old_log_probs, rollout_log_probs, response_mask):
    """Local sums of the mismatch metrics over the masked tokens: (max |p_old - p_mu|, tensor of
    [count, sum diff, sum diff^2, sum k1, sum k3]) to combine over ranks."""
    mask = response_mask.bool()
    old, mu = old_log_probs.double()[mask], rollout_log_probs.double()[mask]
    diff = (old.exp() - mu.exp()).abs()
    log_ratio = (old - mu).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    k3 = torch.exp(log_ratio) - 1.0 - log_ratio
    sums = torch.stack([torch.tensor(float(diff.numel()), dtype=torch.float64), diff.sum(),
                        diff.square().sum(), (mu - old).sum(), k3.sum()])
    return (float(diff.max()) if diff.numel() else 0.0), sums


def mismatch_metrics(old_log_probs, rollout_log_probs, response_mask, group=None):
    """training/rollout_probs_diff_{max,mean,std} and rollout_corr/mismatch_{kl,k3_kl} over the
    response tokens of the DP batch (`group`; None: this batch alone). make gpu-check's GRPO run
    requires the diff's max below a bound (tools/gpu_report.py)."""
    worst, sums = mismatch_sums(old_log_probs, rollout_log_probs, response_mask)
    peak = torch.tensor([worst], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(sums, group=group)
    n, total, square, k1, k3 = sums.tolist()
    mean = total / max(n, 1.0)
    var = (square - n * mean * mean) / (n - 1) if n > 1 else 0.0
    return {"training/rollout_probs_diff_max": float(peak), "training/rollout_probs_diff_mean": mean,
            "training/rollout_probs_diff_std": math.sqrt(max(var, 0.0)),
            "rollout_corr/mismatch_kl": k1 / max(n, 1.0), "rollout_corr/mismatch_k3_kl": k3 / max(n, 1.0)}


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
