"""algorithm.rollout_correction: verl's rollout-correction keys (engine/algorithms/correction.py
has the formulas; engine/config/validate_experience.py refuses a key that cannot act, through
correction.plan_of).

verl's keys without a field here (engine/config/verl.py answers for them): use_policy_gradient
(PPO's clipped loss trains: accepted at false), loss_type (accepted at ppo_clip).

Tests: tests/test_rollout_correction.py, tests/test_config_keys.py
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

CorrectionLevel = Literal["token", "sequence", "geometric"]


@dataclass
class RolloutCorrectionConfig:
    """Truncated IS, rejection sampling and the veto against the policy that produced the
    responses (`rollout_log_probs`: the rollout engine's, logged ones, or a replayed batch's)."""
    rollout_is: Optional[CorrectionLevel] = None  # truncated IS weights at this level (null: off)
    rollout_is_threshold: float = 2.0             # the weight's upper bound
    rollout_is_threshold_lower: Optional[float] = None  # its lower bound (null: none)
    rollout_is_batch_normalize: bool = False      # weights / their mean over the DP batch
    # rejection at a level: token | sequence | geometric (verl's token_k1 | seq_sum_k1 | seq_mean_k1)
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Any = None              # upper bound, or verl's "lower_upper" (0.5_2.0)
    rollout_rs_threshold_lower: Optional[float] = None  # null: from "lower_upper", else 1 / upper
    rollout_token_veto_threshold: Optional[float] = None  # a row with a token ratio below: dropped
    # PPO's ratio and clip against the rollout policy (pi / mu) instead of the recomputed pi_old:
    # a token the updates since its rollout already moved past the clip gets no more gradient
    bypass_mode: bool = False
