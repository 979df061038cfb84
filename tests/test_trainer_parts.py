"""Pieces of the trainer that are plain logic: the KL guard and DP metric reduction."""
import types

import pytest

from engine.algorithms.kl import KLGuard
from tests.multirank import run_on_ranks


def _guard(**kw):
    cfg = types.SimpleNamespace(**dict(dict(kl_ceiling=0.1, entropy_floor=0.5, raise_factor=2.0,
                                            lower_factor=0.5, warn_range=[0.0005, 0.05]), **kw))
    return KLGuard(cfg, coef=0.01)


def test_kl_guard_raises_the_coefficient_above_the_ceiling():
    g = _guard()
    assert g.update(kl=0.3, entropy=1.0) == {"kl_guard/kl_coef": 0.02, "kl_guard/action": 1}
    assert g.update(kl=0.3, entropy=1.0)["kl_guard/kl_coef"] == pytest.approx(0.04)


def test_kl_guard_lowers_it_when_entropy_collapses_and_holds_otherwise():
    g = _guard()
    assert g.update(kl=0.05, entropy=0.2) == {"kl_guard/kl_coef": 0.005, "kl_guard/action": -1}
    assert g.update(kl=0.05, entropy=0.9) == {"kl_guard/kl_coef": 0.005, "kl_guard/action": 0}
    assert g.update(kl=None, entropy=None)["kl_guard/action"] == 0


def test_kl_guard_defaults_follow_the_runbook_and_warn_outside_the_range(caplog):
    from engine.config.schema import KlGuardConfig
    cfg = KlGuardConfig(enable=True)
    assert (cfg.kl_ceiling, cfg.raise_factor, cfg.entropy_floor, cfg.lower_factor) == (0.3, 1.2, 0.1, 0.9)
    g = KLGuard(cfg, coef=0.009)
    with caplog.at_level("WARNING"):
        assert g.update(kl=0.31, entropy=1.0)["kl_guard/kl_coef"] == pytest.approx(0.0108)
    assert "outside algorithm.kl_guard.warn_range" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        g.update(kl=0.1, entropy=0.05)  # 0.0108 x 0.9 = 0.00972: back inside
    assert caplog.text == ""
    restored = KLGuard(cfg, coef=0.001)
    restored.load_state_dict(g.state_dict())
    assert restored.coef == g.coef


def _reduce(values, weights=None):
    import torch.distributed as dist
    from engine.metrics import reduce_over_dp
    from parallel.mesh import Layout, init_mesh
    init_mesh(Layout())
    rank = dist.get_rank()
    return reduce_over_dp(values[rank], 2, weights=None if weights is None else weights[rank])


def test_metrics_of_dp_shards_reduce_to_the_global_batch():
    shards = [{"critic/score/mean": 1.0, "critic/score/max": 3.0, "critic/score/min": -1.0},
              {"critic/score/mean": 2.0, "critic/score/max": 2.0, "critic/score/min": -4.0}]
    for out in run_on_ranks(_reduce, 2, shards):
        assert out == {"critic/score/mean": 1.5, "critic/score/max": 3.0, "critic/score/min": -4.0}


def test_token_means_of_dp_shards_are_weighted_by_their_tokens():
    """Shard 0: 2 tokens of mean 1.0, shard 1: 6 tokens of mean 3.0 -> the batch's token mean
    is (2 + 18) / 8 = 2.5, not the mean of the shard means (2.0)."""
    shards = [{"critic/advantages/mean": 1.0, "critic/score/mean": 1.0},
              {"critic/advantages/mean": 3.0, "critic/score/mean": 3.0}]
    weights = [{"critic/advantages/mean": 2}, {"critic/advantages/mean": 6}]
    for out in run_on_ranks(_reduce, 2, shards, weights):
        assert out == {"critic/advantages/mean": 2.5, "critic/score/mean": 2.0}
