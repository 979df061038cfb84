"""RoPE scaling (Llama 3.x `llama3`, `linear`): Trident's frequencies equal transformers' for
released configurations, the tiny parity configs really exercise scaling, unsupported kinds
fail with one clear message, and the CPU rollout (a transformers model built with parameters
on the meta device) keeps the scaled frequencies. Logit parity of Megatron against
transformers is in test_hf_parity (llama_rope_* cases)."""
import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.models.arch import arch_spec, rope_inv_freq
from engine.rollout.base import SamplingParams
from engine.rollout.cpu import CPURollout
from tests.test_hf_parity import (ROPE_SCALINGS, family_config, hf_logits, save_random_model,
                                  tokens_for)
from tests.tiny_models import tiny_config

# rope_parameters as Meta's config.json files ship them (head_dim 128)
RELEASED = {
    "llama-3.1-8b": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
    "llama-3.2-1b": dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
    "linear-x4": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
}


def _llama(rope, **kw):
    return tiny_config("llama", hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=131072, rope_parameters=dict(rope), **kw)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_frequencies_equal_transformers(name):
    cfg = _llama(RELEASED[name])
    arch = arch_spec(cfg)
    assert arch.transformer["kv_channels"] == 128
    ours = rope_inv_freq(arch.rotary_base, 128, arch.rope_scaling)
    theirs = LlamaRotaryEmbedding(cfg).inv_freq
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, rope_inv_freq(arch.rotary_base, 128, {}))


@pytest.mark.parametrize("name", sorted(ROPE_SCALINGS))
def test_parity_configs_change_logits(name, tmp_path):
    """The parity cases would pass with plain RoPE unless scaling moves logits well past ATOL."""
    cfg = family_config(name)
    scaled = save_random_model(cfg, str(tmp_path))  # the weights the parity test uses
    plain_cfg = family_config(name)
    plain_cfg.rope_parameters = dict(rope_type="default", rope_theta=cfg.rope_parameters["rope_theta"])
    plain = transformers.AutoModelForCausalLM.from_config(plain_cfg, dtype=torch.float32)
    plain.load_state_dict(scaled.state_dict())
    tokens = tokens_for(cfg.vocab_size)
    assert (hf_logits(scaled, tokens) - hf_logits(plain, tokens)).abs().max() > 0.1


def test_dynamic_ntk_is_refused_with_the_reason():
    cfg = tiny_config("llama", rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0,
                                                    factor=2.0))
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type='dynamic'.*per batch.*Megatron"
                                         r".*remove rope_scaling.*max_position_embeddings=64"):
        arch_spec(cfg)


def test_yarn_on_a_dense_family_is_refused():
    cfg = tiny_config("qwen2", rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                    original_max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"rope_type='yarn' is not supported for Qwen2ForCausalLM"
                                         r".*default, linear, llama3"):
        arch_spec(cfg)


def test_llama3_missing_parameter_is_named():
    cfg = _llama(RELEASED["llama-3.1-8b"])
    del cfg.rope_parameters["low_freq_factor"]
    with pytest.raises(ValueError, match=r"rope_scaling\.low_freq_factor is missing.*'llama3'"):
        arch_spec(cfg)


def test_cpu_rollout_uses_scaled_frequencies():
    cfg = family_config("llama_rope_llama3")
    arch = arch_spec(cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    rollout = CPURollout(cfg, eos_token_ids=[1])
    rollout.sync_weights([list(model.state_dict().items())])
    freqs = rollout.model.model.rotary_emb.inv_freq
    assert torch.equal(freqs, rope_inv_freq(arch.rotary_base, 8, arch.rope_scaling))
    prompt = [5, 6, 7, 8, 9, 10, 11]
    out = rollout.generate([prompt], SamplingParams(do_sample=False, max_new_tokens=6))
    # teacher-forced log-probs of the generated tokens under the regularly built model
    seq = torch.tensor([prompt + out.responses[0]])
    with torch.no_grad():
        logp = model(seq).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    expected = logp.gather(-1, torch.tensor(out.responses[0])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(out.log_probs[0]), expected, atol=1e-4, rtol=1e-4)
    assert out.responses[0] == logp.argmax(-1).tolist()
