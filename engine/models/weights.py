"""Megatron global parameter names <-> HuggingFace on-disk checkpoint names, per family.

A Megatron *global name* is the parameter name in the single-process (TP=PP=EP=1) local-spec
model (see `parallel.shards`). Each global tensor is made of row blocks of one or more HF
tensors: a plain tensor is one block; Megatron's fused QKV is, for every query group g,
[q heads of g; k_g; v_g]; a gated fc1 is [gate; up]. `_blocks` describes that once and both
directions use it: `megatron_from_hf` reads (lazily, only the rows a rank asks for) and
`megatron_to_hf` splits.

HF names are those of the files `save_pretrained` writes (transformers 5 fuses MoE experts in
memory, but checkpoints keep one tensor per expert: `mlp.experts.{e}.gate_proj.weight` ...).

Tests: tests/test_convert_checkpoint.py, tests/test_hf_parity.py, tests/test_reshard.py
"""
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

from engine.models.arch import arch_spec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

# TransformerEngine's layer spec fuses the norms into the following linear layer; these are the
# same tensors under their TE names.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}


@dataclass(frozen=True)
class _Block:
    hf_name: str
    start: int   # first row of the block in the HF tensor
    rows: int


_MEMO: Dict[int, tuple] = {}


def _memo(hf_config):
    """(arch spec, global shapes) of a config object, computed once: conversions look up
    tens of thousands of names for one config."""
    hit = _MEMO.get(id(hf_config))
    if hit is None or hit[0] is not hf_config:
        spec = arch_spec(hf_config)
        hit = _MEMO[id(hf_config)] = (hf_config, spec, _global_shapes(spec))
    return hit[1], hit[2]


def _family(hf_config):
    return _memo(hf_config)[0].family


def _attn_dims(hf_config):
    t = _memo(hf_config)[0].transformer
    heads, groups, d = t["num_attention_heads"], t["num_query_groups"], t["kv_channels"]
    return heads, groups, d


def _unknown(global_name, hf_config):
    return ValueError(f"{global_name!r} has no HuggingFace counterpart for the "
                      f"{_family(hf_config)} family (is the model built from this config?)")


def _mlp_names(family, prefix, sub):
    """HF (gate, up, down) names of a gated MLP `sub` under layer `prefix`."""
    if family == "mixtral" and sub.startswith("experts."):
        e = sub.split(".")[1]
        base = f"{prefix}block_sparse_moe.experts.{e}."
        return base + "w1.weight", base + "w3.weight", base + "w2.weight"
    base = f"{prefix}mlp.{sub + '.' if sub else ''}"
    return base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"


def _blocks(hf_config, global_name: str) -> Tuple[List[_Block], Tuple[int, ...]]:
    """The HF row blocks making up `global_name`, in Megatron row order, and its global shape."""
    shape = _memo(hf_config)[1].get(global_name)
    if shape is None:
        raise _unknown(global_name, hf_config)
    family = _family(hf_config)

    def plain(name):
        return [_Block(name, 0, shape[0])]

    if global_name == "embedding.word_embeddings.weight":
        return plain("model.embed_tokens.weight"), shape
    if global_name == "output_layer.weight":
        return plain("lm_head.weight"), shape
    if global_name == "decoder.final_layernorm.weight":
        return plain("model.norm.weight"), shape
    m = _LAYER.match(global_name)
    if not m:
        raise _unknown(global_name, hf_config)
    layer, rest = m.group(1), m.group(2)
    p = f"model.layers.{layer}."
    attn = p + "self_attn."
    if family == "deepseek_v3":
        mla = {"self_attention.linear_q_proj.weight": "q_proj.weight",
               "self_attention.linear_q_down_proj.weight": "q_a_proj.weight",
               "self_attention.q_layernorm.weight": "q_a_layernorm.weight",
               "self_attention.linear_q_up_proj.weight": "q_b_proj.weight",
               "self_attention.linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
               "self_attention.kv_layernorm.weight": "kv_a_layernorm.weight",
               "self_attention.linear_kv_up_proj.weight": "kv_b_proj.weight"}
        if rest in mla:
            return plain(attn + mla[rest]), shape
    simple = {"input_layernorm.weight": p + "input_layernorm.weight",
              "pre_mlp_layernorm.weight": p + "post_attention_layernorm.weight",
              "self_attention.linear_proj.weight": attn + "o_proj.weight",
              "self_attention.q_layernorm.weight": attn + "q_norm.weight",
              "self_attention.k_layernorm.weight": attn + "k_norm.weight",
              "mlp.router.weight": p + ("block_sparse_moe.gate.weight" if family == "mixtral"
                                        else "mlp.gate.weight"),
              "mlp.router.expert_bias": p + "mlp.gate.e_score_correction_bias",
              "mlp.shared_experts.gate_weight": p + "mlp.shared_expert_gate.weight"}
    if rest in simple:
        return plain(simple[rest]), shape
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        heads, groups, d = _attn_dims(hf_config)
        kind = rest.rsplit(".", 1)[1]
        q, k, v = (f"{attn}{x}_proj.{kind}" for x in "qkv")
        per_group = heads // groups * d
        blocks = []
        for g in range(groups):
            blocks += [_Block(q, g * per_group, per_group), _Block(k, g * d, d), _Block(v, g * d, d)]
        return blocks, shape
    sub = None
    e = _EXPERT.match(rest)
    if e:
        sub, which = f"experts.{e.group(1)}", e.group(2)
    elif rest in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
        sub, which = "", rest.split(".")[1]
    elif rest in ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"):
        sub = "shared_experts" if family == "deepseek_v3" else "shared_expert"
        which = rest.split(".")[2]
    if sub is None:
        raise _unknown(global_name, hf_config)
    gate, up, down = _mlp_names(family, p, sub)
    if which == "linear_fc2":
        return plain(down), shape
    half = shape[0] // 2
    return [_Block(gate, 0, half), _Block(up, 0, half)], shape


