"""The local core attention on CUDA (no TransformerEngine). Packed RL batches bring new sequence
lengths every micro-batch, so attention must run on a kernel that needs no per-shape plan:
flash, memory-efficient or math, never cuDNN's (on the first H200 run its plan builds cost
~1.3 ms of host time per call: 4.2 s of a 5.5 s GRPO step's actor passes). And it must still
equal causal attention written out per sequence, values and gradients."""
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.test_step_overhead import per_sequence_attention

pytestmark = pytest.mark.gpu

SDPA_IMPLEMENTATIONS = ("flash", "efficient", "math", "cudnn")


def _implementations(fn):
    """The SDPA implementations `fn` ran, from torch's profiler (op names such as
    aten::_scaled_dot_product_flash_attention, aten::_cudnn_attention_forward)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    return {kind for kind in SDPA_IMPLEMENTATIONS
            for name in names if "attention" in name and kind in name}, names


@pytest.mark.parametrize("kv_heads", [8, 2])  # plain and grouped-query heads
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_attention_runs_without_cudnn_plans(dtype, kv_heads):
    check_packed_attention(dtype, kv_heads)


def test_the_first_attention_call_of_a_process_runs_without_cudnn_plans():
    """torch sets its default SDPA order at the first SDPA call of a process, cuDNN first on an
    H200, over the order a context set (sdp_utils.cpp priority_order): the first H200 run saw
    cuDNN in the first case above only. So the first call, in a fresh process, on its own."""
    script = ("import torch; from tests.gpu.test_attention_gpu import check_packed_attention; "
              "check_packed_attention(torch.bfloat16, 8)")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert run.returncode == 0, run.stderr[-3000:]


def check_packed_attention(dtype, kv_heads):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from engine.models.local_modules import CoreAttention

    config = type("Config", (), dict(kv_channels=64, attention_dropout=0.0))
    attention = CoreAttention(config, 1, AttnMaskType.causal).train()
    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(1, 200, (24,), generator=gen)]  # mostly distinct
    t = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).cuda()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    q = torch.randn(t, 8, 64, generator=gen).to("cuda", dtype).requires_grad_()
    k = torch.randn(t, kv_heads, 64, generator=gen).to("cuda", dtype).requires_grad_()
    v = torch.randn(t, kv_heads, 64, generator=gen).to("cuda", dtype).requires_grad_()
    grad_out = torch.randn(t, 8 * 64, generator=gen).to("cuda", dtype)
    result = {}

    def run():
        out = attention(q, k, v, packed_seq_params=params)
        out.backward(grad_out)
        torch.cuda.synchronize()
        result["out"], result["grads"] = out.detach(), [x.grad for x in (q, k, v)]

    kinds, names = _implementations(run)
    assert kinds and "cudnn" not in kinds, (kinds, sorted(n for n in names if "attention" in n))
    # the reference: the same (rounded) inputs, in float64, one sequence at a time
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = per_sequence_attention(q64, k64, v64, lengths, 1 / math.sqrt(64))
    want.backward(grad_out.double())
    # bf16 keeps 8 bits of mantissa, and its backward rounds the probabilities too; a wrong mask
    # or scale errs by the values themselves
    tols = dict(out=2e-2, dq=5e-2, dk=5e-2, dv=5e-2) if dtype == torch.bfloat16 else \
        dict(out=1e-4, dq=1e-4, dk=1e-4, dv=1e-4)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), [result["out"]] + result["grads"],
                              (want.detach(), q64.grad, k64.grad, v64.grad)):
        err, tol = float((got.double() - ref).abs().max() / ref.abs().max()), tols[name]
        assert err < tol, f"{name}: max error {err:.2e} of the largest value, over {tol}"
