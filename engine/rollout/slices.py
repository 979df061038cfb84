"""Where each slice of a weight sits, on both sides of a weight sync (engine/rollout/transfer.py
plans with it): the boxes of an HF tensor each rollout GPU loads, the boxes of it each
training rank holds, and where those sit in the holder's local tensor.

The rollout side (SGLang's sharding at rollout TP R; `attention_dp` and `rollout_ep` split R as
SGLang's --dp-size with DP attention and --ep-size do; attention TP rank = j % (R/attention_dp),
MoE EP rank = j // (R/rollout_ep), MoE TP rank = j % (R/rollout_ep), j = the GPU's TP rank):
  - q/k/v_proj (QKVParallelLinear), MLA's q_proj / q_b_proj / kv_b_proj (ColumnParallelLinear):
    output dim (0) over attention TP; k/v heads fewer than attention TP are replicated, rank j
    loading head j // (TP / kv heads)                        (sglang/srt/layers/linear.py)
  - o_proj (RowParallelLinear): input dim (1) over attention TP   (sglang/srt/layers/linear.py)
  - dense and shared-expert gate_proj / up_proj (MergedColumnParallelLinear): dim 0 over R;
    down_proj (RowParallelLinear): dim 1 over R                  (sglang/srt/layers/linear.py)
  - routed experts (FusedMoE): whole experts per MoE-EP rank (contiguous, E / rollout_ep each);
    w1 / w3 (gate / up) on dim 0 and w2 (down) on dim 1 over MoE TP
                                                 (sglang/srt/layers/moe/fused_moe_triton/layer.py)
  - embed_tokens / lm_head (VocabParallelEmbedding / ParallelLMHead): dim 0, the vocabulary padded
    to a multiple of 64 (of 64 x TP if that does not divide), rank j loads rows
    [j * padded / TP, (j + 1) * padded / TP) of the real ones (sglang/srt/layers/vocab_parallel_embedding.py)
  - MLA's q_a_proj and kv_a_proj_with_mqa (fused into one ReplicatedLinear), norms, the router
    gate and its score-correction bias, shared-expert gates: replicated  (sglang/srt/models/deepseek_v2.py)

The training side follows parallel/shards.py (tests/test_transfer_plan.py checks it against a
meta build): column-parallel Megatron tensors (embedding, output layer, fused QKV, MLA's q/kv
projections, fc1 with its gate and up halves split separately) on dim 0, row-parallel
(linear_proj, fc2) on dim 1, over TP (experts: expert TP); norms and routers replicated. Ranks
are Megatron's order: rank = tp + TP x (cp + CP x (dp + DP x pp)), experts rank = etp + ETP x
(ep + EP x (edp + EDP x pp)); layer l sits on stage (l // (L / (PP x VPP))) % PP. A LoRA model
counts as W + (alpha / r) B A merged by the holder of W's slice (the bytes of W; the delivery
itself leaves a LoRA actor on the full-tensor path: engine/rollout/delivery.py).

Tests: tests/test_transfer_plan.py
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

Box = Tuple[Tuple[int, int], ...]  # [start, stop) per dimension of the HF tensor
Shift = Tuple[int, ...]            # HF index + shift = index in the holder's local tensor

_COL0 = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
         "linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
         "linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "linear_fc1.weight")
_COL1 = ("linear_proj.weight", "linear_fc2.weight")


@dataclass(frozen=True)
class Slice:
    """What one rollout GPU loads of one HF tensor from one sender: the HF box, and where it sits
    in the sender's local Megatron tensor (`source`, its global name; local index = HF + shift)."""
    hf_name: str
    box: Box
    source: str
    shift: Shift

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.box)

    def local(self) -> Tuple[slice, ...]:
        """The index of this slice in the sender's local tensor."""
        return tuple(slice(lo + s, hi + s) for (lo, hi), s in zip(self.box, self.shift))


