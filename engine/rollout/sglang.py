"""SGLang (GPU) rollout: the offline ``sglang.Engine`` colocated with training.

Weights arrive bucket by bucket through ``update_weights_from_tensor`` (no cache flush per
bucket) and one ``flush_cache`` closes the sync; an engine of a separate pool receives them
instead from its training rank over the weight-update group (``init_weights_update_group`` once,
then ``update_weights_from_distributed`` per bucket: engine/rollout/update_group.py); memory is handed to training with
``release_memory_occupation`` (the engine runs with ``enable_memory_saver=True``). sglang is
imported only when an engine is built, so nothing on a CPU machine imports it.

Partial rollouts (``generate(should_pause=)`` / ``continue_generation``, driven by the separate
pool: engine/rollout/pool.py) abort the requests in flight and send prompt + tokens again:
engine/rollout/sglang_partial.py.

Every sglang name this file (and sglang_partial.py) relies on is listed in ``USED_API``;
tests/test_sglang_contract.py checks each against the source of the pinned wheel.

Tests: tests/test_sglang_contract.py, tests/test_sglang_double.py, tests/test_partial_rollouts.py,
tests/test_fp8_checkpoint.py,
tests/gpu/test_sglang_gpu.py
"""
from __future__ import annotations

import base64
import dataclasses
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from engine.rollout.base import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutAborted, RolloutEngine,
                                 RolloutOutput, SamplingParams, register_rollout)
from engine.rollout.sglang_partial import PartialRollouts, paused_results

SGLANG_VERSION = "0.5.21"

