"""Weight sync by the transfer plan (issue 22 item 2): each rollout GPU receives only the slices
its engine's TP rank loads, from a training rank that holds them (engine/rollout/transfer.py),
where today's path (engine/rollout/colocated.py: `sync_weights`) materialises every full tensor
on every rank.

A sync runs the plan's rounds in order (each at most one bucket of HF bytes, so no rank receives
more than a bucket in a round). In a round, rank r exchanges with each peer in turn, step
d = 1 .. world-1 sending to r + d and receiving from r - d (the two ends of every pair meet in
the same step, so nothing deadlocks): one flattened message per (sender, receiver) pair and
round, skipped where the pair has nothing. What a rank holds itself it hands over as views of
its own parameters (no copy). Then the round's slices go to the rollout group's engine
(`load_slices`: collective in the group), and the received buffers are dropped.

Extra memory per rank: the round's received slices (<= one bucket) and one packed message being
sent (<= one bucket): `bucket_megabytes` / 2 each (the plan is built with half the bucket).

Scope: a colocated rollout whose backend loads slices (`RolloutEngine.LOADS_SLICES`); a LoRA
actor (merged weights), a separate pool, and backends loading full HF tensors keep the
full-tensor path. Slices travel in the training parameters' dtype (one dtype per model).

Tests: tests/test_delivery.py
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Dict

import torch
import torch.distributed as dist

from engine.rollout.transfer import TransferPlan
from parallel import fsdp
from parallel.cpu import suspended
from parallel.shards import local_shards

_BUFFER = re.compile(r"\.router\.expert_bias$")


@dataclass(frozen=True)
class DeliveryStats:
    bytes: int          # bytes this rank handed to its rollout engine (received + local)
    received: int       # of which from other ranks
    sent: int           # bytes it sent to other ranks
    local: int          # bytes it handed over from its own parameters (no network)
    messages: int       # messages it received
    rounds: int
    seconds: float
    peak_bytes: int     # most bytes of buffers held at once (received + one packed message)

    def metrics(self):
        """What a step logs of its sync (the phase times it): GB handed to the engine, of which
        received from other ranks."""
        return {"perf/update_weights_gb": self.bytes / 1e9, "perf/update_weights_received_gb": self.received / 1e9}


class Delivery:
    """This rank's part of the plan, resolved against its model once (the layout is fixed)."""

    def __init__(self, plan: TransferPlan, chunks, whole_tensors: bool = False):
        self.rank, self.world, self.plan = dist.get_rank(), dist.get_world_size(), plan
        self.params: Dict[str, torch.Tensor] = {s.global_name: p for p, s in local_shards(chunks)}
        dtypes = {p.dtype for p in self.params.values()}
        if len(dtypes) != 1:
            raise ValueError(f"the transfer plan sends one dtype per model; this rank holds {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.device = next(iter(self.params.values())).device  # NCCL sends device tensors
        # per round, the HF tensors (name, shape) it carries: a backend loading whole tensors
        # gets each in one round (`whole_tensors`)
        self.tensors = [[(n, shape) for n, shape, source in names if not _BUFFER.search(source)]
                        for names in plan.round_tensors(whole_tensors)]
        sends, recvs = plan.slices_of(self.rank, whole_tensors)
        # per round, {peer: [Slice]} in plan order. The router's expert bias is a buffer, not a
        # parameter: like the full-tensor path, the sync leaves it out (the rollout keeps the
        # bias it was built with)
        self.sends, self.recvs = [_by_peer(r) for r in sends], [_by_peer(r) for r in recvs]
        for by_peer in self.sends:
            for piece in (p for ps in by_peer.values() for p in ps):
                held = self.params.get(piece.source)
                inside = held is not None and all(
                    0 <= s.start < s.stop <= n for s, n in zip(piece.local(), held.shape))
                if not inside:
                    what = f"shape {tuple(held.shape)}" if held is not None else "no such tensor"
                    raise ValueError(f"the transfer plan has rank {self.rank} send {piece.hf_name} {piece.box} "
                                     f"from {piece.source} at {piece.local()}, which its model does not hold "
                                     f"({what}): the layout and the plan disagree")

    @torch.no_grad()
    @suspended()  # plain tensor copies and sends: no Megatron code, no device rewrite on CPU
    def run(self, group) -> DeliveryStats:
        """Collective over all ranks: every round's slices into `group` (its `load_slices`)."""
        start = time.perf_counter()
        received = sent = local = messages = peak = 0
        group.begin_sync()
        for out, inc, tensors in zip(self.sends, self.recvs, self.tensors):
            pieces = [(p.hf_name, p.box, fsdp.value(self.params[p.source])[p.local()]) for p in out.get(self.rank, ())]
            local += sum(t.numel() * t.element_size() for *_, t in pieces)
            held = 0
            for d in range(1, self.world):
                to, frm = (self.rank + d) % self.world, (self.rank - d) % self.world
                outgoing, incoming = out.get(to), inc.get(frm)
                reqs, pack, packed = [], None, 0
                if outgoing:
                    views = [fsdp.value(self.params[p.source])[p.local()] for p in outgoing]
                    if len(views) == 1 and views[0].is_contiguous():
                        pack = views[0]  # one contiguous slice: sent in place, no copy
                    else:
                        pack = torch.cat([v.reshape(-1) for v in views])
                        packed = pack.numel() * pack.element_size()
                    reqs.append(dist.isend(pack, to))
                    sent += pack.numel() * pack.element_size()
                if incoming:
                    buf = torch.empty(sum(_numel(p.shape) for p in incoming), dtype=self.dtype, device=self.device)
                    reqs.append(dist.irecv(buf, frm))
                    offset = 0
                    for p in incoming:
                        n = _numel(p.shape)
                        pieces.append((p.hf_name, p.box, buf[offset:offset + n].view(p.shape)))
                        offset += n
                    held += buf.numel() * buf.element_size()
                    received += buf.numel() * buf.element_size()
                    messages += 1
                peak = max(peak, held + packed)
                for req in reqs:
                    req.wait()
            group.load_slices(pieces, tensors, dtype=self.dtype, device=self.device)
        group.finish_sync()
        return DeliveryStats(bytes=received + local, received=received, sent=sent, local=local, messages=messages,
                             rounds=len(self.sends), seconds=time.perf_counter() - start, peak_bytes=peak)


def _by_peer(entries) -> Dict[int, list]:
    out: Dict[int, list] = {}
    for peer, piece in entries:
        if not _BUFFER.search(piece.source):
            out.setdefault(peer, []).append(piece)
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def transfer_plan_for(hf_config, layout, topology, chunks, bucket_megabytes: float) -> TransferPlan:
    """The colocated plan for this model, its buckets half the sync's (received + one packed
    message <= `bucket_megabytes`)."""
    from engine.rollout.transfer import transfer_plan
    params = [p for p, _ in local_shards(chunks)]
    elt = params[0].element_size() if params else 2
    return transfer_plan(hf_config, layout, topology, bytes_per_element=elt,
                         bucket_megabytes=bucket_megabytes / 2)

