"""HuggingFace architecture -> Megatron TransformerConfig / GPTModel arguments, per family.

One entry per supported `architectures[0]`. Everything that differs between families (qkv bias,
qk-norm, MoE router semantics, shared experts, MLA) is decided here and nowhere else.

Tests: tests/test_hf_parity.py, tests/test_rope_scaling.py, tests/test_recipes.py, tests/test_fusions.py
"""
from dataclasses import dataclass, field

import math

import torch
import torch.nn.functional as F

from engine.errors import ModelError


@dataclass
class ArchSpec:
    """What the builder needs to know about one HF model, in Megatron's terms."""
    family: str
    transformer: dict            # TransformerConfig keyword arguments (model shape only)
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    tie_word_embeddings: bool
    moe_layer_pattern: list = field(default_factory=list)  # 1 = MoE layer, 0 = dense
    rope_scaling: dict = field(default_factory=dict)  # non-MLA static scaling ({}: plain RoPE)
    multi_latent_attention: bool = False

    @property
    def num_experts(self):
        return self.transformer.get("num_moe_experts")


def _get(cfg, *names, default=None):
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def _rope_scaling(cfg):
    """HF's rope scaling dict (transformers 5 keeps it in rope_parameters), or {} for none."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    params.update(getattr(cfg, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    return {} if kind in ("default", None) else dict(params, rope_type=kind)


def _theta(cfg):
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(_get(cfg, "rope_theta") or params.get("rope_theta") or 10000.0)


# The keys each static scaling needs, as transformers reads them (modeling_rope_utils).
_ROPE_KEYS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}


def _dense_rope(cfg):
    """RoPE scaling of a non-MLA family: {} for plain RoPE, else the parameters that
    `rope_inv_freq` turns into frequencies. Megatron's RotaryEmbedding holds fixed frequencies,
    so only scalings that are a fixed function of the config can be expressed."""
    scaling = _rope_scaling(cfg)
    kind = scaling.get("rope_type")
    if not kind:
        return {}
    if kind == "dynamic":
        raise ModelError(
            "rope_scaling.rope_type='dynamic' (dynamic NTK) is not supported: it recomputes the "
            "RoPE frequencies per batch from the longest sequence, which Megatron's rotary "
            "embedding (frequencies fixed at build time) cannot do; remove rope_scaling from "
            "config.json (identical for sequences up to max_position_embeddings="
            f"{cfg.max_position_embeddings})")
    if kind not in _ROPE_KEYS:
        raise ModelError(f"rope_scaling.rope_type={kind!r} is not supported for "
                         f"{architecture_of(cfg)}; supported: default, linear, llama3 (and yarn "
                         "for DeepSeek-V3); remove rope_scaling from config.json to train at the "
                         "original context length")
    out = {"rope_type": kind}
    for key in _ROPE_KEYS[kind]:
        if scaling.get(key) is None:
            raise ModelError(f"rope_scaling.{key} is missing from config.json for rope_type="
                             f"{kind!r}; add it (needed: {', '.join(_ROPE_KEYS[kind])})")
        out[key] = float(scaling[key])
    if out["factor"] <= 0:
        raise ModelError(f"rope_scaling.factor={out['factor']} must be > 0")
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ModelError(f"rope_scaling.high_freq_factor={out['high_freq_factor']} must be "
                         f"greater than low_freq_factor={out['low_freq_factor']}")
    return out


def rope_inv_freq(theta: float, dim: int, scaling: dict) -> torch.Tensor:
    """RoPE inverse frequencies [dim / 2] (fp32) with `scaling` applied as transformers does.

    Computed here rather than by Megatron's RotaryEmbedding: its llama3 option takes only the
    factor and hard-codes low/high_freq_factor = 1 / 4 and an 8192-token original context."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    kind = scaling.get("rope_type")
    if not kind:
        return inv
    factor = scaling["factor"]
    if kind == "linear":
        return inv / factor
    # llama3: long wavelengths (> original context / low_freq_factor) are divided by factor,
    # short ones (< original context / high_freq_factor) kept, those between interpolated.
    context = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    smooth = (context / wavelen - low) / (high - low)
    between = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen > context / low, inv / factor,
                       torch.where(wavelen < context / high, inv, between))


def _check_activation(cfg):
    act = _get(cfg, "hidden_act", default="silu")
    if act != "silu":
        raise ModelError(f"hidden_act={act!r} is not supported; these families use 'silu' (SwiGLU)")


