"""Per-pair preference losses, pure torch. Callers sum them and divide by the GLOBAL pair count
(all micro-batches, all DP ranks), so the update does not depend on the layout.

Bradley-Terry (reward model):  -log sigmoid(r_chosen - r_rejected - margin)
DPO, with h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)) over whole responses
(summed token log-probs):
    sigmoid  -log sigmoid(beta h)                 (Rafailov et al. 2023)
    ipo      (h - 1 / (2 beta))^2                 (Azar et al. 2023, on sequence log-probs)

DPO_LOSSES names the allowed algorithm.dpo.loss_type values (engine/config/schema.py).

Tests: tests/test_offline_layouts.py, tests/test_offline_config.py
"""
import torch.nn.functional as F


def bradley_terry_loss(chosen, rejected, margin=None):
    """[pairs] losses from [pairs] chosen / rejected scores (and an optional margin)."""
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def _sigmoid(h, beta):
    return -F.logsigmoid(beta * h)


def _ipo(h, beta):
    return (h - 1.0 / (2.0 * beta)) ** 2


DPO_LOSSES = {"sigmoid": _sigmoid, "ipo": _ipo}


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, loss_type="sigmoid"):
    """(losses, chosen_rewards, rejected_rewards), each [pairs]; the rewards are DPO's implicit
    beta x log-ratios (detached), as TRL reports them."""
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"algorithm.dpo.loss_type={loss_type!r}; choose one of {list(DPO_LOSSES)}")
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    losses = DPO_LOSSES[loss_type](chosen_ratio - rejected_ratio, beta)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
