"""The vLLM adapter (engine/rollout/vllm.py) without vLLM: verl's keys -> LLM kwargs, our sampling ->
vLLM's SamplingParams, vLLM's results (hand-built with vLLM's attribute names) -> RolloutOutput, and
the calls the adapter makes on a recording stand-in for ``vllm.LLM`` (weights, memory, shutdown).
The names themselves are checked against vLLM's source in tests/test_vllm_contract.py.
"""
import importlib.machinery
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.rollout import registry
from engine.rollout.base import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutAborted, SamplingParams
from engine.rollout.vllm import VLLMRollout, collect, llm_kwargs, parse_completion, request_seed, sampling_kwargs


# -- verl keys -> LLM(**kwargs) -----------------------------------------------------------------
def test_each_verl_key_reaches_its_llm_argument():
    kwargs = llm_kwargs("/m", dtype="float16", load_format="dummy_megatron", tensor_model_parallel_size=4,
                        gpu_memory_utilization=0.7, max_num_batched_tokens=2048, max_num_seqs=64,
                        enforce_eager=True, enable_chunked_prefill=False, seed=9, max_model_len=2048)
    assert kwargs == dict(model="/m", dtype="float16", load_format="dummy", tensor_parallel_size=4,
                          gpu_memory_utilization=0.7, max_num_batched_tokens=2048, max_num_seqs=64,
                          enforce_eager=True, enable_chunked_prefill=False, seed=9, max_model_len=2048,
                          distributed_executor_backend="external_launcher", enable_sleep_mode=True,
                          logprobs_mode="processed_logprobs", enable_return_routed_experts=False)
    defaults = llm_kwargs("/m")
    assert "max_model_len" not in defaults and defaults["load_format"] == "dummy"
    assert llm_kwargs("/m", load_format="hf")["load_format"] == "hf"
    assert llm_kwargs("/m", record_routing=True)["enable_return_routed_experts"] is True


@pytest.mark.parametrize("key, value, fix", [
    ("gpu_memory_utilization", 0.0, "(0, 1]"),
    ("gpu_memory_utilization", 1.5, "(0, 1]"),
    ("load_format", "megatron", "dummy_dtensor"),
    ("dtype", "bf16", "bfloat16"),
    ("tensor_model_parallel_size", 0, "integer >= 1"),
    ("max_num_batched_tokens", 0, "integer >= 1"),
    ("max_num_seqs", True, "integer >= 1"),
    ("max_model_len", 0, "integer >= 1"),
    ("enforce_eager", "yes", "true or false"),
    ("enable_chunked_prefill", 1, "true or false"),
    ("seed", "7", "an integer"),
])
def test_a_bad_verl_key_is_refused_naming_key_and_fix(key, value, fix):
    with pytest.raises(ValueError, match=rf"actor_rollout_ref\.rollout\.{key}={value!r}") as e:
        llm_kwargs("/m", **{key: value})
    assert fix in str(e.value)


def test_without_chunked_prefill_a_prompt_must_fit_one_batch():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=1024.*max_model_len \(4096\).*"
                                         r"enable_chunked_prefill=true"):
        llm_kwargs("/m", max_num_batched_tokens=1024, enable_chunked_prefill=False, max_model_len=4096)
    assert llm_kwargs("/m", max_num_batched_tokens=1024, max_model_len=4096)["enable_chunked_prefill"] is True


# -- sampling ------------------------------------------------------------------------------------
def test_sampling_kwargs():
    out = sampling_kwargs(SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=12, stop_token_ids=(7, 2)),
                          eos_token_ids=[2, 3], seed=11)
    assert out == dict(n=4, temperature=0.7, top_p=0.9, top_k=0, max_tokens=12, stop_token_ids=[2, 3, 7],
                       logprobs=0, detokenize=False, seed=11)
    assert "seed" not in sampling_kwargs(SamplingParams(seed=5), [2])  # only the per-request seed is sent
    assert sampling_kwargs(SamplingParams(top_k=5), [2])["top_k"] == 5
    assert sampling_kwargs(SamplingParams(do_sample=False, temperature=0.7), [2])["temperature"] == 0.0
    bench = sampling_kwargs(SamplingParams(ignore_eos=True, stop_token_ids=(2, 9)), [2])
    assert bench["ignore_eos"] is True and bench["stop_token_ids"] == [9]  # eos does not stop it either