def _canonical(global_name):
    m = _LAYER.match(global_name)
    if m and m.group(2) in _TE_ALIASES:
        return f"decoder.layers.{m.group(1)}.{_TE_ALIASES[m.group(2)]}"
    return global_name


def global_shapes(hf_config) -> Dict[str, Tuple[int, ...]]:
    """Every Megatron global parameter (and the router's expert-bias buffer) with its shape, in
    model order, computed from the config alone."""
    return dict(_memo(hf_config)[1])


def _global_shapes(arch) -> Dict[str, Tuple[int, ...]]:
    t = arch.transformer
    h, v = t["hidden_size"], arch.vocab_size
    out = {"embedding.word_embeddings.weight": (v, h)}
    pattern = arch.moe_layer_pattern or [0] * t["num_layers"]
    for layer in range(t["num_layers"]):
        p = f"decoder.layers.{layer}."
        out[p + "input_layernorm.weight"] = (h,)
        heads = t["num_attention_heads"]
        if arch.multi_latent_attention:
            q_head = t["qk_head_dim"] + t["qk_pos_emb_head_dim"]
            if t["q_lora_rank"] is None:
                out[p + "self_attention.linear_q_proj.weight"] = (heads * q_head, h)
            else:
                out[p + "self_attention.linear_q_down_proj.weight"] = (t["q_lora_rank"], h)
                out[p + "self_attention.q_layernorm.weight"] = (t["q_lora_rank"],)
                out[p + "self_attention.linear_q_up_proj.weight"] = (heads * q_head, t["q_lora_rank"])
            out[p + "self_attention.linear_kv_down_proj.weight"] = (
                t["kv_lora_rank"] + t["qk_pos_emb_head_dim"], h)
            out[p + "self_attention.kv_layernorm.weight"] = (t["kv_lora_rank"],)
            out[p + "self_attention.linear_kv_up_proj.weight"] = (
                heads * (t["qk_head_dim"] + t["v_head_dim"]), t["kv_lora_rank"])
            out[p + "self_attention.linear_proj.weight"] = (h, heads * t["v_head_dim"])
        else:
            d, groups = t["kv_channels"], t["num_query_groups"]
            qkv = (heads + 2 * groups) * d
            out[p + "self_attention.linear_qkv.weight"] = (qkv, h)
            if t["add_qkv_bias"]:
                out[p + "self_attention.linear_qkv.bias"] = (qkv,)
            if t["qk_layernorm"]:
                out[p + "self_attention.q_layernorm.weight"] = (d,)
                out[p + "self_attention.k_layernorm.weight"] = (d,)
            out[p + "self_attention.linear_proj.weight"] = (h, heads * d)
        out[p + "pre_mlp_layernorm.weight"] = (h,)
        if not pattern[layer]:
            f = t["ffn_hidden_size"]
            out[p + "mlp.linear_fc1.weight"] = (2 * f, h)
            out[p + "mlp.linear_fc2.weight"] = (h, f)
            continue
        experts, f = t["num_moe_experts"], t["moe_ffn_hidden_size"]
        out[p + "mlp.router.weight"] = (experts, h)
        if t.get("moe_router_enable_expert_bias"):
            out[p + "mlp.router.expert_bias"] = (experts,)
        for e in range(experts):
            out[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * f, h)
            out[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, f)
        shared = t.get("moe_shared_expert_intermediate_size")
        if shared:
            out[p + "mlp.shared_experts.linear_fc1.weight"] = (2 * shared, h)
            out[p + "mlp.shared_experts.linear_fc2.weight"] = (h, shared)
            if t.get("moe_shared_expert_gate"):
                out[p + "mlp.shared_experts.gate_weight"] = (1, h)
    out["decoder.final_layernorm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = (v, h)
    return out


def hf_names_for(hf_config, global_name: str) -> List[str]:
    """The HF checkpoint tensors that make up `global_name`, in the order HF lists them."""
    names = []
    for b in _blocks(hf_config, _canonical(global_name))[0]:
        if b.hf_name not in names:
            names.append(b.hf_name)
    return names


def row_blocks(hf_config, global_name: str) -> List[Tuple[str, int, int]]:
    """(HF name, first row in the HF tensor, rows) of each row block of `global_name`, in
    Megatron row order: how a tensor whose rows follow the weight's (a LoRA B) splits."""
    return [(b.hf_name, b.start, b.rows) for b in _blocks(hf_config, _canonical(global_name))[0]]


def expected_hf_tensors(hf_config) -> Dict[str, Tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds (MTP layers aside), with its shape."""
    out = {}
    for name in _memo(hf_config)[1]:
        blocks, shape = _blocks(hf_config, name)
        for b in blocks:
            out[b.hf_name] = (max(out.get(b.hf_name, (0,))[0], b.start + b.rows),) + tuple(shape[1:])
    return out


def ignored_hf_tensor(hf_config, hf_name: str) -> bool:
    """True for checkpoint tensors Trident deliberately does not load: DeepSeek-V3's
    multi-token-prediction layers (indices >= num_hidden_layers), rotary caches, and a tied
    model's redundant lm_head copy."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return True
    if hf_name == "lm_head.weight" and _memo(hf_config)[0].tie_word_embeddings:
        return True
    m = re.match(r"^model\.layers\.(\d+)\.", hf_name)
    return bool(m and int(m.group(1)) >= hf_config.num_hidden_layers
                and getattr(hf_config, "num_nextn_predict_layers", 0))


def _shape(x) -> Tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else tuple(x.get_shape())


class LazyGlobal:
    """A Megatron global tensor that is read from its HF pieces only where it is indexed.

    Supports `shape` and `[rows, ...]` indexing with plain slices (what `Shard.take` does), so
    a tensor-parallel rank reads only its own rows (or columns) from the checkpoint files.
    """

    def __init__(self, blocks: List[_Block], shape, read: Callable[[str], object]):
        self.blocks, self.shape, self._read, self._sources = blocks, tuple(shape), read, {}

    def _source(self, name):
        if name not in self._sources:
            self._sources[name] = self._read(name)
        return self._sources[name]

    def _index(self, key):
        if key is Ellipsis:
            key = ()
        key = key if isinstance(key, tuple) else (key,)
        if Ellipsis in key:
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (len(self.shape) - len(key) + 1) + key[i + 1:]
        key = key + (slice(None),) * (len(self.shape) - len(key))
        for k in key:
            if not isinstance(k, slice) or k.step not in (None, 1):
                raise TypeError(f"LazyGlobal supports contiguous slices only, got {key}")
        return key

    def __getitem__(self, key):
        rows, rest = (lambda k: (k[0], k[1:]))(self._index(key))
        start, stop, _ = rows.indices(self.shape[0])
        parts, offset = [], 0
        for b in self.blocks:
            lo, hi = max(start, offset), min(stop, offset + b.rows)
            if lo < hi:
                src = self._source(b.hf_name)
                a = b.start + lo - offset
                parts.append(torch.as_tensor(src[(slice(a, a + hi - lo),) + rest]))
            offset += b.rows
        if not parts:
            raise IndexError(f"empty row range {rows} of a tensor with shape {self.shape}")
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def megatron_from_hf(hf_config, global_name: str, read: Callable[[str], object]):
    """The Megatron global tensor `global_name`, built from HF tensors `read(hf_name)` (tensors
    or safetensors slices). Returns a `LazyGlobal`: index it (or `[...]` for all of it)."""
    blocks, shape = _blocks(hf_config, _canonical(global_name))
    return LazyGlobal(blocks, shape, read)


def megatron_to_hf(hf_config, global_name: str, tensor: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
    """Split (or rename) the global Megatron tensor into its HF checkpoint tensors."""
    blocks, shape = _blocks(hf_config, _canonical(global_name))
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{global_name}: tensor has shape {tuple(tensor.shape)}, this config "
                         f"expects {tuple(shape)}")
    if len(blocks) == 1:
        return [(blocks[0].hf_name, tensor)]
    pieces: Dict[str, list] = {}
    offset = 0
    for b in blocks:
        pieces.setdefault(b.hf_name, []).append((b.start, tensor[offset:offset + b.rows]))
        offset += b.rows
    return [(name, torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])], dim=0))
            for name, parts in pieces.items()]
