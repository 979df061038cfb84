"""Micro-batches through Megatron's pipeline schedules (1F1B, interleaved, or no pipelining).

`forward_backward` hides the schedule's iterator plumbing: the caller gives a list of
micro-batches and a `step_fn(model, micro_batch) -> (output, loss_fn)`; with virtual pipeline
stages every model chunk sees the same micro-batches in order. Gradients are finalised (DP /
SP / tied-embedding reductions) by Megatron's own `finalize_model_grads`.

Tests: tests/test_layouts.py, tests/test_ppo_update.py, tests/test_faults.py
"""
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func


class MicroBatchOOM(RuntimeError):
    """A rank ran out of memory in a micro-batch; raised on every rank together."""


def is_oom(error: BaseException) -> bool:
    """torch's out-of-memory, or the CPU stand-in tests inject (a RuntimeError named so)."""
    return isinstance(error, torch.OutOfMemoryError) or type(error).__name__ == "SimulatedOOM"


def forward_backward(chunks: Sequence, micro_batches: List[dict], step_fn: Callable, *,
                     forward_only: bool, seq_length: int, micro_batch_size: int,
                     agree_on_oom: bool = False, recorded_oom: Optional[Callable] = None):
    """Run every micro-batch forward (and backward unless `forward_only`) through the pipeline.

    Returns the list of per-micro-batch `info` values the loss functions returned (last pipeline
    stage only; empty elsewhere). Losses are *sums* already normalised by the caller (the model
    config sets `calculate_per_token_loss`): the schedule does not average them.

    `agree_on_oom`: before the gradients are reduced, every rank says whether it ran out of
    memory (one all-reduce of a flag) and all raise MicroBatchOOM together if one did, so the
    caller can retry with smaller micro-batches. The ranks meet there only if the failing rank
    left no peer waiting inside the schedule. So a step function with model-parallel peers
    records an out-of-memory instead of raising (`recorded_oom()` returns it) and keeps the
    pipeline's collectives going with idle micro-batches (engine/workers/base.py); an OOM raised
    inside a micro-batch's TP / CP collectives still leaves its peers waiting until the
    collective timeout ends the job (engine.train reports it).
    """
    if not micro_batches:
        return []
    chunks = list(chunks)
    for chunk in chunks:
        chunk.config.finalize_model_grads_func = None  # finalised below, without token scaling

    def forward_step(data_iterator, model):
        return step_fn(model, next(data_iterator))

    iterators = [iter(micro_batches) for _ in chunks]
    oom = None
    try:
        infos = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
    except Exception as e:
        if not (agree_on_oom and is_oom(e)):
            raise
        oom, infos = e, []
    if oom is None and recorded_oom is not None:
        oom = recorded_oom()
    if agree_on_oom:
        flag = torch.tensor([1.0 if oom is not None else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            raise MicroBatchOOM(f"out of memory in a micro-batch ({oom or 'on another rank'})")
    if not forward_only:
        finalize_model_grads(chunks)
    return infos


def split_by_count(n: int, size: int) -> List[List[int]]:
    """Consecutive groups of `size` indices (the last may be smaller)."""
    if size is None or size < 1:
        raise ValueError(f"micro-batch size must be a positive integer, got {size!r}")
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def split_by_tokens(lengths: Sequence[int], max_tokens: int) -> List[List[int]]:
    """Dynamic batching: as few micro-batches as fit `max_tokens` tokens each, balanced.

    Longest sequences first, each into the lightest micro-batch it fits (deterministic); the
    number of micro-batches grows until everything fits. Groups keep ascending index order.
    """
    lengths = [int(n) for n in lengths]
    too_long = [n for n in lengths if n > max_tokens]
    if too_long:
        raise ValueError(f"a sequence of {max(too_long)} tokens exceeds the token budget "
                         f"{max_tokens} per micro-batch; raise ppo_max_token_len_per_gpu "
                         f"(or log_prob_max_token_len_per_gpu) to at least {max(too_long)}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    k = max(1, -(-sum(lengths) // max_tokens))
    while True:
        loads, groups = [0] * k, [[] for _ in range(k)]
        for i in order:
            b = min(range(k), key=lambda j: (loads[j], j))
            if loads[b] + lengths[i] > max_tokens:
                break
            loads[b] += lengths[i]
            groups[b].append(i)
        else:
            return [sorted(g) for g in groups if g]
        k += 1
