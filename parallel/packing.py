"""Remove-padding: many variable-length sequences packed into one row (THD + cu_seqlens), and
the context-parallel (CP) split of such rows.

Packing drops every pad token from the forward pass. Sequences are concatenated into a single
row; attention and RoPE restart at each sequence boundary through Megatron's `PackedSeqParams`
(TransformerEngine's varlen attention on GPU, Trident's masked attention otherwise).

CP (Megatron / TransformerEngine's layout): every sequence -- a packed segment, or a whole row
of a [b, s] batch -- is cut into 2 x CP equal chunks and CP rank r keeps chunks r and
2CP-1-r, so each rank gets as much causal-attention work as the others. Segments are padded
to a multiple of 2 x CP first. `cp_split` gives a rank its tokens and their places in the
unsplit row; `cp_gather` puts per-rank results back in unsplit order.

Tests: tests/test_cp_split.py, tests/test_cp_workers.py
"""
from dataclasses import dataclass
from math import lcm
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class Packed:
    tokens: torch.Tensor        # [1, T] all sequences back to back, then padding
    lengths: List[int]          # real sequence lengths, in order
    offsets: List[int]          # start of each sequence in the row
    params: PackedSeqParams
    bounds: Optional[List[int]] = None  # segment boundaries in the row (cu_seqlens)

    @property
    def total(self):
        return self.tokens.shape[1]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack(sequences: List[torch.Tensor], pad_id: int = 0, multiple_of: int = 1,
         min_length: int = 0, seq_multiple_of: int = 1) -> Packed:
    """Pack 1-D token tensors into one row, padded to a multiple of `multiple_of` (e.g. the TP
    size under sequence parallelism) and to at least `min_length`. The padding forms one extra
    segment of its own, so it never attends to (or is attended by) a real sequence.

    seq_multiple_of > 1 (context parallelism: 2 x CP, x TP under sequence parallelism): each
    sequence is also padded to a multiple of it, and the cu_seqlens are those padded lengths,
    given as both `cu_seqlens_q` and `cu_seqlens_q_padded` (likewise kv). A sequence's pad
    tokens come after it, so under causal attention no real token sees them; counting them as
    part of the sequence keeps every backend's view of the segments identical."""
    lengths = [int(s.numel()) for s in sequences]
    if any(n == 0 for n in lengths):
        raise ValueError("cannot pack an empty sequence; drop it before packing")
    spans = [round_up(n, seq_multiple_of) for n in lengths]
    total = sum(spans)
    padded = round_up(max(total, min_length), lcm(multiple_of, seq_multiple_of))
    row = torch.full((1, padded), pad_id, dtype=torch.long)
    offsets, at = [], 0
    for seq, n, span in zip(sequences, lengths, spans):
        row[0, at:at + n] = seq
        offsets.append(at)
        at += span
    bounds = [0] + [o + span for o, span in zip(offsets, spans)]
    if padded > total:
        bounds.append(padded)
    cu = torch.tensor(bounds, dtype=torch.int32)
    seg_max = int((cu[1:] - cu[:-1]).max())
    extra = {}
    if seq_multiple_of > 1:
        extra = dict(cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=seg_max, max_seqlen_kv=seg_max, **extra)
    return Packed(tokens=row, lengths=lengths, offsets=offsets, params=params, bounds=bounds)


# ------------------------------------------------------------------------------------------
# Context-parallel split and gather (pure: no communication)
# ------------------------------------------------------------------------------------------

def cp_index(bounds: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions in the unsplit flat row of CP rank `cp_rank`'s tokens, in the rank's own order:
    for each segment [bounds[i], bounds[i+1]), its chunk r then its chunk 2CP-1-r."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} outside a context-parallel group of {cp_size}")
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if (end - start) % (2 * cp_size):
            raise ValueError(f"segment [{start}, {end}) of {end - start} tokens does not split "
                             f"into 2 x CP = {2 * cp_size} chunks; pad it to a multiple first")
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def row_bounds(rows: int, width: int) -> List[int]:
    """Segments of a [rows, width] batch flattened row-major: one per row."""
    return [r * width for r in range(rows + 1)]


def cp_split(tokens: torch.Tensor, bounds: Sequence[int], cp_size: int, cp_rank: int):
    """(this rank's tokens [b, s / CP], their positions in `tokens.view(-1)`). `tokens` is a
    packed [1, T] row (bounds: its cu_seqlens) or a [b, s] batch (bounds: `row_bounds`)."""
    index = cp_index(bounds, cp_size, cp_rank)
    return tokens.reshape(-1)[index].view(tokens.shape[0], -1), index


def cp_localize(positions: torch.Tensor, index: torch.Tensor):
    """Which of `positions` (places in the unsplit row) a rank with `index` holds.

    Returns (local, take): `take` indexes `positions` (ascending), `local` the matching places
    in the rank's local row."""
    size = int(max(index.max().item() if index.numel() else -1,
                   positions.max().item() if positions.numel() else -1)) + 1
    where = torch.full((size,), -1, dtype=torch.long)
    where[index] = torch.arange(index.numel())
    local = where[positions]
    take = torch.nonzero(local >= 0).squeeze(1)
    return local[take], take


def cp_gather(parts: Sequence[torch.Tensor], indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-rank results back in unsplit order: `parts[r][i]` goes to `indices[r][i]`; the
    indices of all ranks together must be a permutation. Differentiable."""
    order = torch.cat([i.to(parts[0].device) for i in indices])
    if not torch.equal(torch.sort(order).values, torch.arange(order.numel(), device=order.device)):
        raise ValueError("the ranks' indices do not cover each position exactly once")
    return torch.cat(list(parts))[torch.argsort(order)]


# ------------------------------------------------------------------------------------------
# The collective half: all-gather over the CP group, gradient back to its owner only
# ------------------------------------------------------------------------------------------

class _AllGatherOwnGrad(torch.autograd.Function):
    """All-gather of unevenly sized [n_r, ...] tensors. Backward returns to each rank the
    gradient of its own part only (no sum over ranks): every rank computes the same function
    of the gathered values, so summing would count the gradient CP times."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        width = max(max(sizes), 1)
        buf = x.new_zeros((width, *x.shape[1:]))
        buf[: x.shape[0]] = x
        out = [torch.empty_like(buf) for _ in sizes]
        dist.all_gather(out, buf, group=group)
        ctx.rank, ctx.meta = dist.get_rank(group), (x.shape, x.dtype, x.device)
        return tuple(o[:n] for o, n in zip(out, sizes))

    @staticmethod
    def backward(ctx, *grads):
        own = grads[ctx.rank]
        if own is None:
            shape, dtype, device = ctx.meta
            own = torch.zeros(shape, dtype=dtype, device=device)
        return own, None, None


def cp_all_gather(values: torch.Tensor, sizes: Sequence[int], group) -> List[torch.Tensor]:
    """Every CP rank's `values` (rank r holds sizes[r] rows), differentiable for the own part."""
    return list(_AllGatherOwnGrad.apply(values.contiguous(), list(sizes), group))
