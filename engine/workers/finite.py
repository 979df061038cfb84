"""Whether gradients are finite, cheaply, before an optimizer step applies them: Megatron's
step takes the gradients' global norm as its check (`step_unless_nonfinite`: no pass of its
own); FSDP's shards are checked by `shards_finite`, one read of each.

Tests: tests/test_step_overhead.py, tests/test_faults.py
"""
import math

import torch
import torch.distributed as dist
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from parallel.offload import model_grads


def all_finite(tensors) -> bool:
    """Whether every element of `tensors` is finite. A NaN or an infinity makes a sum
    non-finite, so one reduction per tensor answers (isfinite is three passes and a mask over
    each gradient buffer: a twentieth of a 75M model's step on CPU); only a non-finite sum, which
    finite values can also reach by overflowing, is checked element by element."""
    if not tensors:
        return True
    sums = torch.stack([t.sum(dtype=torch.float32) if t.is_floating_point() else t.new_zeros((), dtype=torch.float32)
                        for t in tensors])
    if bool(torch.isfinite(sums).all()):  # one host read
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def shards_finite(chunks) -> bool:
    """Whether every gradient (FSDP's DTensor shards) on every rank is finite: one all-reduce
    of a flag."""
    flag = torch.tensor([0.0 if all_finite(model_grads(chunks)) else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def step_unless_nonfinite(optimizer):
    """Megatron's optimizer step (a ChainedOptimizer or one MegatronOptimizer: prepare the
    gradients, their global norm, clip, step) with the norm as the finite check: a NaN / Inf
    gradient on any rank makes the norm NaN / Inf on every rank (the DP all-reduce spreads it
    to every replica, the norm's reduction covers the shards), and then nothing is applied.
    One pass over the gradients and one collective fewer than a separate check before
    `step()`: a gradient so large that its squares overflow fp32 (beyond ~1e19) also counts as
    non-finite. The norm is computed even without clipping (clip_grad 0), for the metric.
    Returns (applied, grad norm)."""
    if optimizer.prepare_grads():  # an fp16 loss scaler's overflow (it lowers its scale)
        return False, float("nan")
    norm = float(optimizer.get_grad_norm())
    if not math.isfinite(norm):
        return False, norm
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(part, "is_stub_optimizer", False) or part.config.clip_grad <= 0.0:
            continue
        params = part.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(
                params, max_norm=part.config.clip_grad, total_norm=norm,
                use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return optimizer.step_with_ready_grads(), norm