USED_API = {
    # sglang.srt.entrypoints.engine.Engine: method -> keyword arguments passed to it
    "Engine": {
        "__init__": [],  # takes **kwargs, turned into ServerArgs(**kwargs)
        "generate": ["input_ids", "sampling_params", "return_logprob", "return_routed_experts"],
        "async_generate": ["input_ids", "sampling_params", "return_logprob", "return_routed_experts"],
        "update_weights_from_tensor": ["named_tensors", "flush_cache"],
        "init_weights_update_group": ["master_address", "master_port", "rank_offset", "world_size", "group_name",
                                      "backend"],
        "update_weights_from_distributed": ["names", "dtypes", "shapes", "group_name", "flush_cache"],
        "destroy_weights_update_group": ["group_name"],
        "begin_weight_update": [],
        "end_weight_update": [],
        "flush_cache": [],
        "release_memory_occupation": ["tags"],
        "resume_memory_occupation": ["tags"],
        "shutdown": [],
    },
    # ServerArgs fields passed as sglang.Engine(**kwargs)
    "ServerArgs": ["model_path", "dtype", "load_format", "tp_size", "mem_fraction_static",
                   "chunked_prefill_size", "max_running_requests", "enable_memory_saver", "random_seed",
                   "enable_deterministic_inference", "enable_return_routed_experts",
                   "disable_cuda_graph",
                   # placement (engine/rollout/topology.py)
                   "base_gpu_id", "nnodes", "node_rank", "dist_init_addr"],
    # keys of the per-request sampling_params dict (fields of sglang's SamplingParams)
    "SamplingParams": ["n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids",
                       "sampling_seed", "ignore_eos"],
    # keys read from each result's meta_info
    "meta_info": ["output_token_logprobs", "finish_reason", "routed_experts"],
    # module -> names imported from it (the weight hand-off inside a rollout group)
    "imports": {
        "sglang.srt.utils.common": ["MultiprocessingSerializer"],
        "sglang.srt.utils.patch_torch": ["monkey_patch_torch_reductions"],
        "sglang.srt.managers.io_struct": ["PauseGenerationReqInput", "ContinueGenerationReqInput"],
        "sglang.srt.model_executor.model_runner_components.weight_updater": ["LocalSerializedTensor"],
    },
    # LocalSerializedTensor(values=[one handle per TP rank])
    "LocalSerializedTensor": ["values"],
    # partial rollouts (engine/rollout/sglang_partial.py): mode "abort" answers each request's tokens
    # so far (the others keep the requests and do not mark the weights' change); the pause is lifted
    # at once and prompt + tokens sent again. "file:Class.function" -> fragments
    "pause_requests": {"PauseGenerationReqInput": ["mode"], "ContinueGenerationReqInput": ["torch_empty_cache"]},
    "pause_mode": "abort",
    "partial_rollouts": {
        "sglang/srt/entrypoints/engine.py:Engine.flush_cache":
            ["self.loop.run_until_complete(self.tokenizer_manager.flush_cache())"],
        # abort mode: abort every request until none holds the reader lock (all have answered)
        "sglang/srt/managers/tokenizer_manager.py:TokenizerManager.pause_generation":
            ["self.is_pause = True", "if obj.mode != 'abort':", "self.abort_request(abort_all=True)",
             "is_locked = await self.model_update_lock.is_locked()"],
        "sglang/srt/managers/tokenizer_manager.py:TokenizerManager.continue_generation":
            ["self.is_pause = False", "self.is_pause_cond.notify_all()"],
        # a request waits while paused, then holds the reader lock until it has answered
        "sglang/srt/managers/tokenizer_manager.py:TokenizerManager.generate_request":
            ["await self.is_pause_cond.wait_for(lambda: not self.is_pause)",
             "async with self.model_update_lock.reader_lock:"],
        "sglang/srt/managers/scheduler.py:Scheduler.continue_generation": ["self._engine_paused = False"],
        # a running request finishes after one more decode step with the tokens it has (to_finish
        # beats the stop-token and length checks: its last token may be a stop token, or its
        # last allowed one); a waiting one answers no tokens, "Abort in waiting queue"
        "sglang/srt/managers/scheduler.py:Scheduler.abort_request":
            ["req.to_finish = FINISH_ABORT()", "_make_abort_req(req"],
        "sglang/srt/managers/schedule_batch.py:Req.update_finish_state":
            ["if self.to_finish:\n        self.finished_reason = self.to_finish\n        self.to_finish = None\n"
             "        return\n    new_accepted_tokens"],
        "sglang/srt/managers/schedule_batch.py:FINISH_ABORT.__init__":
            ["self.message = message or 'Aborted'", "self.status_code = status_code"],
        "sglang/srt/managers/tokenizer_manager.py:TokenizerManager._handle_abort_req":
            ["'Abort in waiting queue'", "self.add_logprob_to_meta_info("],
        # only aborts with a status code are errors (raised, or answered: never a pause)
        "sglang/srt/managers/tokenizer_manager.py:TokenizerManager._handle_abort_finish_reason":
            ["HTTPStatus.BAD_REQUEST", "HTTPStatus.SERVICE_UNAVAILABLE", "HTTPStatus.INTERNAL_SERVER_ERROR"],
        # seeded sampling draws from (seed, position): a resent prefix keeps its positions
        "sglang/srt/layers/sampler.py:multinomial_with_seed": ["murmur_hash32(seed, positions, col_indices)"],
    },
    # memory tags of release / resume_memory_occupation (sglang/srt/constants.py)
    "memory_tags": ["weights", "kv_cache", "cuda_graph"],
    # Engine methods answering (success, message): a False is raised, never ignored
    "returns_success": ["begin_weight_update", "update_weights_from_tensor", "end_weight_update",
                        "init_weights_update_group", "update_weights_from_distributed",
                        "destroy_weights_update_group"],
    # the workers' end of the update group: "file:Class.function" -> names it must use. The sender's
    # end (engine/rollout/update_group.py) mirrors them: a store at the sender, prefixed with the
    # group's name, torch's group constructor, worker rank = rank_offset + tp_rank, broadcasts from 0
    "update_group": {
        "sglang/srt/utils/common.py:init_custom_process_group": ["rendezvous", "PrefixStore",
                                                                 "_new_process_group_helper", "pg_group_ranks"],
        "sglang/srt/model_executor/model_runner_components/weight_updater.py:WeightUpdater.init_weights_update_group":
            ["init_custom_process_group", "rank_offset", "tp_rank"],
        "sglang/srt/model_executor/model_runner_components/weight_updater.py:WeightUpdater.receive_weights_from_distributed":
            ["broadcast", "empty"],
    },
    # the planned weight sync (engine/rollout/delivery.py) hands TP worker j a full-shape copy that
    # holds only its own shard (zeros elsewhere): worker j must read member j's handle and its
    # loaders keep only their shard of what they are given. "file:Class.function" -> fragments
    "sharded_load": {
        "sglang/srt/model_executor/model_runner_components/weight_updater.py:_unwrap_tensor":
            ["tensor.get(tp_rank)"],
        "sglang/srt/layers/linear.py:ColumnParallelLinear.weight_loader":
            ["loaded_weight.narrow(output_dim, start_idx, shard_size)"],
        "sglang/srt/layers/linear.py:RowParallelLinear.weight_loader":
            ["loaded_weight.narrow(input_dim, start_idx, shard_size)"],
        "sglang/srt/layers/vocab_parallel_embedding.py:VocabParallelEmbedding.weight_loader":
            ["self.shard_indices.org_vocab_start_index", "loaded_weight.narrow(output_dim, start_idx, shard_size)"],
    },
    # meta_info["finish_reason"]["type"] of every way a request ends (parse_result): "file:Class.function"
    # -> source fragments; an aborted request is refused, never trained on (RolloutAborted)
    "finish_reasons": {
        "sglang/srt/managers/schedule_batch.py:FINISH_MATCHED_TOKEN.to_json": ["'type': 'stop'"],
        "sglang/srt/managers/schedule_batch.py:FINISH_LENGTH.to_json": ["'type': 'length'"],
        "sglang/srt/managers/schedule_batch.py:FINISH_ABORT.to_json": ["'type': 'abort'", "'message'"],
    },
    # the routed-experts shape rule (meta_info["routed_experts"], parse_result): "file:Class.function"
    # -> source fragments it must contain: [tokens, num_hidden_layers, top_k] int32, zeros where no
    # MoE layer writes (dense layers), written at the decoder layer id, positions [start, seqlen - 1)
    "routed_experts": {
        "sglang/srt/state_capturer/routed_experts.py:RoutedExpertsCapturer.__init__":
            ["hf_text_config.num_hidden_layers", "hf_text_config.num_experts_per_tok"],
        "sglang/srt/state_capturer/base.py:BaseDeviceCache.__init__":
            ["torch.zeros((max_batch_size, num_layers, topk_size), dtype=torch.int32"],
        "sglang/srt/state_capturer/base.py:BaseDeviceCache.capture": ["self.buffer[:batch, layer_id, :]"],
        "sglang/srt/state_capturer/base.py:BaseTopkCapturer.get_topk": ["[start_len:seqlen - 1]"],
        "sglang/srt/managers/detokenizer_manager.py:DetokenizerManager._b64_encode_per_request":
            ["b64encode(item.numpy().tobytes())"],
    },
    # what SGLang builds for a block-FP8 model dir (config.json quantization_config): "file:Class.function"
    # -> source fragments. Linears get float8 `weight` + float32 `weight_scale_inv` blocks, so the
    # adapter starts the engine on the config without quantization_config (bf16, see _unquantised)
    "fp8": {
        "sglang/srt/layers/quantization/fp8.py:Fp8Config.from_config":
            ["'weight_block_size'", "['ignored_layers', 'modules_to_not_convert']"],
        "sglang/srt/layers/quantization/fp8.py:Fp8LinearMethod.create_fp8_weight_":
            ["torch.float8_e4m3fn if is_checkpoint_fp8_serialized else params_dtype",
             "register_parameter('weight_scale_inv', scale)",
             "(output_size_per_partition + block_n - 1) // block_n",
             "(input_size_per_partition + block_k - 1) // block_k"],
    },
    # the event loop a multi-turn rollout's concurrent requests are awaited on (run_async): the
    # engine's blocking calls run theirs on Engine.loop, and the tokenizer manager binds its result
    # loop to the loop of the first request it serves. "file:Class.function" -> fragments
    "event_loop": {
        "sglang/srt/entrypoints/engine.py:Engine.__init__": ["self.loop = self._ensure_event_loop()"],
        "sglang/srt/entrypoints/engine.py:Engine.generate": ["self.loop.run_until_complete(generator.__anext__())"],
        "sglang/srt/entrypoints/engine.py:Engine.async_generate": ["await generator.__anext__()"],
        "sglang/srt/managers/tokenizer_manager.py:TokenizerManager.auto_create_handle_loop":
            ["loop = get_or_create_event_loop()", "self.event_loop = loop"],
        "sglang/srt/managers/tokenizer_manager.py:TokenizerManager.generate_request":
            ["self.auto_create_handle_loop()"],
    },
    # environment read by Engine: "0" lets a multi-node engine's node_rank >= 1 return
    "env": ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"],
}


