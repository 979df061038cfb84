"""CPU rollout backend against independent references: a plain no-cache argmax loop on the
transformers model, teacher-forced log_softmax(logits / T), the router's own logits."""
import os
import resource

import psutil
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2MoeConfig

from engine.rollout.base import SamplingParams
from engine.rollout.registry import make_rollout, vllm_runs_here
from engine.rollout.cpu import CPURollout
from tests.multirank import in_fresh_process
from tests.test_cpu_compat import MICRO_BATCH_PAGES

EOS = 1
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def llama_config(**overrides):
    kw = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3,
              tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def reference_model(config, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def buckets(named_tensors, size):
    named_tensors = list(named_tensors)
    for i in range(0, len(named_tensors), size):
        yield named_tensors[i:i + size]


def checkpoint_tensors(model, tmp_path):
    """The tensors under the names transformers writes to a checkpoint (per-expert for MoE)."""
    model.save_pretrained(tmp_path)
    return load_file(os.path.join(tmp_path, "model.safetensors"))


def loaded_rollout(model, bucket_size=3, **kwargs):
    rollout = CPURollout(model.config, eos_token_ids=[EOS], **kwargs)
    rollout.sync_weights(buckets(model.state_dict().items(), bucket_size))
    return rollout


@torch.no_grad()
def reference_greedy(model, prompt, max_new_tokens, stop=(EOS,)):
    """Argmax loop re-running the whole sequence each step (no KV cache, no padding)."""
    seq, tokens, logps = list(prompt), [], []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([seq])).logits[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        logps.append(float(logits.log_softmax(-1)[token]))
        seq.append(token)
        if token in stop:
            break
    return tokens, logps


@torch.no_grad()
def teacher_forced_logits(model, prompt, response):
    """Logits predicting each response token, from one forward over prompt + response."""
    logits = model(torch.tensor([list(prompt) + list(response)])).logits[0]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(response)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matmuls: with several threads on a shared, loaded machine OpenMP spinning makes
    # each step ~100x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama():
    return reference_model(llama_config())


@pytest.fixture(scope="module")
def rollout(llama):
    return loaded_rollout(llama)


def test_greedy_matches_uncached_argmax_loop(llama, rollout):
    out = rollout.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=8))
    assert out.prompt_index == [0, 1, 2]
    for prompt, tokens, logps, reason in zip(PROMPTS, out.responses, out.log_probs, out.finish_reasons):
        ref_tokens, ref_logps = reference_greedy(llama, prompt, 8)
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logps), torch.tensor(ref_logps), atol=1e-4, rtol=1e-4)
        assert reason == ("stop" if ref_tokens[-1] == EOS else "length")
    # temperature 0 is greedy too, whatever do_sample says
    again = rollout.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert again.responses == out.responses


def test_sampled_log_probs_are_full_vocab_log_softmax_of_scaled_logits(llama, rollout):
    sampling = SamplingParams(n=3, temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=6, seed=3)
    out = rollout.generate(PROMPTS, sampling)
    assert len(out.responses) == 9
    for row, prompt_i in enumerate(out.prompt_index):
        logits = teacher_forced_logits(llama, PROMPTS[prompt_i], out.responses[row])
        chosen = torch.tensor(out.responses[row])
        expected = (logits / 0.7).log_softmax(-1).gather(-1, chosen[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(out.log_probs[row]), expected, atol=1e-4, rtol=1e-4)
        # sampled inside the filters: among the top 5, and inside the top-0.9 nucleus
        rank = (logits > logits.gather(-1, chosen[:, None])).sum(-1)
        assert bool((rank < 5).all())
        probs = (logits / 0.7).softmax(-1)
        mass_before = (probs * (probs > probs.gather(-1, chosen[:, None]))).sum(-1)
        assert bool((mass_before < 0.9).all())


def test_padded_output_layout(rollout):
    out = rollout.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=0))
    padded = out.padded(pad_token_id=0, length=7)
    for r, tokens in enumerate(out.responses):
        assert padded["responses"][r, :len(tokens)].tolist() == tokens
        assert padded["response_mask"][r].sum() == len(tokens)
        assert padded["rollout_log_probs"][r, :len(tokens)].tolist() == pytest.approx(out.log_probs[r])
    with pytest.raises(ValueError, match="length"):
        out.padded(0, length=1)


