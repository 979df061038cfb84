"""Rollout groups at run time: the one engine of each group, the weight hand-off inside a group,
and generation results routed to the DP replicas that train on them.

Every rank holds a `GroupedRollout`; only the ranks `RolloutTopology.builds_engine` names hold a
backend engine (the group leader serves; on a multi-node engine the first rank of every other
node only starts that node's engine processes). The process groups it uses are built once, in
`__init__` (a collective over all ranks).

Hand-off of one bucket of full tensors (every rank of the world has materialised it on its own
device, `parallel.reshard`): backends whose TP workers read each rank's copy (SGLang over CUDA
IPC: `share_bucket`) gather the members' handles to the leader, which makes one load call; the
group then waits at a barrier so no member frees its bucket while a worker still reads it. The
CPU backend's leader simply loads its own copy.

SPMD backends (`RolloutEngine.SPMD`, vLLM's external_launcher) have an engine on every rank of a
group, each holding that rank's TP worker in process: every rank makes every engine call together
(begin / load / finish a sync, release / resume, generate), each loading its own copy of a bucket
(its worker keeps its shard); only the leader sends the group's results on.

Routing: `topology.route_plan` gives each group a share of the step's prompts and each DP
replica its training shard; a leader sends each replica's first rank (its relay) only the
responses that replica trains on, and the relay broadcasts them inside the replica. Bytes per
rank therefore follow its own data, not world x batch (`route_bytes` counts them).
`send_object` / `recv_object` (a pickled object between two ranks) also carry dynamic sampling's
kept groups between replicas (engine/experience/dynamic_sampling.py).

Tests: tests/test_rollout_groups.py, tests/test_rollout_topology.py, tests/test_replay_dynamic.py
"""
from __future__ import annotations

import pickle
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from engine.rollout.base import RolloutEngine, SamplingParams
from engine.rollout.topology import RolloutTopology, replicas_of, route_plan, split_evenly
from parallel.mesh import node_address


