"""Step-overhead removals keep their results (issue 28): the non-finite-gradient check against
torch.isfinite element by element, and packed (THD) attention, whose packing is worked out once
per micro-batch, against causal softmax attention written out per sequence."""
import dataclasses
import math

import pytest
import torch

from engine.workers.finite import all_finite


@pytest.mark.parametrize("values, dtype", [
    ([1.0, -2.0, 3.0], torch.float32),
    ([1.0, float("nan"), 3.0], torch.float32),
    ([1.0, float("inf"), 3.0], torch.float32),
    ([float("-inf"), float("inf")], torch.float32),  # a NaN sum
    ([3e38, 3e38, -1.0], torch.float32),  # finite values whose sum overflows: still finite
    ([60000.0, 60000.0], torch.bfloat16),
    ([1.0, float("nan")], torch.bfloat16),
])
def test_all_finite_is_isfinite_everywhere(values, dtype):
    grads = [torch.randn(50).to(dtype), torch.tensor(values, dtype=dtype)]
    want = all(bool(torch.isfinite(g).all()) for g in grads)
    assert all_finite(grads) is want
    assert all_finite(grads[::-1]) is want
    assert all_finite([]) is True


def _reference(q, k, v, lengths, scale):
    """Causal softmax attention of each sequence alone; q, k, v [t, heads, d] packed."""
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))  # [heads, n, d]
        if ks.shape[0] != qs.shape[0]:  # grouped-query: each kv head serves a group of q heads
            ks, vs = (x.repeat_interleave(qs.shape[0] // x.shape[0], 0) for x in (ks, vs))
        scores = qs @ ks.transpose(1, 2) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out).reshape(start, -1)


def test_packed_attention_reads_the_packing_once_per_micro_batch():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from engine.models.local_modules import CoreAttention

    config = type("Config", (), dict(kv_channels=8, attention_dropout=0.0))
    attention = CoreAttention(config, 1, AttnMaskType.causal).eval()

    def packed(lengths):
        cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))

    gen = torch.Generator().manual_seed(0)
    lengths = [5, 3, 5, 1, 3]  # equal lengths are batched together
    q = torch.randn(sum(lengths), 4, 8, generator=gen)
    k, v = torch.randn(2, sum(lengths), 2, 8, generator=gen)
    params = packed(lengths)
    want = _reference(q, k, v, lengths, 1 / math.sqrt(8))
    torch.testing.assert_close(attention(q, k, v, packed_seq_params=params), want)
    # the next layer of the same micro-batch: the packing is not read again
    params.cu_seqlens_q = params.cu_seqlens_kv = torch.tensor([0, sum(lengths)], dtype=torch.int32)
    torch.testing.assert_close(attention(q, k, v, packed_seq_params=params), want)
    # another micro-batch (MicroBatch.to makes new params every step): its own packing
    other = [4, 4, 9]
    fresh = dataclasses.replace(packed(other))
    torch.testing.assert_close(attention(q, k, v, packed_seq_params=fresh),
                               _reference(q, k, v, other, 1 / math.sqrt(8)))