def test_n_samples_and_seed_determinism(rollout):
    sampling = SamplingParams(n=4, temperature=1.5, max_new_tokens=8, seed=11)
    first = rollout.generate(PROMPTS, sampling)
    assert first.prompt_index == [0] * 4 + [1] * 4 + [2] * 4
    assert rollout.generate(PROMPTS, sampling).responses == first.responses
    other = rollout.generate(PROMPTS, SamplingParams(n=4, temperature=1.5, max_new_tokens=8, seed=12))
    assert other.responses != first.responses
    # the n samples of a prompt are drawn independently
    assert len({tuple(r) for r in first.responses[:4]}) > 1


def test_stop_tokens_end_each_request(llama, rollout):
    ref_tokens, _ = reference_greedy(llama, PROMPTS[0], 8, stop=())
    stop = ref_tokens[2]
    out = rollout.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=8, stop_token_ids=(stop,)))
    assert out.responses[0] == ref_tokens[:ref_tokens.index(stop) + 1]
    assert out.finish_reasons[0] == "stop"
    for prompt, tokens in zip(PROMPTS[1:], out.responses[1:]):  # others run on alone, unaffected
        assert tokens == reference_greedy(llama, prompt, 8, stop=(EOS, stop))[0]


def test_left_padding_matches_one_at_a_time(rollout):
    sampling = SamplingParams(do_sample=False, max_new_tokens=8)
    batched = rollout.generate(PROMPTS, sampling)
    for i, prompt in enumerate(PROMPTS):
        alone = rollout.generate([prompt], sampling)
        assert alone.responses[0] == batched.responses[i]
        torch.testing.assert_close(torch.tensor(alone.log_probs[0]), torch.tensor(batched.log_probs[i]),
                                   atol=1e-5, rtol=1e-5)


def test_the_samples_of_a_prompt_share_its_prefill(llama, rollout, monkeypatch):
    """n samples of a prompt: the prefill runs once per distinct prompt (its KV cache and
    next-token logits copied to the prompt's rows) and the answer is the one of prefilling
    every row: the same tokens, the same log-probs; a continued row (prompt + its own tokens)
    gets its own prefill."""
    import engine.rollout.cpu as cpu
    sampling = SamplingParams(n=4, temperature=1.2, max_new_tokens=8, seed=5)
    batch_rows = []
    forward = rollout._forward  # every model call, whichever forward (lean or transformers') runs it

    def counted(input_ids, *args):
        batch_rows.append(input_ids.shape)
        return forward(input_ids, *args)
    monkeypatch.setattr(rollout, "_forward", counted)
    shared = rollout.generate(PROMPTS + [PROMPTS[0]], sampling)
    assert batch_rows[0] == (len(PROMPTS), max(map(len, PROMPTS)))  # 3 distinct prompts of 16 rows
    assert all(shape == (16, 1) for shape in batch_rows[1:])
    monkeypatch.setattr(cpu, "distinct_rows", lambda rows: (list(range(len(rows))), list(range(len(rows)))))
    batch_rows.clear()
    every = rollout.generate(PROMPTS + [PROMPTS[0]], sampling)
    assert batch_rows[0][0] == 16
    assert shared.responses == every.responses
    assert len({tuple(r) for r in shared.responses[:4]}) > 1  # still n draws, not one copied
    assert shared.responses[:4] != shared.responses[12:]  # the same prompt under its own key
    for a, b in zip(shared.log_probs, every.log_probs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)


