"""Where a PPO step's batch of experience comes from: the seam between the loop
(engine/trainer.py) and the ways of getting responses.

A source implements `collect(trainer, prompts, timings) -> (batch, metrics)`: this DP rank's
training Batch for the step's prompts (prompt-major, rollout.n rows per prompt). A batch that
already holds `token_level_scores` is not scored again (logged rewards, or a source that needed
the scores to choose its rows). After the advantages, `after_advantages(trainer, batch)` may
weigh them (truncated IS against the behaviour policy, PF-PPO's reweighting) and returns
metrics. `prepare(trainer, prompts)` runs when the prompt loader makes a batch, in its
prefetch thread when `data.dataloader_num_workers > 0`.

    Online            sync the actor's weights into the rollout engines, generate (and ReMax's
                      greedy baselines), lay them out as this DP rank's Batch
    Logged            logged responses and rewards (data.offline_path; engine/experience_offline.py)
    DynamicSampling   DAPO: generate until the batch is full of informative groups
                      (algorithm.filter_groups; engine/dynamic_sampling.py)
    Replay            wraps any of them: PF-PPO filtration, replayed groups mixed in
                      (algorithm.replay; engine/replay.py)
    Pool              a separate rollout pool (trainer.rollout_pool=separate), one step
                      off-policy with trainer.off_policy_steps=1
"""
from collections import deque

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.algorithms.correction import correction_metrics, rollout_is_weights


class Source:
    def __init__(self, cfg):
        self.correction = cfg.algorithm.rollout_correction

    @property
    def needs_old_log_probs(self):
        """The old log-probs must come from their own pass, before the advantages (the
        trainer's on-policy shortcut takes them from the update's forward, too late)."""
        return self.correction.rollout_is is not None

    def prompts(self, trainer):
        """The next step's prompts."""
        return trainer.loader.next_batch()

    def loader_state(self, trainer):
        """Where the data stands for the steps trained so far."""
        return trainer.loader.state_dict()

    def collect(self, trainer, prompts, timings):
        raise NotImplementedError

    def prepare(self, trainer, prompts):
        pass

    def after_advantages(self, trainer, batch):
        """Truncated IS (algorithm.rollout_correction): the advantages x min(pi_old / mu, C)."""
        rc = self.correction
        if rc.rollout_is is None or "rollout_log_probs" not in batch:
            return {}
        weights, sums = rollout_is_weights(batch["old_log_probs"], batch["rollout_log_probs"],
                                           batch["response_mask"], rc.rollout_is, rc.rollout_is_threshold)
        batch["advantages"] = batch["advantages"] * weights
        total = torch.tensor([sums[k] for k in ("ratio", "weight", "clipped", "count")], dtype=torch.float64)
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        return correction_metrics(dict(zip(("ratio", "weight", "clipped", "count"), total.tolist())))

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class Online(Source):
    def collect(self, trainer, prompts, timings):
        sync = self.sync(trainer, timings)
        return self.generate(trainer, prompts, timings), {"perf/update_weights_gb": sync.bytes / 1e9}

    @staticmethod
    def sync(trainer, timings):
        with trainer._phase("update_weights", timings):
            return trainer.sync_weights()  # ends in the generate phase (engine/config/phases.py)

    @staticmethod
    def generate(trainer, prompts, timings, sampling=None):
        """This DP rank's Batch of the prompts' responses (collective), with ReMax's baselines."""
        cfg = trainer.cfg
        sampling = sampling or trainer._sampling(train=True)
        with trainer._phase("gen", timings):
            batch = trainer.generate(prompts, sampling)
        if cfg.algorithm.adv_estimator == "remax":
            with trainer._phase("gen", timings):
                baseline = trainer.generate(prompts, trainer._sampling(train=True, greedy=True), n=1)
            batch["reward_baselines"] = trainer._scores(baseline).repeat_interleave(
                cfg.actor_rollout_ref.rollout.n)
        return batch


