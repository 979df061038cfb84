"""engine.algorithms.kl controllers against the written update rule, checkpoint round trip,
and the factory from a verl-style `algorithm.kl_ctrl` config."""
from types import SimpleNamespace

import pytest

from engine.algorithms import kl as kl_module
from engine.algorithms.kl import (AdaptiveKLController, FixedKLController, kl_penalty,
                                  make_kl_controller)


def _rule(beta, kl, target, n_steps, horizon):
    """beta * (1 + clip(KL/target - 1, -0.2, 0.2) * n/horizon), written out."""
    error = kl / target - 1
    error = 0.2 if error > 0.2 else (-0.2 if error < -0.2 else error)
    return beta * (1 + error * n_steps / horizon)


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        ctl.update(kl, 256)
    assert ctl.value == 0.05


def test_adaptive_controller_follows_rule():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.02, horizon=10000)
    expected = 0.1
    # above target beyond the clip, inside the clip both ways, far below (clip at -0.2), on target
    for kl, n in [(0.5, 512), (0.022, 256), (0.019, 256), (0.0, 1024), (0.02, 64)]:
        ctl.update(kl, n)
        expected = _rule(expected, kl, 0.02, n, 10000)
        assert ctl.value == pytest.approx(expected, rel=1e-12)
    assert expected != 0.1


def test_adaptive_state_dict_round_trip():
    a = AdaptiveKLController(0.2, 6.0, 1000)
    a.update(9.0, 100)
    b = AdaptiveKLController(0.2, 6.0, 1000)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value != 0.2
    a.update(3.0, 50)
    b.update(3.0, 50)
    assert b.value == a.value
    f = FixedKLController(0.3)
    f.load_state_dict({"value": 0.7})
    assert f.value == 0.7


def test_factory_and_validation():
    cfg = SimpleNamespace(type="adaptive", kl_coef=0.001, target_kl=0.1, horizon=10000)
    ctl = make_kl_controller(cfg)
    assert isinstance(ctl, AdaptiveKLController) and ctl.value == 0.001
    assert (ctl.target_kl, ctl.horizon) == (0.1, 10000)
    fixed = make_kl_controller(SimpleNamespace(type="fixed", kl_coef=0.01, target_kl=0.1,
                                               horizon=10000))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.01
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        make_kl_controller(SimpleNamespace(type="pid", kl_coef=0.1, target_kl=0.1, horizon=1))
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller(SimpleNamespace(type="adaptive", kl_coef=0.1, target_kl=0.0,
                                           horizon=1))
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.1, 0)


def test_estimators_live_in_kernels():
    import kernels.kl
    assert kl_penalty is kernels.kl.kl_penalty
    assert kl_module.linear_full_kl is kernels.kl.linear_full_kl