def engine_kwargs(model_path: str, dtype: str, load_format: str, tensor_model_parallel_size: int,
                  gpu_memory_utilization: float, max_num_batched_tokens: int, seed: int,
                  enable_deterministic_inference: bool, record_routing: bool, max_num_seqs: int = 1024,
                  base_gpu_id: int = 0, placement: Optional[dict] = None, enforce_eager: bool = False,
                  enable_chunked_prefill: bool = True) -> dict:
    """verl's rollout config + the topology's placement -> sglang ServerArgs (USED_API['ServerArgs'])."""
    if not 0 < gpu_memory_utilization < 1:
        raise ValueError(f"actor_rollout_ref.rollout.gpu_memory_utilization={gpu_memory_utilization} "
                         f"must be in (0, 1): the fraction of GPU memory for weights + KV cache")
    # verl's enforce_eager / enable_chunked_prefill: SGLang's CUDA graphs off; -1 prefills whole prompts
    out = dict(model_path=model_path, dtype=dtype, load_format=load_format,
               tp_size=tensor_model_parallel_size, mem_fraction_static=gpu_memory_utilization,
               chunked_prefill_size=max_num_batched_tokens if enable_chunked_prefill else -1,
               disable_cuda_graph=enforce_eager, max_running_requests=max_num_seqs,
               enable_memory_saver=True, random_seed=seed,
               enable_deterministic_inference=enable_deterministic_inference,
               enable_return_routed_experts=record_routing, base_gpu_id=base_gpu_id)
    out.update(placement or {})
    return out


