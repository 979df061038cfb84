"""Rollout correction (engine/algorithms/correction.py) against its formulas written out here in
plain Python: truncated IS and rejection at token, sequence and geometric level with distinct,
asymmetric lower / upper thresholds, the veto, IcePop, batch normalisation; a rejected token has
exactly zero gradient; the mismatch metrics (0 exactly for equal log-probs) and the fractions are
the same on one process and on 2 DP ranks; every key acts or is refused."""
import math

import pytest
import torch

from engine.algorithms.correction import (CorrectionPlan, dp_sum, loss_batch, mismatch_metrics, plan_of,
                                          rollout_correction)
from engine.batch import Batch
from engine.config import ConfigError, load_config
from tests.multirank import run_on_ranks
from tests.test_config_keys import DEMO

# per-token log-ratios log pi_old - log mu (None: padding); chosen so that each level has units
# inside, above and below every band below, and row 4 holds a catastrophic token (ratio e^-5)
LOG_RATIOS = [[0.3, -0.2, 0.1, None, None],
              [-0.6, 0.05, -0.1, 0.2, -0.4],
              [0.9, 0.4, None, None, None],
              [None, None, None, None, None],
              [0.1, -5.0, 0.2, 0.02, None],
              [0.25, 0.35, 0.1, 0.05, 0.15]]
IS_BAND = (0.7, 1.6)   # truncation [lower, upper]
RS_BAND = (0.6, 1.3)   # rejection [lower, upper]
VETO = 0.01


def _tensors(log_ratios=LOG_RATIOS, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[x is not None for x in row] for row in log_ratios], dtype=torch.int64)
    mu = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3  # log-probs < 0
    lr = torch.tensor([[0.0 if x is None else x for x in row] for row in log_ratios], dtype=torch.float64)
    return mu + lr, mu, mask


def _unit_ratio(row, level):
    """The written formula of a level's ratio for one row: per token, product, geometric mean."""
    valid = [x for x in row if x is not None]
    if level == "token":
        return [math.exp(x) if x is not None else None for x in row]
    if not valid:
        return [None] * len(row)
    seq = math.prod(math.exp(x) for x in valid) if level == "sequence" else \
        math.prod(math.exp(x) for x in valid) ** (1 / len(valid))
    return [seq if x is not None else None for x in row]


