"""Streaming groups from a separate rollout pool (trainer.rollout_pool=separate with
data.gen_batch_size > data.train_batch_size, or algorithm.filter_groups): the trainer takes a
group (one prompt's rollout.n responses) as soon as the pool has sent it, and a step starts once
it has data.train_batch_size of them; the pool's side is engine/rollout/streaming.py.

Groups: every prompt drawn gets a group id g (0, 1, ... in draw order) and is trained by DP
replica g mod DP, which takes its groups in id order (so which groups a step trains is fixed by
the seed, not by timing). The pool is kept `k x B + G` groups ahead (k = off_policy_steps, B =
train_batch_size, G = gen_batch_size; at most what the remaining steps can use): at each step,
after the new weights are sent, the prompts to bring the groups requested and not yet taken back
to that are requested (one stream request, its own sampling seed, generated with those weights).

A step takes rounds: each replica takes its next ceil(short / DP) groups (short: the groups the
step still lacks), drops those more than k versions behind (their oldest token; counted
`rollout/groups_dropped_stale`, their samples in `rollout/stale_samples`) and, with
algorithm.filter_groups, scores the round and drops the groups whose metric does not vary
(DAPO; `batch/filtered_groups`); the replicas all-gather their counts and go on until B groups
are kept. A replica short of groups to take asks the pool for G more prompts (at most
filter_groups.max_num_gen_batches such requests per step, 0: no bound). The kept groups are then
re-sharded (engine/experience/dynamic_sampling.reshard_plan) so every replica trains B / DP;
the kept groups no replica needs are put back at the front of their replica's queue, carried to
the next step with the groups in flight: nothing is discarded but the stale and the filtered.
Logged: rollout/groups_{requested,taken,carried,dropped_stale}, batch/{num_gen_batches,
filtered_groups,kept_groups,rerouted_groups}, and the staleness metrics of
engine/experience/staleness.py. Conservation, per step: carried before + requested = taken +
dropped + filtered + carried after.

Checkpoints: the data position saved is the loader's before the oldest batch holding a group not
yet taken, so a resumed run generates the groups in flight (and some already trained) again.

Tests: tests/test_streaming.py
"""
from collections import defaultdict, deque

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.batch import Batch
from engine.experience.base import Source
from engine.experience.pool import send_weights_once
from engine.experience.dynamic_sampling import DynamicSampling, informative_groups, reshard, reshard_plan
from engine.experience.staleness import refuse_stale, staleness_metrics, versions_behind


def window(k, train, gen, remaining, filtering=False):
    """Groups the pool is kept ahead by at a step's start: k x train + gen, no more than the
    `remaining` steps (this one included) take (and the surplus gen - train, when filtering)."""
    return min(k * train + gen, remaining * train + (gen - train if filtering else 0))


