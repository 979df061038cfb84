"""torch's fused Adam / AdamW kernel for the optimizers Megatron builds from torch.

Without TransformerEngine or Apex (CPU; a GPU stack without them), Megatron falls back to
`torch.optim.AdamW`, whose default on CPU is the per-parameter loop: about ten elementwise
passes over every parameter, its gradient and both moments. torch's fused kernel does one
pass per parameter with the same update rule (a quarter of the time for a 75M model on this
CPU, tools/benchmark.py step). It is chosen before the optimizer holds any state, so the step
counters live where the fused kernel reads them (on the parameters' device).

Tests: tests/test_step_overhead.py
"""
import torch

FUSED_DEVICES = ("cpu", "cuda")  # where torch's _fused_adam(w)_ kernels run


def megatron_optimizer(opt_cfg, chunks):
    """Megatron's optimizer for the model chunks (`get_megatron_optimizer`), its torch Adam on
    the fused kernel."""
    from megatron.core.optimizer import get_megatron_optimizer
    optimizer = get_megatron_optimizer(opt_cfg, chunks, use_gloo_process_groups=False)
    use_fused_adam(optimizer)
    return optimizer


def use_fused_adam(optimizer) -> int:
    """Switch every torch Adam / AdamW inside a Megatron (possibly chained) optimizer to the
    fused kernel where all its parameters are floating point on a device that has it; returns
    how many torch optimizers were switched. Any other optimizer (TE's or Apex's FusedAdam,
    SGD) is left as it is."""
    switched = 0
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or inner.state:
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or not all(p.is_floating_point() and p.device.type in FUSED_DEVICES
                                 for p in params):
            continue
        groups = inner.param_groups
        if len({p.device for p in params}) > 1 or any(g.get("differentiable") or g.get("capturable")
                                                        for g in groups):
            continue
        for group in groups:
            group["fused"], group["foreach"] = True, False
        inner.defaults["fused"], inner.defaults["foreach"] = True, False
        switched += 1
    return switched
