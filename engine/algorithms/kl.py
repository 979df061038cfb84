"""KL estimators (re-exported from kernels.kl, where the formulas live) and KL controllers.

Whether a kind is exact (needs both full distributions, so the reference pass keeps its hidden
states) is the registry's metadata: `KL_KINDS[kind].exact` (kernels.kl.KLKind); every caller
asks it (the run's step flags in engine/config/steps.py, the actor, tools/plan.py).

Controllers set the KL coefficient beta (`algorithm.kl_ctrl`, used with
`algorithm.use_kl_in_reward`):

  fixed:    beta = kl_coef, always.
  adaptive: after each step with measured KL and n_steps samples,
            beta <- beta * (1 + clip(KL / target_kl - 1, -0.2, 0.2) * n_steps / horizon)
            (Ziegler et al., 2019): beta grows while KL is above target, shrinks below it.

Both expose `.value`, `update(current_kl, n_steps)`, `state_dict()` / `load_state_dict()`
(saved with the checkpoint so a resumed run continues with the same beta).

`KLGuard` (`algorithm.kl_guard`) automates the users' runbook on whichever KL coefficient the
run uses (the KL loss's, else the in-reward controller's): KL above `kl_ceiling` raises it by
`raise_factor`, entropy below `entropy_floor` lowers it by `lower_factor`, and a warning goes
out when it leaves `warn_range`. Its coefficient is trainer state, saved and restored. On the
in-reward coefficient it composes with the controller: each step the controller updates beta,
then the guard's factor (if a rule fired) multiplies that value.

Tests: tests/test_kl_controllers.py, tests/test_kl_registry.py, tests/test_trainer_parts.py,
tests/test_checkpoint.py
"""
import logging

from kernels.kl import KL_KINDS, KLKind, kl_penalty, linear_full_kl

log = logging.getLogger(__name__)

__all__ = ["kl_penalty", "linear_full_kl", "KL_KINDS", "KLKind", "FixedKLController",
           "AdaptiveKLController", "make_kl_controller", "KLGuard"]

ADAPTIVE_CLIP = 0.2


class FixedKLController:
    """beta = kl_coef, never updated."""

    def __init__(self, kl_coef):
        if not kl_coef >= 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef={kl_coef} must be >= 0")
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps):
        pass

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])


class AdaptiveKLController:
    """beta <- beta * (1 + clip(KL / target_kl - 1, -0.2, 0.2) * n_steps / horizon)."""

    def __init__(self, init_kl_coef, target_kl, horizon):
        if not init_kl_coef >= 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef={init_kl_coef} must be >= 0")
        if not target_kl > 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl={target_kl} must be > 0 for the "
                             f"adaptive controller (or use kl_ctrl.type=fixed)")
        if not horizon > 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon={horizon} must be > 0")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps):
        error = min(max(float(current_kl) / self.target_kl - 1, -ADAPTIVE_CLIP), ADAPTIVE_CLIP)
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])


def make_kl_controller(kl_ctrl_cfg):
    """Controller from a config with `type` ('fixed' | 'adaptive'), `kl_coef`, `target_kl`,
    `horizon` (verl's algorithm.kl_ctrl)."""
    kind = kl_ctrl_cfg.type
    if kind == "fixed":
        return FixedKLController(kl_ctrl_cfg.kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_ctrl_cfg.kl_coef, kl_ctrl_cfg.target_kl,
                                    kl_ctrl_cfg.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r} must be 'fixed' or 'adaptive'")


class KLGuard:
    """The runbook rules on a KL coefficient (see the module docstring)."""

    def __init__(self, cfg, coef):
        self.cfg, self.coef = cfg, float(coef)

    def update(self, kl, entropy):
        action = 0
        if kl is not None and kl > self.cfg.kl_ceiling:
            self.coef *= self.cfg.raise_factor
            action = 1
        elif entropy is not None and entropy < self.cfg.entropy_floor:
            self.coef *= self.cfg.lower_factor
            action = -1
        low, high = self.cfg.warn_range
        if action and not low <= self.coef <= high:
            log.warning("kl_guard: the KL coefficient is now %.3g, outside algorithm.kl_guard.warn_range "
                        "[%g, %g] (KL %s, entropy %s): check the run", self.coef, low, high, kl, entropy)
        return {"kl_guard/kl_coef": self.coef, "kl_guard/action": action}

    def state_dict(self):
        return {"coef": self.coef}

    def load_state_dict(self, state):
        self.coef = float(state["coef"])
