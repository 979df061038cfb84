"""Remove-padding: many variable-length sequences packed into one row (THD + cu_seqlens).

Packing drops every pad token from the forward pass. Sequences are concatenated into a single
row; attention and RoPE restart at each sequence boundary through Megatron's `PackedSeqParams`
(TransformerEngine's varlen attention on GPU, Trident's masked attention otherwise).
"""
from dataclasses import dataclass
from typing import List

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class Packed:
    tokens: torch.Tensor        # [1, T] all sequences back to back, then padding
    lengths: List[int]          # real sequence lengths, in order
    offsets: List[int]          # start of each sequence in the row
    params: PackedSeqParams

    @property
    def total(self):
        return self.tokens.shape[1]


def pack(sequences: List[torch.Tensor], pad_id: int = 0, multiple_of: int = 1,
         min_length: int = 0) -> Packed:
    """Pack 1-D token tensors into one row, padded to a multiple of `multiple_of` (e.g. the TP
    size under sequence parallelism) and to at least `min_length`. The padding forms one extra
    segment of its own, so it never attends to (or is attended by) a real sequence."""
    lengths = [int(s.numel()) for s in sequences]
    if any(n == 0 for n in lengths):
        raise ValueError("cannot pack an empty sequence; drop it before packing")
    total = sum(lengths)
    padded = max(total, min_length)
    padded = -(-padded // multiple_of) * multiple_of
    row = torch.full((1, padded), pad_id, dtype=torch.long)
    offsets, at = [], 0
    for seq, n in zip(sequences, lengths):
        row[0, at:at + n] = seq
        offsets.append(at)
        at += n
    bounds = [0] + [o + n for o, n in zip(offsets, lengths)]
    if padded > total:
        bounds.append(padded)
    cu = torch.tensor(bounds, dtype=torch.int32)
    seg_max = int((cu[1:] - cu[:-1]).max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=seg_max, max_seqlen_kv=seg_max)
    return Packed(tokens=row, lengths=lengths, offsets=offsets, params=params)

