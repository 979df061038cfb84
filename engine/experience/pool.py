"""Experience from a separate rollout pool (trainer.rollout_pool=separate; the pool's side is
engine/rollout/pool.py). With `off_policy_steps` k >= 1, steps s+1 .. s+k are requested before
step s trains, so the pool generates up to k steps ahead: step s+k from the weights of update
s-1, k versions behind when it trains (rollout/staleness: the batch's weights; per token:
engine/experience/staleness.py, which also refuses any sample more than k versions behind and
logs the staleness metrics); the old log-probs are recomputed by the actor (derive turns the
on-policy shortcut off). k = 0 is the synchronous step: request, generate, train.

Tests: tests/test_rollout_pool.py
"""
from collections import deque

from megatron.core import parallel_state as ps

from engine.experience.base import Source
from engine.experience.staleness import refuse_stale, staleness_metrics


def send_weights_once(source, ctx):
    """The pool gets the current weights, once per update (the update_weights phase); `source`
    (a pool source: Pool, engine/experience/streaming.py's Streaming) keeps its `client` and the
    step last `sent`. Returns the bytes sent."""
    if source.sent == ctx.step:
        return 0
    chunks, hf_config, bucket_megabytes, plan = ctx.weights()
    with ctx.phase("update_weights"):
        sent = source.client.send_weights(chunks, hf_config, bucket_megabytes, plan=plan, version=ctx.step)
    source.sent = ctx.step
    return sent


class Pool(Source):
    separate = True

    def __init__(self, cfg, client, off_policy_steps):
        super().__init__(cfg)
        self.client, self.k = client, off_policy_steps
        self.pending = deque()  # (prompts, loader state before they were drawn), oldest first
        self.sent = -1  # the step whose update the pool's weights are from (0: the initial ones)
        self.outstanding = 0  # batches requested and not yet received
        self.received = deque()  # batches received ahead of their step (around a validation)

    def prompts(self, ctx):
        """The next step's prompts; drawn ahead of training when off-policy."""
        if not self.pending:
            self._draw(ctx)
        return self.pending[0][0]

    def _draw(self, ctx):
        state = ctx.loader.state_dict()
        self.pending.append((ctx.loader.next_batch(), state))

    def loader_state(self, ctx):
        """Where the data stands for the steps trained so far (not the batches drawn ahead)."""
        return self.pending[0][1] if self.pending else ctx.loader.state_dict()

    def sync(self, ctx):
        return send_weights_once(self, ctx)

    def collect(self, ctx, prompts):
        step, last = ctx.step + 1, ctx.total_steps
        first = step == ctx.first_step + 1
        sent = 0
        with ctx.phase("gen"):
            if first or self.k == 0:
                sent = self.sync(ctx)
                self._request(ctx, self.pending[0][0], step)
                for ahead in range(1, self.k + 1) if first else ():
                    if step + ahead <= last:
                        self._draw(ctx)
                        self._request(ctx, self.pending[-1][0], step + ahead)
                got, version = self._take(ctx)
            else:
                # the pool made this step's batch while the last one trained; take it, then send
                # the new weights and ask for the step k ahead, generated while this one trains
                got, version = self._take(ctx)
                sent = self.sync(ctx)
                if step + self.k <= last:
                    self._draw(ctx)
                    self._request(ctx, self.pending[-1][0], step + self.k)
            self.pending.popleft()
        batch = ctx.layout(prompts, got)
        # the policy trained is version ctx.step (the updates so far): nothing older than k
        refused = refuse_stale(batch, ctx.step, self.k)
        metrics = {"perf/update_weights_gb": sent / 1e9, "rollout/staleness": float(step - 1 - version)}
        metrics.update(staleness_metrics(batch, ctx.step, self.k, refused, ps.get_data_parallel_group()))
        return batch, metrics

    def _take(self, ctx):
        """The oldest requested batch (the pool answers in request order)."""
        if self.received:
            return self.received.popleft()
        self.outstanding -= 1
        return self.client.receive(ctx.dp_rank, ctx.replica_group)

    def before_validation(self, ctx):
        """Take what the pool is generating first: it waits to hand it over before it reads the
        validation request."""
        while self.outstanding:
            self.outstanding -= 1
            self.received.append(self.client.receive(ctx.dp_rank, ctx.replica_group))
        self.sync(ctx)

    def validate(self, ctx, prompt_ids):
        """The pool's responses to the validation prompts (rank 0 receives them)."""
        self.before_validation(ctx)
        return self.client.validate(prompt_ids, ctx.sampling(train=False))

    def _request(self, ctx, prompts, step):
        # the seed of its own step
        sampling = ctx.sampling(train=True, seed=ctx.cfg.actor_rollout_ref.rollout.seed + 1000003 * (step - 1))
        self.client.request(step, list(prompts.input_ids), list(prompts.indices), sampling, ctx.dp)
        self.outstanding += 1

    def finish(self):
        self.client.stop()


def connect(derived, bridge, world, replicas):
    """The training end of a separate rollout pool (engine/rollout/pool.py): a PoolClient over
    `bridge` for the `world` training ranks, whose DP replicas are `replicas`."""
    from engine.rollout.pool import PoolClient, pool_ranks
    from engine.rollout.registry import backend_class
    cfg, t = derived.config, derived.config.trainer
    train, pool = pool_ranks(world + t.rollout_pool_ranks, t.rollout_pool_ranks)
    groups = derived.rollout_topology.groups
    leaders = [pool.start + g.leader for g in groups]
    direct = backend_class(cfg.actor_rollout_ref.rollout.name).WEIGHTS_FROM_DISTRIBUTED
    return PoolClient(bridge, train, pool, replicas, leaders, tps=[g.tp for g in groups] if direct else None,
                      device=t.device, timeout_s=t.collective_timeout_s)
