"""A recording test double of the `sglang` package (tests only: put tests/fakes on sys.path).

`Engine` takes the keyword arguments Trident's adapter passes, records every construction
(rank, kwargs), weight load (names, shapes, the rank each TP worker's copy came from), memory
call and generation, and generates through Trident's CPU backend, returning results in
sglang's shape. Records go to `RECORDS` in this process and, when TRIDENT_FAKE_SGLANG_LOG is
set, to that JSONL file (for torchrun runs). Every name it offers is one the real adapter uses;
tests/test_sglang_contract.py checks those against the real wheel.
"""
import base64
import json
import os

import torch

TRIDENT_TEST_DOUBLE = True  # lets rollout.name=sglang run on a CPU machine (engine.config)
RECORDS = []


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

    # -- weights ---------------------------------------------------------------------------
    def begin_weight_update(self):
        _record("begin_weight_update")

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
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
                flush_cache=flush_cache)
        self.rollout.update_weights(loaded)

    def end_weight_update(self):
        _record("end_weight_update")
        self.rollout.finish_weight_update()

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
            if return_routed_experts:
                meta["routed_experts"] = base64.b64encode(
                    out.routed_experts[r].to(torch.int32).numpy().tobytes()).decode()
            results.append({"meta_info": meta})
        return results

    def shutdown(self):
        _record("shutdown")
