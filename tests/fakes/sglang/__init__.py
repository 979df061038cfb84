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

import torch

TRIDENT_TEST_DOUBLE = True  # lets rollout.name=sglang run on a CPU machine (engine.config)
RECORDS = []


def digest(tensor) -> str:
    """sha1 of a tensor's bytes: what the engine holds, comparable with a saved checkpoint."""
    return hashlib.sha1(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _record(kind, **fields):
    entry = dict(kind=kind, rank=int(os.environ.get("RANK", "0")), **fields)
    RECORDS.append(entry)
    path = os.environ.get("TRIDENT_FAKE_SGLANG_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry, default=str) + "\n")


class Engine:
    def __init__(self, **kwargs):
        _record("init", kwargs=kwargs)
        self.kwargs = kwargs
        self.rollout = None
        if kwargs.get("node_rank", 0) == 0:  # a node_rank >= 1 engine only starts processes
            from transformers import AutoConfig

            from engine.rollout.cpu import CPURollout
            config = AutoConfig.from_pretrained(kwargs["model_path"])
            self.rollout = CPURollout(config, eos_token_ids=(),
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
            if any(not torch.equal(copies[0], c) for c in copies[1:]):
                raise ValueError(f"{name}: the group's ranks shared different tensors")
            names.append(name)
            shapes.append(list(copies[0].shape))
            origins.append([S.origin(v) for v in value.values])
            loaded.append((name, copies[0]))
        _record("update_weights_from_tensor", names=names, shapes=shapes, origins=origins,
                flush_cache=flush_cache, digests={n: digest(t) for n, t in loaded})
        self.rollout.update_weights(loaded)
        return True, "Success"

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        """Each TP worker (a process of its own, as sglang's schedulers) joins at rank_offset + tp_rank."""
        from tests.update_group_worker import start
        _record("init_weights_update_group", master_address=master_address, master_port=master_port,
                rank_offset=rank_offset, world_size=world_size, group_name=group_name, backend=backend)
        self.workers = getattr(self, "workers", {})
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
        self.rollout.update_weights(copies[0])
        return True, "Succeeded to update parameter online."

    def destroy_weights_update_group(self, group_name):
        _record("destroy_weights_update_group", group_name=group_name)
        from tests.update_group_worker import stop
        stop(self.workers.pop(group_name))
        return True, "Succeeded to destroy custom process group."

    def end_weight_update(self):
        _record("end_weight_update")
        self.session = False
        self.rollout.finish_weight_update()
        return True, "ok"

    def flush_cache(self):
        _record("flush_cache")

    # -- memory ----------------------------------------------------------------------------
    def release_memory_occupation(self, tags=None):
        _record("release_memory_occupation", tags=tags)
        self.rollout.release_memory(tags)

    def resume_memory_occupation(self, tags=None):
        _record("resume_memory_occupation", tags=tags)
        self.rollout.resume_memory(tags)

    # -- generation ------------------------------------------------------------------------
    def generate(self, input_ids=None, sampling_params=None, return_logprob=False,
                 return_routed_experts=False):
        from engine.rollout.base import FINISH_STOP, SamplingParams
        p = dict(sampling_params)
        greedy = p.get("temperature", 1.0) == 0.0
        sampling = SamplingParams(n=p.get("n", 1), temperature=p.get("temperature", 1.0),
                                  top_p=p.get("top_p", 1.0), top_k=p.get("top_k", -1),
                                  max_new_tokens=p["max_new_tokens"],
                                  stop_token_ids=tuple(p.get("stop_token_ids", ())),
                                  seed=p.get("sampling_seed"), do_sample=not greedy,
                                  ignore_eos=p.get("ignore_eos", False))
        out = self.rollout.generate(input_ids, sampling)
        _record("generate", prompts=[list(x) for x in input_ids], responses=out.responses, n=sampling.n)
        results = []
        for r, (tokens, logps, finish) in enumerate(zip(out.responses, out.log_probs, out.finish_reasons)):
            meta = {"output_token_logprobs": [(lp, t, None) for t, lp in zip(tokens, logps)],
                    "finish_reason": {"type": "stop" if finish == FINISH_STOP else "length"}}
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

    def shutdown(self):
        _record("shutdown")
        from tests.update_group_worker import stop
        for workers in getattr(self, "workers", {}).values():
            stop(workers)