def _trunk(cfg):
    """TransformerConfig settings every supported family shares: pre-norm RMSNorm, SwiGLU,
    no linear biases."""
    return dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads,
                ffn_hidden_size=cfg.intermediate_size, normalization="RMSNorm",
                layernorm_epsilon=_get(cfg, "rms_norm_eps", default=1e-6),
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)


def _check_shape(cfg):
    """The sizes every family needs, positive and consistent (one clear error, not a shape
    mismatch deep inside Megatron or the rollout)."""
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "vocab_size"):
        value = getattr(cfg, key, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelError(f"{key}={value!r} must be a positive integer")
    heads = cfg.num_attention_heads
    kv = _get(cfg, "num_key_value_heads", default=heads)
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        raise ModelError(f"num_key_value_heads={kv!r} must divide num_attention_heads={heads} "
                         "(each key/value head serves a whole group of query heads); use a divisor "
                         f"of {heads}")
    if _get(cfg, "head_dim") is None and cfg.hidden_size % heads:
        raise ModelError(f"hidden_size={cfg.hidden_size} is not a multiple of num_attention_heads="
                         f"{heads}; set head_dim, or a hidden_size divisible by {heads}")


def _dense(cfg, family, *, qkv_bias=False, qk_norm=False):
    _check_activation(cfg)
    heads = cfg.num_attention_heads
    head_dim = _get(cfg, "head_dim", default=cfg.hidden_size // heads)
    if _get(cfg, "mlp_bias", default=False):
        raise ModelError("mlp_bias=True is not supported (no family in Trident uses it)")
    return ArchSpec(
        family=family,
        transformer=dict(
            **_trunk(cfg),
            num_query_groups=_get(cfg, "num_key_value_heads", default=heads),
            kv_channels=head_dim,
            add_qkv_bias=qkv_bias or bool(_get(cfg, "attention_bias", default=False)),
            qk_layernorm=qk_norm,
        ),
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rotary_base=_theta(cfg),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", default=False)),
        rope_scaling=_dense_rope(cfg),
    )


def _moe(spec, cfg, *, num_experts, topk, expert_ffn, shared_ffn=None, shared_gate=False,
         renormalize_topk=True, sparse_step=1, mlp_only_layers=(), first_dense=0):
    n = cfg.num_hidden_layers
    pattern = [0 if (i in set(mlp_only_layers) or i < first_dense or (i + 1) % sparse_step)
               else 1 for i in range(n)]
    spec.moe_layer_pattern = pattern
    spec.transformer.update(
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=expert_ffn,
        moe_layer_freq=pattern,
        # softmax over all experts, then top-k; HF's norm_topk_prob=True renormalises the top-k
        # weights, which equals a softmax over the top-k logits (megatron's default order).
        moe_router_pre_softmax=not renormalize_topk,
        moe_router_load_balancing_type="none",  # RL fine-tuning: no aux loss unless asked for
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
    )
    if shared_ffn:
        spec.transformer.update(moe_shared_expert_intermediate_size=shared_ffn,
                                moe_shared_expert_gate=shared_gate)
    return spec


def _llama(cfg):
    return _dense(cfg, "llama")


def _qwen2(cfg):
    return _dense(cfg, "qwen2", qkv_bias=True)


def _qwen3(cfg):
    return _dense(cfg, "qwen3", qk_norm=True)


def _qwen2_moe(cfg):
    spec = _dense(cfg, "qwen2_moe", qkv_bias=True)
    return _moe(spec, cfg, num_experts=_get(cfg, "num_experts", "num_local_experts"),
                topk=cfg.num_experts_per_tok, expert_ffn=cfg.moe_intermediate_size,
                shared_ffn=cfg.shared_expert_intermediate_size, shared_gate=True,
                renormalize_topk=bool(_get(cfg, "norm_topk_prob", default=False)),
                sparse_step=_get(cfg, "decoder_sparse_step", default=1),
                mlp_only_layers=_get(cfg, "mlp_only_layers", default=[]))


def _qwen3_moe(cfg):
    spec = _dense(cfg, "qwen3_moe", qk_norm=True)
    return _moe(spec, cfg, num_experts=_get(cfg, "num_experts", "num_local_experts"),
                topk=cfg.num_experts_per_tok, expert_ffn=cfg.moe_intermediate_size,
                renormalize_topk=bool(_get(cfg, "norm_topk_prob", default=True)),
                sparse_step=_get(cfg, "decoder_sparse_step", default=1),
                mlp_only_layers=_get(cfg, "mlp_only_layers", default=[]))


def _mla_rope(cfg):
    """Megatron MLA rope settings: plain RoPE, or YaRN as in DeepSeek-V3's released config."""
    scaling = _rope_scaling(cfg)
    if not scaling:
        # no YaRN: softmax scale 1/sqrt(q_head_dim), as HF's
        return dict(rope_type="rope", rotary_scaling_factor=1.0)
    if scaling["rope_type"] != "yarn":
        raise ModelError(f"rope_scaling.rope_type={scaling['rope_type']!r} is not supported for "
                         "DeepSeek-V3 (MLA): use 'yarn' as the released config does, or remove "
                         "rope_scaling from config.json")
    return dict(rope_type="yarn", rotary_scaling_factor=float(scaling["factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                beta_fast=float(scaling.get("beta_fast", 32)),
                beta_slow=float(scaling.get("beta_slow", 1)),
                mscale=float(scaling.get("mscale", 1.0)),
                mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)))


def _deepseek_v3(cfg):
    """DeepSeek-V3: MLA attention, sigmoid group-limited router with a score-correction bias,
    shared experts, the first `first_k_dense_replace` layers dense. Its multi-token-prediction
    layers (`num_nextn_predict_layers`) are not built: they only serve speculative decoding and
    the MTP loss, neither of which PPO uses; their checkpoint tensors are skipped on load."""
    _check_activation(cfg)
    if _get(cfg, "attention_bias", default=False):
        raise ModelError("attention_bias=True is not supported for DeepSeek-V3 (MLA has no bias)")
    if not _get(cfg, "rope_interleave", default=True):
        raise ModelError("rope_interleave=False is not supported: Megatron's MLA applies RoPE to "
                         "interleaved rotary dimensions, as DeepSeek-V3 checkpoints store them")
    topk, groups, group_topk = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    if group_topk and topk // group_topk != 2:
        # HF scores a group by its top-2 experts; Megatron by its top-(topk / group_topk).
        raise ModelError(f"num_experts_per_tok={topk} with topk_group={group_topk} scores a "
                         "group by its top-2 experts only when num_experts_per_tok == 2 * topk_group")
    if not _get(cfg, "norm_topk_prob", default=True) and topk > 1:
        raise ModelError("norm_topk_prob=False is not supported with sigmoid routing (Megatron "
                         "always renormalises the top-k sigmoid scores)")
    heads = cfg.num_attention_heads
    spec = ArchSpec(
        family="deepseek_v3",
        transformer=dict(
            **_trunk(cfg),
            num_query_groups=heads,
            add_qkv_bias=False,
            qk_layernorm=True,  # MLA's q_a / kv_a layernorms are Megatron's q/kv "layernorm"
            multi_latent_attention=True,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_nope_head_dim,
            qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            **_mla_rope(cfg),
        ),
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rotary_base=_theta(cfg),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", default=False)),
        multi_latent_attention=True,
    )
    _moe(spec, cfg, num_experts=cfg.n_routed_experts, topk=topk,
         expert_ffn=cfg.moe_intermediate_size,
         shared_ffn=(cfg.n_shared_experts or 0) * cfg.moe_intermediate_size,
         first_dense=_get(cfg, "first_k_dense_replace", default=0))
    spec.transformer.update(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,  # HF's e_score_correction_bias
        moe_router_num_groups=groups if group_topk else None,
        moe_router_group_topk=group_topk or None,
        moe_router_topk_scaling_factor=_get(cfg, "routed_scaling_factor", default=1.0),
    )
    return spec


def _mixtral(cfg):
    spec = _dense(cfg, "mixtral")
    return _moe(spec, cfg, num_experts=_get(cfg, "num_local_experts", "num_experts"),
                topk=cfg.num_experts_per_tok, expert_ffn=cfg.intermediate_size,
                renormalize_topk=True)


ARCHITECTURES = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
    "DeepseekV3ForCausalLM": _deepseek_v3,
}

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def architecture_of(hf_config):
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        # a reward model's checkpoint names its head; the trunk is the causal LM's
        return archs[0].replace("ForSequenceClassification", "ForCausalLM")
    return MODEL_TYPES.get(getattr(hf_config, "model_type", None), str(
        getattr(hf_config, "model_type", None)))


def arch_spec(hf_config) -> ArchSpec:
    """Translate a transformers config object into Megatron's terms, or say what is supported."""
    arch = architecture_of(hf_config)
    if arch not in ARCHITECTURES:
        raise ModelError(f"architecture {arch!r} is not supported; Trident supports "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    _check_shape(hf_config)
    return ARCHITECTURES[arch](hf_config)
