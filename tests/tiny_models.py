"""Tiny HuggingFace configs of every supported family (random weights, built offline)."""
import transformers

_COMMON = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64, vocab_size=96, max_position_embeddings=64, rms_norm_eps=1e-6,
               tie_word_embeddings=False)


def tiny_config(family: str, **overrides):
    kw = dict(_COMMON)
    if family == "llama":
        cls = transformers.LlamaConfig
    elif family == "qwen2":
        cls = transformers.Qwen2Config
    elif family == "qwen3":
        cls, kw = transformers.Qwen3Config, dict(kw, head_dim=8)
    elif family == "qwen2_moe":
        cls = transformers.Qwen2MoeConfig
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  shared_expert_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[0])
    elif family == "qwen3_moe":
        cls = transformers.Qwen3MoeConfig
        kw.update(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  norm_topk_prob=True)
    elif family == "mixtral":
        cls = transformers.MixtralConfig
        kw.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16)
    else:
        raise ValueError(f"no tiny config for {family!r}")
    kw.update(overrides)
    cfg = cls(**kw)
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return cfg
