"""SGLang (GPU) rollout: the offline ``sglang.Engine`` colocated with training.

Weights arrive bucket by bucket through ``update_weights_from_tensor`` (no cache flush per
bucket) and one ``flush_cache`` closes the sync; memory is handed to training with
``release_memory_occupation`` (the engine runs with ``enable_memory_saver=True``). sglang is
imported only when an engine is built, so nothing on a CPU machine imports it.

Every sglang name this file relies on is listed in ``USED_API``;
tests/test_sglang_contract.py checks each against the source of the pinned wheel.
"""
from __future__ import annotations

import base64
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from engine.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutEngine, RolloutOutput, SamplingParams

SGLANG_VERSION = "0.5.21"

USED_API = {
    # sglang.srt.entrypoints.engine.Engine: method -> keyword arguments passed to it
    "Engine": {
        "__init__": [],  # takes **kwargs, turned into ServerArgs(**kwargs)
        "generate": ["input_ids", "sampling_params", "return_logprob", "return_routed_experts"],
        "update_weights_from_tensor": ["named_tensors", "flush_cache"],
        "flush_cache": [],
        "release_memory_occupation": [],
        "resume_memory_occupation": [],
        "shutdown": [],
    },
    # ServerArgs fields passed as sglang.Engine(**kwargs)
    "ServerArgs": ["model_path", "dtype", "load_format", "tp_size", "mem_fraction_static",
                   "chunked_prefill_size", "enable_memory_saver", "random_seed",
                   "enable_deterministic_inference", "enable_return_routed_experts"],
    # keys of the per-request sampling_params dict (fields of sglang's SamplingParams)
    "SamplingParams": ["n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids",
                       "sampling_seed", "ignore_eos"],
    # keys read from each result's meta_info
    "meta_info": ["output_token_logprobs", "finish_reason", "routed_experts"],
}


def engine_kwargs(model_path: str, dtype: str, load_format: str, tensor_model_parallel_size: int,
                  gpu_memory_utilization: float, max_num_batched_tokens: int, seed: int,
                  enable_deterministic_inference: bool, record_routing: bool) -> dict:
    """verl's rollout config -> sglang ServerArgs (the keys are USED_API['ServerArgs'])."""
    if not 0 < gpu_memory_utilization < 1:
        raise ValueError(f"actor_rollout_ref.rollout.gpu_memory_utilization={gpu_memory_utilization} "
                         f"must be in (0, 1): the fraction of GPU memory for weights + KV cache")
    return dict(model_path=model_path, dtype=dtype, load_format=load_format,
                tp_size=tensor_model_parallel_size, mem_fraction_static=gpu_memory_utilization,
                chunked_prefill_size=max_num_batched_tokens, enable_memory_saver=True, random_seed=seed,
                enable_deterministic_inference=enable_deterministic_inference,
                enable_return_routed_experts=record_routing)


def sampling_dict(sampling: SamplingParams, eos_token_ids: Sequence[int]) -> dict:
    """Our SamplingParams -> sglang's per-request dict (keys are USED_API['SamplingParams']).

    sglang turns temperature 0 into greedy (top_k=1, temperature 1), matching ours.
    ``sampling_seed`` only takes effect when the engine runs with
    ``enable_deterministic_inference=True``.
    """
    params = dict(n=sampling.n, temperature=0.0 if sampling.greedy else sampling.temperature,
                  top_p=sampling.top_p, top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens,
                  stop_token_ids=sorted(set(eos_token_ids) | set(sampling.stop_token_ids)))
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    if sampling.ignore_eos:
        params["ignore_eos"] = True
    return params


def parse_result(result: dict, prompt_len: int, routing_top_k: Optional[int] = None):
    """One sglang result -> (tokens, log-probs, finish reason, routed experts or None).

    ``routing_top_k`` (experts per token) is given when routing was recorded: sglang sends it
    base64-encoded int32, flat over [positions, layers, top_k].
    """
    meta = result["meta_info"]
    # (logprob, token_id, text) per generated token: ids and log-probs stay aligned
    token_logprobs = meta["output_token_logprobs"]
    tokens = [int(t) for _, t, _ in token_logprobs]
    logps = [float(lp) for lp, _, _ in token_logprobs]
    reason = meta["finish_reason"]
    reason = reason.get("type") if isinstance(reason, dict) else reason
    finish = FINISH_LENGTH if reason == "length" else FINISH_STOP
    routed = None
    if routing_top_k is not None:
        flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).copy()
        positions = prompt_len + len(tokens) - 1  # the layout of RolloutOutput.routed_experts
        routed = torch.from_numpy(flat).reshape(positions, -1, routing_top_k)
    return tokens, logps, finish, routed


class SGLangRollout(RolloutEngine):
    """Rollout through ``sglang.Engine`` (needs CUDA and sglang==0.5.21)."""

    def __init__(self, hf_config, eos_token_ids: Sequence[int] = (), model_path: Optional[str] = None,
                 dtype: str = "bfloat16", load_format: str = "dummy", tensor_model_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, max_num_batched_tokens: int = 8192, seed: int = 0,
                 enable_deterministic_inference: bool = False, record_routing: bool = False, **extra_server_args):
        if model_path is None:
            raise ValueError("SGLangRollout needs model_path= (a directory with the HF config and tokenizer; "
                             "with load_format='dummy' the weights come from update_weights)")
        import sglang  # lazy: GPU-only dependency

        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.record_routing = record_routing
        self.routing_top_k = getattr(hf_config, "num_experts_per_tok", None) if record_routing else None
        if record_routing and self.routing_top_k is None:
            raise ValueError("record_routing=True needs a MoE hf_config with num_experts_per_tok; "
                             "set record_routing=False for dense models")
        kwargs = engine_kwargs(model_path, dtype, load_format, tensor_model_parallel_size, gpu_memory_utilization,
                               max_num_batched_tokens, seed, enable_deterministic_inference, record_routing)
        self.engine = sglang.Engine(**kwargs, **extra_server_args)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights_from_tensor(named_tensors=list(named_tensors), flush_cache=False)

    def finish_weight_update(self) -> None:
        # sglang loads whatever names it is given and cannot tell whether a sync was complete;
        # the CPU backend's test checks the names the trainer streams
        self.engine.flush_cache()

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> RolloutOutput:
        prompts = [list(p) for p in prompt_ids]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: prompt_ids must be a non-empty list of non-empty token id lists")
        results = self.engine.generate(input_ids=prompts, sampling_params=sampling_dict(sampling, self.eos_token_ids),
                                       return_logprob=True, return_routed_experts=self.record_routing)
        # sglang returns prompt-major order: all n samples of prompt 0, then prompt 1, ...
        prompt_index = [i for i in range(len(prompts)) for _ in range(sampling.n)]
        parsed = [parse_result(r, len(prompts[i]), self.routing_top_k)
                  for r, i in zip(results, prompt_index)]
        return RolloutOutput(prompt_index=prompt_index, responses=[p[0] for p in parsed],
                             log_probs=[p[1] for p in parsed], finish_reasons=[p[2] for p in parsed],
                             routed_experts=[p[3] for p in parsed] if self.record_routing else None)

    def release_memory(self) -> None:
        self.engine.release_memory_occupation()

    def resume_memory(self) -> None:
        self.engine.resume_memory_occupation()

    def shutdown(self) -> None:
        self.engine.shutdown()