def top_up(outstanding, target, dp):
    """Prompts to request to bring `outstanding` groups to `target`, a multiple of `dp`."""
    short = max(0, target - outstanding)
    return -(-short // dp) * dp


class Streaming(Source):
    separate = True

    def __init__(self, cfg, client, off_policy_steps):
        super().__init__(cfg)
        r, d = cfg.actor_rollout_ref.rollout, cfg.data
        self.client, self.k, self.n = client, off_policy_steps, r.n
        self.train, self.gen = d.train_batch_size, d.gen_batch_size or d.train_batch_size
        self.chunk = max(1, r.max_num_seqs // r.n)  # prompts per engine call: what it runs at once
        self.filter = cfg.algorithm.filter_groups
        self.seed = r.seed
        self.next_gid, self.requests, self.sent = 0, 0, -1
        self.drawn = deque()  # [PromptBatch, loader state before it, first gid, rows used]
        self.prompt_of = {}  # gid -> (PromptBatch, row): this replica's groups not yet taken
        self.expected = defaultdict(deque)  # engine -> deque of [gids]: messages still to come here
        self.where = {}  # gid -> the engine whose message brings it
        self.queue = deque()  # this replica's gids not yet taken, in id order
        self.lengths = None  # every replica's queue length (all ranks agree: the decisions' input)
        self.ready = {}  # gid -> (share, version): received
        self.carried = {}  # gid -> its laid-out Batch, put back by a step
        self.ctx = None  # the step context (the end drains the pool with it)

    # -- prompts ---------------------------------------------------------------------------
    def prompts(self, ctx):
        """The newest prompt batch drawn (the step's epoch); groups are drawn as requested."""
        if not self.drawn:
            self._next_batch(ctx)
        return self.drawn[-1][0]

    def _next_batch(self, ctx):
        state = ctx.loader.state_dict()
        self.drawn.append([ctx.loader.next_batch(), state, self.next_gid, 0])

    def _draw(self, ctx, count):
        out = []
        while len(out) < count:
            if not self.drawn or self.drawn[-1][3] == len(self.drawn[-1][0].input_ids):
                self._next_batch(ctx)
            last = self.drawn[-1]
            out.append((last[0], last[3]))
            last[3] += 1
        return out

    def loader_state(self, ctx):
        """The loader before the oldest batch with a group not yet taken."""
        oldest = min(self.queue, default=self.next_gid)
        for batch, state, first, used in self.drawn:
            if first + used > oldest:
                return state
        return ctx.loader.state_dict()

    # -- the pool --------------------------------------------------------------------------
    def sync(self, ctx):
        return send_weights_once(self, ctx)

    def request(self, ctx, count):
        """Ask the pool for `count` more groups (a multiple of DP; collective decision: every rank
        draws the same prompts)."""
        from engine.rollout.streaming import expected, request_stream
        if self.lengths is None:
            self.lengths = [0] * ctx.dp
        items = self._draw(ctx, count)
        gids = list(range(self.next_gid, self.next_gid + count))
        self.next_gid += count
        relays = [replica[0] for replica in self.client.replicas]
        owners = [relays[g % ctx.dp] for g in gids]
        sampling = ctx.sampling(train=True, seed=self.seed + 1000003 * self.requests)
        self.requests += 1
        # keyed by group id: a prompt drawn again (a later epoch) samples afresh
        request_stream(self.client, gids, [b.input_ids[row] for b, row in items], gids, owners, sampling,
                       self.chunk)
        for engine, mine in expected(gids, owners, self.chunk, len(self.client.leaders), relays[ctx.dp_rank]):
            self.expected[engine].append(mine)
            self.where.update({g: engine for g in mine})
        for g, item in zip(gids, items):
            if g % ctx.dp == ctx.dp_rank:
                self.prompt_of[g] = item
                self.queue.append(g)
        self.lengths = [x + count // ctx.dp for x in self.lengths]

    def _receive(self, ctx, engine):
        from engine.rollout.streaming import receive_chunk
        relay = self.client.replicas[ctx.dp_rank][0]
        part, version = receive_chunk(self.client, engine, relay, ctx.replica_group)
        mine = self.expected[engine].popleft()
        assert sorted(part) == sorted(mine), (sorted(part), mine)
        for g in mine:
            self.ready[g] = (part[g], version)
            del self.where[g]

    def _take(self, ctx):
        """This replica's next group as a Batch (received first if it has not come yet)."""
        g = self.queue.popleft()
        if g in self.carried:
            return g, self.carried.pop(g)
        while g not in self.ready:
            self._receive(ctx, self.where[g])
        share, _ = self.ready.pop(g)
        prompts, row = self.prompt_of.pop(g)
        batch = ctx.layout(prompts, {row: share}, rows=[row])
        batch["uid"] = [("group", g)] * self.n  # unique: a prompt may come again in a later epoch
        return g, batch

    # -- a step ----------------------------------------------------------------------------
    def collect(self, ctx, prompts):
        self.ctx = ctx
        dp, group = ctx.dp, ps.get_data_parallel_group()
        q = self.train // dp
        with ctx.phase("gen"):
            sent = self.sync(ctx)
            if self.lengths is None:
                self.lengths = [0] * dp
            carried_before = sum(self.lengths)
            target = window(self.k, self.train, self.gen, ctx.total_steps - ctx.step, self.filter.enable)
            count = top_up(sum(self.lengths), target, dp)
            requested = count
            if count:
                self.request(ctx, count)
        kept, extras = [], defaultdict(list)
        dropped = filtered = total = 0
        gen_batches = 1  # the step's first: the top-up above
        oldest = 0
        counts = [0] * dp
        while total < self.train:
            short = -(-(self.train - total) // dp)
            with ctx.phase("gen"):
                while min(self.lengths) < short:  # the pool owes too few: another generation batch
                    if 0 < self.filter.max_num_gen_batches <= gen_batches:
                        raise ValueError(
                            f"algorithm.filter_groups: {gen_batches} generation batches left fewer than "
                            f"data.train_batch_size={self.train} groups whose {self.filter.metric} differs; raise "
                            f"algorithm.filter_groups.max_num_gen_batches={self.filter.max_num_gen_batches} "
                            "(0: no bound), data.gen_batch_size, or use easier prompts")
                    gen_batches += 1
                    self.request(ctx, self.gen)
                    requested += self.gen
                taken = [self._take(ctx) for _ in range(short)]
            self.lengths = [x - short for x in self.lengths]
            behind = [int((versions_behind(b, ctx.step) * b["response_mask"]).max()) for _, b in taken]
            good = set(range(short))
            if self.filter.enable:  # every replica scores its `short` groups (carried ones again: same scores)
                fields = set.intersection(*(set(b.keys()) for _, b in taken))  # a carried group was scored
                batch = Batch.concat([b.select(fields) for _, b in taken])
                extra = ctx.score(batch)
                for key, v in extra.items():
                    extras[key] += list(v)
                good = set(informative_groups(DynamicSampling.group_metric(batch, extra, self.filter.metric), self.n))
                taken = [(g, batch.index_select(list(range(i * self.n, (i + 1) * self.n))))
                         for i, (g, _) in enumerate(taken)]
            for i, (g, b) in enumerate(taken):
                if behind[i] > self.k:
                    dropped += 1
                elif i not in good:
                    filtered += 1
                else:
                    kept.append((g, b))
                    oldest = max(oldest, behind[i])
            dist.all_gather_object(counts, len(kept), group=group)
            total = sum(counts)
        moves = reshard_plan(counts, q)
        mine, rest = reshard([b for _, b in kept], moves, q, ctx.dp_rank, keep_rest=True)
        moved_out = {g for s, _, g in moves if s == ctx.dp_rank}
        back = [kept[i] for i in range(q, len(kept)) if i not in moved_out]
        assert len(back) == len(rest)
        for g, b in reversed(back):  # carried to the next step, first in line
            self.carried[g] = b
            self.queue.appendleft(g)
        for r, c in enumerate(counts):
            self.lengths[r] += max(0, c - q) - sum(1 for s, _, _ in moves if s == r)
        assert self.lengths[ctx.dp_rank] == len(self.queue), (self.lengths, len(self.queue))
        low = min(self.queue, default=self.next_gid)
        while len(self.drawn) > 1 and self.drawn[1][2] <= low:  # batches whose groups were all taken
            self.drawn.popleft()
        batch = Batch.concat(mine)
        refused = refuse_stale(batch, ctx.step, self.k)  # none: the stale groups were dropped
        rows = defaultdict(int)
        for u in batch["uid"]:
            rows[u] += 1
        whole = sum(1 for c in rows.values() if c == self.n)  # groups of all their n responses
        totals = torch.tensor([requested if ctx.dp_rank == 0 else 0, whole, dropped, filtered, len(kept),
                               carried_before if ctx.dp_rank == 0 else 0, len(batch)], dtype=torch.float64)
        dist.all_reduce(totals, group=group)
        high = torch.tensor([float(oldest)], dtype=torch.float64)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        metrics = {"perf/update_weights_gb": sent / 1e9, "rollout/staleness": float(high),
                   "rollout/groups_requested": float(totals[0]), "rollout/groups_taken": float(totals[1]),
                   "rollout/groups_dropped_stale": float(totals[2]), "rollout/groups_carried": float(sum(self.lengths)),
                   "rollout/groups_carried_in": float(totals[5]), "rollout/samples_taken": float(totals[6])}
        if self.filter.enable:
            metrics.update(ctx.reward_metrics(extras))
            metrics.update({"batch/num_gen_batches": float(gen_batches), "batch/filtered_groups": float(totals[3]),
                            "batch/kept_groups": float(totals[4]), "batch/rerouted_groups": float(len(moves))})
        metrics.update(staleness_metrics(batch, ctx.step, self.k, refused + dropped * self.n, group))
        return batch, metrics

    # -- validation and the end ------------------------------------------------------------
    def drain(self, ctx):
        """Receive every message the pool owes this replica (kept until taken)."""
        for engine in sorted(self.expected):
            while self.expected[engine]:
                self._receive(ctx, engine)

    def before_validation(self, ctx):
        """Take every message the pool owes first: it sends them before it reads the validation
        request, and rank 0's validation answers come after them."""
        self.drain(ctx)
        self.sync(ctx)

    def validate(self, ctx, prompt_ids):
        self.before_validation(ctx)
        return self.client.validate(prompt_ids, ctx.sampling(train=False))

    def finish(self):
        """Take what the pool still owes (it waits until every message it sent was received),
        then stop it."""
        if self.ctx is not None:
            self.drain(self.ctx)
        self.client.stop()
