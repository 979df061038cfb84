"""The `hf` rollout backend: the CPU backend's transformers model and decoding
(engine/rollout/cpu.py) on this rank's GPU, for GPU machines without SGLang (`make gpu-check`
on a bare machine).

Tests: tests/gpu/test_hf_rollout_gpu.py, tests/test_gpu_check.py
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from engine.rollout.base import register_rollout
from engine.rollout.cpu import CPURollout


@register_rollout("hf")
class HFRollout(CPURollout):
    """The CPU backend's transformers model and decoding on this rank's GPU (bf16 by default):
    a rollout for GPU machines without SGLang (e.g. `make gpu-check` on a bare machine). Same
    interface and grouping; no paged KV cache or CUDA graphs, so it is for checks, not speed."""

    NEEDS_CUDA = True

    def __init__(self, hf_config, eos_token_ids: Sequence[int] = (), pad_token_id: Optional[int] = None,
                 dtype: torch.dtype = torch.bfloat16, record_routing: bool = False, max_num_seqs: int = 1 << 30):
        super().__init__(hf_config, eos_token_ids, pad_token_id, dtype=dtype, record_routing=record_routing,
                         max_num_seqs=max_num_seqs,
                         device=f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cuda")
