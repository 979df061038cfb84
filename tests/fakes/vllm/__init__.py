"""A recording test double of the `vllm` package (tests only: put tests/fakes on sys.path).

It offers exactly the names engine/rollout/vllm.py uses (its USED_API; tests/test_vllm_contract.py
checks those against the pinned wheel) and mirrors the vLLM 0.34 behaviour the adapter relies on,
each behaviour naming the vllm source file it mirrors:

- ``LLM(**kwargs)`` takes LLM's own keywords and EngineArgs fields (vllm/entrypoints/llm.py passes
  the rest to the EngineArgs dataclass: an unknown name is a TypeError; the double knows the names
  USED_API lists, which tests/test_vllm_contract.py checks in the wheel);
- ``LLM(**kwargs)`` with ``distributed_executor_backend="external_launcher"``: every rank of
  torch.distributed's world builds one (vllm/distributed/parallel_state.py
  ``initialize_model_parallel`` makes every TP group collectively), TP groups are consecutive
  ranks of the world (``torch.arange(world_size).reshape(-1, dp, pp, pcp, tp)``; a world the TP
  size does not divide fails that reshape), this rank is TP worker ``rank % tp``;
- ``apply_model(func)`` calls ``func`` on this rank's in-process model and returns ``[result]``
  (vllm/v1/worker/worker_base.py ``WorkerBase.apply_model``); the model's ``load_weights`` keeps
  only this worker's shard (``tp_shard``);
- ``sleep(level)`` / ``wake_up(tags)``: vllm/v1/executor/abstract.py ``Executor.sleep`` /
  ``wake_up`` (asleep means both SLEEP_TAGS; sleeping again is a no-op; a tag not asleep makes
  wake_up do nothing; level 1 keeps the weights on the CPU);
- ``generate``: every rank of a TP group runs the same requests (the TP collectives would
  deadlock otherwise: the double checks it), through Trident's CPU backend on the model
  assembled from the group's shards; results in vllm/outputs.py's RequestOutput /
  CompletionOutput shape with vllm/logprobs.py ``Logprob`` entries.

Records (kind, rank, args) go to `RECORDS` and, when TRIDENT_FAKE_VLLM_LOG is set, to that JSONL file.

Tests: tests/test_vllm_double.py
"""
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch

TRIDENT_TEST_DOUBLE = True  # lets rollout.name=vllm run on a CPU machine (engine/rollout/registry.py)
RECORDS = []
SLEEP_TAGS = frozenset(("weights", "kv_cache"))  # vllm/v1/executor/abstract.py
VOCAB_PADDING = 64  # vllm/model_executor/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE


def record(kind, **args):
    import torch.distributed as dist
    entry = dict(kind=kind, rank=dist.get_rank() if dist.is_initialized() else 0, args=args)
    RECORDS.append(entry)
    path = os.environ.get("TRIDENT_FAKE_VLLM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry, default=str) + "\n")


@dataclass
class SamplingParams:
    """vllm/sampling_params.py SamplingParams: the fields the adapter sets (top_k 0 = off)."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: Optional[int] = 16
    stop_token_ids: list = field(default_factory=list)
    seed: Optional[int] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    detokenize: bool = True


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


def tp_shard(name, shape, j, tp, config):
    """The index of HF tensor `name` that TP worker j of `tp` keeps, or None (replicated). Mirrors:
      vllm/model_executor/layers/vocab_parallel_embedding.py  embed_tokens / lm_head: the vocab
          padded to a multiple of 64 (pad_vocab_size), split evenly (``divide``), worker j's rows
      vllm/model_executor/layers/linear.py  QKVParallelLinear (k/v heads fewer than tp replicated:
          worker j loads head j // (tp / heads)), MergedColumnParallelLinear (gate / up): output
          rows over tp; RowParallelLinear (o_proj, down_proj): input columns over tp
    Everything else (norms) is replicated."""
    leaf = name.split(".")[-2] if name.count(".") else name
    index = [slice(None)] * len(shape)

    def along(dim, size, i):
        index[dim] = slice(min(i * size, shape[dim]), min((i + 1) * size, shape[dim]))
        return tuple(index)
    if leaf in ("embed_tokens", "lm_head"):
        padded = -(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING
        if padded % tp:
            raise ValueError(f"{padded} is not divisible by {tp}")  # vllm/distributed/utils.py divide
        return along(0, padded // tp, j)
    if leaf in ("k_proj", "v_proj"):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = shape[0] // head_dim
        if heads < tp:
            return along(0, head_dim, j // (tp // heads))
        return along(0, shape[0] // tp, j)
    if leaf in ("q_proj", "gate_proj", "up_proj"):
        return along(0, shape[0] // tp, j)
    if leaf in ("o_proj", "down_proj"):
        return along(1, shape[1] // tp, j)
    return None


def _box(index):
    return [(s.start, s.stop) for s in index]


class WorkerModel:
    """TP worker j's model: ``load_weights`` keeps worker j's shard of each tensor it is given and
    returns the names it loaded (vllm/model_executor/models/*.py ``load_weights``)."""

    def __init__(self, config, tp_rank, tp):
        self.config, self.tp_rank, self.tp = config, tp_rank, tp
        self.shards = {}  # name -> (full shape, box or None, tensor)
        self.version = 0  # bumps on every load: the assembled model is rebuilt

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            index = tp_shard(name, tuple(tensor.shape), self.tp_rank, self.tp, self.config)
            kept = tensor if index is None else tensor[index]
            self.shards[name] = (tuple(tensor.shape), None if index is None else _box(index),
                                 kept.detach().to("cpu", copy=True))
            loaded.add(name)
        self.version += 1
        record("load_weights", names=sorted(loaded), tp_rank=self.tp_rank,
               kept={n: list(self.shards[n][2].shape) for n in sorted(loaded)})
        return loaded


def _tp_groups(kwargs):
    """This rank's TP group (its ranks, its gloo group), built on every rank for every group."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise RuntimeError("external_launcher needs torch.distributed initialised by the launcher "
                           "(vllm/v1/executor/uniproc_executor.py ExecutorWithExternalLauncher)")
    world, rank, tp = dist.get_world_size(), dist.get_rank(), kwargs.get("tensor_parallel_size", 1)
    if world % tp:  # what torch.arange(world).reshape(-1, 1, 1, 1, tp) raises
        raise RuntimeError(f"shape '[-1, 1, 1, 1, {tp}]' is invalid for input of size {world}")
    mine = None
    for start in range(0, world, tp):
        ranks = list(range(start, start + tp))
        pg = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = (ranks, pg)
    return mine


class LLM:
    def __init__(self, **kwargs):
        import torch.distributed as dist
        from transformers import AutoConfig

        from engine.rollout.cpu import CPURollout
        from engine.rollout.vllm import USED_API
        unknown = sorted(set(kwargs) - set(USED_API["LLM"]["__init__"]) - set(USED_API["EngineArgs"]))
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {unknown[0]!r}")
        backend = kwargs.get("distributed_executor_backend")
        if backend != "external_launcher":
            raise ValueError(f"the double runs only distributed_executor_backend='external_launcher', not {backend!r}")
        self.kwargs = kwargs
        self.ranks, self.pg = _tp_groups(kwargs)
        # every rank of a TP group builds the same engine (vllm/config/vllm.py: one VllmConfig per group)
        config = AutoConfig.from_pretrained(kwargs["model"])
        # the model's directory may differ between ranks (each writes its own), its config may not
        mine = ({k: v for k, v in kwargs.items() if k != "model"},
                {k: v for k, v in config.to_dict().items() if k != "_name_or_path"})
        every = [None] * len(self.ranks)
        dist.all_gather_object(every, mine, group=self.pg)
        if any(k != mine for k in every):
            raise ValueError(f"the ranks {self.ranks} of one TP group built LLM with different arguments: {every}")
        self.model = WorkerModel(config, self.ranks.index(dist.get_rank()), len(self.ranks))
        self.rollout = CPURollout(config, eos_token_ids=())
        self.assembled = -1  # the model version the CPU rollout holds
        self.sleeping_tags = set()
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=self._shutdown))
        record("init", kwargs=kwargs, tp_ranks=self.ranks, tp_rank=self.model.tp_rank)

    # -- weights (vllm/entrypoints/llm.py LLM.apply_model -> worker_base.py: fn(self.get_model())) --
    def apply_model(self, func):
        if "weights" in self.sleeping_tags:
            raise RuntimeError("apply_model on a sleeping engine: its weights are not on the device")
        record("apply_model")
        return [func(self.model)]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        record("reset_prefix_cache")
        return True  # no request runs between generate calls (vllm/v1/core/sched/scheduler.py)

    # -- memory: vllm/v1/executor/abstract.py Executor.sleep / wake_up --------------------
    def sleep(self, level=1):
        record("sleep", level=level)
        if not self.kwargs.get("enable_sleep_mode"):
            raise ValueError("sleep needs the engine built with enable_sleep_mode=True")
        if level != 1:
            raise ValueError("the double offloads weights (level 1) only; level 2 discards them")
        if "weights" in self.sleeping_tags:  # "Executor is already sleeping."
            return
        self.sleeping_tags |= SLEEP_TAGS  # weights to the CPU (kept), the KV cache forgotten

    def wake_up(self, tags=None):
        record("wake_up", tags=tags)
        if not self.sleeping_tags:  # "Executor is not sleeping."
            return not self.sleeping_tags
        if tags and any(t not in self.sleeping_tags for t in tags):  # "Tag ... is not in sleeping tags"
            return not self.sleeping_tags
        self.sleeping_tags -= set(tags) if tags else set(self.sleeping_tags)
        return not self.sleeping_tags

    # -- generation ----------------------------------------------------------------------
    def _assemble(self):
        """The group's model: each worker's shards, gathered over the TP group (where vLLM's
        forward all-reduces / all-gathers across the workers instead)."""
        import torch.distributed as dist
        if self.assembled == self.model.version:
            return
        every = [None] * len(self.ranks)
        dist.all_gather_object(every, self.model.shards, group=self.pg)
        full = []
        for name, (shape, _, mine) in sorted(self.model.shards.items()):
            out = torch.zeros(shape, dtype=mine.dtype)
            for shards in every:
                _, box, t = shards[name]
                if box is None:
                    if not torch.equal(t, mine):
                        raise ValueError(f"{name}: a replicated weight differs between the TP workers")
                    out = t.clone()
                else:
                    out[tuple(slice(a, b) for a, b in box)] = t
            full.append((name, out))
        self.rollout.update_weights(full)
        self.rollout.finish_weight_update()
        self.assembled = self.model.version

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
        import torch.distributed as dist

        from engine.rollout.base import SamplingParams as Ours
        if self.sleeping_tags:
            raise RuntimeError(f"generate while {sorted(self.sleeping_tags)} sleep: wake_up first")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        ids = [list(p["prompt_token_ids"]) for p in prompts]
        # every rank of the TP group must make the same call (the workers' collectives pair up)
        every = [None] * len(self.ranks)
        dist.all_gather_object(every, (ids, [vars(p) for p in params]), group=self.pg)
        if any(e != every[0] for e in every):
            raise RuntimeError(f"the ranks {self.ranks} of one TP group called generate with different "
                               "requests: vLLM's TP collectives would hang")
        self._assemble()
        results = []
        for prompt, p in zip(ids, params):
            if p.logprobs != 0:
                raise ValueError("the double answers logprobs=0 (the sampled token's) only")
            # sample j of a seeded request draws with seed + j (vllm/v1/engine/parallel_sampling.py)
            completions = []
            for j in range(p.n):
                ours = Ours(n=1, temperature=p.temperature or 1.0, top_p=p.top_p,
                            top_k=-1 if p.top_k in (0, -1) else p.top_k, max_new_tokens=p.max_tokens,
                            stop_token_ids=tuple(p.stop_token_ids), do_sample=p.temperature != 0,
                            seed=None if p.seed is None else p.seed + j, ignore_eos=p.ignore_eos)
                out = self.rollout.generate([prompt], ours, keys=[0])
                tokens, logps = out.responses[0], out.log_probs[0]
                completions.append(SimpleNamespace(
                    index=j, token_ids=list(tokens), routed_experts=None,
                    logprobs=[{t: Logprob(logprob=lp, rank=1)} for t, lp in zip(tokens, logps)],
                    finish_reason="stop" if out.finish_reasons[0] == "stop" else "length"))
            results.append(SimpleNamespace(prompt_token_ids=prompt, outputs=completions))
        record("generate", prompts=ids, responses=[[c.token_ids for c in r.outputs] for r in results],
               seeds=[p.seed for p in params])
        return results

    def _shutdown(self):
        record("shutdown")
