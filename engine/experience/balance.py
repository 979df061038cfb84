"""Balanced DP ranks (`trainer.balance_batch`, verl's key): a step's rows reordered over the
data-parallel ranks so that every rank holds about as many tokens, without changing the update.

Without it a step's prompts are split contiguously, and with long chain-of-thought responses the
rank that drew the long ones makes every other rank wait, in every pass of the step (old / ref
log-probs, values, both updates). Right after the batch is collected (before scoring, so a
reward model's pass is balanced too) whole *units* of rows move between DP ranks:

* A unit is whole prompt groups (the consecutive rows sharing a uid: group advantages are
  computed on one rank), and whole runs of the mini-batch layout. A rank's mini-batch k holds
  rows k, k+m, k+2m, ... of its n rows (m mini-batches; engine/workers/template.py
  mini_batch_layout), so a unit of L = lcm(group size, m_actor, m_critic) rows at a multiple of
  L holds the same places of the same runs wherever it lands: every global mini-batch keeps
  the same sequences, and the update is the unbalanced one up to fp32 summation order. (A
  layout of contiguous chunks, n not a multiple of the mini-batch, only lets a unit move to
  the same slot class: units are matched by the mini-batches their rows fall in.) With
  actor.shuffle each row keeps its step position in `step_row`, whose key orders its run.
* Every rank keeps the same number of units of each class (so the mini-batch plan holds), and
  the units are partitioned to minimise the largest token count: longest first onto the
  lightest rank with room, then swaps between the heaviest and a lighter rank while they lower
  it. The cost of a unit is its tokens (prompt + response, attention_mask), verl's measure;
  attention's quadratic term is left out (a token count is what the log reports and what the
  MLPs, most of a step's FLOPs at these lengths, pay for).
* The partition is computed by every rank from the all-gathered token counts (the same on each:
  a DP replica's TP / PP / CP ranks hold the same rows), the partitions are matched to the ranks
  that already hold most of their units, and only the moved units travel, point to point
  between the same positions of two DP replicas (as dynamic sampling's reshard). Every field
  moves (tensors, uid, ground_truth, extra_info, routed experts); per-batch meta stays.

Logged every step (verl's names; tokens per DP rank): global_seqlen/min, /max, /minmax_diff
(before), /balanced_min, /balanced_max (after), /mean.

Tests: tests/test_balance_batch.py
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.batch import Batch
from engine.rollout.group import recv_object, send_object
from engine.workers.template import mini_batch_layout

STEP_ROW = "step_row"  # a row's position in the step's unbalanced global batch (shuffle keys)


def group_size(uids):
    """Rows per prompt group: the common length of the runs of equal consecutive uids."""
    runs, start = [], 0
    for i in range(1, len(uids) + 1):
        if i == len(uids) or uids[i] != uids[start]:
            runs.append(i - start)
            start = i
    if len(set(runs)) > 1:
        raise ValueError(f"trainer.balance_batch moves whole prompt groups, but this batch's groups "
                         f"(consecutive rows of one uid) have {sorted(set(runs))} rows; set "
                         "trainer.balance_batch=false for this experience source")
    return runs[0] if runs else 1


def unit_layout(rows, group, mini_sizes):
    """(L, classes): the rows of a unit, and each of the rows // L unit slots' class (slots of
    one class hold the same places of the same mini-batches of every model in `mini_sizes`)."""
    unit = group
    for size in mini_sizes:
        m, strided = mini_batch_layout(rows, size)
        if strided:
            unit = unit * m // math.gcd(unit, m)

    def place(i):
        return tuple(i % m if strided else i // (size or rows)
                     for m, strided, size in ((*mini_batch_layout(rows, s), s) for s in mini_sizes))
    names = {}
    classes = [names.setdefault(tuple(place(i) for i in range(s * unit, (s + 1) * unit)), len(names))
               for s in range(rows // unit)]
    return unit, classes


@dataclass
class Plan:
    rows: list      # rows[dst][slot] = (src rank, src slot): where each unit of dst's new batch comes from
    before: list    # tokens per rank, unbalanced
    after: list     # tokens per rank, balanced

    def metrics(self):
        mean = sum(self.before) / len(self.before)
        return {"global_seqlen/min": float(min(self.before)), "global_seqlen/max": float(max(self.before)),
                "global_seqlen/minmax_diff": float(max(self.before) - min(self.before)),
                "global_seqlen/balanced_min": float(min(self.after)),
                "global_seqlen/balanced_max": float(max(self.after)), "global_seqlen/mean": float(mean)}


def _partition(costs, classes):
    """Bins of (rank, slot) units, one per rank, each with as many units of every class as a
    rank has slots of it, with the largest bin cost about as low as it goes."""
    dp = len(costs)
    room = [[classes.count(c) for c in range(max(classes, default=-1) + 1)] for _ in range(dp)]
    bins, load = [[] for _ in range(dp)], [0] * dp
    for r, s in sorted(((r, s) for r in range(dp) for s in range(len(classes))),
                       key=lambda u: (-costs[u[0]][u[1]], u)):
        b = min((b for b in range(dp) if room[b][classes[s]]), key=lambda b: (load[b], b))
        room[b][classes[s]] -= 1
        bins[b].append((r, s))
        load[b] += costs[r][s]
    # swaps between the heaviest bin and a lighter one while they lower the heavier's cost (each
    # swap narrows a pair's spread, so the sum of squared loads falls: it ends)
    for _ in range(4 * dp * max(1, len(classes))):
        hi = max(range(dp), key=lambda b: (load[b], -b))
        best = None
        for lo in sorted(range(dp), key=lambda b: (load[b], b)):
            if lo == hi:
                continue
            for i, a in enumerate(bins[hi]):
                for j, b in enumerate(bins[lo]):
                    d = costs[a[0]][a[1]] - costs[b[0]][b[1]]
                    if classes[a[1]] == classes[b[1]] and 0 < d < load[hi] - load[lo]:
                        new = max(load[hi] - d, load[lo] + d)
                        if best is None or new < best[0]:
                            best = (new, lo, i, j, d)
            if best is not None:
                break
        if best is None:
            break
        _, lo, i, j, d = best
        bins[hi][i], bins[lo][j] = bins[lo][j], bins[hi][i]
        load[hi] -= d
        load[lo] += d
    return bins, load


def balance_plan(costs, classes):
    """The Plan for units of `costs[rank][slot]` tokens whose slot classes are `classes` (the
    same on every rank): partitioned (or left as it is, if that is no worse), each partition given
    to the rank holding most of it, a kept unit in its own slot, a received one in a free slot of
    its class."""
    dp = len(costs)
    bins, load = _partition(costs, classes)
    before = [sum(c) for c in costs]
    if max(load) >= max(before):  # no better than it is: nothing moves
        bins, load = [[(r, s) for s in range(len(classes))] for r in range(dp)], before
    overlap = sorted(((-sum(r == src for src, _ in bins[b]), b, r) for b in range(dp) for r in range(dp)))
    owner, taken = {}, set()
    for _, b, r in overlap:
        if b not in owner and r not in taken:
            owner[b] = r
            taken.add(r)
    rows, after = [None] * dp, [0] * dp
    for b, dst in owner.items():
        slots = [None] * len(classes)
        for src, s in bins[b]:
            if src == dst:
                slots[s] = (src, s)
        for src, s in sorted(u for u in bins[b] if u[0] != dst):
            free = next(k for k, v in enumerate(slots) if v is None and classes[k] == classes[s])
            slots[free] = (src, s)
        rows[dst], after[dst] = slots, load[b]
    return Plan(rows, before, after)


def balance_batch(batch, mini_sizes, group=None):
    """This DP rank's balanced batch and the step's global_seqlen metrics (collective over the
    DP process group `group`, default Megatron's). mini_sizes: rows per rank of each trained
    model's mini-batch."""
    group = ps.get_data_parallel_group() if group is None else group
    dp, me = dist.get_world_size(group), dist.get_rank(group)
    tokens = batch["attention_mask"].sum(-1).tolist()
    group_rows = group_size(list(batch["uid"])) if "uid" in batch else 1
    every = [None] * dp
    dist.all_gather_object(every, (len(batch), group_rows, tokens), group=group)
    if len({(n, g) for n, g, _ in every}) > 1:
        raise ValueError(f"trainer.balance_batch: the DP ranks hold (rows, rows per group) "
                         f"{[(n, g) for n, g, _ in every]}; they must be equal to move whole groups, "
                         "set trainer.balance_batch=false for this experience source")
    unit, classes = unit_layout(len(batch), group_rows, mini_sizes)
    costs = [[sum(t[s * unit:(s + 1) * unit]) for s in range(len(classes))] for _, _, t in every]
    plan = balance_plan(costs, classes)
    if dp > 1:
        batch = _move(batch, plan, me, unit, group)
    return batch, plan.metrics()


def _move(batch, plan, me, unit, group):
    """This rank's rows under `plan`: its kept units where they were, the others received from
    their ranks (point to point; every rank sends first, then receives)."""
    device = batch["attention_mask"].device
    if STEP_ROW not in batch:  # a new Batch: the input is left as it was
        batch = Batch(batch.tensors, batch.non_tensors, batch.meta)
        batch[STEP_ROW] = torch.arange(len(batch), device=device) + me * len(batch)
    ranks = dist.get_process_group_ranks(group)

    def part(s):
        return batch.index_select(list(range(s * unit, (s + 1) * unit)))
    pending, buffers = [], []
    for dst, slots in enumerate(plan.rows):
        out = {s: part(s).to("cpu") for src, s in slots if src == me and dst != me}
        if out:
            reqs, bufs, _ = send_object({s: (b.tensors, b.non_tensors) for s, b in out.items()}, ranks[dst])
            pending += reqs
            buffers += bufs
    got = {src: recv_object(ranks[src])[0] for src in sorted({src for src, _ in plan.rows[me]} - {me})}
    for req in pending:
        req.wait()
    parts = [part(s) if src == me else Batch(*got[src][s]).to(device) for src, s in plan.rows[me]]
    moved = Batch.concat(parts)
    return Batch(moved.tensors, moved.non_tensors, meta=batch.meta)