def sampling_dict(sampling: SamplingParams, eos_token_ids: Sequence[int], seed: Optional[int] = None) -> dict:
    """Our SamplingParams -> sglang's per-request dict (keys are USED_API['SamplingParams']).

    sglang turns temperature 0 into greedy (top_k=1, temperature 1), matching ours.
    ``seed`` becomes ``sampling_seed``, which sglang reads only when the engine runs with
    ``enable_deterministic_inference=True`` (sglang/srt/sampling/sampling_batch_info.py; a request
    without one then gets 42), so it is sent only then: see ``SGLangRollout.generate``.
    """
    params = dict(n=sampling.n, temperature=0.0 if sampling.greedy else sampling.temperature,
                  top_p=sampling.top_p, top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens,
                  stop_token_ids=sorted(set(eos_token_ids) | set(sampling.stop_token_ids)))
    if seed is not None:
        params["sampling_seed"] = seed
    if sampling.ignore_eos:
        params["ignore_eos"] = True
    return params


def request_seed(seed: Optional[int], key: int, sample: int) -> int:
    """The sampling seed of sample j of the prompt keyed `key`: sglang draws from
    (seed, token position), so the n samples of a prompt need seeds of their own, and a
    prompt's seeds must not depend on the batch it lands in (a resumed run rebatches)."""
    return hash((0 if seed is None else int(seed), int(key), int(sample))) & ((1 << 63) - 1)


FINISH_TYPES = ("stop", "length", "abort")  # USED_API["finish_reasons"]


def parse_result(result: dict, prompt_len: int, routing_top_k: Optional[int] = None,
                 routing_layers: Optional[int] = None):
    """One sglang result -> (tokens, log-probs, finish reason, routed experts or None).

    ``routing_top_k`` (experts per token) is given when routing was recorded. sglang sends it
    base64-encoded int32, flat over [positions, num_hidden_layers, top_k]
    (sglang/srt/state_capturer/: one row per hidden layer, dense layers' rows 0; positions
    [0, prompt + response - 1) from BaseTopkCapturer.get_topk). ``routing_layers``: the model's
    num_hidden_layers, checked when given.
    """
    meta = result["meta_info"]
    # (logprob, token_id, text) per generated token: ids and log-probs stay aligned; an aborted
    # request may come back without them (sglang turns return_logprob off when it aborts early)
    token_logprobs = meta.get("output_token_logprobs") or []
    tokens = [int(t) for _, t, _ in token_logprobs]
    logps = [float(lp) for lp, _, _ in token_logprobs]
    reason = meta["finish_reason"]
    reason = reason.get("type") if isinstance(reason, dict) else reason
    if reason not in FINISH_TYPES:
        raise ValueError(f"sglang finish_reason {meta['finish_reason']!r}: expected one of {FINISH_TYPES}")
    finish = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}[reason]
    routed = None
    if routing_top_k is not None and finish != FINISH_ABORT:
        flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).copy()
        positions = prompt_len + len(tokens) - 1  # the layout of RolloutOutput.routed_experts
        layers = routing_layers or flat.size // max(positions * routing_top_k, 1)
        if flat.size != positions * layers * routing_top_k:
            raise ValueError(f"routed_experts: {flat.size} ids, expected {positions} positions x {layers} "
                             f"hidden layers x top-{routing_top_k} (prompt {prompt_len} + {len(tokens)} "
                             f"tokens - 1); is the engine's model the training model?")
        routed = torch.from_numpy(flat).reshape(positions, layers, routing_top_k)
    return tokens, logps, finish, routed


