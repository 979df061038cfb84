"""The CPU rollout's lean forward (engine/rollout/lean_decode.py) against transformers' own
forward with its KV cache: the same tokens and log-probs for every supported family (Llama with
GQA, Qwen2 with q/k/v biases and tied embeddings, Qwen3 with per-head q/k norms and its own head
dim, Mistral without a sliding window, YaRN- and dynamic-NTK-scaled RoPE), left-padded prompts,
shared prefills and continued rows; the models it does not cover keep transformers' forward; and
a decoded token makes fewer than half of transformers' Python calls (the point of it)."""
import sys

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen2MoeConfig,
                          Qwen3Config)

from engine.rollout.base import SamplingParams
from engine.rollout.cpu import CPURollout
from engine.rollout.lean_decode import unsupported
from tests.test_rollout_cpu import one_thread  # noqa: F401  (tiny matmuls: one thread, autouse)

EOS = 1
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3)
FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),  # q/k/v biases
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False),  # q/k norms, 4 x 16 != 32
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
    # static RoPE scaling: other frequencies and a cos / sin scale (attention_scaling 1.14)
    "llama-yarn": lambda: LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}),
    # dynamic NTK: the rotary module rescales its frequencies once positions pass 8
    "llama-dynamic": lambda: LlamaConfig(**{**COMMON, "max_position_embeddings": 8}, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
}


def loaded(config, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if getattr(config, "attention_bias", False) or config.model_type == "qwen2":
        with torch.no_grad():  # random biases: zeros would not show a dropped one
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.3)
    rollout = CPURollout(config, eos_token_ids=[EOS], dtype=dtype)
    rollout.sync_weights([[(name, t.to(dtype)) for name, t in model.state_dict().items()]])
    return rollout


def both_ways(rollout, run):
    """run(rollout) with the lean forward, then with transformers' (the reference)."""
    lean = rollout.lean_forward
    assert lean is not None, unsupported(rollout.model)
    made, make = [], lean.cache
    lean.cache = lambda capacity: made.append(make(capacity)) or made[-1]
    # dynamic RoPE's module keeps state between forwards (its frequencies for the longest
    # sequence seen): both runs start from the same
    rotary = rollout.model.model.rotary_emb
    state = rotary.inv_freq.clone(), getattr(rotary, "max_seq_len_cached", None)
    try:
        got = run(rollout)
        assert made and all(c.length > 0 for c in made)  # the lean forward ran the generation
        rollout.lean_forward = None
        rotary.inv_freq.copy_(state[0])
        rotary.max_seq_len_cached = state[1]
        want = run(rollout)
    finally:
        rollout.lean_forward = lean
        del lean.cache
    return got, want


def assert_same(got, want):
    assert got.responses == want.responses
    assert got.finish_reasons == want.finish_reasons
    for a, b in zip(got.log_probs, want.log_probs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the hf backend's default
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_same_tokens_and_log_probs_as_transformers_forward(family, dtype):
    rollout = loaded(FAMILIES[family](), dtype=dtype)
    greedy = SamplingParams(do_sample=False, max_new_tokens=10)
    sampled = SamplingParams(n=3, temperature=0.9, max_new_tokens=10, seed=7)  # shared prefills
    for sampling in (greedy, sampled):
        got, want = both_ways(rollout, lambda r: r.generate(PROMPTS, sampling))
        assert_same(got, want)
        assert len({len(p) for p in PROMPTS}) == len(PROMPTS)  # left padding of every width
    # continued rows prefill prompt + their own tokens, in a batch of other lengths
    paused = rollout.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, seed=3))
    paused.finish_reasons = ["paused"] * len(paused.finish_reasons)
    more = SamplingParams(n=2, max_new_tokens=9, seed=3)
    got, want = both_ways(rollout, lambda r: r.continue_generation(PROMPTS, more, [0, 1, 2], paused))
    assert_same(got, want)


def test_prefill_mask_causal_over_a_rows_tokens_and_never_empty():
    """A query sees its row's real positions up to itself; a padding query sees itself only, so
    no attention row is empty (an empty row is NaN in some attention kernels, 0 in others)."""
    lean = CPURollout(FAMILIES["llama"](), eos_token_ids=[EOS]).lean_forward
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    mask = lean._mask(attention, start=2, new=3)  # positions 2..4 of 5, after 2 cached ones
    assert mask.shape == (2, 1, 3, 5)
    for row in range(2):
        for q in range(3):
            pos = 2 + q
            want = [bool(attention[row, c]) and c <= pos for c in range(5)]
            assert mask[row, 0, q].tolist() == want
    pad = lean._mask(attention, start=0, new=5)[0, 0]
    assert pad[0].tolist() == [True, False, False, False, False]  # a padding query: itself
    assert pad.any(-1).all()
    assert lean._mask(attention, start=4, new=1).tolist() == attention[:, None, None, :5].bool().tolist()


def test_other_models_keep_transformers_forward():
    moe = Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16)
    windowed = MistralConfig(**COMMON, sliding_window=8)
    for config, why in ((moe, "model_type 'qwen2_moe'"), (windowed, "sliding window")):
        rollout = CPURollout(config, eos_token_ids=[EOS])
        assert rollout.lean_forward is None
        assert why in unsupported(rollout.model)
    assert CPURollout(FAMILIES["llama"](), eos_token_ids=[EOS]).lean_forward is not None


def test_a_decoded_token_makes_under_half_the_python_calls():
    """What a small model's decoded token costs is the Python around its arithmetic (on a GPU,
    the host time between kernel launches): Python and builtin calls of one decoded token, 2
    layers, counted by the interpreter's profiler hook (deterministic, unlike a timing)."""
    from engine.rollout.kv_cache import preallocated_cache
    rollout = loaded(FAMILIES["llama"]())
    rows, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    step = (torch.tensor([[3], [4]]), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1), positions[:, -1:] + 1)
    counts = {}
    for name in ("lean", "transformers"):
        if name == "transformers":
            rollout.lean_forward = None
        cache = (rollout.lean_forward.cache(8) if rollout.lean_forward is not None
                 else preallocated_cache(rollout.model.config, 8))
        calls = [0]

        def hook(frame, event, arg):
            calls[0] += event in ("call", "c_call")
        with torch.no_grad():
            rollout._forward(rows, mask, positions, cache)  # the prefill, not counted
            sys.setprofile(hook)
            try:
                rollout._forward(*step, cache)
            finally:
                sys.setprofile(None)
        counts[name] = calls[0]
    assert counts["lean"] < 0.5 * counts["transformers"], counts