def test_request_seeds_follow_the_prompt_key_not_the_batch():
    assert request_seed(None, 3) is None
    seeds = [request_seed(7, k) for k in range(100)]
    assert len(set(seeds)) == 100 and all(0 <= s < 2 ** 62 for s in seeds)  # room for vLLM's seed + j
    assert request_seed(7, 42) == request_seed(7, 42) != request_seed(8, 42)


# -- results -------------------------------------------------------------------------------------
def completion(tokens, logps=None, finish="stop", index=0, routed=None, logprobs="build"):
    if logprobs == "build":  # vLLM's SampleLogprobs: one {token_id: Logprob} per generated token
        logprobs = [{t: SimpleNamespace(logprob=lp, rank=1, decoded_token=None)} for t, lp in zip(tokens, logps)]
    return SimpleNamespace(index=index, text="", token_ids=list(tokens), cumulative_logprob=None, logprobs=logprobs,
                           routed_experts=routed, finish_reason=finish, stop_reason=None)


def test_parse_completion():
    assert parse_completion(completion([5, 2], [-0.5, -1.25]), prompt_len=3) == ([5, 2], [-0.5, -1.25],
                                                                                 FINISH_STOP, None)
    assert parse_completion(completion([5], [-0.5], finish="length"), 3)[2] == FINISH_LENGTH
    assert parse_completion(completion([5], logprobs=None, finish="abort"), 3)[:3] == ([5], [], FINISH_ABORT)
    with pytest.raises(ValueError, match="finish_reason 'repetition'"):
        parse_completion(completion([5], [-0.5], finish="repetition"), 3)
    with pytest.raises(ValueError, match=r"0 log-prob entries for 1 tokens.*logprobs=0"):
        parse_completion(completion([5], logprobs=None), 3)
    with pytest.raises(ValueError, match="lack the sampled token 5"):
        parse_completion(completion([5], logprobs=[{6: SimpleNamespace(logprob=-1.0)}]), 3)


def test_routed_experts_are_read_in_rollout_layout():
    routing = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2)  # 3 prompt + 2 response tokens - 1
    tokens, _, _, routed = parse_completion(completion([5, 2], [-0.5, -1.0], routed=routing), 3, routing_top_k=2)
    assert routed.dtype == torch.int32 and routed.shape == (4, 3, 2) and routed.flatten().tolist() == list(range(24))
    assert parse_completion(completion([5, 2], [-0.5, -1.0], routed=routing), 3, 2, routing_layers=3)[3] is not None
    with pytest.raises(ValueError, match=r"expected \(4, 4, 2\).*training model"):
        parse_completion(completion([5, 2], [-0.5, -1.0], routed=routing), 3, 2, routing_layers=4)
    with pytest.raises(ValueError, match=r"expected \(5, 3, 2\)"):
        parse_completion(completion([5, 2], [-0.5, -1.0], routed=routing), 4, 2)
    with pytest.raises(ValueError, match="no routed_experts"):
        parse_completion(completion([5], [-0.5]), 3, 2)


