"""Rollout topology: which ranks form one rollout engine, who builds it, on which GPUs.

A pure function of the config (world size, GPUs per node, rollout TP R): no torch.distributed.

    topo = rollout_topology(world_size=16, gpus_per_node=8, tp=4)
    topo.groups[1].ranks        # (4, 5, 6, 7): one SGLang engine with tp_size=4
    topo.engine_fields(4)       # {'tp_size': 4, 'base_gpu_id': 4, ...}: what rank 4 passes to sglang

R consecutive ranks make a group; SGLang TP rank j of a group's engine runs on the GPU of the
group's j-th rank (torchrun numbers ranks node by node, local rank = GPU), so every TP worker
reads the weights its own rank materialised. A group within a node must not straddle two nodes
(R divides the node size); a group wider than a node spans whole nodes (R a multiple of it):
SGLang then runs one engine process tree per node, each started by the group's first rank on
that node with `node_rank`, and all of them meet at `dist_init_addr`.

`route_plan` splits a step's prompts over the groups (generation) and over the DP replicas
(training): each leader sends each replica exactly the responses of the prompts it trains on.

Tests: tests/test_rollout_topology.py, tests/test_sglang_double.py, tests/test_transfer_plan.py
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


class TopologyError(ValueError):
    """An impossible rollout grouping; the message names the key and a fix."""


@dataclass(frozen=True)
class RolloutGroup:
    """One rollout engine: `ranks` are consecutive; SGLang TP rank j runs on `ranks[j]`'s GPU."""
    index: int
    ranks: tuple[int, ...]
    gpus_per_node: int

    @property
    def leader(self) -> int:
        """Builds the serving engine, receives the hand-off, generates for the group."""
        return self.ranks[0]

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @property
    def nnodes(self) -> int:
        return max(1, self.tp // self.gpus_per_node)

    @property
    def base_gpu_id(self) -> int:
        return self.leader % self.gpus_per_node

    @property
    def node_leaders(self) -> tuple[int, ...]:
        """The first rank of the group on each node it spans: each starts that node's engine."""
        return self.ranks[::self.gpus_per_node] if self.nnodes > 1 else (self.leader,)

    def node_rank(self, rank: int) -> int:
        return (rank - self.leader) // self.gpus_per_node if self.nnodes > 1 else 0


@dataclass(frozen=True)
class RolloutTopology:
    world_size: int
    gpus_per_node: int
    tp: int
    groups: tuple[RolloutGroup, ...]

    def group_of(self, rank: int) -> RolloutGroup:
        return self.groups[rank // self.tp]

    def is_leader(self, rank: int) -> bool:
        return self.group_of(rank).leader == rank

    def builds_engine(self, rank: int, spmd: bool = False) -> bool:
        """The leader, and on a multi-node engine the group's first rank on every other node;
        every rank for an SPMD backend (vLLM's external_launcher: each rank is one TP worker)."""
        return spmd or rank in self.group_of(rank).node_leaders

    def engine_fields(self, rank: int, dist_init_addr: Optional[str] = None, spmd: bool = False) -> dict:
        """The placement fields of sglang's ServerArgs for the engine `rank` builds (an SPMD
        backend's engine on every rank: tp_size and this rank's GPU)."""
        if spmd:
            return dict(tp_size=self.tp, base_gpu_id=rank % self.gpus_per_node)
        if not self.builds_engine(rank):
            raise ValueError(f"rank {rank} builds no rollout engine (its group's leader is "
                             f"{self.group_of(rank).leader})")
        g = self.group_of(rank)
        fields = dict(tp_size=g.tp, base_gpu_id=rank % self.gpus_per_node)
        if g.nnodes > 1:
            if dist_init_addr is None:
                raise ValueError(f"group {g.index} spans {g.nnodes} nodes: its engines need the "
                                 f"leader's dist_init_addr (host:port)")
            fields.update(nnodes=g.nnodes, node_rank=g.node_rank(rank), dist_init_addr=dist_init_addr)
        return fields

    def summary(self) -> dict:
        """What tools/plan.py prints and writes as JSON."""
        g = self.groups[0]
        return {"engines": len(self.groups), "gpus_per_engine": self.tp, "nodes_per_engine": g.nnodes,
                "engines_per_node": max(1, self.gpus_per_node // self.tp),
                "groups": [{"ranks": [r.ranks[0], r.ranks[-1]], "leader": r.leader,
                            "base_gpu_id": r.base_gpu_id, "node_leaders": list(r.node_leaders)}
                           for r in self.groups]}


def _divisor_list(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def rollout_topology(world_size: int, gpus_per_node: int, tp: int,
                     num_attention_heads: Optional[int] = None) -> RolloutTopology:
    """The rollout groups of a run; raises TopologyError naming the key and a fix."""
    for name, value in (("world size", world_size), ("GPUs per node", gpus_per_node), (TP_KEY, tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TopologyError(f"{name}={value!r}: must be a positive integer")
    node = min(gpus_per_node, world_size)
    if world_size % tp:
        raise TopologyError(f"{TP_KEY}={tp} does not divide the world size {world_size}; use one of "
                            f"{_divisor_list(world_size)}")
    if tp <= node and node % tp:
        raise TopologyError(f"{TP_KEY}={tp} does not divide the {node} GPUs of a node, so an engine "
                            f"would straddle two nodes; use one of {_divisor_list(node)} (or a multiple "
                            f"of {node} to span whole nodes)")
    if tp > node and tp % node:
        raise TopologyError(f"{TP_KEY}={tp} spans more than one node of {node} GPUs, so it must be a "
                            f"multiple of {node} (whole nodes per engine); use {node * (tp // node)} or "
                            f"{node * (tp // node + 1)}")
    if num_attention_heads is not None and num_attention_heads % tp:
        raise TopologyError(f"{TP_KEY}={tp} does not divide the model's {num_attention_heads} attention "
                            f"heads (SGLang shards heads over its TP ranks); use one of "
                            f"{_divisor_list(num_attention_heads)} that also divides the world size")
    groups = tuple(RolloutGroup(i, tuple(range(i * tp, (i + 1) * tp)), node)
                   for i in range(world_size // tp))
    return RolloutTopology(world_size, node, tp, groups)


# --------------------------------------------------------------------------------------------
# Routing: prompts -> groups (generation), prompts -> DP replicas (training)
# --------------------------------------------------------------------------------------------

def split_evenly(n: int, parts: int) -> tuple[range, ...]:
    """`parts` contiguous ranges covering range(n), sizes differing by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return tuple(out)


def overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


@dataclass(frozen=True)
class RoutePlan:
    """Prompt index ranges: `generate[g]` by rollout group g, `train[d]` by DP replica d."""
    generate: tuple[range, ...]
    train: tuple[range, ...]

    def sends(self, group: int) -> list[tuple[int, range]]:
        """(replica, prompts) that group `group`'s leader sends; empty overlaps left out."""
        return [(d, o) for d, r in enumerate(self.train) if len(o := overlap(self.generate[group], r))]

    def receives(self, replica: int) -> list[tuple[int, range]]:
        """(group, prompts) that replica `replica` receives, in prompt order."""
        return [(g, o) for g, r in enumerate(self.generate) if len(o := overlap(r, self.train[replica]))]


def route_plan(num_prompts: int, num_groups: int, dp: int) -> RoutePlan:
    """Training shards are the DP ranks' contiguous equal shares (as the trainer requires);
    generation is split evenly over the groups."""
    if num_prompts % dp:
        raise ValueError(f"{num_prompts} prompts do not split over {dp} data-parallel ranks")
    return RoutePlan(split_evenly(num_prompts, num_groups), split_evenly(num_prompts, dp))


def replicas_of(dp_ranks: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Global ranks of each DP replica (ranks sharing a DP index train on the same data), from
    every rank's DP index in rank order; the first rank of each is its relay."""
    dp = max(dp_ranks) + 1
    return tuple(tuple(r for r, d in enumerate(dp_ranks) if d == i) for i in range(dp))
