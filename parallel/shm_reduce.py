"""Same-host gradient collectives through shared memory, for gloo groups on the CPU.

On one machine gloo moves an all-reduce through loopback TCP: each rank sends and receives
(W-1)/W of the tensor twice through the kernel (2.9 M floats between two ranks: ~9 ms here).
Through one shared-memory segment the same reduction is three copies and two barriers (~3.7 ms):
each rank publishes the chunks of its tensor it does not own, sums the chunk it owns (its own
values first, then the other ranks' in rank order), publishes that sum and copies the other
owners' sums back. Every rank ends with the same bits; with two ranks they are gloo's bits too
(a + b = b + a in floating point), with more a fixed order of the same sum. A reduce-scatter is
the first half of that, an all-gather the second.

`register(group)` (parallel/mesh.py, for the CPU's data-parallel gradient group) sets up the
segment once, collectively, and wraps torch.distributed's `all_reduce`, `reduce_scatter_tensor`
and `all_gather_into_tensor` (and megatron-core's own names for the last two, which
param_and_grad_buffer.py binds at import): a synchronous call on a registered group with
contiguous CPU tensors of at least `MIN_ELEMENTS` takes this path when it is a SUM of float32 /
float64 (DDP's gradient all-reduce; the distributed optimizer's reduce-scatter) or a gather of any
dtype (its parameter all-gather); every other call goes to gloo unchanged. A group whose ranks
are on several hosts, or a /dev/shm without room, stays on gloo.

Tests: tests/test_shm_reduce.py
"""
import os
import socket
import uuid

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
MIN_ELEMENTS = 1 << 16  # below this gloo's latency, not its bandwidth, is the cost
SEGMENT_BYTES = 64 << 20  # both turns of all ranks' slots; larger tensors go in pieces
_DTYPES = (torch.float32, torch.float64)

_GROUPS = {}  # process group -> _Segment
_TORCH = {}  # torch.distributed's functions before `register` wrapped them


class _Segment:
    """One mapping of the shared file: two turns of a slot of `slot_bytes` per group rank.
    Consecutive pieces alternate turns, so a rank may publish its next piece while a slower
    one still reads the last: a piece's first barrier orders it after the piece two before."""

    def __init__(self, path, world, rank, slot_bytes):
        self.world, self.rank, self.slot_bytes = world, rank, slot_bytes
        self.bytes = torch.from_file(path, shared=True, size=2 * world * slot_bytes, dtype=torch.uint8)
        self.turn = 0

    def slots(self, dtype, n):
        """[world, n] views of this turn's slots as `dtype`; the next call gets the other turn."""
        half = self.bytes.view(2, self.world, self.slot_bytes)[self.turn]
        self.turn ^= 1
        return half[:, :n * dtype.itemsize].view(dtype)