def send_object(obj, dst) -> tuple[list, int]:
    """Send a picklable `obj` to rank `dst` without waiting: (the requests to wait on, the buffers
    to keep alive until then, its size in bytes). `recv_object(src)` on `dst` receives it."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    return [dist.isend(size, dst), dist.isend(data, dst)], [size, data], data.numel()


def recv_object(src):
    """The object rank `src` sent with `send_object`, and its size in bytes."""
    size = torch.empty(1, dtype=torch.long)
    dist.recv(size, src)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src)
    return pickle.loads(data.numpy().tobytes()), int(size)


def full_shape(pieces: list, tensors: list, dtype, device) -> list:
    """[(name, tensor of `shape`)] for each of `tensors`, holding `pieces` [(name, box, slice)]
    where they sit and zeros elsewhere."""
    out = {}
    for name, shape in tensors:
        out[name] = torch.zeros(shape, dtype=dtype, device=device)
    for name, box, t in pieces:
        out[name][tuple(slice(lo, hi) for lo, hi in box)].copy_(t)
    return list(out.items())


class GroupedRollout:
    """This rank's part of the rollout: its group, its engine (if it builds one), the routes.

    `engine_factory(fields)` builds this rank's backend engine from the topology's placement
    fields (called only on ranks that build one); `backend` is the backend class (its
    `SHARES_BUCKETS` / `share_bucket` are used on every rank of a group).
    """

    def __init__(self, topology: RolloutTopology, backend: type, engine_factory, dp_rank: int,
                 rank: Optional[int] = None):
        self.topology, self.backend = topology, backend
        # the transfer plan's delivery (engine/rollout/delivery.py): slices, or whole tensors per
        # TP worker for backends whose workers read each member's copy
        self.loads_slices = backend.LOADS_SLICES or backend.SHARES_BUCKETS
        self.whole_tensors = backend.SHARES_BUCKETS
        # rank: this rank's in the topology (a restartable pool rank is a world of its own)
        self.rank = dist.get_rank() if rank is None else rank
        self.group = topology.group_of(self.rank)
        self.is_leader = self.group.leader == self.rank
        self.spmd = bool(getattr(backend, "SPMD", False))
        self.calls_engine = self.is_leader or self.spmd  # this rank's engine takes the group's calls
        # process groups, built once and in the same order on every rank (gloo: object traffic)
        self._group_pg = None
        for g in topology.groups:
            pg = dist.new_group(list(g.ranks), backend="gloo") if g.tp > 1 else None
            if g is self.group:
                self._group_pg = pg
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, dp_rank)
        self.replicas = replicas_of(every)
        self.dp_rank = dp_rank
        self._replica_pg = None
        for ranks in self.replicas:
            pg = dist.new_group(list(ranks), backend="gloo") if len(ranks) > 1 else None
            if self.rank in ranks:
                self._replica_pg = pg
        self.route_bytes = 0  # bytes this rank sent + received routing the last generation
        addr = self._dist_init_addr() if self.group.nnodes > 1 else None
        self.engine: Optional[RolloutEngine] = None
        if topology.builds_engine(self.rank, self.spmd):
            self.engine = engine_factory(topology.engine_fields(self.rank, addr, self.spmd))

    # -- placement -------------------------------------------------------------------------
    def _dist_init_addr(self) -> str:
        """host:port of the leader, shared with its group (a multi-node engine meets there)."""
        import socket
        obj = [None]
        if self.is_leader:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            obj = [f"{node_address()}:{port}"]
        dist.broadcast_object_list(obj, src=self.group.leader, group=self._group_pg)
        return obj[0]

    # -- weights ---------------------------------------------------------------------------
    def load_bucket(self, named_tensors: list) -> None:
        """Collective within the group: one bucket of full HF-named tensors into the engine."""
        if self.backend.SHARES_BUCKETS and self.group.tp > 1:
            mine = self.backend.share_bucket(named_tensors)
            gathered = [None] * self.group.tp if self.is_leader else None
            dist.gather_object(mine, gathered, dst=self.group.leader, group=self._group_pg)
            if self.is_leader:
                self.engine.update_weights_from_shared(gathered)
            dist.barrier(group=self._group_pg)  # members keep the bucket until it was read
        elif self.backend.SHARES_BUCKETS:
            self.engine.update_weights_from_shared([self.backend.share_bucket(named_tensors)])
        elif self.calls_engine:  # SPMD: each rank's engine loads its own copy (its worker's shard)
            self.engine.update_weights(named_tensors)

    def load_slices(self, pieces: list, tensors: list, dtype=None, device=None) -> None:
        """Collective within the group: each member's slices of the transfer plan (what its TP
        rank loads) of one round, whose HF tensors are `tensors` [(name, shape)], into the engine.

        A backend whose TP workers read each member's copy (SGLang: `SHARES_BUCKETS`) loads whole
        HF tensors and each worker cuts its own shard from its member's copy
        (sglang/srt/layers/linear.py's and vocab_parallel_embedding.py's weight loaders): each
        member shares the round's tensors at full shape holding its slices, zeros elsewhere (no
        worker reads there). The bytes that crossed the network are the slices alone; the memory
        is the round's tensors (<= a bucket, or one tensor larger than it).

        The CPU backend's one process plays every TP rank: the leader gathers the members'
        slices and loads each (name, box) once (replicated tensors come from every member).
        `dtype` / `device`: the training weights' (the full-shape tensors are made in them)."""
        if self.backend.SHARES_BUCKETS:
            self.load_bucket(full_shape(pieces, tensors, dtype, device))
            return
        if self.group.tp == 1:
            self.engine.load_slices(pieces)
            return
        gathered = [None] * self.group.tp if self.is_leader else None
        dist.gather_object(pieces, gathered, dst=self.group.leader, group=self._group_pg)
        if self.is_leader:
            seen, unique = set(), []
            for part in gathered:
                for name, box, tensor in part:
                    if (name, box) not in seen:
                        seen.add((name, box))
                        unique.append((name, box, tensor))
            self.engine.load_slices(unique)

    def begin_sync(self) -> None:
        if self.calls_engine:
            self.engine.begin_weight_update()

    def finish_sync(self) -> None:
        if self.calls_engine:
            self.engine.finish_weight_update()

    # -- memory ----------------------------------------------------------------------------
    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        if self.calls_engine:
            self.engine.release_memory(tags)

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        if self.calls_engine:
            self.engine.resume_memory(tags)

    def barrier(self) -> None:
        """Collective within the group: its ranks are the GPUs its engine's workers run on, so
        they alone meet around a memory move; a group of one rank (an engine per GPU) waits for
        no one, and no step waits on the whole world."""
        if self._group_pg is not None:
            dist.barrier(group=self._group_pg)

    # -- generation ------------------------------------------------------------------------
    def generate_for_replicas(self, prompt_ids: list, keys: list, sampling: SamplingParams,
                              generate=None) -> dict:
        """{prompt index: RolloutOutput.share of its n samples} for the
        prompts of this rank's DP replica. Collective over all ranks.

        `generate(engine, prompt_ids, sampling, keys)` runs the engine (the trainer passes one
        that leaves parallel.cpu's per-op device mode)."""
        plan = route_plan(len(prompt_ids), len(self.topology.groups), len(self.replicas))
        n = sampling.n
        produced = {}
        mine = plan.generate[self.group.index]
        if self.calls_engine and len(mine):  # SPMD: the group's ranks generate together, the leader sends
            run = generate or (lambda e, p, s, k: e.generate(p, s, keys=k))
            out = run(self.engine, [prompt_ids[i] for i in mine], sampling, [keys[i] for i in mine])
            for k, i in enumerate(mine):
                produced[i] = out.share(slice(k * n, (k + 1) * n))
        moved, pending, keep = 0, [], []
        if self.is_leader:
            for d, prompts in plan.sends(self.group.index):
                relay = self.replicas[d][0]
                if relay != self.rank:
                    reqs, bufs, size = send_object({i: produced[i] for i in prompts}, relay)
                    pending += reqs
                    keep += bufs
                    moved += size
        result = {}
        relay = self.replicas[self.dp_rank][0]
        if relay == self.rank:
            for g, prompts in plan.receives(self.dp_rank):
                leader = self.topology.groups[g].leader
                if leader == self.rank:
                    result.update({i: produced[i] for i in prompts})
                else:
                    part, size = recv_object(leader)
                    result.update(part)
                    moved += size
        for req in pending:
            req.wait()
        if self._replica_pg is not None:
            box = [result if relay == self.rank else None]
            dist.broadcast_object_list(box, src=relay, group=self._replica_pg)
            result = box[0]
            moved += len(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        self.route_bytes = moved
        return result

    def generate_split(self, prompt_ids: list, keys: list, sampling: SamplingParams, generate=None):
        """Validation: each leader generates its group's share; returns (indices, RolloutOutput)
        on leaders, (indices, None) elsewhere. Not collective (SPMD: collective within each group)."""
        mine = split_evenly(len(prompt_ids), len(self.topology.groups))[self.group.index]
        if not (self.calls_engine and len(mine)):
            return list(mine), None
        run = generate or (lambda e, p, s, k: e.generate(p, s, keys=k))
        out = run(self.engine, [prompt_ids[i] for i in mine], sampling, [keys[i] for i in mine])
        return list(mine), out if self.is_leader else None

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
