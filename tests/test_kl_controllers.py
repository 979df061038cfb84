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


# -- the adaptive controller and the KL guard together, through the real trainer ---------------

def _kl_steps(tmp, guard_overrides, steps=3):
    """Three PPO steps with the in-reward KL on an adaptive controller and the KL guard on."""
    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed
    demo = __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "recipes",
                                      "tiny_cpu_demo.yaml")
    cfg = load_config(demo, [
        "trainer.n_gpus_per_node=1", "trainer.logger=[]", "trainer.resume_mode=disable",
        "trainer.save_freq=-1", "trainer.test_freq=-1", f"trainer.default_local_dir={tmp}/ckpt",
        f"trainer.log_dir={tmp}/logs", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05",
        "algorithm.kl_ctrl.target_kl=0.01", "algorithm.kl_ctrl.horizon=40",
        "algorithm.kl_guard.enable=true", *guard_overrides])
    set_seed(cfg.trainer.seed)
    t = Trainer(*build(cfg, 1))
    out = []
    for _ in range(steps):
        m = t.train_step(t.loader.next_batch())
        t.step_count += 1
        out.append({k: m[k] for k in ("actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff",
                                      "kl_guard/kl_coef", "kl_guard/action")})
    t.colocated.to_training()
    t.rollout.shutdown()
    return out


@pytest.mark.parametrize("guard,factor", [
    # the guard never acts: the controller alone moves beta
    (["algorithm.kl_guard.kl_ceiling=1e9", "algorithm.kl_guard.entropy_floor=0"], 1.0),
    # the guard lowers beta every step (entropy is always below the floor): on top of the controller
    (["algorithm.kl_guard.kl_ceiling=1e9", "algorithm.kl_guard.entropy_floor=1e9",
      "algorithm.kl_guard.lower_factor=0.5", "algorithm.kl_guard.warn_range=[0,100]"], 0.5),
])
def test_the_kl_guard_composes_with_the_adaptive_controller(tmp_path, guard, factor):
    """beta_{k+1} = rule(beta_k, KL_k) x (the guard's factor when it acted): the controller's
    update is not overwritten by the guard's own copy of the coefficient (that froze beta)."""
    from tests.multirank import run_on_ranks
    steps = run_on_ranks(_kl_steps, 1, str(tmp_path), guard)[0]
    beta = 0.05
    for s in steps:
        assert s["actor/reward_kl_penalty_coeff"] == pytest.approx(beta, rel=1e-6)  # float32
        beta = _rule(beta, s["actor/reward_kl_penalty"], 0.01, 8, 40) * factor  # 4 prompts x 2
        assert s["kl_guard/action"] == (-1 if factor != 1.0 else 0)
        assert s["kl_guard/kl_coef"] == pytest.approx(beta, rel=1e-9)
    assert steps[-1]["actor/reward_kl_penalty_coeff"] != pytest.approx(0.05, rel=1e-3)
