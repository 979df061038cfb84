"""The rollout interface shared by the SGLang and vLLM (GPU) and CPU backends.

A weight sync is a series of ``update_weights`` calls, each with one bucket of full
(unsharded) tensors under their Hugging Face checkpoint names, closed by one
``finish_weight_update()`` which validates completeness and flushes any cached KV.
Between phases of a colocated PPO step the engine gives its memory back with
``release_memory()`` and takes it again with ``resume_memory()``; weights must be
re-sent after a resume. `ROLLOUT_MEMORY` names the two parts of that memory.
Which backend runs for a config is decided in engine/rollout/registry.py.

Tests: tests/test_rollout_cpu.py, tests/test_sglang_double.py, tests/test_sglang_contract.py,
tests/test_vllm_adapter.py
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

FINISH_STOP = "stop"      # ended on an eos / stop token (the token is part of the response)
FINISH_LENGTH = "length"  # hit max_new_tokens
FINISH_ABORT = "abort"    # the engine gave up on it (SGLang: out of KV cache): never trained on
# the rollout's memory tags, in the order a colocated engine takes them back (weights, then the KV
# cache); release_memory / resume_memory take them, the memory schedule (engine/config/phases.py)
# says which are resident in each phase
ROLLOUT_MEMORY = ("weights", "kv_cache")


class RolloutAborted(RuntimeError):
    """The engine aborted a request (SGLang, vLLM: its KV cache could not hold the sequence): the
    step is not trained on a cut-off response."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; names follow verl's ``actor_rollout_ref.rollout.*`` keys.

    Greedy decoding when ``do_sample`` is false or ``temperature`` is 0; ``top_k=-1``
    and ``top_p=1.0`` switch those filters off. ``seed`` makes sampling reproducible
    for the same prompts and parameters.
    """
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: Optional[int] = None
    do_sample: bool = True
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            ("n", self.n, self.n >= 1, "use n >= 1 samples per prompt"),
            ("temperature", self.temperature, self.temperature >= 0, "use temperature >= 0 (0 = greedy)"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "use 0 < top_p <= 1 (1 = off)"),
            ("top_k", self.top_k, self.top_k == -1 or self.top_k >= 1, "use top_k >= 1 or -1 (off)"),
            ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, "use max_new_tokens >= 1"),
        ]
        for name, value, ok, fix in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {fix}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


@dataclass
class RolloutOutput:
    """Responses in prompt-major order: row ``i * n + j`` is sample ``j`` of prompt ``i``.

    ``log_probs[r][t]`` is the rollout log-prob of ``responses[r][t]``:
    ``log_softmax(logits / temperature)`` over the full vocabulary, before any top-k /
    top-p filtering (what SGLang reports); greedy rows use temperature 1.

    ``routed_experts`` (only when routing was recorded, MoE models): one int32 tensor per
    row of shape ``[prompt_len + response_len - 1, num_hidden_layers, top_k]``: the experts
    chosen at every position the model was run on, prompt tokens first, then every
    response token except the last (which is sampled, never fed back); one row per hidden
    layer, 0 for dense layers. This is SGLang's ``return_routed_experts`` layout, so training
    can replay either backend's routing (engine/workers/routing.py picks the MoE layers' rows).
    """
    prompt_index: list[int]
    responses: list[list[int]]
    log_probs: list[list[float]]
    finish_reasons: list[str]
    routed_experts: Optional[list[torch.Tensor]] = field(default=None)

    def share(self, rows: slice) -> tuple:
        """(responses, log_probs, routed or None, loss masks or None, trajectory stats or None) of
        `rows`: what a DP replica receives (a multi-turn rollout's masks and per-trajectory
        turns / tools / ending, engine/rollout/multi_turn.py)."""
        masks, stats = getattr(self, "loss_masks", None), getattr(self, "stats", None)
        return (self.responses[rows], self.log_probs[rows],
                None if self.routed_experts is None else self.routed_experts[rows],
                masks[rows] if masks else None, stats[rows] if stats else None)

    def padded(self, pad_token_id: int, length: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Right-padded ``responses`` [rows, L] (long), ``response_mask`` [rows, L] (1 = real
        token) and ``rollout_log_probs`` [rows, L] (float32, 0 on padding)."""
        longest = max((len(r) for r in self.responses), default=0)
        length = longest if length is None else length
        if length < longest:
            raise ValueError(f"length={length} is shorter than the longest response ({longest}); "
                             f"pass length >= {longest} or None")
        rows = len(self.responses)
        ids = torch.full((rows, length), pad_token_id, dtype=torch.long)
        mask = torch.zeros((rows, length), dtype=torch.long)
        logp = torch.zeros((rows, length), dtype=torch.float32)
        for r, (tokens, lps) in enumerate(zip(self.responses, self.log_probs)):
            ids[r, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[r, :len(tokens)] = 1
            logp[r, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
        return {"responses": ids, "response_mask": mask, "rollout_log_probs": logp}


ROLLOUT_BACKENDS: dict[str, type] = {}  # rollout.name -> engine class (engine/rollout/registry.py)


def register_rollout(name: str):
    """Class decorator: the backend `actor_rollout_ref.rollout.name=<name>` selects."""
    def add(cls):
        ROLLOUT_BACKENDS[name] = cls
        cls.name = name
        return cls
    return add


class RolloutEngine(ABC):
    """Generates responses with weights streamed in from the trainer.

    One engine serves one rollout group (engine/rollout/topology.py); it lives on the group's
    leader. Backends whose workers read every group member's own copy of a weight bucket set
    `SHARES_BUCKETS`: each member calls `share_bucket` on its copy, the leader passes the
    gathered handles to `update_weights_from_shared`; the others load the leader's copy with
    `update_weights`. Backends that set `WEIGHTS_FROM_DISTRIBUTED` receive a separate pool's
    weights from the training rank over a collective group (`join_update_group`, then
    `update_weights_from_distributed` per bucket: engine/rollout/update_group.py); the others get
    them over the pool's bridge. Backends that set `SPMD` (vLLM's external_launcher) are built
    on every rank of a group instead, each rank's engine holding its own TP worker; every rank
    makes every call (weights from its own copy, memory, generation) together. Backends that
    set `ASYNC_GENERATE` serve concurrent requests (SGLang's continuous batching): a multi-turn
    rollout drives each trajectory as its own coroutine; the others get the ready trajectories'
    turns batched into one generate call.
    """

    name = "?"
    SHARES_BUCKETS = False
    LOADS_SLICES = False  # load_slices: the transfer plan's slices (engine/rollout/delivery.py)
    NEEDS_CUDA = False
    WEIGHTS_FROM_DISTRIBUTED = False
    SPMD = False  # one engine per rank of a group, all called together (engine/rollout/group.py)
    # `async def agenerate(prompt_ids, sampling, keys)` awaited inside `run_async(coroutine)`: each
    # multi-turn trajectory a request of its own while others wait for tools (engine/rollout/multi_turn.py)
    ASYNC_GENERATE = False

    @staticmethod
    def share_bucket(named_tensors):
        raise NotImplementedError

    def update_weights_from_shared(self, per_rank) -> None:
        raise NotImplementedError

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of full tensors named as in the HF checkpoint."""

    def load_slices(self, pieces) -> None:
        """Load [(HF name, box, tensor)]: `tensor` is the box ((start, stop) per dimension) of the
        HF tensor; a sync's slices together cover every weight (backends with LOADS_SLICES)."""
        raise NotImplementedError(f"{type(self).__name__} loads full tensors only (LOADS_SLICES is False)")

    def begin_weight_update(self) -> None:
        """Open a weight sync (before its first bucket)."""

    @abstractmethod
    def finish_weight_update(self) -> None:
        """Close a weight sync: check every weight was sent, flush cached KV."""

    @abstractmethod
    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 keys: Optional[Sequence[int]] = None) -> RolloutOutput:
        """Sample ``sampling.n`` responses for each prompt (token ids, no padding).

        ``keys`` (one int per prompt, e.g. its dataset index) make sampling a function of the
        prompt rather than of its place in the batch, so any grouping of prompts over engines
        draws the same responses for the same seed (where the backend supports it)."""

    @abstractmethod
    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Free weights and KV cache (or only the `tags` given, from ROLLOUT_MEMORY)."""

    @abstractmethod
    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Take the memory back (all, or `tags`); weights must be re-sent after 'weights'."""

    def shutdown(self) -> None:
        """Stop background processes, if any."""

    def sync_weights(self, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> None:
        """One full weight sync: every bucket, then ``finish_weight_update``."""
        self.begin_weight_update()
        for bucket in buckets:
            self.update_weights(bucket)
        self.finish_weight_update()
