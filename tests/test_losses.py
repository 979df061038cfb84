"""PPO losses against their written formulas, and split invariance of every loss.

Split invariance: cutting a mini-batch into micro-batches (and DP ranks) and summing the
micro-batch losses computed with the global normaliser gives the full-batch loss and gradient.
"""
import math
import statistics

import pytest
import torch

from engine.algorithms.losses import (
    LOSS_AGG_MODES, LossNormaliser, agg_loss, entropy_bonus, policy_loss, policy_loss_gspo,
    token_weights, value_loss)
from tests.multirank import run_on_ranks

B, T = 10, 7


def make_mask(seed=0):
    """Right-padded rows of random length, two empty rows, one hole inside a row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[1] = lengths[6] = 0
    lengths[3] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    mask[3, 2] = 0
    return mask


def rand(seed, *shape, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, dtype=torch.float64)


def valid(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t] > 0]


def agg_reference(per_token, mask, mode, max_len=T):
    """per_token: nested lists; the written formula of each aggregation mode, local counts."""
    rows = [[per_token[i][t] for t in valid(mask, i)] for i in range(mask.shape[0])]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / max(sum(len(r) for r in rows), 1)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / max(len(nonempty), 1)
    if mode == "seq-mean-token-mean":
        return sum(statistics.fmean(r) for r in nonempty) / max(len(nonempty), 1)
    return sum(sum(r) / max_len for r in nonempty) / max(len(nonempty), 1)


def as_lists(t):
    return t.detach().tolist()


# ---------------------------------------------------------------------------------------------
# formulas
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_written_formula(mode):
    loss_mat, mask = rand(1, B, T), make_mask(1)
    got = agg_loss(loss_mat, mask, mode)
    assert float(got.detach()) == pytest.approx(agg_reference(as_lists(loss_mat), mask, mode))
    norm = agg_loss(loss_mat, mask, mode, max_response_len=32)
    assert float(norm) == pytest.approx(agg_reference(as_lists(loss_mat), mask, mode, 32))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_token_weights_turn_every_mode_into_a_weighted_token_sum(mode):
    """What the actor's single-pass kernel relies on: agg = sum(loss * weight), local and
    global counts alike."""
    loss_mat, mask = rand(2, B, T), make_mask(2)
    for counts in ({}, dict(global_token_count=123.0, global_seq_count=17.0, max_response_len=32)):
        weights = token_weights(mask, mode, **counts)
        got = float((loss_mat * weights).sum())
        assert got == pytest.approx(float(agg_loss(loss_mat, mask, mode, **counts)))
        assert float(weights[mask == 0].abs().sum()) == 0


def test_agg_loss_ignores_non_finite_padding_and_empty_masks():
    loss_mat, mask = rand(2, B, T), make_mask(2)
    poisoned = torch.where(mask > 0, loss_mat, torch.full_like(loss_mat, -math.inf))
    for mode in LOSS_AGG_MODES:
        assert float(agg_loss(poisoned, mask, mode)) == pytest.approx(
            float(agg_loss(loss_mat, mask, mode)))
        assert float(agg_loss(loss_mat, torch.zeros_like(mask), mode)) == 0.0
    with pytest.raises(ValueError, match="loss_agg_mode 'token-sum'"):
        agg_loss(loss_mat, mask, "token-sum")


def ppo_inputs(seed, log_ratio_scale=0.4):
    mask = make_mask(seed)
    old = rand(seed + 1, B, T) - 2.0
    log_prob = (old + rand(seed + 2, B, T, scale=log_ratio_scale)).requires_grad_(True)
    advantages = rand(seed + 3, B, T) * mask
    return log_prob, old, advantages, mask


def ppo_reference(log_prob, old, advantages, mask, low, high, clip_c, mode):
    """Per-token PPO loss from the formula, plus the clip flags and per-token kl."""
    log_prob = log_prob.detach()
    losses, clipped, lower, kl = ([[0.0] * T for _ in range(B)] for _ in range(4))
    for i in range(B):
        for t in range(T):
            log_ratio = min(max(float(log_prob[i, t] - old[i, t]), -20.0), 20.0)
            ratio, adv = math.exp(log_ratio), float(advantages[i, t])
            surrogate = -adv * ratio
            surrogate_clipped = -adv * min(max(ratio, 1 - low), 1 + high)
            loss = max(surrogate, surrogate_clipped)
            clipped[i][t] = float(surrogate_clipped > surrogate)
            if clip_c is not None and adv < 0:
                lower[i][t] = float(loss > -adv * clip_c)
                loss = min(loss, -adv * clip_c)
            losses[i][t], kl[i][t] = loss, -log_ratio
    return (agg_reference(losses, mask, mode), agg_reference(clipped, mask, "token-mean"),
            agg_reference(lower, mask, "token-mean"), agg_reference(kl, mask, "token-mean"),
            clipped, lower)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("low,high,clip_c", [(0.2, 0.2, 3.0), (0.1, 0.3, 2.0), (0.2, 0.28, None)])
def test_policy_loss_matches_clip_dual_clip_and_clip_higher_formula(mode, low, high, clip_c):
    log_prob, old, advantages, mask = ppo_inputs(10, log_ratio_scale=1.0)
    loss, metrics = policy_loss(log_prob, old, advantages, mask, clip_ratio=0.2,
                                clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_c,
                                loss_agg_mode=mode)
    ref_loss, ref_clip, ref_lower, ref_kl, clipped, lower = ppo_reference(
        log_prob, old, advantages, mask, low, high, clip_c, mode)
    assert float(loss.detach()) == pytest.approx(ref_loss)
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx(ref_clip)
    assert float(metrics["actor/pg_clipfrac_lower"]) == pytest.approx(ref_lower)
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(ref_kl)
    # the inputs reach every branch: clipped tokens, and the dual-clip bound when it is on
    assert any(clipped[i][t] for i in range(B) for t in valid(mask, i))
    assert any(lower[i][t] for i in range(B) for t in valid(mask, i)) == (clip_c is not None)


def test_clip_higher_is_asymmetric():
    """ratio 1.25 with A > 0 is inside [1 - 0.1, 1 + 0.3] so it keeps its gradient; with the
    symmetric 0.2 range it is clipped and gets none. ratio 0.85 with A < 0 is the mirror case."""
    log_prob = torch.log(torch.tensor([[1.25, 0.85]], dtype=torch.float64)).requires_grad_(True)
    old, advantages, mask = torch.zeros(1, 2, dtype=torch.float64), torch.tensor([[1.0, -1.0]]), \
        torch.ones(1, 2)
    loss, _ = policy_loss(log_prob, old, advantages, mask, clip_ratio_low=0.1,
                          clip_ratio_high=0.3, clip_ratio_c=None)
    # token 0: -A * r unclipped; token 1: -A * (1 - 0.1) clipped at the lower bound
    assert float(loss.detach()) == pytest.approx((-1.25 + 0.9) / 2)
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, torch.tensor([[-1.25 / 2, 0.0]], dtype=torch.float64))
    loss_sym, _ = policy_loss(log_prob, old, advantages, mask, clip_ratio=0.2, clip_ratio_c=None)
    (grad_sym,) = torch.autograd.grad(loss_sym, log_prob)
    torch.testing.assert_close(grad_sym, torch.tensor([[0.0, 0.85 / 2]], dtype=torch.float64))


def test_policy_loss_clamps_huge_log_ratios():
    log_prob, old, advantages, mask = ppo_inputs(20)
    huge = (log_prob.detach() + 60.0 * torch.sign(rand(24, B, T))).requires_grad_(True)
    loss, metrics = policy_loss(huge, old, advantages, mask, clip_ratio_c=None)
    ref_loss, *_ = ppo_reference(huge, old, advantages, mask, 0.2, 0.2, None, "token-mean")
    assert math.isfinite(float(loss.detach())) and float(loss.detach()) == pytest.approx(ref_loss)
    (grad,) = torch.autograd.grad(loss, huge)
    assert torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_policy_loss_rejects_bad_clip_ratio_c():
    with pytest.raises(ValueError, match="clip_ratio_c=0.5"):
        policy_loss(*ppo_inputs(1), clip_ratio_c=0.5)


def test_gspo_matches_sequence_level_objective_and_gradient():
    log_prob, old, _, mask = ppo_inputs(30, log_ratio_scale=0.01)
    seq_adv = rand(34, B)
    advantages = seq_adv[:, None] * mask  # GSPO's advantages are per sequence
    low, high = 3e-3, 4e-3
    loss, metrics = policy_loss_gspo(log_prob, old, advantages, mask, low, high)

    # reference: s_i = exp(mean_t (logp - old)) with its true gradient, one term per sequence
    ref_terms, clipped_rows = [], 0
    for i in range(B):
        tokens = valid(mask, i)
        if not tokens:
            continue
        s = torch.exp(sum(log_prob[i, t] - old[i, t] for t in tokens) / len(tokens))
        a = float(seq_adv[i])
        ref_terms.append(torch.maximum(-a * s, -a * torch.clamp(s, 1 - low, 1 + high)))
        s_value = float(s.detach())
        clipped_rows += len(tokens) * (-a * min(max(s_value, 1 - low), 1 + high) > -a * s_value)
    ref_loss = sum(ref_terms) / len(ref_terms)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(torch.autograd.grad(loss, log_prob)[0],
                               torch.autograd.grad(ref_loss, log_prob)[0])
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx(clipped_rows / float(mask.sum()))
    assert 0 < clipped_rows < float(mask.sum())  # both branches are exercised
    kl = [[float(old[i, t] - log_prob[i, t].detach()) for t in range(T)] for i in range(B)]
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(agg_reference(kl, mask, "token-mean"))


@pytest.mark.parametrize("cliprange", [0.1, None])
def test_value_loss_matches_clipped_formula(cliprange):
    mask = make_mask(40)
    values, old_values, returns = rand(41, B, T), rand(42, B, T), rand(43, B, T)
    losses, flags = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            v, v_old, r = float(values[i, t]), float(old_values[i, t]), float(returns[i, t])
            unclipped = (v - r) ** 2
            clipped = unclipped if cliprange is None else \
                (min(max(v, v_old - cliprange), v_old + cliprange) - r) ** 2
            losses[i][t], flags[i][t] = 0.5 * max(unclipped, clipped), float(clipped > unclipped)
    for mode in LOSS_AGG_MODES:
        vf_loss, vf_clipfrac = value_loss(values, old_values, returns, mask, cliprange, mode)
        assert float(vf_loss) == pytest.approx(agg_reference(losses, mask, mode))
        assert float(vf_clipfrac) == pytest.approx(agg_reference(flags, mask, "token-mean"))
    if cliprange is not None:
        assert 0 < float(vf_clipfrac) < 1


def _float32_values(seed, spread, cliprange):
    """fp32 values, old values and returns: |V - V_old| < cliprange, except (spread > 1) on
    about half the tokens. Drawn in float64 then rounded, so every mantissa bit is used."""
    old = rand(seed, B, T, scale=0.1)
    step = rand(seed + 1, B, T).tanh() * cliprange * 0.99 * spread
    return ((old + step).float(), old.float(), rand(seed + 2, B, T).float())


def test_value_clipfrac_counts_only_tokens_where_the_bound_binds():
    """fp32 values inside the clip range: V_clip is V itself and nothing counts as clipped,
    though old + (V - old) is not V for many of them (what the clipfrac used to count)."""
    cliprange, mask = 0.2, make_mask(44)
    values, old, returns = _float32_values(45, 1.0, cliprange)
    assert ((values - old).abs() < cliprange).all()
    assert (old + (values - old) != values).any()  # the data has such rounding cases
    _, clipfrac = value_loss(values, old, returns, mask.float(), cliprange)
    assert float(clipfrac) == 0.0

    values, old, returns = _float32_values(46, 2.0, cliprange)  # now the bound binds somewhere
    values.requires_grad_(True)
    loss, clipfrac = value_loss(values, old, returns, mask.float(), cliprange)
    loss.backward()
    n = float(mask.sum())
    flags, ref_loss, ref_grad = 0, 0.0, torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in valid(mask, i):
            v, v_old, r = (float(x[i, t]) for x in (values.detach(), old, returns))
            bound = abs(v - v_old) > cliprange
            v_clip = min(max(v, v_old - cliprange), v_old + cliprange)
            clipped = bound and (v_clip - r) ** 2 > (v - r) ** 2
            flags += clipped
            ref_loss += 0.5 * ((v_clip - r) ** 2 if clipped else (v - r) ** 2) / n
            ref_grad[i, t] = 0.0 if clipped else (v - r) / n  # a bound V_clip has no gradient
    assert 0 < flags < n
    assert float(clipfrac) == pytest.approx(flags / n, abs=1e-7)
    assert float(loss.detach()) == pytest.approx(ref_loss, rel=1e-5)
    torch.testing.assert_close(values.grad.double(), ref_grad, rtol=1e-5, atol=1e-7)


def test_entropy_bonus_is_the_aggregated_entropy():
    entropy, mask = rand(50, B, T).abs(), make_mask(50)
    for mode in LOSS_AGG_MODES:
        assert float(entropy_bonus(entropy, mask, mode)) == pytest.approx(
            agg_reference(as_lists(entropy), mask, mode))


# ---------------------------------------------------------------------------------------------
# split invariance
# ---------------------------------------------------------------------------------------------

SPLITS = [[B], [5, 5], [3, 2, 3, 2], [1, 4, 2, 3], [6, 1, 3]]


def loss_fns():
    """name -> fn(tensors dict, mask, mode, normaliser) -> (loss, metrics dict)."""
    return {
        "policy": lambda x, m, mode, n: policy_loss(
            x["log_prob"], x["old"], x["adv"], m, clip_ratio_low=0.1, clip_ratio_high=0.3,
            clip_ratio_c=2.0, loss_agg_mode=mode, normaliser=n),
        "gspo": lambda x, m, mode, n: policy_loss_gspo(
            x["log_prob"], x["old"], x["adv"], m, 0.05, 0.1, loss_agg_mode=mode, normaliser=n),
        "value": lambda x, m, mode, n: (lambda out: (out[0], {"vf_clipfrac": out[1]}))(
            value_loss(x["log_prob"], x["old"], x["adv"], m, 0.3, mode, n)),
        "entropy": lambda x, m, mode, n: (entropy_bonus(x["log_prob"], m, mode, n), {}),
    }


def split_inputs(seed):
    log_prob, old, advantages, mask = ppo_inputs(seed, log_ratio_scale=1.0)
    return {"log_prob": log_prob, "old": old, "adv": advantages}, mask


def run_micro_batches(fn, tensors, mask, mode, sizes, normaliser=None):
    """Sum of micro-batch losses/metrics with the global normaliser of the whole batch."""
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    pieces = [(s, s + n) for s, n in zip(starts, sizes)]
    if normaliser is None:  # counts summed over micro-batches, as the caller does
        normaliser = sum((LossNormaliser.from_mask(mask[a:b], T) for a, b in pieces[1:]),
                         LossNormaliser.from_mask(mask[pieces[0][0]:pieces[0][1]], T))
    total, metrics = 0.0, {}
    for a, b in pieces:
        loss, m = fn({k: v[a:b] for k, v in tensors.items()}, mask[a:b], mode, normaliser)
        total = total + loss
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v
    return total, metrics


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["policy", "gspo", "value", "entropy"])
def test_micro_batch_sum_equals_full_batch_loss_and_gradient(name, mode):
    fn = loss_fns()[name]
    tensors, mask = split_inputs(60)
    full_loss, full_metrics = fn(tensors, mask, mode, None)
    (full_grad,) = torch.autograd.grad(full_loss, tensors["log_prob"])
    for sizes in SPLITS:
        loss, metrics = run_micro_batches(fn, tensors, mask, mode, sizes)
        (grad,) = torch.autograd.grad(loss, tensors["log_prob"])
        torch.testing.assert_close(loss, full_loss)
        torch.testing.assert_close(grad, full_grad)
        for key, value in full_metrics.items():
            torch.testing.assert_close(metrics[key], value)


def test_local_normaliser_would_break_split_invariance():
    """The reason for the global normaliser: per-micro-batch means do not add up."""
    tensors, mask = split_inputs(61)
    fn = loss_fns()["policy"]
    full_loss, _ = fn(tensors, mask, "token-mean", None)
    local = sum(fn({k: v[a:a + 5] for k, v in tensors.items()}, mask[a:a + 5], "token-mean",
                   None)[0] for a in (0, 5)) / 2
    assert abs(float(local.detach()) - float(full_loss.detach())) > 1e-6


def _dp_rank_loss(mode, sizes_per_rank):
    """On each DP rank: its share of the batch in micro-batches, global counts all-reduced."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    tensors, mask = split_inputs(70)
    rows = B // world
    tensors = {k: v.detach()[rank * rows:(rank + 1) * rows].clone().requires_grad_(k == "log_prob")
               for k, v in tensors.items()}
    mask = mask[rank * rows:(rank + 1) * rows]
    counts = torch.tensor([float(mask.sum()), float((mask.sum(-1) > 0).sum())],
                          dtype=torch.float64)
    dist.all_reduce(counts)
    normaliser = LossNormaliser(float(counts[0]), float(counts[1]), T)
    loss, metrics = run_micro_batches(loss_fns()["policy"], tensors, mask, mode,
                                      sizes_per_rank[rank], normaliser)
    (grad,) = torch.autograd.grad(loss, tensors["log_prob"])
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total), grad, float(metrics["actor/ppo_kl"])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_data_parallel_ranks_with_different_micro_batches_match_one_process(mode):
    tensors, mask = split_inputs(70)
    full_loss, full_metrics = loss_fns()["policy"](tensors, mask, mode, None)
    (full_grad,) = torch.autograd.grad(full_loss, tensors["log_prob"])
    results = run_on_ranks(_dp_rank_loss, 2, mode, [[5], [2, 3]])
    for rank, (loss, grad, _) in enumerate(results):
        assert loss == pytest.approx(float(full_loss.detach()))
        torch.testing.assert_close(grad, full_grad[rank * 5:(rank + 1) * 5])
    assert sum(r[2] for r in results) == pytest.approx(float(full_metrics["actor/ppo_kl"]))


