"""The CPU / hf rollout backends' forward for dense Llama-family models (Llama, Qwen2, Qwen3,
Mistral without a sliding window): the transformers model's own modules and functions
(embedding, rotary embedding, norms, projections, rotation, MLP, head) called in the decoder's
order, with one rotary table and one attention mask per forward and a KV cache of plain buffers
(LeanCache, engine/rollout/kv_cache.py).

Why: transformers' forward spends a small model's decoded token largely outside the arithmetic
(the mask builder, the cache classes, keyword plumbing and decorators): a 2-layer model's token
makes 501 Python calls there and 173 here (309 and 119 builtin calls; the aten operators barely
change, 214 -> 183). That Python is host time between a GPU's kernel launches and, on a CPU, a
sixth of a 3m model's generation. Same modules and weights, so the same arithmetic: logits agree with
transformers' forward to float rounding (tests/test_lean_decode.py). Anything else (MoE,
sliding windows) keeps transformers' forward.

Tests: tests/test_lean_decode.py, tests/test_rollout_cpu.py
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F

from engine.rollout.kv_cache import LeanCache

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def unsupported(model) -> Optional[str]:
    """Why `model` (a transformers causal LM) must keep transformers' forward, or None."""
    config = model.config
    model_type = getattr(config, "model_type", "")
    if model_type not in MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {MODEL_TYPES}"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return "sliding-window layers"
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "Mistral's sliding window"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if getattr(getattr(model, "model", None), "rotary_emb", None) is None:
        return "no rotary embedding module"
    layer = model.model.layers[0]
    if not all(hasattr(layer.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
        return "an attention without q/k/v/o projections"
    if not hasattr(sys.modules[type(layer.self_attn).__module__], "apply_rotary_pos_emb"):
        return "no apply_rotary_pos_emb beside its attention"
    if not hasattr(layer, "post_attention_layernorm"):
        return "a decoder layer with other norms"
    return None


class LeanForward:
    """`forward(input_ids, attention_mask, position_ids, cache)` -> fp32 logits of each row's
    last position, as `model(...).logits[:, -1]` with a KV cache; `cache(capacity)` makes the
    cache. Reads the model's modules at every call: the rollout swaps their storage (released,
    resumed, reloaded) in place."""

    def __init__(self, model):
        self.model = model
        self.body = model.model
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # the family's own rotation (transformers' modeling_<family>.py)
        self.rotate = sys.modules[type(self.body.layers[0].self_attn).__module__].apply_rotary_pos_emb

    def cache(self, capacity: int) -> LeanCache:
        return LeanCache(len(self.body.layers), capacity)

    def _mask(self, attention_mask, start: int, new: int):
        """[rows, 1, new, start + new] bool: a query sees the cached and new positions its row
        holds (not padding) up to itself. A padding query sees itself, so its (unused) output
        stays finite and never reaches a real token through the cache."""
        end = start + new
        keys = attention_mask[:, None, None, :end].bool()
        if new == 1:
            return keys
        cols = torch.arange(end, device=attention_mask.device)
        rows = start + torch.arange(new, device=attention_mask.device)[:, None]
        return (keys & (cols <= rows)) | (cols == rows)

    @torch.no_grad()
    def forward(self, input_ids, attention_mask, position_ids, cache: LeanCache):
        rows, new = input_ids.shape
        start = cache.length
        h = self.body.embed_tokens(input_ids)
        # once for every layer, by the model's rotary module (its scaling, its dynamic updates)
        cos, sin = self.body.rotary_emb(h, position_ids)
        mask = self._mask(attention_mask, start, new)
        shape = (rows, new, -1, self.head_dim)
        for i, layer in enumerate(self.body.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            keys, values = cache.write(i, k, attn.v_proj(x).view(shape).transpose(1, 2), start)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling,
                                                 enable_gqa=keys.shape[1] != q.shape[1])
            h = h + attn.o_proj(out.transpose(1, 2).reshape(rows, new, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        cache.length = start + new
        return self.model.lm_head(self.body.norm(h[:, -1:]))[:, -1].float()

    __call__ = forward