def test_weight_name_shape_and_completeness_errors(llama):
    rollout = CPURollout(llama.config, eos_token_ids=[EOS])
    state = llama.state_dict()
    with pytest.raises(RuntimeError, match="no weights loaded"):
        rollout.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="unknown weight name 'model.layers.0.self_attn.qkv.weight'"):
        rollout.update_weights([("model.layers.0.self_attn.qkv.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"model.norm.weight.*shape \(31,\), expected \(32,\)"):
        rollout.update_weights([("model.norm.weight", torch.zeros(31))])
    rollout.update_weights((n, t) for n, t in state.items() if n != "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        rollout.finish_weight_update()
    rollout.update_weights([("model.layers.1.mlp.up_proj.weight", state["model.layers.1.mlp.up_proj.weight"])])
    rollout.finish_weight_update()
    # a new sync must again be complete
    rollout.update_weights([("model.norm.weight", state["model.norm.weight"])])
    with pytest.raises(ValueError, match="never sent"):
        rollout.finish_weight_update()


@pytest.mark.parametrize("tied_name", ["lm_head.weight", "model.embed_tokens.weight"])
def test_tied_embeddings_accept_either_name(tied_name):
    model = reference_model(llama_config(tie_word_embeddings=True), seed=1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rollout = CPURollout(model.config, eos_token_ids=[EOS])
    other = {"lm_head.weight", "model.embed_tokens.weight"} - {tied_name}
    rollout.sync_weights(buckets(((n, t) for n, t in model.state_dict().items() if n not in other), 4))
    out = rollout.generate(PROMPTS[:2], SamplingParams(do_sample=False, max_new_tokens=6))
    assert out.responses == [reference_greedy(model, p, 6)[0] for p in PROMPTS[:2]]
    # one copy: the tied pair is a single parameter in the rollout model too
    assert rollout.model.lm_head.weight is rollout.model.model.embed_tokens.weight
    rollout.update_weights((n, t) for n, t in model.state_dict().items() if n not in ("lm_head.weight", "model.embed_tokens.weight"))
    with pytest.raises(ValueError, match="embed_tokens"):
        rollout.finish_weight_update()


def test_release_resume_cycle(llama):
    rollout = loaded_rollout(llama, bucket_size=5)
    sampling = SamplingParams(do_sample=False, max_new_tokens=6)
    before = rollout.generate(PROMPTS, sampling)
    rollout.release_memory()
    assert all(p.device.type == "meta" for p in rollout.model.parameters())
    with pytest.raises(RuntimeError, match="no weights loaded"):
        rollout.generate(PROMPTS, sampling)
    rollout.resume_memory()
    with pytest.raises(RuntimeError, match="no weights loaded"):
        rollout.generate(PROMPTS, sampling)
    rollout.sync_weights(buckets(llama.state_dict().items(), 5))
    assert rollout.generate(PROMPTS, sampling).responses == before.responses


def _memory_across_rollout_cycles():
    """In a process keeping freed memory as a CPU trainer does (parallel/cpu.py), per cycle of
    the rollout (resume, load, generate, release) then a training micro-batch: (page faults
    of the resume and load, of the micro-batch, RSS MiB after it); and the weights' MiB."""
    from parallel.cpu import keep_freed_memory
    from tests.test_cpu_compat import micro_batch_faults

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    assert keep_freed_memory({})
    # ~6M parameters (~23 MiB in fp32)
    config = llama_config(vocab_size=4096, hidden_size=384, intermediate_size=768, num_attention_heads=6,
                          num_key_value_heads=3)
    state = reference_model(config).state_dict()
    weight_mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    rollout = CPURollout(config, eos_token_ids=[EOS])
    figures = []
    for cycle in range(6):
        before = faults()
        rollout.resume_memory()
        rollout.sync_weights(buckets(state.items(), 4))
        loaded = faults() - before
        rollout.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0))
        rollout.release_memory()
        figures.append((loaded, micro_batch_faults(), round(psutil.Process().memory_info().rss / 2**20)))
    return figures, weight_mib


def test_released_weights_and_trainings_memory_take_turns_without_faulting_pages():
    # colocated in one process, the rollout's weights and training's activations take the same
    # pages in turn. A process-wide malloc_trim on release gave both back to the OS, and every
    # phase faulted its memory in again (~4 000 faults per reference pass and ~17 000 per update
    # of the 3m benchmark, per rank)
    figures, weight_mib = in_fresh_process(_memory_across_rollout_cycles)
    print(f"\nweights {weight_mib:.1f} MiB; per cycle (faults loading, faults of a micro-batch, RSS MiB): {figures}")
    # the heap settles in the first cycles (under transformers 5.17 one 4 MiB block still
    # found no free room in the third); faulting again every cycle is what must not happen
    weight_pages, steady = weight_mib * 2**20 / resource.getpagesize(), figures[3:]
    assert figures[0][0] > 0.5 * weight_pages  # the first load does fault its pages in
    assert max(loaded for loaded, _, _ in steady) < 0.1 * weight_pages, figures
    assert max(micro for _, micro, _ in steady) < 0.1 * MICRO_BATCH_PAGES, figures
    # released weights are reused, not added to: RSS does not grow across cycles
    assert steady[-1][2] - steady[0][2] < 0.25 * weight_mib, figures


def qwen2_moe_config():
    return Qwen2MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                          shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=128, initializer_range=0.3,
                          tie_word_embeddings=False)


def mixtral_config():
    return MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=128, initializer_range=0.3, tie_word_embeddings=False)


@pytest.mark.parametrize("make_config", [qwen2_moe_config, mixtral_config], ids=["qwen2_moe", "mixtral"])
def test_moe_checkpoint_names_and_routing_record(make_config, tmp_path):
    config = make_config()
    model = reference_model(config, seed=2)
    checkpoint = checkpoint_tensors(model, tmp_path)
    assert any(".experts.0." in name for name in checkpoint)  # per-expert names, not the fused params
    rollout = CPURollout(config, eos_token_ids=[EOS], record_routing=True)
    rollout.sync_weights(buckets(checkpoint.items(), 5))

    out = rollout.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=4))
    greedy = rollout.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=6))
    assert greedy.responses == [reference_greedy(model, p, 6)[0] for p in PROMPTS]

    top_k, layers = config.num_experts_per_tok, config.num_hidden_layers
    for row, prompt_i in enumerate(out.prompt_index):
        fed = PROMPTS[prompt_i] + out.responses[row][:-1]  # the last sampled token is never fed
        routed = out.routed_experts[row]
        assert routed.shape == (len(fed), layers, top_k) and routed.dtype == torch.int32
        with torch.no_grad():
            router_logits = model(torch.tensor([fed]), output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            expected = logits.float().softmax(-1).topk(top_k, dim=-1).indices
            assert torch.equal(routed[:, layer].sort(-1).values, expected.sort(-1).values.to(torch.int32))


def test_record_routing_needs_a_moe_model(llama):
    with pytest.raises(ValueError, match="record_routing"):
        CPURollout(llama.config, record_routing=True)


def test_sampling_params_validation():
    for bad in (dict(n=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=0), dict(max_new_tokens=0)):
        field = next(iter(bad))
        with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
            SamplingParams(**bad)


def test_make_rollout(llama):
    assert isinstance(make_rollout("cpu", llama.config, eos_token_ids=[EOS]), CPURollout)
    if not vllm_runs_here():  # no vllm or no GPU: refused before anything is built
        with pytest.raises(ValueError, match=r"rollout.name='vllm' needs vLLM installed \(pip install -e "
                                             r"\.\[gpu\]\) and a CUDA GPU; use 'cpu' here"):
            make_rollout("vllm", llama.config, eos_token_ids=[EOS])
    if not torch.cuda.is_available():
        assert isinstance(make_rollout("auto", llama.config, eos_token_ids=[EOS]), CPURollout)
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            make_rollout("sglang", llama.config, eos_token_ids=[EOS])



def test_sampling_depends_on_the_prompt_key_not_the_batch(llama):
    """max_num_seqs splits the batch; keyed sampling draws the same responses for each prompt
    whether it is decoded alone, in a split batch or in one batch (what rollout groups need)."""
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=11)
    keys = [40, 41, 42]
    whole = loaded_rollout(llama).generate(PROMPTS, sampling, keys=keys)
    split = loaded_rollout(llama, max_num_seqs=3).generate(PROMPTS, sampling, keys=keys)
    alone = loaded_rollout(llama).generate(PROMPTS[2:], sampling, keys=keys[2:])
    assert split.responses == whole.responses and split.prompt_index == whole.prompt_index
    assert alone.responses == whole.responses[4:]
    other = loaded_rollout(llama).generate(PROMPTS, sampling, keys=[1, 2, 3])
    assert other.responses != whole.responses  # the key, not the position, picks the stream
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        CPURollout(llama.config, eos_token_ids=[EOS], max_num_seqs=0)