# ---------------------------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------------------------

def test_kl_loss_and_kl_in_reward_use_the_k1_estimator():
    from engine.algorithms.losses import apply_kl_penalty, kl_loss
    log_prob, old, _, mask = ppo_inputs(80)
    ref = rand(84, B, T) - 2.0
    k1 = [[float(log_prob[i, t].detach() - ref[i, t]) for t in range(T)] for i in range(B)]
    for mode in LOSS_AGG_MODES:
        got = kl_loss(log_prob, ref, mask, "kl", mode)
        assert float(got.detach()) == pytest.approx(agg_reference(k1, mask, mode))
    (grad,) = torch.autograd.grad(kl_loss(log_prob, ref, mask, "kl"), log_prob)
    torch.testing.assert_close(grad, (mask / mask.sum()).to(grad.dtype))  # d(k1 mean)/dlogp
    mse = [[0.5 * k1[i][t] ** 2 for t in range(T)] for i in range(B)]
    assert float(kl_loss(log_prob, ref, mask, "mse").detach()) == pytest.approx(
        agg_reference(mse, mask, "token-mean"))

    scores, coef = rand(85, B, T) * mask, 0.05
    rewards, metrics = apply_kl_penalty(scores, log_prob.detach(), ref, mask, coef, "kl")
    expected = torch.tensor([[float(scores[i, t]) - coef * k1[i][t] * float(mask[i, t])
                              for t in range(T)] for i in range(B)], dtype=torch.float64)
    torch.testing.assert_close(rewards, expected)
    row_means = [statistics.fmean([k1[i][t] for t in valid(mask, i)]) if valid(mask, i) else 0.0
                 for i in range(B)]
    assert float(metrics["actor/reward_kl_penalty"]) == pytest.approx(statistics.fmean(row_means))
    assert float(metrics["actor/reward_kl_penalty_coeff"]) == pytest.approx(coef)


def test_bad_clip_ranges_are_named():
    with pytest.raises(ValueError, match="clip_ratio_high=-0.1"):
        policy_loss(*ppo_inputs(2), clip_ratio_high=-0.1)
    with pytest.raises(ValueError, match="clip_ratio_low=None"):
        policy_loss_gspo(*ppo_inputs(2), clip_ratio_low=None)
    with pytest.raises(ValueError, match="cliprange_value=-1"):
        value_loss(*ppo_inputs(2), cliprange_value=-1)
