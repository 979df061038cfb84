"""Weight sync by a transfer plan (issue 22 item 1; DESIGN.md "Weight sync by a transfer plan"):
for every HF tensor the rollout loads, the slice each rollout GPU loads and the training rank
that sends it, computed once from the HF config, the training layout and the rollout topology.
Pure Python + numpy: no process group, any world size (1024 ranks of DeepSeek-V3 in seconds).

    plan = transfer_plan(hf_config, Layout(tp=8, ep=256, etp=1, world_size=256),
                         rollout_topology(256, 8, 16), bucket_megabytes=512)
    plan.summary(nvlink_gbps=400, internode_gbps=50)  # planned vs today: bytes, messages, seconds
    plan.transfers(["model.layers.3.mlp.experts.7.down_proj.weight"])  # [Transfer(...)]

Where each slice sits (SGLang's rule, Megatron's pieces): engine/rollout/slices.py.

Senders: among the ranks holding a needed slice, the receiver itself (colocated: a copy on the
GPU, no network), else one on its node, else any; ties are rotated over member, engine and
position so the sending spreads; an expert comes only from the EP rank that owns it (and its
expert-DP replicas), once to each GPU that loads it. Each (sender, receiver) pair's slices are
one flattened stream cut into `bucket_megabytes` buckets: one message per bucket.

Time model (per sync, `summary`): links are full duplex and a GPU's intra-node (NVLink) and
inter-node (its NIC) traffic do not overlap, so GPU g takes
max(intra sent, intra received) / nvlink_gbps + max(inter sent, inter received) / internode_gbps,
and the sync the slowest GPU's time (GB = 1e9 bytes). Today (parallel/reshard.py): every piece
is broadcast to every rank, so each GPU receives the whole model less what it holds and, in a
ring, forwards as much; a broadcast across nodes runs at the per-GPU network rate. Its
messages are its broadcasts, one per training piece, each reaching every GPU.

Tests: tests/test_transfer_plan.py
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from engine.models.arch import arch_spec
from engine.models.weights import expected_hf_tensors, global_shapes, row_blocks
from engine.rollout.slices import (Box, RolloutShards, Shift, Slice, area, full_box, megatron_boxes, overlap, stage_of,
                                   to_hf_boxes, training_split, with_range)
from engine.rollout.topology import RolloutTopology

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
GB = 1e9


@dataclass(frozen=True)
class Transfer:
    """One slice of one HF tensor from a training rank to a rollout GPU (global ranks)."""
    hf_name: str
    box: Box
    sender: int
    receiver: int
    nbytes: int


@dataclass
class _Group:
    """HF tensors alike but for their member index (one layer's experts' w1, say), or one tensor."""
    names: Tuple[str, ...]                       # M names
    shape: Tuple[int, ...]
    pieces: List[Tuple[Box, np.ndarray]]         # training pieces: box, holders (M, h)
    sources: List[Tuple[str, Shift]]             # each piece's Megatron name (member 0) and shift
    needs: List[Optional[Box]]                   # the box rollout TP rank j loads (None: nothing)
    owner: Optional[np.ndarray]                  # (M, R) bool: which ranks load member m (rollout EP)
    replicated: bool


class TransferPlan:
    """The plan: see the module docstring. Build with `transfer_plan`."""

    def __init__(self, groups: List[_Group], *, R: int, receivers: np.ndarray, senders: int,
                 n_gpus: int, gpus_per_node: int, elt: int, bucket: int, megatron_pieces: int,
                 held: np.ndarray, separate_pool: bool):
        self.groups, self.R, self.elt, self.bucket = groups, R, elt, bucket
        self.receivers = receivers                # (engines, R): global rank of each rollout GPU
        self.n_train, self.n_gpus, self.gpus_per_node = senders, n_gpus, gpus_per_node
        self.megatron_pieces, self.held, self.separate_pool = megatron_pieces, held, separate_pool
        self.model_bytes = sum(len(g.names) * area(full_box(g.shape)) for g in groups) * elt
        self.replicated_bytes = sum(len(g.names) * area(full_box(g.shape)) for g in groups
                                    if g.replicated) * elt
        self._pairs, self._cache = None, {}

    @property
    def engines(self) -> int:
        return self.receivers.shape[0]

    def node(self, rank):
        return np.asarray(rank) // self.gpus_per_node

    def _senders(self, ordinal: int, j: int, holders: np.ndarray):
        """((M, engines) sender of each member to rollout rank j of each engine, a key naming it).

        Ties rotate with (member + engine + (j + ordinal) mod 8) mod h, so the tensors with the
        same holders share at most 8 choices per j: each is computed once."""
        m, h = holders.shape
        turn = (j + ordinal) % 8
        key = (id(holders), j, turn)
        hit = self._cache.get(key)
        if hit is not None:
            return hit, key
        recv = self.receivers[:, j]
        cand = holders[:, None, :]
        score = np.where(cand == recv[None, :, None], 0,
                         np.where(self.node(cand) == self.node(recv)[None, :, None], 1, 2))
        rot = (np.arange(m)[:, None] + np.arange(len(recv))[None, :] + turn) % h
        order = (np.arange(h)[None, None, :] - rot[:, :, None]) % h
        pick = np.argmin(score * h + order, axis=2)
        self._cache[key] = send = np.take_along_axis(holders, pick, axis=1)
        return send, key

    def _walk(self):
        """(group, member mask or None, position j, overlap box, senders (M, engines), key,
        piece index)."""
        for ordinal, g in enumerate(self.groups):
            for j, need in enumerate(g.needs):
                if need is None:
                    continue
                for pi, (box, holders) in enumerate(g.pieces):
                    part = overlap(need, box)
                    if part is not None:
                        mask = None if g.owner is None else g.owner[:, j]
                        yield (g, mask, j, part) + self._senders(ordinal, j, holders) + (pi,)

    def _units(self, g, whole: bool) -> List[Tuple[int, int, int, int]]:
        """A group cut into units of at most one bucket: (first member, end, first row, end).
        `whole`: a tensor is never cut by rows (a larger one is a unit of its own)."""
        rows = g.shape[0]
        row_bytes = area(full_box(g.shape)) // rows * self.elt
        full, M = rows * row_bytes, len(g.names)
        if full <= self.bucket or whole:
            k = max(1, self.bucket // full)
            return [(m, min(M, m + k), 0, rows) for m in range(0, M, k)]
        k = max(1, self.bucket // row_bytes)
        return [(m, m + 1, r, min(rows, r + k)) for m in range(M) for r in range(0, rows, k)]

    def rounds(self, whole_tensors: bool = False) -> List[List[Tuple[int, Tuple[int, int, int, int]]]]:
        """The sync's rounds, in order: consecutive units packed up to one bucket of HF tensor
        bytes, so no GPU receives more than a bucket in a round. [(group ordinal, unit)].
        `whole_tensors`: no tensor spans two rounds (backends that load whole HF tensors)."""
        out, current, room = [], [], self.bucket
        for ordinal, g in enumerate(self.groups):
            row_bytes = area(full_box(g.shape)) // g.shape[0] * self.elt
            for unit in self._units(g, whole_tensors):
                size = (unit[1] - unit[0]) * (unit[3] - unit[2]) * row_bytes
                if current and size > room:
                    out.append(current)
                    current, room = [], self.bucket
                current.append((ordinal, unit))
                room -= size
        return out + ([current] if current else [])

    def round_tensors(self, whole_tensors: bool = False) -> List[List[Tuple[str, Tuple[int, ...], str]]]:
        """Per round, the HF tensors it carries: (HF name, shape, Megatron source of member 0)."""
        out = []
        for units in self.rounds(whole_tensors):
            names = []
            for ordinal, (m0, m1, _, _) in units:
                g = self.groups[ordinal]
                names += [(g.names[m], g.shape, g.sources[0][0]) for m in range(m0, m1)
                          if not names or names[-1][0] != g.names[m]]
            out.append(names)
        return out

    def slices_of(self, rank: int, whole_tensors: bool = False) -> Tuple[List[List[tuple]], List[List[tuple]]]:
        """What `rank` sends and receives, per round (see `rounds`), in plan order, so both ends
        of a pair list their common slices alike: (sends, receives), each per round a list of
        (other rank, Slice). The diagonal (a GPU loading what it holds) is in both."""
        index = {}
        rounds = self.rounds(whole_tensors)
        for r, units in enumerate(rounds):
            for ordinal, unit in units:
                index.setdefault(ordinal, []).append((unit, r))
        nrounds = len(rounds)
        sends = [[] for _ in range(nrounds)]
        recvs = [[] for _ in range(nrounds)]
        ordinal_of = {id(g): i for i, g in enumerate(self.groups)}
        for g, mask, j, part, send, _, pi in self._walk():
            column = self.receivers[:, j]
            mine_in = np.nonzero(column == rank)[0]
            mine_out = np.argwhere(send == rank)
            if not mine_in.size and not mine_out.size:
                continue
            mname, shift = g.sources[pi]
            units = index[ordinal_of[id(g)]]

            def cut(mi):
                name = g.names[mi]
                source = mname if len(g.names) == 1 else mname.replace(".local_experts.0.", f".local_experts.{mi}.", 1)
                for (m0, m1, r0, r1), r in units:
                    if m0 <= mi < m1:
                        box = overlap(part, with_range(part, 0, r0, r1))
                        if box is not None:
                            yield r, Slice(name, box, source, shift)
            for ei in mine_in:
                for mi in range(len(g.names)):
                    if mask is None or mask[mi]:
                        for r, piece in cut(mi):
                            recvs[r].append((int(send[mi, ei]), piece))
            for mi, ei in mine_out:
                if mask is None or mask[mi]:
                    for r, piece in cut(mi):
                        sends[r].append((int(column[ei]), piece))
        return sends, recvs

    def pair_bytes(self) -> np.ndarray:
        """(n_gpus, n_gpus) bytes sender -> receiver per sync (the diagonal: copies on a GPU)."""
        if self._pairs is None:
            n = self.n_gpus
            pairs = np.zeros(n * n)
            same: Dict[tuple, list] = {}   # slices with the same senders and receivers: summed first
            for g, mask, j, part, send, key, _ in self._walk():
                entry = same.setdefault(key + (mask is not None,), [send, mask, j, 0])
                entry[3] += area(part) * self.elt
            keys, weights, size = [], [], 0
            for send, mask, j, nbytes in same.values():
                if mask is not None:
                    send = send[mask]
                keys.append((send * n + self.receivers[:, j][None, :]).ravel())
                weights.append(np.full(keys[-1].size, float(nbytes)))
                size += keys[-1].size
                if size > 4_000_000:
                    pairs += np.bincount(np.concatenate(keys), np.concatenate(weights), minlength=n * n)
                    keys, weights, size = [], [], 0
            if keys:
                pairs += np.bincount(np.concatenate(keys), np.concatenate(weights), minlength=n * n)
            self._pairs = pairs.reshape(n, n)
        return self._pairs

    def transfers(self, names: Optional[Iterable[str]] = None) -> List[Transfer]:
        """Every transfer (of the tensors `names`, default all) in plan order: slow at scale."""
        wanted = None if names is None else set(names)
        out = []
        for g, mask, j, part, send, _, _ in self._walk():
            for mi, name in enumerate(g.names):
                if (wanted is not None and name not in wanted) or (mask is not None and not mask[mi]):
                    continue
                out += [Transfer(name, part, int(s), int(r), area(part) * self.elt)
                        for s, r in zip(send[mi], self.receivers[:, j])]
        return out

    def buckets(self, sender: int, receiver: int) -> List[List[Tuple[Transfer, int, int]]]:
        """The flattened buckets of one pair: [(transfer, first byte, bytes in this bucket)]."""
        out, current, room = [], [], self.bucket
        for t in self.transfers():
            if (t.sender, t.receiver) != (sender, receiver):
                continue
            done = 0
            while done < t.nbytes:
                n = min(room, t.nbytes - done)
                current.append((t, done, n))
                done, room = done + n, room - n
                if room == 0:
                    out.append(current)
                    current, room = [], self.bucket
        return out + ([current] if current else [])

    def summary(self, nvlink_gbps: float = 400.0, internode_gbps: float = 50.0) -> dict:
        """Per sync, planned vs today: GB received / sent per GPU (max, mean), messages, seconds."""
        pairs = self.pair_bytes()
        n, gpus = self.n_gpus, np.unique(self.receivers)
        local = np.diag(pairs).copy()
        net = pairs.copy()
        np.fill_diagonal(net, 0.0)
        same = self.node(np.arange(n))[:, None] == self.node(np.arange(n))[None, :]
        intra, inter = np.where(same, net, 0.0), np.where(same, 0.0, net)
        seconds = (np.maximum(intra.sum(0), intra.sum(1)) / (nvlink_gbps * GB)
                   + np.maximum(inter.sum(0), inter.sum(1)) / (internode_gbps * GB))
        recv, sent = net.sum(0), net.sum(1)
        msgs = np.ceil(net / self.bucket)
        loaded = recv[gpus] + local[gpus]
        senders = np.arange(self.n_train)
        planned = dict(recv_gb_max=recv[gpus].max() / GB, recv_gb_mean=recv[gpus].mean() / GB,
                       sent_gb_max=sent[senders].max() / GB, sent_gb_mean=sent[senders].mean() / GB,
                       loaded_gb_max=loaded.max() / GB, local_gb_max=local[gpus].max() / GB,
                       messages=int(msgs.sum()), messages_per_gpu_max=int(msgs.sum(0).max()),
                       seconds=float(seconds.max()))
        # today: every GPU (training ranks and a separate pool's) receives the whole model less
        # what it holds; a ring broadcast forwards as much as it receives
        held = np.zeros(n)
        held[:self.n_train] = self.held
        today_recv = self.model_bytes - held
        rate = (internode_gbps if n > self.gpus_per_node else nvlink_gbps) * GB
        today = dict(recv_gb_max=today_recv.max() / GB, recv_gb_mean=today_recv.mean() / GB,
                     sent_gb_max=today_recv.max() / GB, sent_gb_mean=today_recv.mean() / GB,
                     messages=self.megatron_pieces, messages_per_gpu_max=self.megatron_pieces,
                     seconds=float(today_recv.max() / rate))
        def r(d):
            return {k: (round(float(v), 3) if isinstance(v, float) else v) for k, v in d.items()}
        return dict(model_gb=round(self.model_bytes / GB, 3),
                    replicated_gb=round(self.replicated_bytes / GB, 3),
                    rollout_tp=self.R, engines=self.engines, separate_pool=self.separate_pool,
                    bucket_mb=self.bucket / (1 << 20), nvlink_gbps=nvlink_gbps,
                    internode_gbps=internode_gbps, today=r(today), planned=r(planned))


def transfer_plan(hf_config, layout, topology: RolloutTopology, *, bytes_per_element: int = 2,
                  bucket_megabytes: float = 512, attention_dp: int = 1, rollout_ep: int = 1,
                  separate_pool: bool = False) -> TransferPlan:
    """The transfer plan of `hf_config` trained at `layout` (parallel.mesh.Layout, world_size
    set) into the rollout engines of `topology`: colocated (rollout GPU g is training rank g), or
    with `separate_pool` on the ranks after the training ones (topology counts from 0 there)."""
    W = layout.world_size
    if not separate_pool and topology.world_size != W:
        raise ValueError(f"colocated: the rollout topology covers {topology.world_size} ranks, "
                         f"the training layout {W}")
    layout.check(W)
    spec = arch_spec(hf_config)
    t = spec.transformer
    L, experts = t["num_layers"], spec.num_experts or 0
    tp, pp, ep, etp = layout.tp, layout.pp, layout.ep, layout.expert_tp
    S = W // pp                                 # ranks per stage
    edp = S // (ep * etp)
    R = topology.tp
    offset = W if separate_pool else 0
    receivers = offset + np.array([g.ranks for g in topology.groups])
    rollout = RolloutShards(R, attention_dp, rollout_ep, t.get("kv_channels") or 1, experts)
    hf_shapes = expected_hf_tensors(hf_config)

    memo: Dict[tuple, np.ndarray] = {}

    def holders(stages, t_index, count, expert_owner=None):
        """(M, h) ranks holding piece t_index: one array per distinct answer (plans key on it)."""
        key = (tuple(stages), t_index, count, expert_owner is not None)
        if key not in memo:
            memo[key] = _holders(stages, t_index, count, expert_owner)
        return memo[key]

    def _holders(stages, t_index, count, expert_owner):
        out = []
        for p in stages:
            if expert_owner is not None:   # (E,) EP rank of each expert
                base = p * S + (t_index if count > 1 else 0) + etp * expert_owner
                out.append(base[:, None] + etp * ep * np.arange(edp)[None, :])
            elif count > 1:
                out.append((p * S + t_index + tp * np.arange(S // tp))[None, :])
            else:
                out.append((p * S + np.arange(S))[None, :])
        return np.concatenate(out, axis=1)

    groups: List[_Group] = []
    held = np.zeros(W)
    pieces_count = 0
    owner_of = np.arange(experts) // max(1, experts // ep) if experts else None
    for gname, shape in global_shapes(hf_config).items():
        m = _LAYER.match(gname)
        e = _EXPERT.search(gname)
        if e and e.group(1) != "0":
            continue
        rest = m.group(2) if m else gname
        if m:
            stages = [stage_of(int(m.group(1)), L, pp, layout.vpp)]
        elif gname.startswith("embedding"):
            stages = sorted({0, pp - 1}) if spec.tie_word_embeddings else [0]
        else:
            stages = [pp - 1]
        dim, gated = training_split(rest)
        count = (etp if e else tp) if dim is not None else 1
        M = experts if e else 1
        pieces_count += M * count
        blocks = row_blocks(hf_config, gname)
        per_hf: Dict[str, List[Tuple[Box, np.ndarray, Shift]]] = {}
        for ti in range(count):
            h = holders(stages, ti, count, owner_of if e else None)
            for mbox, base in megatron_boxes(shape, dim, gated, count, ti):
                for name, boxes in to_hf_boxes(blocks, mbox, base).items():
                    for box, shift in boxes:
                        per_hf.setdefault(name, []).append((box, h, shift))
                        np.add.at(held, h.ravel(), area(box) * bytes_per_element)
        for name, pieces in per_hf.items():
            hf_shape = hf_shapes[name]
            needs, replicated = rollout.need(name, hf_shape)
            names = ((name,) if not e else
                     tuple(name.replace(".experts.0.", f".experts.{x}.", 1) for x in range(experts)))
            groups.append(_Group(names, hf_shape, [(b, h) for b, h, _ in pieces], [(gname, sh) for *_, sh in pieces],
                                 needs, rollout.owner(M) if e else None, replicated))
    return TransferPlan(groups, R=R, receivers=receivers, senders=W,
                        n_gpus=W + (topology.world_size if separate_pool else 0),
                        gpus_per_node=topology.gpus_per_node, elt=bytes_per_element,
                        bucket=max(1, int(bucket_megabytes * (1 << 20))),
                        megatron_pieces=pieces_count, held=held, separate_pool=separate_pool)
