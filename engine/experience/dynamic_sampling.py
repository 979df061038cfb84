"""DAPO dynamic sampling (`algorithm.filter_groups`, verl's keys): a prompt whose responses all
score the same (all right, all wrong) gives GRPO no gradient, so such groups are dropped and
generation goes on with the next prompt batches until the step's batch is full.

A step needs data.train_batch_size groups, q = train_batch_size / DP of them on each DP rank.
Generation is collective and each DP rank receives its own share of each generation batch, so
after a few batches the ranks hold different numbers k_r of informative groups. The choice:

* The decision is global and cheap: the ranks all-gather their counts k_r (one integer each) and
  stop once sum k_r >= DP x q, or fail after max_num_gen_batches (0: no bound).
* The batch is re-sharded with the least traffic: every rank keeps its first min(k_r, q) groups;
  the ranks short of q receive the missing groups from the ranks with more, point to point
  between the same positions of two DP replicas (ranks of a DP group), in an order every rank
  derives from the counts alone (surplus ranks in rank order, each sending its earliest
  surplus groups). Only moved groups travel; the surplus that is not needed is dropped, as
  verl drops what exceeds the batch.

Every DP rank then trains on exactly q groups, and the mini-batch plan holds. Counted per step:
`batch/num_gen_batches`, `batch/filtered_groups` (dropped for equal metrics), `batch/kept_groups`
(informative, before trimming), `batch/rerouted_groups`. The extra prompt batches come from the
step's prompt loader, whose position is checkpointed: a resumed run sees the same batches.

Tests: tests/test_experience_parts.py, tests/test_replay_dynamic.py, tests/test_streaming.py
"""
from collections import defaultdict

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.batch import Batch
from engine.experience.online import Online
from engine.rollout.group import recv_object as _recv, send_object as _send


def informative_groups(values, n):
    """Indices of the groups (n consecutive rows) whose values are not all equal."""
    return [g for g in range(len(values) // n) if len(set(float(v) for v in values[g * n:(g + 1) * n])) > 1]


def reshard_plan(counts, q):
    """[(src DP rank, dst DP rank, group index on src)] so that every rank ends with q groups:
    each keeps its first min(k_r, q) and the short ranks take the surplus in rank order."""
    surplus = [(r, g) for r, k in enumerate(counts) for g in range(q, k)]
    moves = []
    for dst, k in enumerate(counts):
        for _ in range(max(0, q - k)):
            src, g = surplus.pop(0)
            moves.append((src, dst, g))
    return moves


class DynamicSampling(Online):
    def collect(self, ctx, prompts):
        cfg, fg = ctx.cfg, ctx.cfg.algorithm.filter_groups
        n, dp = cfg.actor_rollout_ref.rollout.n, ctx.dp
        q = len(prompts) // dp
        sync = ctx.sync_weights()
        kept, extras, tries, filtered = [], defaultdict(list), 0, 0
        while True:
            tries += 1
            if tries > 1:
                prompts = ctx.loader.next_batch()
                if not ctx.rollout_ready():  # a reward model's phase took the rollout's memory
                    ctx.sync_weights()
            base = ctx.sampling(train=True)
            batch = self.generate(ctx, prompts, ctx.sampling(train=True, seed=base.seed + 7919 * (tries - 1)))
            if tries > 1:  # a prompt may come again in a later batch (next epoch): its own group
                batch["uid"] = [(tries, u) for u in batch["uid"]]
            extra = ctx.score(batch)
            for k, v in extra.items():
                extras[k] += list(v)
            values = self.group_metric(batch, extra, fg.metric)
            good = informative_groups(values, n)
            filtered += len(values) // n - len(good)
            kept += [batch.index_select(list(range(g * n, (g + 1) * n))) for g in good]
            counts = [None] * dp
            dist.all_gather_object(counts, len(kept), group=ps.get_data_parallel_group())
            if sum(counts) >= q * dp:
                break
            if 0 < fg.max_num_gen_batches <= tries:
                raise ValueError(
                    f"algorithm.filter_groups: {tries} generation batches gave {sum(counts)} prompt groups "
                    f"whose {fg.metric} differs, fewer than data.train_batch_size={q * dp}; raise "
                    f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} (0: no bound), "
                    "or use easier prompts")
        moves = reshard_plan(counts, q)
        batch = Batch.concat(reshard(kept, moves, q, ctx.dp_rank))
        totals = torch.tensor([filtered, len(kept)], dtype=torch.float64)
        dist.all_reduce(totals, group=ps.get_data_parallel_group())
        metrics = ctx.reward_metrics(extras)
        metrics.update(sync.metrics())
        metrics.update({"batch/num_gen_batches": float(tries),
                        "batch/filtered_groups": float(totals[0]), "batch/kept_groups": float(totals[1]),
                        "batch/rerouted_groups": float(len(moves))})
        return batch, metrics

    @staticmethod
    def group_metric(batch, extra, metric):
        """Per row, the value filter_groups.metric names."""
        if metric in ("seq_reward", "seq_final_reward"):  # no in-reward KL here (validated)
            return batch["token_level_scores"].sum(-1).tolist()
        if metric not in extra:
            raise ValueError(f"algorithm.filter_groups.metric={metric!r} is not among the reward's values "
                             f"{sorted(['seq_reward', 'seq_final_reward'] + list(extra))}; pick one of them")
        return [float(v) for v in extra[metric]]


def reshard(kept, moves, q, me, keep_rest=False):
    """This rank's q groups: its own first ones, then those the plan sends it (collective over
    the DP group, point to point). keep_rest: also the groups it kept that no rank takes
    (streaming carries them to the next step: engine/experience/streaming.py)."""
    ranks = dist.get_process_group_ranks(ps.get_data_parallel_group())
    pending, buffers = [], []
    for dst in sorted({d for s, d, _ in moves if s == me}):
        reqs, bufs, _ = _send([kept[g] for s, d, g in moves if s == me and d == dst], ranks[dst])
        pending += reqs
        buffers += bufs
    mine = kept[:q]
    for src in sorted({s for s, d, _ in moves if d == me}):
        mine += _recv(ranks[src])[0]
    for req in pending:
        req.wait()
    assert len(mine) == q, (len(mine), q)
    if not keep_rest:
        return mine
    moved = {g for s, _, g in moves if s == me}
    return mine, [kept[g] for g in range(q, len(kept)) if g not in moved]