def chunk_bounds(n, world):
    """[lo, hi) of the chunk each rank owns in an all-reduce of n elements."""
    return [(n * c // world, n * (c + 1) // world) for c in range(world)]


def _sum_own(seg, group, slots, parts, offsets, out):
    """The reduce-scatter half, in one turn of the slots: this rank publishes its values of the
    chunks other ranks own (`parts[c]` at `offsets[c]` of its slot), then `out` gets the sum
    over ranks of the chunk it owns: its own values first, then the others' in rank order (`out`
    may be `parts[rank]` itself)."""
    for c, part in enumerate(parts):
        if c != seg.rank:
            slots[seg.rank, offsets[c]:offsets[c] + part.numel()].copy_(part)
    dist.barrier(group=group)
    lo = offsets[seg.rank]
    out.copy_(parts[seg.rank])  # harmless when they are the same memory
    for q in range(seg.world):
        if q != seg.rank:
            out.add_(slots[q, lo:lo + out.numel()])


def _gather_others(seg, group, slots, own, parts, offsets):
    """The all-gather half, in one turn: this rank publishes `own` at `offsets[rank]` of its
    slot, then `parts[c]` gets rank c's for every other rank c."""
    lo = offsets[seg.rank]
    slots[seg.rank, lo:lo + own.numel()].copy_(own)
    dist.barrier(group=group)
    for c, part in enumerate(parts):
        if c != seg.rank:
            part.copy_(slots[c, offsets[c]:offsets[c] + part.numel()])


def all_reduce_shared(tensor, group):
    """SUM-all-reduce `tensor` (contiguous, CPU, float32 / float64) over registered `group`:
    per piece, both halves in one turn (a rank's own chunk of its slot, unused by the first
    half, carries its sum to the others)."""
    seg = _GROUPS[group]
    flat = tensor.view(-1)
    step = seg.slot_bytes // tensor.element_size()
    for start in range(0, flat.numel(), step):
        piece = flat[start:start + step]
        bounds = chunk_bounds(piece.numel(), seg.world)
        parts, offsets = [piece[lo:hi] for lo, hi in bounds], [lo for lo, _ in bounds]
        slots = seg.slots(tensor.dtype, piece.numel())
        _sum_own(seg, group, slots, parts, offsets, parts[seg.rank])
        _gather_others(seg, group, slots, parts[seg.rank], parts, offsets)


def reduce_scatter_shared(output, tensor, group):
    """output = the SUM over `group` of row `rank` of `tensor` viewed as [world, output.numel()]
    (torch's reduce_scatter_tensor; `output` may be that row of `tensor` itself)."""
    seg = _GROUPS[group]
    rows, out = tensor.view(seg.world, -1), output.view(-1)
    step = seg.slot_bytes // tensor.element_size() // seg.world
    for start in range(0, rows.shape[1], step):
        parts = list(rows[:, start:start + step])
        n = parts[0].numel()
        slots = seg.slots(tensor.dtype, seg.world * n)
        _sum_own(seg, group, slots, parts, [c * n for c in range(seg.world)], out[start:start + n])


def all_gather_shared(output, tensor, group):
    """Row q of `output` viewed as [world, tensor.numel()] = rank q's `tensor` (torch's
    all_gather_into_tensor; `tensor` may be this rank's row of `output` itself). Any dtype."""
    seg = _GROUPS[group]
    rows, flat = output.view(seg.world, -1), tensor.view(-1)
    step = seg.slot_bytes // tensor.element_size()
    for start in range(0, flat.numel(), step):
        own, parts = flat[start:start + step], list(rows[:, start:start + step])
        slots = seg.slots(tensor.dtype, own.numel())
        _gather_others(seg, group, slots, own, parts, [0] * seg.world)
        parts[seg.rank].copy_(own)  # harmless when they are the same memory


def takes(tensor, op, group, async_op, out=None, reduce=True):
    """Whether this call (an all-reduce; a reduce-scatter / all-gather with `out`, the larger
    side `tensor`) goes through shared memory."""
    if not (group in _GROUPS and not async_op and tensor.device.type == "cpu"
            and tensor.is_contiguous() and tensor.numel() >= MIN_ELEMENTS):
        return False
    if reduce and not (op == dist.ReduceOp.SUM and tensor.dtype in _DTYPES):
        return False
    return out is None or (out.device.type == "cpu" and out.is_contiguous() and out.dtype == tensor.dtype
                           and tensor.numel() == out.numel() * _GROUPS[group].world)


def _all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if takes(tensor, op, group, async_op):
        return all_reduce_shared(tensor, group)
    return _TORCH["all_reduce"](tensor, op=op, group=group, async_op=async_op)


def _reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if takes(input, op, group, async_op, out=output):
        return reduce_scatter_shared(output, input, group)
    return _TORCH["reduce_scatter_tensor"](output, input, op=op, group=group, async_op=async_op)


def _all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    if takes(output_tensor, None, group, async_op, out=input_tensor, reduce=False):
        return all_gather_shared(output_tensor, input_tensor, group)
    return _TORCH["all_gather_into_tensor"](output_tensor, input_tensor, group=group, async_op=async_op)


_WRAPPERS = {"all_reduce": _all_reduce, "reduce_scatter_tensor": _reduce_scatter_tensor,
             "all_gather_into_tensor": _all_gather_into_tensor}
# megatron-core's names for torch's functions, bound when param_and_grad_buffer.py is imported
_MEGATRON_NAMES = {"dist_reduce_scatter_func": "reduce_scatter_tensor",
                   "dist_all_gather_func": "all_gather_into_tensor"}


def _wrap():
    """Once per process: torch.distributed's functions, and megatron-core's bindings of them."""
    if _TORCH:
        return
    from megatron.core.distributed import param_and_grad_buffer as buffers
    for name, wrapper in _WRAPPERS.items():
        _TORCH[name] = getattr(dist, name)
        setattr(dist, name, wrapper)
    for alias, name in _MEGATRON_NAMES.items():
        if getattr(buffers, alias, None) is _TORCH[name]:  # else megatron chose another (fp32 RS)
            setattr(buffers, alias, _WRAPPERS[name])


def segment_bytes(free, world):
    """The segment's size: SEGMENT_BYTES, or a quarter of what the shared-memory file system has
    free when that is less (a container's /dev/shm is 64 MiB by default); 0 (gloo) when a slot
    would hold fewer than MIN_ELEMENTS floats."""
    unit = 2 * world * 64  # two turns of `world` slots, each a multiple of 64 bytes
    size = min(SEGMENT_BYTES, free // 4) // unit * unit
    return size if size // (2 * world) >= 4 * MIN_ELEMENTS else 0


def _open(group):
    """The group's segment, or None for all its ranks alike (collective over `group`)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1 or dist.get_backend(group) != "gloo":
        return None  # nothing to reduce; or not gloo (torch's fake backend builds models on meta)
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) != 1:
        return None
    name = ["", 0]  # the file, a slot's bytes
    if rank == 0:
        path = os.path.join(SHM_DIR, f"trident-reduce-{uuid.uuid4().hex}")
        try:
            room = os.statvfs(SHM_DIR)
            size = segment_bytes(room.f_bavail * room.f_frsize, world)
            if size:
                with open(path, "wb") as f:
                    f.truncate(size)
                name = [path, size // (2 * world)]
        except OSError:
            pass
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    if not name[0]:
        return None
    seg, failed = None, torch.zeros(1)
    try:
        seg = _Segment(name[0], world, rank, name[1])
    except (OSError, RuntimeError):
        failed += 1
    dist.all_reduce(failed, group=group)  # every rank has tried to map it
    if rank == 0:
        os.unlink(name[0])  # the mappings stay; no file is left behind, whatever happens next
    return seg if int(failed) == 0 else None


def register(group):
    """Collective over `group`: its gradient collectives go through shared memory when its
    ranks share a host. Returns whether they will."""
    if group in _GROUPS:
        return True
    seg = _open(group)
    if seg is None:
        return False
    _GROUPS[group] = seg
    _wrap()
    return True


def forget_all():
    """Drop every registration (the groups are being destroyed: parallel/mesh.py)."""
    _GROUPS.clear()
