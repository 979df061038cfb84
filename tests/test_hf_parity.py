"""Model parity per family: a tiny random HF model saved with `save_pretrained` is converted to
Megatron at a parallel layout (tools.convert_checkpoint.hf_to_mcore, i.e. hf_io's direct load);
Megatron's logits equal transformers' (fp32, atol 2e-5 on logits of magnitude ~1-10); the
Megatron dist checkpoint read back at TP=PP=EP=1 and written as HF (mcore_to_hf), and the
parallel model written directly (save_hf_weights with small shards), are bit-identical to
the original files, and `from_pretrained` loads them.
"""
import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open

from tests.multirank import run_on_ranks
from tests.tiny_models import tiny_config

BATCH, SEQ = 2, 8
ATOL = 2e-5  # fp32; reductions in a different order (TP splits, SDPA vs eager attention)


def deepseek_v3_config(**overrides):
    kw = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
              num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
              first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=8, vocab_size=96, max_position_embeddings=64,
              routed_scaling_factor=2.5, tie_word_embeddings=False)
    kw.update(overrides)
    cfg = transformers.DeepseekV3Config(**kw)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


# Llama 3.x RoPE with none of the defaults (factor 8, low 1, high 4, 8192 positions), and a
# theta / original context that put the 4 frequencies of head_dim 8 into all three llama3
# bands (kept, interpolated, divided by factor) within 8 positions.
ROPE_SCALINGS = {
    "llama_rope_llama3": dict(rope_type="llama3", rope_theta=100.0, factor=4.0, low_freq_factor=1.5,
                              high_freq_factor=8.0, original_max_position_embeddings=32),
    "llama_rope_linear": dict(rope_type="linear", rope_theta=100.0, factor=3.0),
}


def family_config(name):
    if name == "deepseek_v3":
        return deepseek_v3_config()
    if name == "deepseek_v3_no_q_lora_yarn":
        # DeepSeek-V3's released config uses YaRN rope scaling (factor 40); so does this case
        return deepseek_v3_config(q_lora_rank=None, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))
    if name == "llama_tied":
        return tiny_config("llama", tie_word_embeddings=True)
    if name in ROPE_SCALINGS:
        return tiny_config("llama", rope_parameters=dict(ROPE_SCALINGS[name]))
    return tiny_config(name)


def save_random_model(cfg, path, seed=0):
    """A HF model with O(1) random weights (HF's init is too small to tell layers apart)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


def tokens_for(vocab):
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def hf_logits(model_or_dir, tokens):
    model = model_or_dir
    if isinstance(model, str):
        model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits


def read_all(hf_dir):
    out = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def megatron_logits(chunks, tokens):
    """Full-vocabulary logits on the last stage's TP rank 0, None elsewhere (collective)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from parallel.schedule import forward_backward

    def step(model, mb):
        ids = tokens[mb["row"]:mb["row"] + 1]
        out = model(ids, torch.arange(SEQ).expand_as(ids), None)
        return out, lambda logits: (logits.sum() * 0, torch.tensor(1), dict(logits=logits.detach()))

    for c in chunks:
        c.eval()
    # one sample per micro-batch: interleaved pipelines need at least PP micro-batches
    infos = forward_backward(chunks, [dict(row=i) for i in range(BATCH)], step, forward_only=True,
                             seq_length=SEQ, micro_batch_size=1)
    if not infos:
        return None
    local = torch.cat([info["logits"] for info in infos])
    pieces = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(pieces, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=-1) if ps.get_tensor_model_parallel_rank() == 0 else None


def roundtrip(hf_dir, work, layout_kwargs, tokens):
    import torch.distributed as dist

    from engine.models.hf_io import load_config, save_hf_weights
    from parallel.mesh import Layout
    from tools.convert_checkpoint import hf_to_mcore, mcore_to_hf

    ckpt = os.path.join(work, "mcore")
    chunks = hf_to_mcore(hf_dir, ckpt, Layout(**layout_kwargs), params_dtype="float32")
    logits = megatron_logits(chunks, tokens)
    # the parallel model straight back to HF, in many small shards
    save_hf_weights(chunks, load_config(hf_dir), os.path.join(work, "direct"), shard_size_mb=0.02,
                    source_dir=hf_dir)
    dist.barrier()
    # the dist checkpoint read at TP=PP=EP=1 (every rank a data-parallel replica) and written
    mcore_to_hf(ckpt, os.path.join(work, "back"), Layout())
    return logits


CASES = [
    ("llama", dict(tp=2), 2),
    ("llama", dict(tp=2, pp=2), 4),
    ("llama_tied", dict(pp=2), 2),
    ("llama_rope_llama3", dict(tp=2), 2),
    ("llama_rope_linear", dict(pp=2), 2),
    ("qwen2", dict(tp=2), 2),
    ("qwen3", dict(pp=2, vpp=2), 2),
    ("qwen2_moe", dict(ep=2), 2),
    ("qwen3_moe", dict(tp=2, ep=2, etp=1, sequence_parallel=True), 2),
    ("mixtral", dict(ep=2), 2),
    ("deepseek_v3", dict(ep=2), 2),
    ("deepseek_v3_no_q_lora_yarn", dict(tp=2, sequence_parallel=True), 2),
]


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            path = str(tmp_path_factory.mktemp(f"hf_{name}"))
            model = save_random_model(family_config(name), path)
            cache[name] = (path, model)
        return cache[name]
    return get


@pytest.mark.parametrize("family,layout,world", CASES,
                         ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in l.items())}" for f, l, _ in CASES])
def test_hf_megatron_parity_and_roundtrip(family, layout, world, saved_models, tmp_path):
    hf_dir, model = saved_models(family)
    tokens = tokens_for(model.config.vocab_size)
    results = run_on_ranks(roundtrip, world, hf_dir, str(tmp_path), layout, tokens)
    logits = [r for r in results if r is not None]  # one per data-parallel replica
    assert logits
    expected = hf_logits(model, tokens)
    assert expected.abs().max() > 1.0  # weights large enough for layers to matter
    for got in logits:
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)

    original = read_all(hf_dir)
    for out in ("direct", "back"):
        out_dir = str(tmp_path / out)
        with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
            assert set(json.load(f)["weight_map"]) == set(original)
        written = read_all(out_dir)
        assert set(written) == set(original)
        for name, t in original.items():
            assert written[name].dtype == t.dtype and torch.equal(written[name], t), name
        torch.testing.assert_close(hf_logits(out_dir, tokens), expected, atol=0, rtol=0)
    assert len([n for n in os.listdir(tmp_path / "direct") if n.endswith(".safetensors")]) > 1
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # no temporary dirs left
