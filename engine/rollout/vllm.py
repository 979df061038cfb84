"""vLLM (GPU) rollout: ``vllm.LLM`` in SPMD mode, colocated with training.

Every rank of a rollout group builds its part of the engine (``distributed_executor_backend=
"external_launcher"``: vLLM joins torchrun's process group, consecutive ranks form its TP groups,
each rank runs one worker in its own process, all ranks of a group are given the same prompts).
Weights arrive bucket by bucket straight into the model's ``load_weights`` (``LLM.apply_model``,
in process: no copy) and ``reset_prefix_cache`` closes the sync; memory goes to training with
``LLM.sleep`` / ``LLM.wake_up`` (the engine runs with ``enable_sleep_mode=True``). vllm is
imported only when an engine is built, so nothing on a CPU machine imports it.

Every vllm name this file relies on is listed in ``USED_API``; tests/test_vllm_contract.py
checks each against the source of the pinned wheel.

Tests: tests/test_vllm_adapter.py, tests/test_vllm_contract.py, tests/test_rollout_cpu.py,
tests/gpu/test_vllm_gpu.py
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from engine.rollout.base import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, ROLLOUT_MEMORY, RolloutAborted,
                                 RolloutEngine, RolloutOutput, SamplingParams, register_rollout)

VLLM_VERSION = "0.34.0"
KEY = "actor_rollout_ref.rollout"

# verl's rollout.load_format -> vLLM's: verl's dummy_* formats all mean "random weights, the trainer
# syncs the real ones"; the others read the checkpoint at model_path
LOAD_FORMATS = {"dummy": "dummy", "dummy_dtensor": "dummy", "dummy_megatron": "dummy", "dummy_hf": "dummy",
                "auto": "auto", "hf": "hf", "safetensors": "safetensors"}
DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")
LOGPROBS_MODE = "processed_logprobs"  # log_softmax(logits / temperature): see VLLMRollout

USED_API = {
    # names vllm/__init__.py exports (lazily, MODULE_ATTRS)
    "exports": ["LLM", "SamplingParams"],
    # vllm/entrypoints/llm.py LLM: method -> keyword arguments passed to it
    "LLM": {
        "__init__": ["model", "tensor_parallel_size", "dtype", "seed", "gpu_memory_utilization", "enforce_eager",
                     "enable_return_routed_experts"],  # and **kwargs -> EngineArgs
        "generate": ["prompts", "sampling_params", "use_tqdm"],
        "apply_model": ["func"],
        "sleep": ["level"],
        "wake_up": ["tags"],
        "reset_prefix_cache": [],
    },
    # fields of vllm/engine/arg_utils.py EngineArgs given to LLM(**kwargs)
    "EngineArgs": ["load_format", "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
                   "distributed_executor_backend", "enable_sleep_mode", "logprobs_mode", "max_model_len"],
    # fields of vllm.SamplingParams (a msgspec.Struct) we set
    "SamplingParams": ["n", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed", "ignore_eos",
                       "logprobs", "detokenize"],
    # the prompt dict LLM.generate takes (vllm/inputs/llm.py TokensPrompt)
    "TokensPrompt": ["prompt_token_ids"],
    # what generate returns: RequestOutput.outputs -> CompletionOutput, logprobs: [{token_id: Logprob}]
    "RequestOutput": ["outputs"],
    "CompletionOutput": ["index", "token_ids", "logprobs", "finish_reason", "routed_experts"],
    "Logprob": ["logprob"],
    # values of vLLM Literals we pass: "file:Name" -> values
    "literals": {
        "vllm/config/model.py:ModelDType": list(DTYPES),
        "vllm/config/model.py:LogprobsMode": [LOGPROBS_MODE],
        "vllm/config/parallel.py:DistributedExecutorBackend": ["external_launcher"],
        "vllm/model_executor/model_loader/__init__.py:LoadFormats": sorted(set(LOAD_FORMATS.values())),
    },
    # string constants: "file:NAME" -> values it must contain
    "constants": {
        "vllm/v1/engine/__init__.py:FINISH_REASON_STRINGS": ["stop", "length", "abort"],
        "vllm/v1/executor/abstract.py:SLEEP_TAGS": list(ROLLOUT_MEMORY),  # wake_up's tags
    },
    # behaviour the adapter relies on: "file:Class.function" -> source fragments it must contain
    "fragments": {
        # external_launcher runs the engine core and its one worker in this process ...
        "vllm/config/parallel.py:ParallelConfig.__post_init__":
            ["os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'"],
        # ... so apply_model's function is called directly on the model, with our tensors
        "vllm/v1/engine/llm_engine.py:LLMEngine.apply_model": ["self.collective_rpc('apply_model', args=(func,))"],
        "vllm/v1/serial_utils.py:run_method": ["partial(method, obj)"],
        "vllm/v1/worker/worker_base.py:WorkerBase.apply_model": ["fn(self.get_model())"],
        # logprobs=0: the sampled token's log-prob alone (the sampler puts it first)
        "vllm/v1/engine/logprobs.py:LogprobsProcessor._update_sample_logprobs": ["sampled_token_logprob = logprobs[0]"],
        # sample j of a seeded request with n > 1 draws with seed + j (request_seed leaves room)
        "vllm/v1/engine/parallel_sampling.py:ParentRequest._get_child_sampling_params": ["seed + index"],
        # routed experts: [prompt + response - 1 positions, every hidden layer, top_k], zeros where no
        # MoE layer writes (RolloutOutput.routed_experts' layout)
        "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py:_get_routed_experts_shape":
            ["get_total_num_hidden_layers()", "get_num_experts_per_tok()"],
        "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py:RoutedExpertsCapturer.__init__":
            ["torch.zeros((max_num_batched_tokens, *self.shape_per_token)"],
        "vllm/distributed/aux_output_connector/connector.py:AuxOutputSchedulerConnector.build_connector_meta":
            ["request.num_tokens - 1"],
        # shutdown: LLM.llm_engine.engine_core.shutdown()
        "vllm/entrypoints/llm.py:LLM.__init__": ["self.llm_engine = LLMEngine.from_engine_args("],
        "vllm/v1/engine/llm_engine.py:LLMEngine.__init__": ["self.engine_core = EngineCoreClient.make_client("],
        "vllm/v1/engine/core_client.py:InprocClient.shutdown": ["self.engine_core.shutdown()"],
    },
}


def _refuse(key: str, value, fix: str):
    raise ValueError(f"{KEY}.{key}={value!r}: {fix}")


def llm_kwargs(model_path: str, *, dtype: str = "bfloat16", load_format: str = "dummy",
               tensor_model_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
               max_num_batched_tokens: int = 8192, max_num_seqs: int = 1024, enforce_eager: bool = False,
               enable_chunked_prefill: bool = True, seed: int = 0, max_model_len: Optional[int] = None,
               record_routing: bool = False) -> dict:
    """verl's rollout keys -> ``vllm.LLM(**kwargs)`` (USED_API['LLM']['__init__'] + ['EngineArgs'])."""
    if not 0 < gpu_memory_utilization <= 1:
        _refuse("gpu_memory_utilization", gpu_memory_utilization,
                "use a fraction in (0, 1]: the share of GPU memory vLLM takes for weights + KV cache")
    if load_format not in LOAD_FORMATS:
        _refuse("load_format", load_format, f"use one of {', '.join(LOAD_FORMATS)} (dummy: the trainer's sync "
                                            "brings the weights)")
    if dtype not in DTYPES:
        _refuse("dtype", dtype, f"use one of {', '.join(DTYPES)}")
    for key, value in (("tensor_model_parallel_size", tensor_model_parallel_size),
                       ("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs),
                       ("max_model_len", 1 if max_model_len is None else max_model_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _refuse(key, value, "use an integer >= 1")
    for key, value in (("enforce_eager", enforce_eager), ("enable_chunked_prefill", enable_chunked_prefill)):
        if not isinstance(value, bool):
            _refuse(key, value, "use true or false")
    if isinstance(seed, bool) or not isinstance(seed, int):
        _refuse("seed", seed, "use an integer")
    if max_model_len is not None and not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        _refuse("max_num_batched_tokens", max_num_batched_tokens,
                f"without chunked prefill a whole prompt is one batch: raise it to max_model_len "
                f"({max_model_len}) or set {KEY}.enable_chunked_prefill=true")
    out = dict(model=model_path, dtype=dtype, load_format=LOAD_FORMATS[load_format],
               tensor_parallel_size=tensor_model_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
               max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
               enforce_eager=enforce_eager, enable_chunked_prefill=enable_chunked_prefill, seed=seed,
               distributed_executor_backend="external_launcher", enable_sleep_mode=True,
               logprobs_mode=LOGPROBS_MODE, enable_return_routed_experts=record_routing)
    if max_model_len is not None:
        out["max_model_len"] = max_model_len
    return out


def request_seed(seed: Optional[int], key: int) -> Optional[int]:
    """The seed of the request for the prompt keyed `key` (None: unseeded). vLLM gives sample j of
    a request with n > 1 the seed ``seed + j``, so seeds stay below 2**62 (int64 on the device), and
    a prompt's seeds do not depend on the batch it lands in (a resumed run rebatches)."""
    if seed is None:
        return None
    return hash((int(seed), int(key))) & ((1 << 62) - 1)


def sampling_kwargs(sampling: SamplingParams, eos_token_ids: Sequence[int], seed: Optional[int] = None) -> dict:
    """Our SamplingParams -> ``vllm.SamplingParams(**kwargs)`` (keys in USED_API['SamplingParams']).

    ``logprobs=0`` asks for the sampled token's log-prob alone; vLLM reads temperature 0 as greedy,
    and top_k 0 as off (ours: -1). With ``ignore_eos`` the eos ids do not stop it either."""
    eos = set(eos_token_ids)
    stop = set(sampling.stop_token_ids) - eos if sampling.ignore_eos else set(sampling.stop_token_ids) | eos
    out = dict(n=sampling.n, temperature=0.0 if sampling.greedy else sampling.temperature,
               top_p=sampling.top_p, top_k=0 if sampling.top_k == -1 else sampling.top_k,
               max_tokens=sampling.max_new_tokens, stop_token_ids=sorted(stop), logprobs=0, detokenize=False)
    if seed is not None:
        out["seed"] = seed
    if sampling.ignore_eos:
        out["ignore_eos"] = True
    return out


FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}  # USED_API constants


def parse_completion(completion, prompt_len: int, routing_top_k: Optional[int] = None,
                     routing_layers: Optional[int] = None):
    """One vLLM CompletionOutput -> (tokens, log-probs, finish reason, routed experts or None).

    ``completion.logprobs[t]`` maps token ids to ``Logprob``; the sampled token's is read (the
    engine runs with logprobs_mode='processed_logprobs'). ``routing_top_k`` is given when routing
    was recorded: ``routed_experts`` is then [prompt + response - 1, num_hidden_layers, top_k]
    (uint8 / uint16), checked against ``routing_layers`` when given."""
    tokens = [int(t) for t in completion.token_ids]
    reason = completion.finish_reason
    if reason not in FINISH:
        raise ValueError(f"vllm finish_reason {reason!r}: expected one of {tuple(FINISH)}")
    finish = FINISH[reason]
    per_token = completion.logprobs
    if per_token is None or len(per_token) != len(tokens):
        if finish == FINISH_ABORT:
            return tokens, [], finish, None
        raise ValueError(f"vllm returned {0 if per_token is None else len(per_token)} log-prob entries for "
                         f"{len(tokens)} tokens; the engine must be asked with SamplingParams(logprobs=0)")
    logps = []
    for t, (token, entry) in enumerate(zip(tokens, per_token)):
        if token not in entry:
            raise ValueError(f"vllm log-probs at position {t} lack the sampled token {token} "
                             f"(have {sorted(entry)})")
        logps.append(float(entry[token].logprob))
    routed = None
    if routing_top_k is not None and finish != FINISH_ABORT:
        routed = _routing(completion.routed_experts, prompt_len + len(tokens) - 1, routing_top_k, routing_layers)
    return tokens, logps, finish, routed


def _routing(array, positions: int, top_k: int, layers: Optional[int]) -> torch.Tensor:
    if array is None:
        raise ValueError("vllm returned no routed_experts: the engine must be built with record_routing=True")
    routed = torch.as_tensor(array).to(torch.int32)
    if layers is None and routed.dim() == 3:
        layers = routed.shape[1]
    expected = (positions, layers, top_k)
    if tuple(routed.shape) != expected:
        raise ValueError(f"routed_experts of shape {tuple(routed.shape)}, expected {expected} (positions = prompt "
                         f"+ response - 1, hidden layers, top-k); is the engine's model the training model?")
    return routed


@register_rollout("vllm")
class VLLMRollout(RolloutEngine):
    """Rollout through ``vllm.LLM`` (needs CUDA and vllm==0.34.0), SPMD: every rank of a rollout
    group builds one with the same arguments and is given the same calls.

    Log-probs are vLLM's 'processed_logprobs': log_softmax(logits / temperature), as
    RolloutOutput asks, while top-k / top-p are off (verl's rollout defaults); with either on,
    vLLM reports the log-prob under the filtered, renormalised distribution it sampled from.

    Memory: ``sleep(level=1)`` frees weights and KV cache (weights kept on the CPU), ``wake_up``
    takes tags back. The weights are kept resident whenever the KV cache is (the memory
    schedule's order: weights first); releasing the KV cache alone sleeps and wakes the weights
    back from that CPU copy.
    """

    NEEDS_CUDA = True
    SPMD = True  # every rank of a group builds one and makes every call (engine/rollout/group.py)

    def __init__(self, hf_config, eos_token_ids: Sequence[int] = (), model_path: Optional[str] = None,
                 record_routing: bool = False, **rollout):
        if model_path is None:
            raise ValueError("VLLMRollout needs model_path= (a directory with the HF config and tokenizer; "
                             "with load_format='dummy' the weights come from update_weights)")
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.routing_top_k = getattr(hf_config, "num_experts_per_tok", None) if record_routing else None
        self.routing_layers = getattr(hf_config, "num_hidden_layers", None)
        if record_routing and self.routing_top_k is None:
            raise ValueError("record_routing=True (actor_rollout_ref.actor.router_replay) needs a MoE hf_config "
                             "with num_experts_per_tok; set router_replay off for dense models")
        kwargs = llm_kwargs(model_path, record_routing=record_routing, **rollout)
        import vllm  # lazy: GPU-only dependency

        self.llm = vllm.LLM(**kwargs)
        self.released: set = set()  # ROLLOUT_MEMORY tags the engine has given back

    # -- weights ---------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket into the model's own loader, which reads HF names and keeps this rank's TP
        shard. The path: ``LLM.apply_model`` (public, documented "run a function on the model
        inside each worker"); under external_launcher the worker lives in this process and the
        function is called directly (USED_API fragments), so the bucket is never serialised or
        copied whole. Not ``collective_rpc('reload_weights')``: a whole-model reload per call,
        which warns about every weight a bucket lacks; not the weight-transfer engine
        (``update_weights``): it moves tensors between processes, ours are here already."""
        if "weights" in self.released:
            raise RuntimeError("update_weights while the rollout's weights are released: resume_memory(['weights']) "
                               "first")
        bucket = list(named_tensors)
        self.llm.apply_model(lambda model: model.load_weights(bucket))

    def finish_weight_update(self) -> None:
        # vLLM loads whatever names it is given and cannot tell whether a sync was complete (as
        # with SGLang); cached prefixes were computed with the old weights
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vllm reset_prefix_cache failed (requests still running?) after a weight sync")

    # -- generation ------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 keys: Optional[Sequence[int]] = None) -> RolloutOutput:
        prompts = [list(p) for p in prompt_ids]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: prompt_ids must be a non-empty list of non-empty token id lists")
        if self.released:
            raise RuntimeError(f"generate while {sorted(self.released)} are released: resume_memory() first")
        keys = list(range(len(prompts))) if keys is None else list(keys)
        if len(keys) != len(prompts):
            raise ValueError(f"generate: {len(keys)} keys for {len(prompts)} prompts")
        from vllm import SamplingParams as VllmSampling

        params = [VllmSampling(**sampling_kwargs(sampling, self.eos_token_ids, request_seed(sampling.seed, k)))
                  for k in keys]
        results = self.llm.generate(prompts=[{"prompt_token_ids": p} for p in prompts], sampling_params=params,
                                    use_tqdm=False)
        return collect(results, prompts, sampling.n, self.routing_top_k, self.routing_layers)

    # -- memory ----------------------------------------------------------------------------
    @staticmethod
    def _tags(tags) -> set:
        wanted = set(ROLLOUT_MEMORY if tags is None else tags)
        unknown = wanted - set(ROLLOUT_MEMORY)
        if unknown:
            raise ValueError(f"memory tags {sorted(unknown)} are unknown; use {ROLLOUT_MEMORY}")
        return wanted

    def release_memory(self, tags=None) -> None:
        released = self.released | self._tags(tags)
        if released == self.released:
            return
        if released == {"weights"}:
            raise ValueError("the vLLM rollout keeps its weights while it keeps its KV cache: release "
                             "'kv_cache' with or before 'weights'")
        self.llm.sleep(level=1)  # what is already asleep stays so; weights go to the CPU
        if "weights" not in released:  # the KV cache alone: the weights come back from the CPU
            self.llm.wake_up(tags=["weights"])
        self.released = released

    def resume_memory(self, tags=None) -> None:
        back = self._tags(tags) & self.released
        if not back:
            return
        if self.released - back == {"weights"}:
            raise ValueError("the vLLM rollout keeps its weights while it keeps its KV cache: resume 'weights' "
                             "with or before 'kv_cache'")
        self.llm.wake_up(tags=[t for t in ROLLOUT_MEMORY if t in back])
        self.released -= back

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def collect(results, prompts, n: int, routing_top_k: Optional[int] = None,
            routing_layers: Optional[int] = None) -> RolloutOutput:
    """vLLM's RequestOutputs (one per prompt, in order, n completions each) -> RolloutOutput in
    prompt-major order; an aborted request is refused, never trained on."""
    if len(results) != len(prompts):
        raise ValueError(f"vllm returned {len(results)} results for {len(prompts)} prompts")
    rows, prompt_index = [], []
    for i, result in enumerate(results):
        completions = sorted(result.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise ValueError(f"vllm returned {len(completions)} samples for prompt {i}, expected n={n}")
        for c in completions:
            rows.append(parse_completion(c, len(prompts[i]), routing_top_k, routing_layers))
            prompt_index.append(i)
    aborted = [k for k, row in enumerate(rows) if row[2] == FINISH_ABORT]
    if aborted:  # a partial response trained as a finished one would teach the policy to stop
        first = prompt_index[aborted[0]]
        raise RolloutAborted(
            f"vllm aborted {len(aborted)} of {len(rows)} requests (first: prompt {first}, {len(prompts[first])} "
            f"prompt tokens + {len(rows[aborted[0]][0])} generated); give the KV cache room for one whole "
            f"sequence: raise {KEY}.gpu_memory_utilization or lower data.max_prompt_length / "
            "data.max_response_length")
    return RolloutOutput(prompt_index=prompt_index, responses=[r[0] for r in rows], log_probs=[r[1] for r in rows],
                         finish_reasons=[r[2] for r in rows],
                         routed_experts=[r[3] for r in rows] if routing_top_k is not None else None)
