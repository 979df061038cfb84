"""The CPU / hf rollout backends' forward for dense Llama-family models (Llama, Qwen2, Qwen3,
Mistral without a sliding window): the transformers model's own modules (embedding, norms,
projections, MLP, head) called in the decoder's order, with the rotary table computed once per
forward, one attention mask per forward and a KV cache of plain buffers (LeanCache).

Why: transformers' forward spends a small model's decoded token largely outside the arithmetic
(the mask builder, the cache classes, keyword plumbing and decorators): a 2-layer model's token
makes 499 Python calls there and 166 here (309 and 114 builtin calls; the aten operators barely
change, 214 -> 183). That Python is host time between a GPU's kernel launches and, on a CPU, a
sixth of a 3m model's generation. Same modules and weights, so the same arithmetic: logits agree with
transformers' forward to float rounding (tests/test_lean_decode.py). Anything else (MoE,
sliding windows, dynamic RoPE, routing capture) keeps transformers' forward.

Tests: tests/test_lean_decode.py, tests/test_rollout_cpu.py
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

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
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", None)
    if rotary is None or rope_type is None or "dynamic" in rope_type or rope_type == "longrope":
        # these rescale the frequencies with the sequence length at every forward
        return f"rope_type {rope_type!r}"
    layer = model.model.layers[0]
    if not all(hasattr(layer.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
        return "an attention without q/k/v/o projections"
    if not hasattr(layer, "post_attention_layernorm"):
        return "a decoder layer with other norms"
    return None


class LeanCache:
    """Keys and values of every layer in buffers sized for the whole generation: [rows, kv
    heads, capacity, head dim] each, allocated at the first write (the prefill), written in
    place after."""

    def __init__(self, layers: int, capacity: int):
        self.capacity, self.length = capacity, 0
        self.keys: list = [None] * layers
        self.values: list = [None] * layers

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """k, v [rows, kv heads, new, head dim] at positions start.. ; returns the layer's keys
        and values so far."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions overflowed ({end})")
        if self.keys[layer] is None:
            self.keys[layer] = k.new_empty(*k.shape[:2], self.capacity, k.shape[3])
            self.values[layer] = v.new_empty(*v.shape[:2], self.capacity, v.shape[3])
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def reorder_cache(self, index: torch.Tensor):
        """Rows picked (and repeated) along the batch: the n samples of a prompt share its
        prefill (engine/rollout/cpu.py)."""
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                if buf is not None:
                    store[i] = buf.index_select(0, index.to(buf.device))


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
        self.half = self.head_dim // 2

    def cache(self, capacity: int) -> LeanCache:
        return LeanCache(len(self.body.layers), capacity)

    def _rotary(self, position_ids, dtype):
        """cos, sin [rows, 1, seq, head dim], as transformers' rotary embedding makes them
        (fp32, scaled, cast to the activations' dtype), once for every layer."""
        rotary = self.body.rotary_emb
        freqs = position_ids[..., None].float() * rotary.inv_freq.to(position_ids.device, torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * rotary.attention_scaling).to(dtype)
        sin = (emb.sin() * rotary.attention_scaling).to(dtype)
        return cos[:, None], sin[:, None]

    def _rotate(self, x, cos, sin):
        return x * cos + torch.cat((-x[..., self.half:], x[..., :self.half]), dim=-1) * sin

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
        cos, sin = self._rotary(position_ids, h.dtype)
        mask = self._mask(attention_mask, start, new)
        shape = (rows, new, -1, self.head_dim)
        for i, layer in enumerate(self.body.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = self._rotate(q.transpose(1, 2), cos, sin)
            k = self._rotate(k.transpose(1, 2), cos, sin)
            keys, values = cache.write(i, k, attn.v_proj(x).view(shape).transpose(1, 2), start)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling,
                                                 enable_gqa=keys.shape[1] != q.shape[1])
            h = h + attn.o_proj(out.transpose(1, 2).reshape(rows, new, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        cache.length = start + new
        return self.model.lm_head(self.body.norm(h[:, -1:]))[:, -1].float()

    __call__ = forward
