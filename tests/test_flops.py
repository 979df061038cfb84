"""Parameter counts for MFU: the production configs against their published totals / activated
counts, tiny models of every family against the parameters transformers actually builds, and
step_flops' use of the active count."""
import os

import pytest
import torch
import transformers

from engine.perf import model_flops_params, param_counts, peak_flops_per_rank, step_flops
from tests.test_hf_parity import deepseek_v3_config
from tests.tiny_models import tiny_config

HF_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes", "hf_configs")

# (total, activated) from the model cards / technical reports
PUBLISHED = {
    "DeepSeek-V3": (671e9, 37e9),  # without the 14B multi-token-prediction module
    "Qwen3-30B-A3B": (30.5e9, 3.3e9),
    "Qwen2.5-7B-Instruct": (7.61e9, 7.61e9),
    "Qwen2-7B-Instruct": (7.6e9, 7.6e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_counts_match_published_figures(name):
    counts = param_counts(transformers.AutoConfig.from_pretrained(os.path.join(HF_CONFIGS, name)))
    total, active = PUBLISHED[name]
    assert counts.total == pytest.approx(total, rel=0.02)
    assert counts.active == pytest.approx(active, rel=0.02)


def test_dense_flop_params_drop_only_the_embedding_lookup():
    hf = transformers.AutoConfig.from_pretrained(os.path.join(HF_CONFIGS, "Qwen2.5-7B-Instruct"))
    counts = param_counts(hf)
    assert counts.active == counts.total
    # published: 6.53B non-embedding parameters; the LM head (a matmul) is added back
    non_embedding = counts.total - 2 * hf.vocab_size * hf.hidden_size
    assert non_embedding == pytest.approx(6.53e9, rel=0.01)
    assert model_flops_params(hf) == (counts.total, non_embedding + hf.vocab_size * hf.hidden_size)


def _built_counts(hf):
    """(total, active) of the model transformers builds: routed-expert tensors (names with
    '.experts.'; DeepSeek's shared ones are '.shared_experts.') count top-k / E when active."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf)
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) \
        or getattr(hf, "n_routed_experts", None)
    total = active = 0.0
    for name, p in model.named_parameters():  # tied weights are yielded once
        total += p.numel()
        active += p.numel() * (hf.num_experts_per_tok / experts if ".experts." in name else 1)
    return total, active


FAMILIES = ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3",
            "llama_tied", "deepseek_v3_no_q_lora"]


def _family(name):
    if name == "deepseek_v3":
        return deepseek_v3_config(num_hidden_layers=4)
    if name == "deepseek_v3_no_q_lora":
        return deepseek_v3_config(num_hidden_layers=5, q_lora_rank=None)
    if name == "llama_tied":
        return tiny_config("llama", tie_word_embeddings=True)
    if name == "qwen3_moe":
        return tiny_config(name, decoder_sparse_step=2, mlp_only_layers=[3])
    return tiny_config(name, attention_bias=True) if name == "llama" else tiny_config(name)


@pytest.mark.parametrize("name", FAMILIES)
def test_counts_equal_the_built_model(name):
    hf = _family(name)
    counts = param_counts(hf)
    total, active = _built_counts(hf)
    assert counts.total == total
    assert counts.active == pytest.approx(active, abs=1e-6)
    if name.startswith(("qwen2_moe", "qwen3_moe", "mixtral", "deepseek")):
        assert counts.active < counts.total
    else:
        assert counts.active == counts.total


def test_step_flops_counts_active_params_when_given():
    old = step_flops(1e9, 1000, ppo_epochs=2, critic=True, ref=True)
    # generation, old log-prob, ref, 2 actor epochs x 3, critic values + 1 epoch x 3
    assert old == 2.0 * 1e9 * 1000 * (1 + 1 + 1 + 6 + 1 + 3)
    assert step_flops(1e9, 1000, ppo_epochs=2, critic=True, ref=True,
                      active_params=1e8) == pytest.approx(old / 10)


def test_cpu_peak_is_measured():
    assert peak_flops_per_rank("cpu", torch.float32) > 1e8


def test_deepseek_moe_layer_freq_follows_deepseeks_rule():
    """DeepSeek's reference code makes layer i MoE when i >= first_k_dense_replace and
    i % moe_layer_freq == 0 (transformers' port has no moe_layer_freq; V3 uses 1): with freq 2
    layers 1 and 3 of 5 become dense, each swapping a MoE block for a dense MLP."""
    every, second = (param_counts(deepseek_v3_config(num_hidden_layers=5, moe_layer_freq=f))
                     for f in (1, 2))
    hf = deepseek_v3_config()
    h = hf.hidden_size
    moe_block = (hf.n_routed_experts * (h + 3 * h * hf.moe_intermediate_size)
                 + 3 * h * hf.moe_intermediate_size * hf.n_shared_experts)
    assert every.total - second.total == 2 * (moe_block - 3 * h * hf.intermediate_size)
