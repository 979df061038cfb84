"""A recording test double of the `sglang` package (tests only: put tests/fakes on sys.path).

`Engine` takes the keyword arguments Trident's adapter passes, records every construction
(rank, kwargs), weight load (names, shapes, the rank each TP worker's copy came from), memory
call and generation, and generates through Trident's CPU backend, returning results in
sglang's shape. Records go to `RECORDS` in this process and, when TRIDENT_FAKE_SGLANG_LOG is
set, to that JSONL file (for torchrun runs). Every name it offers is one the real adapter uses;
tests/test_sglang_contract.py checks those against the real wheel.
"""
import base64
import hashlib
import json
import os
import random
from types import SimpleNamespace

import torch

TRIDENT_TEST_DOUBLE = True  # lets rollout.name=sglang run on a CPU machine (engine.config)
RECORDS = []


def digest(tensor) -> str:
    """sha1 of a tensor's bytes: what the engine holds, comparable with a saved checkpoint."""
    return hashlib.sha1(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _record(kind, **fields):
    # the calling (training) process's own agent-store setting: the engine's children must not
    # inherit it, the trainer must keep it
    entry = dict(kind=kind, rank=int(os.environ.get("RANK", "0")),
                 trainer_env={"TORCHELASTIC_USE_AGENT_STORE": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")},
                 **fields)
    RECORDS.append(entry)
    path = os.environ.get("TRIDENT_FAKE_SGLANG_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry, default=str) + "\n")


def tp_shard(name, shape, j, tp, config):
    """The index of HF tensor `name` (of `shape`) that TP worker j of `tp` loads, or None for a
    replicated weight (every worker loads it whole). ep_size = dp_size = 1 (Trident passes
    neither). Mirrors the weight loaders of:
      sglang/srt/layers/vocab_parallel_embedding.py  embed_tokens / lm_head: rows of the vocab
          padded to a multiple of 64 (of 64 x tp when that does not divide), worker j's
          [j * padded / tp, (j + 1) * padded / tp) of the real rows
      sglang/srt/layers/linear.py  QKVParallelLinear (q/k/v_proj; k/v heads fewer than tp are
          replicated: worker j loads head j // (tp / heads)), ColumnParallelLinear (MLA's q_b_proj,
          kv_b_proj), MergedColumnParallelLinear (gate / up): output rows over tp;
          RowParallelLinear (o_proj, down_proj): input columns over tp
      sglang/srt/layers/moe/fused_moe_triton/layer.py  FusedMoE: an expert's w1 / w3 rows and
          w2 columns over tp (ep_size 1: every worker holds every expert)
    Everything else (norms, the router, MLA's q_a_proj / kv_a_proj_with_mqa) is replicated."""
    leaf = name.split(".")[-2] if name.count(".") else name
    whole = [slice(None)] * len(shape)

    def along(dim, parts, i):
        size = shape[dim] // parts
        whole[dim] = slice(i * size, (i + 1) * size)
        return tuple(whole)
    if leaf in ("embed_tokens", "lm_head"):
        padded = -(-shape[0] // 64) * 64
        if padded % tp:
            padded = -(-shape[0] // (64 * tp)) * 64 * tp
        per = padded // tp
        whole[0] = slice(min(j * per, shape[0]), min((j + 1) * per, shape[0]))
        return tuple(whole)
    if leaf in ("k_proj", "v_proj"):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = shape[0] // head_dim
        if heads < tp:
            h = j // (tp // heads)
            whole[0] = slice(h * head_dim, (h + 1) * head_dim)
            return tuple(whole)
        return along(0, tp, j)
    if leaf in ("q_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "w1", "w3"):
        return along(0, tp, j)
    if leaf in ("o_proj", "down_proj", "w2"):
        return along(1, tp, j)
    return None


class Engine:
    def __init__(self, **kwargs):
        from sglang.srt.entrypoints.engine import check_arguments
        check_arguments(kwargs)  # ServerArgs' checks come before anything starts
        # weights + KV pool against its GPUs' budget, sized at start as sglang does (that file cites the source)
        from sglang.srt.utils.torch_memory_saver_adapter import EngineMemory
        self.memory = EngineMemory(kwargs)
        _record("memory", pre=self.memory.pre, weights_bytes=self.memory.weights_bytes,
                kv_pool_bytes=self.memory.kv_pool_bytes)
        # one scheduler process per TP rank of this node, joined into its TP group, as the real
        # engine starts them (sglang/srt/entrypoints/engine.py; tests/fakes/.../entrypoints/engine.py)
        from sglang.srt.entrypoints.engine import launch_scheduler_processes
        self.schedulers = launch_scheduler_processes(kwargs)
        self.environ_at_start = dict(os.environ)
        _record("init", kwargs=kwargs, schedulers=[info for _, _, info in self.schedulers])
        # sglang/srt/entrypoints/engine.py: the engine's tokenizer manager answers the control
        # requests (pause / continue: tests/fakes/sglang/srt/managers/tokenizer_manager.py)
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        self.tokenizer_manager = TokenizerManager(_record)
        self.kwargs = kwargs
        self.generator = random.Random(kwargs.get("random_seed", 0))  # sglang seeds its schedulers so
        self.rollout = None
        if kwargs.get("node_rank", 0) == 0:  # a node_rank >= 1 engine only starts processes
            from transformers import AutoConfig

            from engine.rollout.cpu import CPURollout
            from engine.models.fp8 import unquantised_config
            from sglang.srt.layers.quantization.fp8 import Fp8Linears
            self.fp8 = Fp8Linears(kwargs["model_path"])  # FP8 parameters for a block-FP8 model dir
            # the CPU model that generates holds what the FP8 parameters dequantise to
            config = unquantised_config(AutoConfig.from_pretrained(kwargs["model_path"]))
            # at most max_running_requests decode together; the rest wait in the queue
            self.rollout = CPURollout(config, eos_token_ids=(),
                                      max_num_seqs=kwargs.get("max_running_requests", 1 << 30),
                                      record_routing=bool(kwargs.get("enable_return_routed_experts")))

    # -- weights (each answers (success, message), as sglang's do) ----------------------------
    def begin_weight_update(self):
        _record("begin_weight_update")
        self.session = True
        return True, "ok"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if not getattr(self, "session", False):
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
        from sglang.srt.utils.common import MultiprocessingSerializer as S

        names, shapes, origins, loaded = [], [], [], []
        for name, value in named_tensors:
            if not isinstance(value, LocalSerializedTensor):
                raise TypeError(f"{name}: expected a LocalSerializedTensor per weight, got {type(value)}")
            if len(value.values) != self.kwargs["tp_size"]:
                raise ValueError(f"{name}: {len(value.values)} handles for tp_size={self.kwargs['tp_size']}")
            copies = [S.deserialize(v) for v in value.values]
            if any(c.shape != copies[0].shape for c in copies[1:]):
                return False, f"{name}: the TP ranks' copies have shapes {[tuple(c.shape) for c in copies]}"
            try:
                weight = self._as_workers_load(name, copies)
            except ValueError as e:
                return False, str(e)
            names.append(name)
            shapes.append(list(copies[0].shape))
            origins.append([S.origin(v) for v in value.values])
            loaded.append((name, weight))
        _record("update_weights_from_tensor", names=names, shapes=shapes, origins=origins,
                flush_cache=flush_cache, digests={n: digest(t) for n, t in loaded})
        try:
            self.rollout.update_weights(self.fp8.load(loaded))
        except ValueError as e:  # a load failure answers (False, message)
            return False, str(e)
        return True, "Success"

    def _as_workers_load(self, name, copies):
        """The weight the TP workers hold after each loaded `name` from its own copy: worker j
        keeps only its shard of copy j (the weight loaders narrow it), so the double assembles
        those shards and nothing else; a replicated weight must be the same in every copy."""
        if len(copies) == 1:
            return copies[0]
        out = torch.zeros_like(copies[0])
        shards = [tp_shard(name, tuple(copies[0].shape), j, len(copies), self.rollout.model.config)
                  for j in range(len(copies))]
        if all(s is None for s in shards):
            if any(not torch.equal(copies[0], c) for c in copies[1:]):
                raise ValueError(f"{name}: a replicated weight differs between the TP workers' copies")
            return copies[0]
        for j, (copy, shard) in enumerate(zip(copies, shards)):
            if shard is not None:
                out[shard] = copy[shard]
        return out

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        """Each TP worker (a process of its own, as sglang's schedulers) joins at rank_offset + tp_rank."""
        from tests.update_group_worker import start
        _record("init_weights_update_group", master_address=master_address, master_port=master_port,
                rank_offset=rank_offset, world_size=world_size, group_name=group_name, backend=backend)
        self.workers = getattr(self, "workers", {})
        from sglang.srt.entrypoints.engine import as_started
        with as_started(self.environ_at_start):
            self.workers[group_name] = start(master_address, master_port,
                                             [rank_offset + r for r in range(self.kwargs["tp_size"])],
                                             world_size, group_name, backend)
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        if not getattr(self, "session", False):
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        workers = getattr(self, "workers", {}).get(group_name)
        if workers is None:
            return False, f"Failed to receive weights: group {group_name} was never initialised"
        for conn, _ in workers:
            conn.send((names, dtypes, shapes))
        copies = [conn.recv() for conn, _ in workers]  # each worker's [(name, tensor)]
        for name, dtype, shape, *got in zip(names, dtypes, shapes, *copies):
            tensors = [t for _, t in got]
            if any(list(t.shape) != list(shape) or str(t.dtype) != f"torch.{dtype}" for t in tensors):
                return False, f"{name}: received {[tuple(t.shape) for t in tensors]}, manifest {shape} {dtype}"
            if any(not torch.equal(tensors[0], t) for t in tensors[1:]):
                return False, f"{name}: the TP workers received different tensors"
        _record("update_weights_from_distributed", names=list(names), dtypes=list(dtypes),
                shapes=[list(s) for s in shapes], group_name=group_name, flush_cache=flush_cache,
                workers=len(workers), digests={n: digest(t) for n, t in copies[0]})
        try:
            self.rollout.update_weights(self.fp8.load(copies[0]))
        except ValueError as e:
            return False, f"Failed to update parameter online: {e}"
        return True, "Succeeded to update parameter online."

    def destroy_weights_update_group(self, group_name):
        _record("destroy_weights_update_group", group_name=group_name)
        from tests.update_group_worker import stop
        stop(self.workers.pop(group_name))
        return True, "Succeeded to destroy custom process group."

    def end_weight_update(self):
        _record("end_weight_update")
        self.session = False
        try:
            self.fp8.finish()
        except ValueError as e:
            return False, str(e)
        self.rollout.finish_weight_update()
        return True, "ok"

    def flush_cache(self):
        _record("flush_cache")

    # -- memory ----------------------------------------------------------------------------
    def release_memory_occupation(self, tags=None):
        _record("release_memory_occupation", tags=tags)
        self.memory.release(tags)
        self.rollout.release_memory(tags)

    def resume_memory_occupation(self, tags=None):
        _record("resume_memory_occupation", tags=tags)
        self.memory.resume(tags)  # raises as a scheduler's out-of-memory would end it
        self.rollout.resume_memory(tags)

    # -- generation ------------------------------------------------------------------------
    def _bind_handle_loop(self, loop):
        """sglang/srt/managers/tokenizer_manager.py ``auto_create_handle_loop``: the first request
        starts the loop that reads the scheduler's results on the loop it runs on (Engine.generate
        runs its requests on ``Engine.loop``, sglang/srt/entrypoints/engine.py); a request awaited
        on any other loop is never answered. The double raises where sglang would hang."""
        bound = getattr(self, "_handle_loop", None)
        if bound is None:
            self._handle_loop = loop
        elif bound is not loop:
            raise RuntimeError("async_generate awaited on an event loop that is not the one the engine's "
                               "result loop runs on (Engine.loop): sglang would never answer it")

    @property
    def loop(self):
        """sglang/srt/entrypoints/engine.py ``Engine.__init__``: ``self.loop = self._ensure_event_loop()``."""
        if getattr(self, "_loop", None) is None:
            import asyncio
            self._loop = asyncio.new_event_loop()
        return self._loop

    async def async_generate(self, input_ids=None, sampling_params=None, return_logprob=False,
                             return_routed_experts=False):
        """sglang/srt/entrypoints/engine.py ``Engine.async_generate``: the same request as
        ``generate`` (a batch of input_ids answers a list, one list of ids a dict), answered when
        the scheduler has run it. It passes the tokenizer manager's pause gate and holds its
        reader lock meanwhile (tokenizer_manager.py ``generate_request``); the scheduler (one
        worker thread, as sglang's runs in a process of its own) runs it while the event loop
        stays free for control requests (pause / continue: the modes act on it)."""
        import asyncio
        import functools
        loop = asyncio.get_running_loop()
        self._bind_handle_loop(loop)
        request = await self.tokenizer_manager.admit()
        try:
            await asyncio.sleep(0)  # requests sent together reach the scheduler together
            single = bool(input_ids) and isinstance(input_ids[0], int)
            batch = [input_ids] if single else input_ids
            params = [sampling_params] if single and isinstance(sampling_params, dict) else sampling_params
            results = await loop.run_in_executor(self._scheduler(), functools.partial(
                self._generate, batch, params, return_routed_experts, kind="async_generate", request=request))
        finally:
            self.tokenizer_manager.release(request)
        return results[0] if single else results

    def _scheduler(self):
        if getattr(self, "_worker", None) is None:
            from concurrent.futures import ThreadPoolExecutor
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-sglang-scheduler")
        return self._worker

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False,
                 return_routed_experts=False):
        if self.tokenizer_manager.is_pause:  # generate_request waits on is_pause_cond, on this thread
            raise RuntimeError("Engine.generate while generation is paused (pause_generation without "
                               "continue_generation): sglang would wait forever")
        self._bind_handle_loop(self.loop)
        return self._generate(input_ids, sampling_params, return_routed_experts)

    def _generate(self, input_ids, sampling_params, return_routed_experts, kind="generate", request=None):
        from engine.rollout.base import FINISH_STOP
        from sglang.srt.managers.schedule_batch import fit_to_pool
        from sglang.srt.sampling.sampling_batch_info import generate
        n, out, aborts = generate(self.rollout, input_ids, sampling_params,
                                  bool(self.kwargs.get("enable_deterministic_inference")), self.generator, request)
        sampling = SimpleNamespace(n=n)
        _record(kind, prompts=[list(x) for x in input_ids], responses=out.responses, n=sampling.n,
                sampling_params=sampling_params, aborts=aborts)
        results = []
        capacity = self._pool_tokens()
        for r, (tokens, logps, finish) in enumerate(zip(out.responses, out.log_probs, out.finish_reasons)):
            reason = aborts[r] or {"type": "stop" if finish == FINISH_STOP else "length"}
            if capacity is not None:  # a request the KV pool cannot hold is aborted where it stopped
                tokens, abort = fit_to_pool(len(input_ids[r // sampling.n]), list(tokens), capacity)
                if abort is not None:
                    reason, logps = abort, logps[:len(tokens)]
            meta = {"output_token_logprobs": [(lp, t, None) for t, lp in zip(tokens, logps)],
                    "finish_reason": reason}
            if reason["type"] == "abort":  # it never reached the detokenizer's routed-experts output
                results.append({"meta_info": meta})
                continue
            if return_routed_experts and out.routed_experts is not None:
                # mirrors sglang/srt/state_capturer/{base,routed_experts}.py and the detokenizer's
                # base64: int32 [prompt + response - 1, num_hidden_layers, top_k], a row for
                # every hidden layer (0 for dense ones, which no router writes); nothing unless
                # the engine started with enable_return_routed_experts (no capturer)
                routed = out.routed_experts[r]
                layers = self.rollout.model.config.num_hidden_layers
                assert routed.dtype == torch.int32 and routed.shape[:2] == (
                    len(input_ids[r // sampling.n]) + len(tokens) - 1, layers), routed.shape
                meta["routed_experts"] = base64.b64encode(routed.numpy().tobytes()).decode()
            results.append({"meta_info": meta})
        return results

    def _pool_tokens(self):
        """The KV pool's size in tokens, when the engine holds memory on a simulated device."""
        if self.memory.kv_pool_bytes is None:
            return None
        from sglang.srt.managers.schedule_batch import max_total_num_tokens
        return max_total_num_tokens(self.memory.kv_pool_bytes, self.kwargs["model_path"],
                                    self.kwargs["tp_size"], self.kwargs.get("dtype", "auto"))

    def shutdown(self):
        _record("shutdown")
        from sglang.srt.entrypoints.engine import shutdown
        from tests.update_group_worker import stop
        for workers in getattr(self, "workers", {}).values():
            stop(workers)
        shutdown(self.schedulers)
        if getattr(self, "_worker", None) is not None:
            self._worker.shutdown()
        if getattr(self, "_loop", None) is not None:
            self._loop.close()