@pytest.mark.parametrize("is_level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("rs_level", [None, "token", "sequence", "geometric"])
@pytest.mark.parametrize("veto", [None, VETO])
def test_each_level_truncates_and_masks_by_its_formula(is_level, rs_level, veto):
    old, mu, mask = _tensors()
    plan = CorrectionPlan(is_level=is_level, is_lower=IS_BAND[0], is_upper=IS_BAND[1], rs_level=rs_level,
                          rs_lower=RS_BAND[0] if rs_level else 0.0, rs_upper=RS_BAND[1] if rs_level else math.inf,
                          veto=veto)
    weights, keep, m = rollout_correction(old, mu, mask, plan)
    dropped_tokens = dropped_rows = vetoed_rows = 0
    high = low = units = 0
    for i, row in enumerate(LOG_RATIOS):
        w_ratio, r_ratio = _unit_ratio(row, is_level), _unit_ratio(row, rs_level or "token")
        vetoed = veto is not None and any(x is not None and math.exp(x) < veto for x in row)
        row_dropped = False
        for j, x in enumerate(row):
            if x is None:
                assert float(weights[i, j]) == 0.0 and not keep[i, j]
                continue
            want_w = min(max(w_ratio[j], IS_BAND[0]), IS_BAND[1])
            assert float(weights[i, j]) == pytest.approx(want_w, rel=1e-12)
            kept = not vetoed and (rs_level is None or RS_BAND[0] <= r_ratio[j] <= RS_BAND[1])
            assert bool(keep[i, j]) == kept, (i, j)
            dropped_tokens += not kept
            row_dropped |= not kept
        valid = [j for j, x in enumerate(row) if x is not None]
        dropped_rows += row_dropped
        vetoed_rows += vetoed and bool(valid)
        for j in (valid if is_level == "token" else valid[:1]):  # IS units: tokens or rows
            units += 1
            high += w_ratio[j] > IS_BAND[1]
            low += w_ratio[j] < IS_BAND[0]
    tokens, rows = int(mask.sum()), sum(any(x is not None for x in r) for r in LOG_RATIOS)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(dropped_tokens / tokens)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(dropped_rows / rows)
    assert m["rollout_corr/rollout_token_veto_fraction"] == pytest.approx(vetoed_rows / rows)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(high / units)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(low / units)
    assert 0 < high and 0 < low  # both bounds truncate something at every level
    if rs_level is not None:  # and rejection keeps some units and drops others
        assert 0 < dropped_tokens < tokens


def test_icepop_weighs_inside_the_band_by_the_ratio_and_masks_outside():
    """IcePop: M(k) = k on [alpha, beta], 0 outside, k = pi_old / mu per token."""
    old, mu, mask = _tensors()
    alpha, beta = 0.6, 1.3
    plan = plan_of(_rc(rollout_is="token", rollout_is_threshold=5.0, rollout_rs="token",
                       rollout_rs_threshold=f"{alpha}_{beta}"))
    weights, keep, _ = rollout_correction(old, mu, mask, plan)
    for i, row in enumerate(LOG_RATIOS):
        for j, x in enumerate(row):
            k = math.exp(x) if x is not None else None
            want = k if k is not None and alpha <= k <= beta else 0.0
            assert float(weights[i, j] * keep[i, j]) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalisation_gives_mean_one_over_its_units(level):
    old, mu, mask = _tensors()
    plan = CorrectionPlan(is_level=level, is_upper=1.6, batch_normalize=True)
    weights, _, m = rollout_correction(old, mu, mask, plan)
    raw, _, _ = rollout_correction(old, mu, mask, CorrectionPlan(is_level=level, is_upper=1.6))
    units = weights[mask.bool()] if level == "token" else weights[mask.bool().any(-1), 0]
    assert float(units.mean()) == pytest.approx(1.0, rel=1e-12)
    assert torch.allclose(weights * m["rollout_corr/rollout_is_batch_norm_factor"], raw, rtol=1e-12)


def test_a_rejected_token_has_exactly_zero_gradient_in_every_loss_term():
    """The policy update's batch (loss_batch) leaves a rejected token out of the policy, KL and
    entropy terms and out of the token count: its gradient is exactly zero, and the loss is the
    written token mean over the kept tokens only."""
    from engine.algorithms.losses import entropy_bonus, kl_loss, policy_loss, token_weights
    old, mu, mask = _tensors()
    plan = CorrectionPlan(rs_level="token", rs_lower=0.6, rs_upper=1.3, veto=VETO)
    _, keep, _ = rollout_correction(old, mu, mask, plan)
    batch = loss_batch(Batch({"response_mask": mask, "old_log_probs": old}), keep)
    assert torch.equal(batch["response_mask"], mask * keep) and torch.equal(mask, _tensors()[2])
    m = batch["response_mask"]
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    ref = old - 0.1 * torch.rand(mask.shape, generator=g, dtype=torch.float64)
    ent = torch.rand(mask.shape, generator=g, dtype=torch.float64, requires_grad=True)
    log_prob = (old + 0.05 * torch.randn(mask.shape, generator=g, dtype=torch.float64)).requires_grad_()
    pg, _ = policy_loss(log_prob, old, adv, m, clip_ratio=0.2)
    loss = pg + 0.1 * kl_loss(log_prob, ref, m, "low_var_kl") - 0.01 * entropy_bonus(ent, m)
    loss.backward()
    out = ~m.bool()
    assert float(log_prob.grad[out].abs().max()) == 0.0 and float(ent.grad[out].abs().max()) == 0.0
    assert bool((log_prob.grad[m.bool()] != 0).all())
    ratio = torch.exp(log_prob.detach() - old)
    pg_terms = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    assert float(pg.detach()) == pytest.approx(float(pg_terms[m.bool()].sum() / m.sum()), rel=1e-12)
    # the fused kernel's per-token weights (engine/workers/actor.py): zero off the kept tokens
    w = token_weights(m, "token-mean")
    assert float(w[out].abs().max()) == 0.0 and float(w[m.bool()].sum()) == pytest.approx(1.0)


def test_mismatch_metrics_follow_their_formulas_and_vanish_for_equal_log_probs():
    old, mu, mask = _tensors()
    same = mismatch_metrics(old, old.clone(), mask)
    assert all(v == 0.0 for v in same.values()), same
    m = mismatch_metrics(old, mu, mask)
    sel = mask.bool()
    diff = (old.exp() - mu.exp()).abs()[sel]
    lr = (old - mu)[sel]
    assert m["training/rollout_probs_diff_max"] == float(diff.max())
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(float(diff.mean()), rel=1e-12)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(float(diff.std()), rel=1e-9)
    assert m["rollout_corr/mismatch_kl"] == pytest.approx(float((-lr).mean()), rel=1e-12)
    assert m["rollout_corr/mismatch_k3_kl"] == pytest.approx(float((lr.exp() - 1 - lr).mean()), rel=1e-12)


FULL_PLAN = dict(is_level="geometric", is_lower=0.7, is_upper=1.6, batch_normalize=True, rs_level="token",
                 rs_lower=0.6, rs_upper=1.3, veto=VETO)


def _on_my_rows(rows):
    """This rank's rows (uneven token counts per rank: a mean of means would differ)."""
    import torch.distributed as dist
    old, mu, mask = _tensors()
    mine = rows[dist.get_rank()]
    w, keep, m = rollout_correction(old[mine], mu[mine], mask[mine], CorrectionPlan(**FULL_PLAN),
                                    reduce=dp_sum(dist.group.WORLD))
    m.update(mismatch_metrics(old[mine], mu[mine], mask[mine], dist.group.WORLD))
    return w, keep, m


def test_metrics_and_weights_are_the_same_on_one_rank_and_on_two_dp_ranks():
    """One process with the whole batch (the sums of one rank) against 2 gloo ranks with 3 rows
    each: the weights (batch-normalised over the DP batch) and every metric."""
    split = [[0, 1, 5], [2, 3, 4]]
    old, mu, mask = _tensors()
    w, keep, m = rollout_correction(old, mu, mask, CorrectionPlan(**FULL_PLAN))
    m.update(mismatch_metrics(old, mu, mask))
    two = run_on_ranks(_on_my_rows, 2, split)
    for got in (two[0][2], two[1][2]):
        assert got.keys() == m.keys()
        for k in m:
            assert got[k] == pytest.approx(m[k], rel=1e-12, abs=1e-15), k
    for r, rows in enumerate(split):
        assert torch.allclose(two[r][0], w[rows], rtol=1e-12) and torch.equal(two[r][1], keep[rows])
    assert m["rollout_corr/rollout_rs_masked_fraction"] > 0 and m["rollout_corr/rollout_token_veto_fraction"] > 0


def _rc(**keys):
    from engine.config.rollout_correction import RolloutCorrectionConfig
    return RolloutCorrectionConfig(**keys)


P = "algorithm.rollout_correction."


def test_every_key_acts():
    plan = plan_of(load_config(DEMO, [P + "rollout_is=geometric", P + "rollout_is_threshold=3",
                                      P + "rollout_is_threshold_lower=0.25", P + "rollout_is_batch_normalize=true",
                                      P + "rollout_rs=seq_mean_k1", P + "rollout_rs_threshold=1.5",
                                      P + "rollout_rs_threshold_lower=0.9",
                                      P + "rollout_token_veto_threshold=1e-4"]).algorithm.rollout_correction)
    assert plan == CorrectionPlan("geometric", 3.0, 0.25, True, "geometric", 0.9, 1.5, 1e-4)
    assert plan_of(_rc(rollout_rs="token", rollout_rs_threshold=2.0)).rs_lower == 0.5  # 1 / upper
    assert plan_of(_rc(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.25_4")).rs_level == "sequence"
    assert (plan_of(_rc(rollout_rs="token_k1", rollout_rs_threshold="0.25_4")).rs_lower,) == (0.25,)
    assert not plan_of(_rc()).active and plan_of(_rc(rollout_token_veto_threshold=1e-3)).masks
    bypass = plan_of(load_config(DEMO, [P + "bypass_mode=true", P + "rollout_rs=token",
                                        P + "rollout_rs_threshold=2"]).algorithm.rollout_correction)
    assert bypass == CorrectionPlan(rs_level="token", rs_lower=0.5, rs_upper=2.0, bypass=True)
    assert plan_of(_rc(bypass_mode=True)).active  # it needs the pass and the rollout's log-probs


@pytest.mark.parametrize("overrides,match", [
    ([P + "rollout_rs=token"], "rollout_rs_threshold=None: rollout_rs='token' needs bounds"),
    ([P + "rollout_rs=seq_mean_k3", P + "rollout_rs_threshold=0.01"], "rollout_rs='seq_mean_k3': use token"),
    ([P + "rollout_rs=token", P + "rollout_rs_threshold=0.5_0.9"], "rollout_rs_threshold='0.5_0.9': the bounds"),
    ([P + "rollout_rs=token", P + "rollout_rs_threshold=-1"], "rollout_rs_threshold=-1: the bounds"),
    ([P + "rollout_rs=token", P + "rollout_rs_threshold=0.5_2.0", P + "rollout_rs_threshold_lower=0.4"],
     "rollout_rs_threshold_lower=0.4: rollout_rs_threshold='0.5_2.0' already"),
    ([P + "rollout_rs=token", P + "rollout_rs_threshold=0.5_2"], "YAML reads 0.5_2 as the number 0.52"),
    ([P + "rollout_rs_threshold=2"], "rollout_rs_threshold=2: read only with rollout_rs set"),
    ([P + "rollout_is_threshold_lower=0.5"], "rollout_is_threshold_lower=0.5: read only with rollout_is"),
    ([P + "rollout_is_batch_normalize=true"], "rollout_is_batch_normalize=True: read only with rollout_is"),
    ([P + "rollout_is=token", P + "rollout_is_threshold_lower=1.5"], "rollout_is_threshold_lower=1.5: must be"),
    ([P + "rollout_token_veto_threshold=1.5"], "rollout_token_veto_threshold=1.5: must be in (0, 1)"),
    ([P + "bypass_mode=true", P + "rollout_is=token"], "rollout_is='token': bypass_mode=true takes PPO's ratio"),
    ([P + "use_policy_gradient=true"], "use_policy_gradient=True: PPO's clipped loss trains"),
    ([P + "loss_type=reinforce"], "loss_type='reinforce': PPO's clipped loss trains, in bypass mode too"),
    (["trainer.task=dpo", "actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae",
      "actor_rollout_ref.actor.use_kl_loss=false", P + "rollout_rs=token", P + "rollout_rs_threshold=2"],
     "rollout_rs='token': a PPO key"),
    (["trainer.task=dpo", "actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae",
      "actor_rollout_ref.actor.use_kl_loss=false", P + "bypass_mode=true"], "bypass_mode=True: a PPO key"),
])
def test_keys_that_cannot_act_are_refused(overrides, match):
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, overrides)
    assert match in str(info.value) and "\n" not in str(info.value)


def test_bypass_without_the_rollouts_log_probs_stops_the_step():
    """A source whose responses lack the behaviour policy's log-probs cannot be trained against
    them: bypass_mode is refused at that step (a logged dataset without the column is refused
    earlier, at load), never silently trained against pi_old."""
    from engine.experience.base import Source
    cfg = load_config(DEMO, [P + "bypass_mode=true"])
    batch = Batch(dict(old_log_probs=torch.zeros(2, 3), response_mask=torch.ones(2, 3),
                       advantages=torch.ones(2, 3)))
    with pytest.raises(ValueError, match="bypass_mode=true: this step's responses came without"):
        Source(cfg).after_advantages(None, batch)
    assert Source(load_config(DEMO, [])).after_advantages(None, batch) == {}  # decoupled: nothing to do
