"""Whether gradients are finite, cheaply: the check before every optimizer step
(MegatronWorker.grads_finite) reads each gradient buffer once.

Tests: tests/test_step_overhead.py, tests/test_faults.py
"""
import torch


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
