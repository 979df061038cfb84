"""Advantage estimators against their written formulas, computed with plain python loops."""
import inspect
import statistics

import numpy as np
import pytest
import torch

from engine.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS, compute_advantage, compute_gae, compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_advantage, compute_reinforce_plus_plus_baseline_advantage,
    compute_remax_advantage, compute_rloo_outcome_advantage, masked_mean, masked_var,
    masked_whiten)

B, T = 7, 6


def make_mask(seed=0, holes=False):
    """Right-padded rows of random length, row 2 empty; optionally holes inside the rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[2] = 0
    lengths[4] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    if holes:
        mask[0, :] = torch.tensor([1, 0, 1, 1, 0, 1.0])
        mask[4, 2] = 0
    return mask


def rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def valid(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t] > 0]


def whiten_reference(values, mask):
    """Whiten the valid entries (mean / unbiased std of the valid entries); zeros elsewhere."""
    flat = [values[i][t] for i in range(len(values)) for t in valid(mask, i)]
    mean, var = statistics.fmean(flat), statistics.variance(flat)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        for t in valid(mask, i):
            out[i, t] = (values[i][t] - mean) / (var + 1e-8) ** 0.5
    return out


def group_reference(scores, groups):
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return members


# ---------------------------------------------------------------------------------------------

def test_masked_statistics_match_plain_formulas_and_survive_empty_masks():
    values, mask = rand(1, B, T), make_mask(1, holes=True)
    flat = [float(values[i, t]) for i in range(B) for t in valid(mask, i)]
    assert float(masked_mean(values, mask)) == pytest.approx(statistics.fmean(flat))
    assert float(masked_var(values, mask)) == pytest.approx(statistics.variance(flat))
    assert float(masked_var(values, mask, unbiased=False)) == pytest.approx(
        statistics.pvariance(flat))
    rows = masked_mean(values, mask, dim=-1)
    for i in range(B):
        expected = statistics.fmean([float(values[i, t]) for t in valid(mask, i)]) \
            if valid(mask, i) else 0.0
        assert float(rows[i]) == pytest.approx(expected)
    torch.testing.assert_close(masked_whiten(values, mask), whiten_reference(values.tolist(), mask))
    scaled = masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(scaled, (whiten_reference(values.tolist(), mask)
                                        + statistics.fmean(flat)) * mask)
    empty = torch.zeros(B, T, dtype=torch.float64)
    for stat in (masked_mean, masked_var, masked_whiten):
        out = stat(values, empty)
        assert torch.isfinite(out).all() and (out == 0).all()


@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_backward_recursion_over_valid_tokens(holes):
    rewards, values, mask = rand(2, B, T), rand(3, B, T), make_mask(2, holes)
    gamma, lam = 0.9, 0.8
    adv_ref = [[0.0] * T for _ in range(B)]
    ret_ref = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        next_value = next_adv = 0.0
        for t in reversed(valid(mask, i)):  # padding rewards are random here and must be ignored
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            adv_ref[i][t] = delta + gamma * lam * next_adv
            ret_ref[i, t] = adv_ref[i][t] + float(values[i, t])
            next_value, next_adv = float(values[i, t]), adv_ref[i][t]
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(returns, ret_ref)
    torch.testing.assert_close(advantages, whiten_reference(adv_ref, mask))


def test_gae_with_all_rows_empty_is_zero_not_nan():
    advantages, returns = compute_gae(rand(4, B, T), rand(5, B, T), torch.zeros(B, T), 1.0, 0.95)
    assert (advantages == 0).all() and (returns == 0).all()


GROUPS = ["a", "a", "b", "b", "b", "c", "a"]  # "c" is a group of one


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("as_type", ["list", "numpy", "tensor"])
def test_grpo_normalises_scores_within_groups(norm_by_std, as_type):
    rewards, mask = rand(6, B, T), make_mask(3)
    groups = {"list": GROUPS, "numpy": np.array(GROUPS, dtype=object),
              "tensor": torch.tensor([ord(g) for g in GROUPS])}[as_type]
    scores = [sum(float(rewards[i, t]) for t in valid(mask, i)) for i in range(B)]
    expected = torch.zeros(B, T, dtype=torch.float64)
    for rows in group_reference(scores, GROUPS).values():
        group_scores = [scores[i] for i in rows]
        for i in rows:
            if len(rows) == 1:
                adv = scores[i]  # no baseline for a lone response: mean 0, std 1
            elif norm_by_std:
                adv = (scores[i] - statistics.fmean(group_scores)) / (
                    statistics.stdev(group_scores) + 1e-6)
            else:
                adv = scores[i] - statistics.fmean(group_scores)
            for t in valid(mask, i):
                expected[i, t] = adv
    advantages, returns = compute_grpo_outcome_advantage(rewards, mask, groups,
                                                         norm_adv_by_std_in_grpo=norm_by_std)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


def test_grpo_group_with_equal_scores_gives_zero_advantage():
    rewards = torch.zeros(4, 3, dtype=torch.float64)
    rewards[:, -1] = 1.0
    advantages, _ = compute_grpo_outcome_advantage(rewards, torch.ones(4, 3), [0, 0, 1, 1])
    assert torch.isfinite(advantages).all() and (advantages == 0).all()


def test_rloo_uses_leave_one_out_mean():
    rewards, mask = rand(7, B, T), make_mask(4)
    scores = [sum(float(rewards[i, t]) for t in valid(mask, i)) for i in range(B)]
    expected = torch.zeros(B, T, dtype=torch.float64)
    for rows in group_reference(scores, GROUPS).values():
        for i in rows:
            others = [scores[j] for j in rows if j != i]
            adv = scores[i] - statistics.fmean(others) if others else scores[i]
            for t in valid(mask, i):
                expected[i, t] = adv
    advantages, returns = compute_rloo_outcome_advantage(rewards, mask, GROUPS)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_whitens_discounted_returns(holes):
    rewards, mask, gamma = rand(8, B, T), make_mask(5, holes), 0.9
    returns_ref = [[0.0] * T for _ in range(B)]
    for i in range(B):
        running = 0.0
        for t in reversed(valid(mask, i)):
            running = float(rewards[i, t]) + gamma * running
            returns_ref[i][t] = running
    advantages, returns = compute_reinforce_plus_plus_advantage(rewards, mask, gamma)
    torch.testing.assert_close(returns, torch.tensor(returns_ref, dtype=torch.float64))
    torch.testing.assert_close(advantages, whiten_reference(returns_ref, mask))


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens():
    rewards, mask = rand(9, B, T), make_mask(6)
    scores = [sum(float(rewards[i, t]) for t in valid(mask, i)) for i in range(B)]
    per_token = [[0.0] * T for _ in range(B)]
    for rows in group_reference(scores, GROUPS).values():
        mean = statistics.fmean([scores[i] for i in rows]) if len(rows) > 1 else 0.0
        for i in rows:
            for t in valid(mask, i):
                per_token[i][t] = scores[i] - mean
    advantages, returns = compute_reinforce_plus_plus_baseline_advantage(rewards, mask, GROUPS)
    torch.testing.assert_close(advantages, whiten_reference(per_token, mask))
    torch.testing.assert_close(returns, advantages)


def test_remax_subtracts_greedy_baseline_from_return_to_go():
    rewards, mask, baselines = rand(10, B, T), make_mask(7, holes=True), rand(11, B)
    adv_ref = torch.zeros(B, T, dtype=torch.float64)
    ret_ref = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in valid(mask, i):
            ret_ref[i, t] = sum(float(rewards[i, k]) for k in valid(mask, i) if k >= t)
            adv_ref[i, t] = ret_ref[i, t] - float(baselines[i])
    advantages, returns = compute_remax_advantage(rewards, baselines, mask)
    torch.testing.assert_close(advantages, adv_ref)
    torch.testing.assert_close(returns, ret_ref)


def test_compute_advantage_dispatches_with_only_the_fields_each_estimator_takes():
    fields = dict(token_level_rewards=rand(12, B, T), values=rand(13, B, T),
                  response_mask=make_mask(8), group_index=GROUPS, reward_baselines=rand(14, B),
                  gamma=0.95, lam=0.9)
    for name, entry in ADVANTAGE_ESTIMATORS.items():
        estimator = entry.fn
        got = compute_advantage(name, **fields)
        params = inspect.signature(estimator).parameters
        want = estimator(**{k: v for k, v in fields.items() if k in params})
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="one of .*'gae'.*'grpo'"):
        compute_advantage("ppo2", **fields)
    with pytest.raises(ValueError, match="lam"):
        compute_advantage("gae", token_level_rewards=fields["token_level_rewards"],
                          values=fields["values"], response_mask=fields["response_mask"],
                          gamma=1.0)


def test_bad_shapes_and_group_lengths_are_named():
    mask = make_mask(9)
    with pytest.raises(ValueError, match="values"):
        compute_gae(rand(1, B, T), rand(2, B, T + 1), mask, 1.0, 1.0)
    with pytest.raises(ValueError, match="group_index"):
        compute_grpo_outcome_advantage(rand(1, B, T), mask, GROUPS[:-1])
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_remax_advantage(rand(1, B, T), rand(2, B + 1), mask)


# -- whitening over the global batch under data parallelism -----------------------------------
SHARDED = ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
ROWS = 8
SHARD_GROUPS = ["a", "a", "b", "b", "c", "c", "c", "d"]  # no group straddles the two shards


def _full_fields(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (ROWS,), generator=g)
    lengths[:4] = torch.tensor([1, 2, 1, 3])  # the shards hold very different token counts
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    return dict(token_level_rewards=torch.randn(ROWS, T, generator=g, dtype=torch.float64),
                values=torch.randn(ROWS, T, generator=g, dtype=torch.float64) + 3.0,
                response_mask=mask, group_index=SHARD_GROUPS, gamma=0.9, lam=0.8)


def _shard(fields, rows):
    return {k: ([v[i] for i in rows] if isinstance(v, list) else v[rows]
                if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}


def _estimate_on_shards(seed):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = list(range(rank * ROWS // world, (rank + 1) * ROWS // world))
    mine = _shard(_full_fields(seed), rows)

    def batch_sum(t):
        dist.all_reduce(t)
        return t
    return {name: (compute_advantage(name, batch_sum=batch_sum, **mine),
                   compute_advantage(name, **mine)) for name in SHARDED}


def test_whitening_is_over_the_global_batch_on_every_dp_rank():
    """Each of 2 gloo ranks whitens its shard with the batch's statistics (batch_sum: the
    all-reduce): together they give the one-process advantages of the whole batch, and the
    written formula (mean / unbiased std of every valid token of the batch)."""
    from tests.multirank import run_on_ranks

    fields = _full_fields(21)
    shards = run_on_ranks(_estimate_on_shards, 2, 21)
    for name in SHARDED:
        whole_adv, whole_ret = compute_advantage(name, **fields)
        adv = torch.cat([s[name][0][0] for s in shards])
        ret = torch.cat([s[name][0][1] for s in shards])
        torch.testing.assert_close(adv, whole_adv, rtol=0, atol=1e-12)
        torch.testing.assert_close(ret, whole_ret, rtol=0, atol=1e-12)
        local = torch.cat([s[name][1][0] for s in shards])  # per-shard whitening: what it was
        assert (local - whole_adv).abs().max() > 1e-2, name
    # the written formula, for REINFORCE++: whiten the discounted returns over the batch
    mask = fields["response_mask"]
    raw = compute_advantage("reinforce_plus_plus", **fields)[1]
    adv = torch.cat([s["reinforce_plus_plus"][0][0] for s in shards])
    torch.testing.assert_close(adv, whiten_reference(raw.tolist(), mask))
