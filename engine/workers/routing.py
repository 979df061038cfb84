"""Router replay (actor.router_replay): the training forward routes every token the rollout ran
to the experts the rollout chose.

The rollout's record is SGLang's layout (engine/rollout/base.py RolloutOutput.routed_experts):
[positions, num_hidden_layers, top_k], a row for every hidden layer, dense ones included. So a
MoE layer replays the row of its own layer index (Megatron's global `layer_number - 1`), never
its MoE ordinal: on a model with dense layers (DeepSeek-V3's first_k_dense_replace, Qwen-MoE's
mlp_only_layers) the ordinal would replay an earlier layer's routing.

Recomputed forwards (activation recompute): Megatron's RouterReplay keeps every target it is
given in a FIFO, popped by a router running with REPLAY_BACKWARD. Each micro-batch's forward
pushes its routing and runs REPLAY_FORWARD; once it returns the routers switch to
REPLAY_BACKWARD, so a recomputation inside a backward pass takes the oldest micro-batch not yet
recomputed. Backward passes of one model chunk run in the order of its forwards (no pipelining,
1F1B and interleaved 1F1B alike), so that is the micro-batch being back-propagated, not the
latest one forwarded (which is what REPLAY_FORWARD would give under PP > 1).

Also here, for MoE models under EP > 1: the DP ranks' token-budget micro-batches are made as
many (`as_many_as_expert_peers`), since every MoE layer's dispatch is an EP collective.

Tests: tests/test_router_replay.py, tests/test_moe_ppo.py
"""
from typing import List

import torch
from megatron.core import parallel_state as ps


def replay_routing(batch, rows: List[int], starts, seqs, tokens_shape, index=None):
    """The rollout's recorded experts laid out in Megatron's token order, one tensor per hidden
    layer ([tokens, topk]). The rollout never runs the last token of a response (it is sampled,
    not fed back) nor padding; those positions take expert ids 0..topk-1 — their outputs reach
    no log-prob (attention is causal and they come last). `index`: a CP rank's tokens."""
    recorded = [batch["routed_experts"][r] for r in rows]
    layers, topk = recorded[0].shape[1], recorded[0].shape[2]
    b, s = tokens_shape
    flat = torch.arange(topk).expand(b * s, layers, topk).clone()  # [b*s, L, k], row-major (b, s)
    for start, rec, (seq, _, _) in zip(starts, recorded, seqs):
        n = min(rec.shape[0], seq.numel())
        flat[start:start + n] = rec[:n].long()
    if index is not None:  # this CP rank's tokens, [b, s / CP] row-major
        flat, s = flat[index], index.numel() // b
    # Megatron's router sees [s, b] flattened s-major
    flat = flat.view(b, s, layers, topk).transpose(0, 1).reshape(s * b, layers, topk)
    return [flat[:, layer].contiguous() for layer in range(layers)]


def _replays(model):
    """(decoder layer, its router's RouterReplay) of every MoE layer of one model chunk."""
    inner = getattr(model, "module", model)
    for layer in inner.decoder.layers:
        replay = getattr(getattr(layer.mlp, "router", None), "router_replay", None)
        if replay is not None:
            yield layer, replay


def start_replay(models) -> None:
    """Before a schedule call: forget the routing queued by the last one."""
    for model in models:
        for _, replay in _replays(model):
            replay.clear_indices()


def set_replay(model, routing, sequence_parallel: bool) -> None:
    """Point this chunk's routers at the rollout's choices for the micro-batch about to run
    (sliced to this rank's sequence shard under sequence parallelism) and queue them for its
    recomputation. `routing` None (a batch without a record): the routers route themselves."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    tp = ps.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    rank = ps.get_tensor_model_parallel_rank() if tp > 1 else 0
    for layer, replay in _replays(model):
        if routing is None:
            replay.clear_router_replay_action()
            continue
        if len(routing) != layer.config.num_layers:
            raise ValueError(f"router_replay: the rollout recorded {len(routing)} layers, the model has "
                             f"{layer.config.num_layers}; the record must hold every hidden layer "
                             "(SGLang's layout, dense layers included)")
        idx = routing[layer.layer_number - 1]  # the global layer index, dense layers counted
        shard = idx.shape[0] // tp
        replay.set_target_indices(idx[rank * shard:(rank + 1) * shard])  # also queued for backward
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def replay_in_backward(model) -> None:
    """After a micro-batch's forward: a recomputation (in a backward pass) pops the queue."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for _, replay in _replays(model):
        if replay.router_replay_action is not None:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)


def as_many_as_expert_peers(groups: List[List[int]]) -> List[List[int]]:
    """Token-budget micro-batches (`split_by_tokens`) of a MoE model under EP > 1: every MoE
    layer's token dispatch is a collective over the EP peers (other DP ranks), so each DP rank
    must run as many micro-batches. The ranks agree on the largest count; a rank short of it
    halves its largest micro-batches (subsets stay within the budget). Ranks hold as many rows
    (the batch splits evenly over DP), so the count never exceeds a rank's rows."""
    import torch.distributed as dist

    if ps.get_expert_model_parallel_world_size() == 1:
        return groups
    count = torch.tensor([len(groups)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group(with_context_parallel=True))
    groups = [list(g) for g in groups]
    while len(groups) < int(count):
        big = max(range(len(groups)), key=lambda i: (len(groups[i]), -i))
        if len(groups[big]) < 2:
            raise ValueError(f"{len(groups)} micro-batches of one row cannot become {int(count)} to match "
                             "the EP peers; give every DP rank as many rows")
        g = groups.pop(big)
        groups[big:big] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups
