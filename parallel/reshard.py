"""Hybrid engine, training side: the full (unsharded) tensors of a training layout, streamed to
every rank bucket by bucket.

Every rank's rollout engine needs the whole model (SGLang shards it again by its own TP), while
training holds only pieces of it: TP / expert-TP pieces, one PP stage (or several virtual
stages), one EP rank's experts. `iter_buckets` turns those pieces into full tensors under their
global Megatron names, a bounded bucket at a time, so no rank ever holds a second copy of the
model: the extra memory a rank allocates is at most one bucket (the planner counts the full
tensors of the bucket plus the one staging piece that row-parallel pieces need).

How: a `ReshardPlan` is built once from metadata (one `all_gather_object` of every rank's
`Shard`s; the layout does not change between syncs, so keep it). For every global tensor, in a
fixed global order, each piece is broadcast from one rank that holds it (spread over DP / tied
replicas) straight into its place in the full tensor, so TP, ETP, EP and PP need no other
collective and no intermediate copy. A tensor every rank already holds whole (e.g. norms
without PP) is yielded as is, with no communication. Collectives run on the default group and
work on gloo and NCCL.

Model-agnostic: names stay Megatron's global names; engine/models maps them to HF names.

Tests: tests/test_reshard.py
"""
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from parallel import fsdp
from parallel.shards import local_shards


@dataclass(frozen=True)
class TensorPlan:
    """One global tensor: how it is cut and which rank sends each piece."""
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    dim: Optional[int]            # split dimension (None: one piece)
    gated: bool                   # [gate; up] rows, each half split into `len(sources)` pieces
    sources: Tuple[int, ...]      # global rank that broadcasts piece i
    held_by_all: bool             # one piece that every rank holds: nothing to send

    @property
    def count(self):
        return len(self.sources)

    @property
    def nbytes(self):
        return _numel(self.shape) * _itemsize(self.dtype)

    @property
    def staging_bytes(self):
        """A piece that is not contiguous inside the full tensor is received into a buffer first."""
        if self.count == 1 or _contiguous_region(self.shape, self.dim):
            return 0
        return self.nbytes // self.count

    @property
    def alloc_bytes(self):
        """The most a rank allocates for this tensor (a source of a single piece allocates less)."""
        return 0 if self.held_by_all else self.nbytes


@dataclass(frozen=True)
class Bucket:
    tensors: Tuple[TensorPlan, ...]

    @property
    def nbytes(self):
        """Bytes of the full tensors yielded."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def peak_bytes(self):
        """The most a rank allocates while building this bucket (full tensors + staging)."""
        peak = alive = 0
        for t in self.tensors:
            alive += t.alloc_bytes
            peak = max(peak, alive + t.staging_bytes)
        return peak

    @property
    def size_bytes(self):
        """What the planner bounds: the yielded bytes (the consumer may convert them, SGLang
        receives them in one message) and the allocation peak."""
        return max(self.nbytes + max(t.staging_bytes for t in self.tensors), self.peak_bytes)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()


def _contiguous_region(shape, dim):
    """Whether a slice along `dim` of a contiguous tensor of `shape` is itself contiguous."""
    return dim is None or _numel(shape[:dim]) == 1


def _natural_key(name):
    # decoder.layers.2 before decoder.layers.10; re.split alternates text and numbers
    return [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name))]


@dataclass(frozen=True)
class ReshardPlan:
    """Every global tensor of the model, in a fixed global order (the same on every rank)."""
    tensors: Tuple[TensorPlan, ...]

    @classmethod
    def build(cls, chunks, select: Optional[Callable[[str], bool]] = None) -> "ReshardPlan":
        """Collective over all ranks: one all_gather_object of this rank's shard metadata.
        `select(global_name)`: only those tensors (e.g. a LoRA model's base weights)."""
        mine = [(s.global_name, s.global_shape, param.dtype, s.dim, s.index, s.count, s.gated)
                for param, s in local_shards(chunks) if select is None or select(s.global_name)]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        world = len(every)
        meta: Dict[str, tuple] = {}
        holders: Dict[str, Dict[int, List[int]]] = {}
        for rank, entries in enumerate(every):
            for name, shape, dtype, dim, index, count, gated in entries:
                layout = (tuple(shape), dtype, dim, count, gated)
                if meta.setdefault(name, layout) != layout:
                    raise ValueError(f"{name}: ranks disagree on its layout ({meta[name]} vs {layout} on "
                                     f"rank {rank}); every rank must build the model from the same config")
                ranks = holders.setdefault(name, {}).setdefault(index, [])
                if rank not in ranks:
                    ranks.append(rank)
        tensors = []
        for position, name in enumerate(sorted(meta, key=_natural_key)):
            shape, dtype, dim, count, gated = meta[name]
            pieces = holders[name]
            if sorted(pieces) != list(range(count)):
                raise ValueError(f"{name}: no rank holds piece(s) {sorted(set(range(count)) - set(pieces))} "
                                 f"of {count}; the model chunks do not cover the layout")
            # spread the sending over replicas (DP, tied copies) so no one rank sends everything
            sources = tuple(pieces[i][(position + i) % len(pieces[i])] for i in range(count))
            held_by_all = count == 1 and len(pieces[0]) == world
            tensors.append(TensorPlan(name, shape, dtype, dim if count > 1 else None, gated and count > 1,
                                      sources, held_by_all))
        return cls(tuple(tensors))

    @property
    def nbytes(self):
        return sum(t.nbytes for t in self.tensors)

    def buckets(self, bucket_bytes: int) -> List[Bucket]:
        """Consecutive tensors grouped so each bucket's `size_bytes` stays within `bucket_bytes`
        (a tensor larger than that is a bucket of its own)."""
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes!r}: must be a positive number of bytes "
                             f"(e.g. 512 << 20 for 512 MiB)")
        out, current = [], []
        for t in self.tensors:
            if current and Bucket(tuple(current + [t])).size_bytes > bucket_bytes:
                out.append(Bucket(tuple(current)))
                current = []
            current.append(t)
        if current:
            out.append(Bucket(tuple(current)))
        return out