@register_rollout("sglang")
class SGLangRollout(PartialRollouts, RolloutEngine):
    """Rollout through ``sglang.Engine`` (needs CUDA and sglang==0.5.21).

    One per rollout group, on the group's leader (``engine_fields`` of the topology give
    ``tp_size`` / ``base_gpu_id`` and, for an engine spanning nodes, ``nnodes`` / ``node_rank`` /
    ``dist_init_addr``). On a multi-node engine the group's first rank on every other node builds
    one with its ``node_rank``: it only starts that node's scheduler processes and is never called.
    """

    SHARES_BUCKETS = True
    NEEDS_CUDA = True
    WEIGHTS_FROM_DISTRIBUTED = True  # in a separate pool: straight from the training rank
    ASYNC_GENERATE = True  # agenerate / run_async: multi-turn trajectories as concurrent requests

    def __init__(self, hf_config, eos_token_ids: Sequence[int] = (), model_path: Optional[str] = None,
                 dtype: str = "bfloat16", load_format: str = "dummy", tensor_model_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, max_num_batched_tokens: int = 8192, seed: int = 0,
                 enable_deterministic_inference: bool = False, record_routing: bool = False,
                 max_num_seqs: int = 1024, placement: Optional[dict] = None, enforce_eager: bool = False,
                 enable_chunked_prefill: bool = True, **extra_server_args):
        if model_path is None:
            raise ValueError("SGLangRollout needs model_path= (a directory with the HF config and tokenizer; "
                             "with load_format='dummy' the weights come from update_weights)")
        import os

        import sglang  # lazy: GPU-only dependency

        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.deterministic = enable_deterministic_inference
        self.record_routing = record_routing
        self.routing_top_k = getattr(hf_config, "num_experts_per_tok", None) if record_routing else None
        self.routing_layers = getattr(hf_config, "num_hidden_layers", None)
        if record_routing and self.routing_top_k is None:
            raise ValueError("record_routing=True needs a MoE hf_config with num_experts_per_tok; "
                             "set record_routing=False for dense models")
        model_path = self._unquantised(model_path, load_format)
        placement = dict(placement or {})
        tp = placement.pop("tp_size", tensor_model_parallel_size)
        kwargs = engine_kwargs(model_path, dtype, load_format, tp, gpu_memory_utilization,
                               max_num_batched_tokens, seed, enable_deterministic_inference, record_routing,
                               max_num_seqs=max_num_seqs, base_gpu_id=placement.pop("base_gpu_id", 0),
                               placement=placement, enforce_eager=enforce_eager,
                               enable_chunked_prefill=enable_chunked_prefill)
        self.serves = kwargs.get("node_rank", 0) == 0
        if not self.serves:  # node_rank >= 1 of a multi-node engine: start, do not block
            os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
        from engine.rollout.update_group import engine_environment
        with engine_environment():  # its scheduler processes start now, and keep this environment
            self.engine = sglang.Engine(**kwargs, **extra_server_args)
        self.update_group = None  # the weight-update group's name, once joined

    @staticmethod
    def _unquantised(model_path: str, load_format: str) -> str:
        """A block-FP8 model directory (DeepSeek-V3's release) would make SGLang build FP8 linears
        (float8 `weight` + `weight_scale_inv`, sglang/srt/layers/quantization/fp8.py), while the
        sync streams the trainer's bf16 weights: the engine gets the directory's config without
        quantization_config instead, and loads in bf16 (twice the bytes per weight of FP8)."""
        from engine.models import fp8
        quant = fp8.block_fp8_dir(model_path)
        if quant is None:
            return model_path
        if load_format != "dummy":
            raise ValueError(f"{model_path} is a block-FP8 checkpoint and load_format={load_format!r}: SGLang "
                             "would read its FP8 weights; the rollout loads in bf16 from the trainer's sync, "
                             "so use load_format='dummy'")
        import tempfile
        out = fp8.unquantised_model_dir(model_path, tempfile.mkdtemp(prefix="trident-rollout-bf16-"))
        print(f"rollout: {model_path} is block-FP8 (weight_block_size {quant['weight_block_size']}); SGLang "
              f"loads it in bf16 from {out} (its config without quantization_config), the weights come "
              f"from the trainer's bf16 sync", flush=True)
        return out

    @staticmethod
    def _check(result, call: str):
        """sglang answers weight calls with (success, message) instead of raising."""
        ok, message = result
        if not ok:
            raise RuntimeError(f"sglang Engine.{call} failed: {message}")

    # -- weights ---------------------------------------------------------------------------
    @staticmethod
    def share_bucket(named_tensors):
        """(name, CUDA IPC handle) of each tensor on this rank's GPU: no copy. The tensor must
        stay alive (and unchanged) until the leader's load returns (the group waits at a barrier)."""
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # handles name the GPU by UUID, not by visible index
        if any(t.is_cuda for _, t in named_tensors):
            torch.cuda.current_stream().synchronize()  # the bucket's broadcasts have landed
        return [(name, MultiprocessingSerializer.serialize(t.detach())) for name, t in named_tensors]

    def update_weights_from_shared(self, per_rank) -> None:
        """One load call for the group: TP worker j reads the tensor of the group's rank j."""
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

        names = [n for n, _ in per_rank[0]]
        for j, part in enumerate(per_rank):
            if [n for n, _ in part] != names:
                raise RuntimeError(f"rollout group rank {j} shared other tensors than rank 0 for this bucket; "
                                   f"every rank must stream the same buckets")
        named = [(name, LocalSerializedTensor(values=[part[i][1] for part in per_rank]))
                 for i, name in enumerate(names)]
        self._check(self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=False),
                    "update_weights_from_tensor")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.update_weights_from_shared([self.share_bucket(list(named_tensors))])

    def join_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                          group_name: str, backend: str) -> None:
        """The engine's TP workers join the training rank's group (blocks until all have)."""
        self._check(self.engine.init_weights_update_group(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend), "init_weights_update_group")
        self.update_group = group_name

    def update_weights_from_distributed(self, manifest: dict) -> None:
        """One bucket ({names, dtypes, shapes}), broadcast by the training rank meanwhile."""
        self._check(self.engine.update_weights_from_distributed(
            names=manifest["names"], dtypes=manifest["dtypes"], shapes=manifest["shapes"],
            group_name=self.update_group, flush_cache=False), "update_weights_from_distributed")

    def begin_weight_update(self) -> None:
        self._check(self.engine.begin_weight_update(), "begin_weight_update")

    def finish_weight_update(self) -> None:
        # sglang loads whatever names it is given and cannot tell whether a sync was complete;
        # the CPU backend's test checks the names the trainer streams
        self._check(self.engine.end_weight_update(), "end_weight_update")
        self.engine.flush_cache()

    # -- generation ------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 keys: Optional[Sequence[int]] = None, should_pause=None) -> RolloutOutput:
        """`should_pause()` (partial rollouts: engine/rollout/partial.py), asked while the requests
        run, stops them when it answers True: the rows not finished come back with finish reason
        FINISH_PAUSED and the tokens they have (each made by the weights loaded now);
        `continue_generation` goes on."""
        prompts, inputs, params = self._requests(prompt_ids, sampling, keys)
        if should_pause is None:
            results = self.engine.generate(input_ids=inputs, sampling_params=params,
                                           return_logprob=True, return_routed_experts=self.record_routing)
            return self._output(results, prompts, sampling.n)
        results, paused = self.run_async(self.pausable(inputs, params, should_pause))
        return self._output(results, prompts, sampling.n,
                            budgets=[sampling.max_new_tokens] * len(results) if paused else None,
                            sampling=sampling)

    async def agenerate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                        keys: Optional[Sequence[int]] = None) -> RolloutOutput:
        """`generate` as one of many concurrent requests (a multi-turn trajectory's turn): the
        engine's scheduler batches whatever is in flight (continuous batching), so a trajectory
        waiting for its tools holds no slot. Await it inside `run_async`."""
        prompts, inputs, params = self._requests(prompt_ids, sampling, keys)
        results = await self.engine.async_generate(input_ids=inputs, sampling_params=params,
                                                   return_logprob=True, return_routed_experts=self.record_routing)
        return self._output(results, prompts, sampling.n)

    def run_async(self, coroutine):
        """Run `coroutine` (awaiting `agenerate`) to its end on the engine's own event loop: the
        tokenizer manager's result loop runs on the loop of the engine's first request, which
        the blocking calls made on `Engine.loop` (USED_API['event_loop']); a request awaited on
        another loop would never be answered."""
        return self.engine.loop.run_until_complete(coroutine)

    def _requests(self, prompt_ids, sampling, keys):
        prompts = [list(p) for p in prompt_ids]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: prompt_ids must be a non-empty list of non-empty token id lists")
        if self.deterministic:  # one request per sample, each with its own seed
            keys = list(range(len(prompts))) if keys is None else list(keys)
            one = dataclasses.replace(sampling, n=1)
            inputs = [p for p in prompts for _ in range(sampling.n)]
            params = [sampling_dict(one, self.eos_token_ids, request_seed(sampling.seed, k, j))
                      for k in keys for j in range(sampling.n)]
        else:
            inputs, params = prompts, sampling_dict(sampling, self.eos_token_ids)
        return prompts, inputs, params

    def _output(self, results, prompts, n, budgets=None, sampling=None) -> RolloutOutput:
        """budgets (paused requests: the tokens each could still make): the pause's aborts become
        FINISH_PAUSED rows; any other abort is refused."""
        # sglang returns prompt-major order: all n samples of prompt 0, then prompt 1, ...
        prompt_index = [i for i in range(len(prompts)) for _ in range(n)]
        parsed = [list(parse_result(r, len(prompts[i]), self.routing_top_k, self.routing_layers))
                  for r, i in zip(results, prompt_index)]
        if budgets is not None:  # the pause's aborts (engine/rollout/sglang_partial.py)
            parsed = paused_results(parsed, results, budgets, sampling, self.eos_token_ids)
        aborted = [k for k, p in enumerate(parsed) if p[2] == FINISH_ABORT]
        if aborted:  # a partial response trained as a finished one would teach the policy to stop
            reason = results[aborted[0]]["meta_info"]["finish_reason"]
            message = reason.get("message") if isinstance(reason, dict) else reason
            raise RolloutAborted(
                f"sglang aborted {len(aborted)} of {len(parsed)} requests (first: prompt "
                f"{prompt_index[aborted[0]]}, {len(prompts[prompt_index[aborted[0]]])} prompt tokens + "
                f"{len(parsed[aborted[0]][0])} generated): {message}; give the KV cache room for one "
                "whole sequence: raise actor_rollout_ref.rollout.gpu_memory_utilization or lower "
                "data.max_prompt_length / data.max_response_length")
        return RolloutOutput(prompt_index=prompt_index, responses=[p[0] for p in parsed],
                             log_probs=[p[1] for p in parsed], finish_reasons=[p[2] for p in parsed],
                             routed_experts=[p[3] for p in parsed] if self.record_routing else None)

    # -- memory ----------------------------------------------------------------------------
    @staticmethod
    def _tags(tags):
        # CUDA graphs are captured against the KV cache: they leave and return with it
        if tags is None:
            return None
        return list(tags) + (["cuda_graph"] if "kv_cache" in tags else [])

    def release_memory(self, tags=None) -> None:
        self.engine.release_memory_occupation(tags=self._tags(tags))

    def resume_memory(self, tags=None) -> None:
        self.engine.resume_memory_occupation(tags=self._tags(tags))

    def shutdown(self) -> None:
        if self.update_group is not None:
            self._check(self.engine.destroy_weights_update_group(group_name=self.update_group),
                        "destroy_weights_update_group")
            self.update_group = None
        self.engine.shutdown()