def overlap(a: Box, b: Box) -> Optional[Box]:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def area(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def full_box(shape) -> Box:
    return tuple((0, n) for n in shape)


def with_range(box: Box, dim: int, lo: int, hi: int) -> Box:
    return box[:dim] + ((lo, hi),) + box[dim + 1:]


def _chunk(n: int, parts: int, i: int, what: str) -> Tuple[int, int]:
    if n % parts:
        raise ValueError(f"{what}: {n} does not split over {parts} rollout ranks")
    return i * (n // parts), (i + 1) * (n // parts)


def stage_of(layer: int, layers: int, pp: int, vpp: Optional[int]) -> int:
    chunks = pp * (vpp or 1)
    return (layer // (layers // chunks)) % pp


def training_split(rest: str):
    """(dim, gated) of a Megatron tensor in the training layout (parallel/shards.py's rule)."""
    for suffix in _COL0:
        if rest.endswith(suffix):
            return 0, suffix == "linear_fc1.weight"
    if any(rest.endswith(s) for s in _COL1):
        return 1, False
    return None, False


def megatron_boxes(shape, dim, gated, count, t) -> List[Tuple[Box, int]]:
    """Piece t of `count` of a Megatron tensor: (box in Megatron coordinates, the box's first
    row in the holder's local tensor) for each part (a gated fc1's gate and up halves)."""
    full = full_box(shape)
    if dim is None or count == 1:
        return [(full, 0)]
    if gated:
        half = shape[0] // 2
        step = half // count
        return [(with_range(full, 0, s + t * step, s + (t + 1) * step), k * step) for k, s in enumerate((0, half))]
    step = shape[dim] // count
    return [(with_range(full, dim, t * step, (t + 1) * step), 0)]


def to_hf_boxes(blocks, mbox: Box, base: int = 0) -> Dict[str, List[Tuple[Box, Shift]]]:
    """A Megatron box cut into HF boxes (rows through the row blocks; other dims unchanged),
    each with the shift from HF to the holder's local indices (`base`: the box's first local
    row). Rows adjacent in HF and in the local tensor are one box."""
    out: Dict[str, List[Tuple[Box, Shift]]] = {}
    (lo, hi), rest = mbox[0], mbox[1:]
    tail = tuple(-a for a, _ in rest)
    offset = 0
    for name, start, rows in blocks:
        a, b = max(lo, offset), min(hi, offset + rows)
        if a < b:
            boxes = out.setdefault(name, [])
            row = (start + a - offset, start + b - offset)
            shift = (offset - start - lo + base,) + tail
            if boxes and boxes[-1][0][0][1] == row[0] and boxes[-1][0][1:] == rest and boxes[-1][1] == shift:
                boxes[-1] = (((boxes[-1][0][0][0], row[1]),) + rest, shift)
            else:
                boxes.append(((row,) + rest, shift))
        offset += rows
    return out


class RolloutShards:
    """SGLang's sharding rule (module docstring) for rollout TP rank j."""

    def __init__(self, R, attention_dp, rollout_ep, head_dim, experts):
        for name, v in (("attention_dp", attention_dp), ("rollout_ep", rollout_ep)):
            if R % v:
                raise ValueError(f"{name}={v} does not divide the rollout TP {R}")
        if experts and experts % rollout_ep:
            raise ValueError(f"rollout_ep={rollout_ep} does not divide the model's {experts} experts")
        self.R, self.attn, self.moe_tp, self.ep = R, R // attention_dp, R // rollout_ep, rollout_ep
        self.head_dim, self.experts = head_dim, experts

    def need(self, name: str, shape) -> Tuple[List[Optional[Box]], bool]:
        """(the box each rollout rank j loads, replicated?)."""
        full, R = full_box(shape), self.R
        leaf = name.split(".")[-2] if name.count(".") else name
        if leaf in ("embed_tokens", "lm_head"):
            vocab = shape[0]
            padded = -(-vocab // 64) * 64
            if padded % R:
                padded = -(-vocab // (64 * R)) * 64 * R
            per = padded // R
            return [with_range(full, 0, j * per, min((j + 1) * per, vocab)) if j * per < vocab else None
                    for j in range(R)], False
        expert = ".experts." in name
        if leaf in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj"):
            dim = 1 if leaf == "o_proj" else 0
            return [with_range(full, dim, *_chunk(shape[dim], self.attn, j % self.attn, name))
                    for j in range(R)], False
        if leaf in ("k_proj", "v_proj"):
            heads, out = shape[0] // self.head_dim, []
            for j in range(R):
                i = j % self.attn
                if heads >= self.attn:
                    out.append(with_range(full, 0, *_chunk(shape[0], self.attn, i, name)))
                else:
                    h = i // (self.attn // heads)
                    out.append(with_range(full, 0, h * self.head_dim, (h + 1) * self.head_dim))
            return out, False
        if leaf in ("gate_proj", "up_proj", "w1", "w3", "down_proj", "w2"):
            dim = 1 if leaf in ("down_proj", "w2") else 0
            tp = self.moe_tp if expert else R
            return [with_range(full, dim, *_chunk(shape[dim], tp, j % tp, name)) for j in range(R)], False
        return [full] * R, True

    def owner(self, members: int) -> Optional[np.ndarray]:
        """(E, R): rollout rank j loads expert e when its MoE-EP rank owns e (None: all load all)."""
        if self.ep == 1:
            return None
        per = self.experts // self.ep
        return (np.arange(members)[:, None] // per) == (np.arange(self.R)[None, :] // self.moe_tp)