class MemoryCounter:
    """Bytes reshard has allocated and not yet freed on this rank; `peak` is their maximum."""

    def __init__(self):
        self.alive = 0
        self.peak = 0

    def add(self, nbytes):
        self.alive += nbytes
        self.peak = max(self.peak, self.alive)

    def sub(self, nbytes):
        self.alive -= nbytes


def plan_buckets(chunks, bucket_bytes: int, plan: Optional[ReshardPlan] = None) -> List[Bucket]:
    """The buckets `iter_buckets` will yield (collective unless `plan` is given)."""
    return (plan or ReshardPlan.build(chunks)).buckets(bucket_bytes)


def _regions(full: torch.Tensor, plan: TensorPlan, index: int):
    """Views of `full` that piece `index` fills, in the order of the piece's own rows."""
    if plan.count == 1:
        return [full]
    size = plan.shape[plan.dim]
    if plan.gated:
        half = size // 2
        piece = half // plan.count
        return [full.narrow(plan.dim, start + index * piece, piece) for start in (0, half)]
    piece = size // plan.count
    return [full.narrow(plan.dim, index * piece, piece)]


def _piece_parts(local: torch.Tensor, plan: TensorPlan):
    """The local piece cut like `_regions` (gated: its gate rows, then its up rows)."""
    return list(local.chunk(2, dim=plan.dim)) if plan.gated else [local]


def _materialise(plan: TensorPlan, local: Dict[Tuple[str, int], torch.Tensor], rank: int,
                 device, counter: MemoryCounter) -> torch.Tensor:
    """The full tensor on this rank (collective); its bytes are added to `counter`."""
    mine = local.get((plan.name, 0))
    if plan.held_by_all:
        return mine
    if plan.count == 1 and plan.sources[0] == rank:
        dist.broadcast(mine.contiguous(), src=rank)  # params are contiguous: no copy
        return mine
    full = torch.empty(plan.shape, dtype=plan.dtype, device=device)
    counter.add(plan.nbytes)
    staging = None
    for index, src in enumerate(plan.sources):
        regions = _regions(full, plan, index)
        if src == rank:
            for region, part in zip(regions, _piece_parts(local[(plan.name, index)], plan)):
                part = part.contiguous()
                dist.broadcast(part, src=src)
                region.copy_(part)
            continue
        for region in regions:
            if region.is_contiguous():
                dist.broadcast(region, src=src)
            else:
                if staging is None:
                    staging = torch.empty(region.shape, dtype=plan.dtype, device=device)
                    counter.add(staging.numel() * staging.element_size())
                dist.broadcast(staging, src=src)
                region.copy_(staging)
    if staging is not None:
        counter.sub(staging.numel() * staging.element_size())
    return full


def iter_buckets(chunks, bucket_bytes: int, plan: Optional[ReshardPlan] = None,
                 counter: Optional[MemoryCounter] = None) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Yield lists of (global name, full tensor) covering the whole model once, on every rank.

    Collective over all ranks: every rank must drive the iterator to the end. Each yielded list
    is emptied when the iterator advances, so its tensors are freed even if the caller still
    holds the list: copy out what you need before asking for the next bucket. Tensors that this
    rank holds whole may be its parameters themselves: treat every tensor as read-only.
    `plan` (from `ReshardPlan.build`, reusable while the layout is unchanged) skips the
    metadata exchange; `counter` receives the bytes allocated (for tests and benchmarks).
    """
    plan = plan or ReshardPlan.build(chunks)
    buckets = plan.buckets(bucket_bytes)
    counter = counter or MemoryCounter()
    shards = local_shards(chunks)
    local = {(s.global_name, s.index): fsdp.value(param).detach() for param, s in shards}
    device = shards[0][0].device if shards else torch.device("cpu")
    rank = dist.get_rank()
    for bucket in buckets:
        before = counter.alive
        # no loop variable may keep a tensor of this bucket alive into the next one
        out = [(t.name, _materialise(t, local, rank, device, counter)) for t in bucket.tensors]
        yield out
        out.clear()
        counter.sub(counter.alive - before)