class Pool(Source):
    """A separate rollout pool (engine/rollout/pool.py). With `off_policy_steps` k = 1, step
    s+1 is requested before step s trains, so the pool generates it meanwhile from the weights of
    update s-1: staleness 1, logged as rollout/staleness; the old log-probs are recomputed by the
    actor (the trainer turns on_policy_old_log_prob off)."""

    def __init__(self, cfg, client, off_policy_steps):
        super().__init__(cfg)
        self.client, self.k = client, off_policy_steps
        self.pending = deque()  # (prompts, loader state before they were drawn), oldest first
        self.sent = -1  # the step whose update the pool's weights are from (0: the initial ones)
        self.outstanding = 0  # batches requested and not yet received
        self.received = deque()  # batches received ahead of their step (around a validation)

    def prompts(self, trainer):
        """The next step's prompts; drawn ahead of training when off-policy."""
        if not self.pending:
            self._draw(trainer)
        return self.pending[0][0]

    def _draw(self, trainer):
        state = trainer.loader.state_dict()
        self.pending.append((trainer.loader.next_batch(), state))

    def loader_state(self, trainer):
        """Where the data stands for the steps trained so far (not the batches drawn ahead)."""
        return self.pending[0][1] if self.pending else trainer.loader.state_dict()

    def sync(self, trainer):
        """The pool gets the current weights, once per update."""
        if self.sent == trainer.step_count:
            return 0
        a = trainer.cfg.actor_rollout_ref.rollout
        sent = self.client.send_weights(trainer.actor.chunks, trainer.hf_config, a.update_weights_bucket_megabytes,
                                        plan=trainer.hybrid.plan())
        self.sent = trainer.step_count
        return sent

    def collect(self, trainer, prompts, timings):
        step, last = trainer.step_count + 1, trainer.total_steps
        first = step == trainer.first_step + 1
        sent = 0
        with trainer._phase("gen", timings):
            if first or self.k == 0:
                with trainer._phase("update_weights", timings):
                    sent = self.sync(trainer)
                self._request(trainer, self.pending[0][0], step)
                for ahead in range(1, self.k + 1) if first else ():
                    if step + ahead <= last:
                        self._draw(trainer)
                        self._request(trainer, self.pending[-1][0], step + ahead)
                got, version = self._take(trainer)
            else:
                # the pool made this step's batch while the last one trained; take it, then send
                # the new weights and ask for the step k ahead, generated while this one trains
                got, version = self._take(trainer)
                with trainer._phase("update_weights", timings):
                    sent = self.sync(trainer)
                if step + self.k <= last:
                    self._draw(trainer)
                    self._request(trainer, self.pending[-1][0], step + self.k)
            self.pending.popleft()
        r = trainer.cfg.actor_rollout_ref.rollout
        from engine.rollout.batches import training_batch
        batch = training_batch(prompts, got, trainer._my_prompts(prompts), r.n, trainer.pad_id, r.prompt_length,
                               r.response_length, raw_chat=trainer.cfg.data.return_raw_chat)
        return batch, {"perf/update_weights_gb": sent / 1e9, "rollout/staleness": float(step - 1 - version)}

    def _take(self, trainer):
        """The oldest requested batch (the pool answers in request order)."""
        if self.received:
            return self.received.popleft()
        self.outstanding -= 1
        return self.client.receive(trainer.dp_rank, trainer.replica_group)

    def before_validation(self, trainer):
        """Take what the pool is generating first: it waits to hand it over before it reads the
        validation request."""
        while self.outstanding:
            self.outstanding -= 1
            self.received.append(self.client.receive(trainer.dp_rank, trainer.replica_group))
        self.sync(trainer)

    def _request(self, trainer, prompts, step):
        import dataclasses
        sampling = dataclasses.replace(trainer._sampling(train=True), seed=trainer.cfg.actor_rollout_ref.rollout.seed
                                       + 1000003 * (step - 1))  # the seed of its own step
        self.client.request(step, list(prompts.input_ids), list(prompts.indices), sampling, trainer.dp)
        self.outstanding += 1