def test_collect_is_prompt_major_and_refuses_aborts():
    results = [SimpleNamespace(request_id="0", prompt_token_ids=[1, 2], finished=True,
                               outputs=[completion([4], [-0.4], index=1), completion([3], [-0.3], index=0)]),
               SimpleNamespace(request_id="1", prompt_token_ids=[1], finished=True,
                               outputs=[completion([6], [-0.6], index=0), completion([7, 2], [-0.7, -0.1], index=1)])]
    out = collect(results, [[1, 2], [1]], n=2)
    assert out.prompt_index == [0, 0, 1, 1] and out.responses == [[3], [4], [6], [7, 2]]
    assert out.log_probs[3] == [-0.7, -0.1] and out.routed_experts is None
    with pytest.raises(ValueError, match="expected n=3"):
        collect(results, [[1, 2], [1]], n=3)
    results[1].outputs[1] = completion([7], logprobs=None, finish="abort", index=1)
    with pytest.raises(RolloutAborted, match=r"aborted 1 of 4 requests \(first: prompt 1, 1 prompt tokens \+ 1 "
                                             r"generated\).*gpu_memory_utilization"):
        collect(results, [[1, 2], [1]], n=2)


# -- the adapter's calls, on a recording stand-in for vllm.LLM ----------------------------------------
class RecordingLLM:
    """Records every call; generate answers one completion per sample; apply_model runs the
    function on a model whose load_weights records the bucket (in process, as external_launcher)."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.loaded = kwargs, [], []
        model = SimpleNamespace(load_weights=lambda weights: self.loaded.append(list(weights)) or set())
        self.apply_model = lambda func: self.calls.append(("apply_model",)) or [func(model)]
        self.reset_ok = True
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(
            shutdown=lambda: self.calls.append(("shutdown",))))

    def generate(self, prompts, sampling_params, use_tqdm):
        self.calls.append(("generate", prompts, sampling_params))
        return [SimpleNamespace(outputs=[completion([9, 2], [-0.2, -0.3], index=j) for j in range(p["n"])])
                for p in sampling_params]

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return self.reset_ok


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM = RecordingLLM
    module.SamplingParams = dict  # the kwargs, as vllm.SamplingParams(**kwargs) would get them
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


DENSE = SimpleNamespace(num_hidden_layers=2)


def test_construction(fake_vllm):
    rollout = VLLMRollout(DENSE, eos_token_ids=[2], model_path="/m", tensor_model_parallel_size=2, seed=3)
    assert rollout.llm.kwargs == llm_kwargs("/m", tensor_model_parallel_size=2, seed=3)
    with pytest.raises(ValueError, match="model_path="):
        VLLMRollout(DENSE)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.router_replay.*MoE"):
        VLLMRollout(DENSE, model_path="/m", record_routing=True)
    moe = VLLMRollout(SimpleNamespace(num_hidden_layers=2, num_experts_per_tok=2), model_path="/m",
                      record_routing=True)
    assert moe.llm.kwargs["enable_return_routed_experts"] is True and moe.routing_top_k == 2


def test_weights_go_to_the_models_loader_and_a_sync_resets_the_prefix_cache(fake_vllm):
    rollout = VLLMRollout(DENSE, model_path="/m")
    w = torch.ones(2, 2)
    rollout.sync_weights([[("model.embed_tokens.weight", w)], (x for x in [("lm_head.weight", w)])])
    assert [[n for n, _ in bucket] for bucket in rollout.llm.loaded] == [["model.embed_tokens.weight"],
                                                                        ["lm_head.weight"]]
    assert rollout.llm.loaded[0][0][1] is w  # the tensor itself: no copy
    assert [c[0] for c in rollout.llm.calls] == ["apply_model", "apply_model", "reset_prefix_cache"]
    rollout.llm.reset_ok = False
    with pytest.raises(RuntimeError, match="reset_prefix_cache failed"):
        rollout.finish_weight_update()


def test_generate_sends_token_prompts_with_a_seed_per_prompt_key(fake_vllm):
    rollout = VLLMRollout(DENSE, eos_token_ids=[2], model_path="/m")
    out = rollout.generate([[1, 5], [1]], SamplingParams(n=2, seed=4, max_new_tokens=3), keys=[10, 11])
    _, prompts, params = rollout.llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [1, 5]}, {"prompt_token_ids": [1]}]
    assert [p["seed"] for p in params] == [request_seed(4, 10), request_seed(4, 11)]
    assert params[0]["stop_token_ids"] == [2] and params[0]["max_tokens"] == 3 and params[0]["logprobs"] == 0
    assert out.prompt_index == [0, 0, 1, 1] and out.responses == [[9, 2]] * 4
    with pytest.raises(ValueError, match="non-empty"):
        rollout.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="1 keys for 2 prompts"):
        rollout.generate([[1], [2]], SamplingParams(), keys=[0])


def test_memory_tags_map_onto_sleep_and_wake_up(fake_vllm):
    rollout = VLLMRollout(DENSE, model_path="/m")
    llm = rollout.llm

    def step(call, tags, *expected):
        del llm.calls[:]
        call(tags)
        assert llm.calls == list(expected), (call.__name__, tags)

    step(rollout.release_memory, None, ("sleep", 1))  # weights to the CPU, KV cache dropped
    step(rollout.release_memory, ["weights"])  # already released: nothing
    with pytest.raises(RuntimeError, match=r"\['kv_cache', 'weights'\] are released"):
        rollout.generate([[1]], SamplingParams())
    with pytest.raises(RuntimeError, match="resume_memory"):
        rollout.update_weights([("lm_head.weight", torch.ones(1))])
    step(rollout.resume_memory, ["weights"], ("wake_up", ["weights"]))  # the memory schedule's order
    step(rollout.resume_memory, ["kv_cache"], ("wake_up", ["kv_cache"]))
    step(rollout.release_memory, ["kv_cache"], ("sleep", 1), ("wake_up", ["weights"]))  # KV cache alone
    step(rollout.release_memory, ["weights"], ("sleep", 1))  # the rest
    step(rollout.resume_memory, None, ("wake_up", ["weights", "kv_cache"]))
    with pytest.raises(ValueError, match="keeps its weights while it keeps its KV cache"):
        rollout.release_memory(["weights"])
    rollout.release_memory(None)
    with pytest.raises(ValueError, match="resume 'weights' with or before 'kv_cache'"):
        rollout.resume_memory(["kv_cache"])
    with pytest.raises(ValueError, match=r"\['cuda_graph'\] are unknown"):
        rollout.release_memory(["cuda_graph"])
    step(lambda _: rollout.shutdown(), None, ("shutdown",))


# -- which backend runs ---------------------------------------------------------------------------
def test_registry_refuses_vllm_where_it_cannot_run(monkeypatch):
    assert "vllm" in registry.backend_names() and registry.backend_class("vllm") is VLLMRollout
    with pytest.raises(ValueError, match=r"name='vllm': this backend needs a GPU.*rollout.name=cpu"):
        registry.rollout_backend("vllm", "cpu")
    assert registry.rollout_backend("vllm", "cuda") == "vllm"  # a plan may describe a GPU machine
    monkeypatch.setattr(registry, "vllm_installed", lambda: False)
    with pytest.raises(ValueError, match=r"name='vllm' needs vLLM installed \(pip install -e \.\[gpu\]\) and a "
                                         r"CUDA GPU; use 'cpu' here"):
        registry.rollout_backend("vllm", "cuda", here=True)


@pytest.mark.parametrize("sglang, vllm, expected", [(True, True, "sglang"), (True, False, "sglang"),
                                                    (False, True, "vllm"), (False, False, "sglang")])
def test_auto_on_cuda_prefers_sglang_then_vllm(monkeypatch, sglang, vllm, expected):
    monkeypatch.setattr(registry, "sglang_installed", lambda: sglang)
    monkeypatch.setattr(registry, "vllm_installed", lambda: vllm)
    assert registry.rollout_backend("auto", "cuda") == expected
    assert registry.rollout_backend("auto", "cpu") == "cpu"
