"""torch's fused kernels for what Megatron's optimizer falls back to without TE or Apex.

Without TransformerEngine or Apex (CPU; a GPU stack without them), Megatron falls back to
`torch.optim.AdamW`, whose default on CPU is the per-parameter loop: about ten elementwise
passes over every parameter, its gradient and both moments. torch's fused kernel does one
pass per parameter with the same update rule (a quarter of the time for a 75M model on this
CPU, tools/benchmark.py step). It is chosen before the optimizer holds any state, so the step
counters live where the fused kernel reads them (on the parameters' device).

The same fallback clips gradients with megatron/core/utils.py's local multi-tensor functions:
the L2 norm takes one `torch.norm` per gradient and turns each into a Python float (on a GPU,
a device-to-host copy per parameter tensor, every optimizer step), and scaling allocates a
product per tensor. `use_foreach_multi_tensor` puts torch's foreach kernels in their place
(one norm over the list, one in-place multiply): on the CPU the same per-tensor reductions,
bit for bit; on a GPU torch's multi-tensor kernels and no host copy until Megatron's own.

Tests: tests/test_step_overhead.py
"""
import torch

FUSED_DEVICES = ("cpu", "cuda")  # where torch's _fused_adam(w)_ kernels run


def megatron_optimizer(opt_cfg, chunks):
    """Megatron's optimizer for the model chunks (`get_megatron_optimizer`), its torch Adam on
    the fused kernel, its gradient clipping on foreach kernels."""
    from megatron.core.optimizer import get_megatron_optimizer
    optimizer = get_megatron_optimizer(opt_cfg, chunks, use_gloo_process_groups=False)
    use_fused_adam(optimizer)
    use_foreach_multi_tensor()
    init_adam_state(optimizer)
    return optimizer


def torch_adams(optimizer) -> list:
    """The torch Adam / AdamW optimizers inside a Megatron (possibly chained) optimizer."""
    inner = [getattr(w, "optimizer", None) for w in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [o for o in inner if type(o) in (torch.optim.Adam, torch.optim.AdamW)]


def use_fused_adam(optimizer) -> int:
    """Switch every torch Adam / AdamW inside a Megatron (possibly chained) optimizer to the
    fused kernel where all its parameters are floating point on a device that has it; returns
    how many torch optimizers were switched. Any other optimizer (TE's or Apex's FusedAdam,
    SGD) is left as it is."""
    switched = 0
    for inner in torch_adams(optimizer):
        if inner.state:
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


def init_adam_state(optimizer) -> int:
    """Give every parameter of the fused torch Adam / AdamW optimizers inside `optimizer` the
    state the first step would create (torch/optim/adam.py `_init_group`, fused: a float32 step
    counter on the parameter's device, zeroed moments), now, before the first forward; returns
    how many parameters got it. Parameters with state keep theirs.

    Why: created lazily, the moments were allocated at the end of the first update, in the
    memory its activations had just freed, so the second update's activations went into fresh
    pages (3m workload: ~10 000 page faults, +0.2 s in the second step) and the moments' memory
    showed up only after a whole rollout. Made here, they sit below the activations from the
    start, and a model whose optimizer does not fit fails at setup."""
    made = 0
    for inner in torch_adams(optimizer):
        for group in inner.param_groups:
            if not group.get("fused"):  # use_fused_adam kept the loop: its counters live elsewhere
                continue
            for p in group["params"]:
                state = inner.state[p]
                if state:
                    continue
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                made += 1
    return made


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract, as megatron.core.utils.local_multi_tensor_l2_norm:
    ([1] fp32 norm of every tensor of `tensor_lists[0]` together, None); no per-tensor norms."""
    if per_tensor:
        raise NotImplementedError("foreach_l2_norm: per-tensor norms are not provided")
    # the result lives where Megatron's overflow buffer does (its device="cuda"), as the loop's
    # does, whichever devices the gradients are on (an offloaded optimizer holds some on the host)
    device = noop_flag.device if isinstance(noop_flag, torch.Tensor) else tensor_lists[0][0].device
    norms = [n.to(device, torch.float32) for n in torch._foreach_norm(tensor_lists[0])]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract: tensor_lists[1][i] = tensor_lists[0][i] * scale."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_multi_tensor() -> list:
    """Where Megatron's optimizer modules hold megatron.core.utils' local fallbacks (no TE, no
    Apex), swap in `foreach_l2_norm` / `foreach_scale`; kernels from TE or Apex stay. Returns
    the (module, name) pairs swapped."""
    import importlib

    from megatron.core import utils
    local = {utils.local_multi_tensor_l2_norm: foreach_l2_norm,
             utils.local_multi_tensor_scale: foreach_scale}
    swapped = []
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(name)
        for attr in ("l2_norm_impl", "multi_tensor_scale_impl"):
            current = getattr(module, attr, None)
            if current in local:
                setattr(module, attr, local[current])
                swapped.append((name, attr))
    return swapped
