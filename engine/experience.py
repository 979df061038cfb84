"""Where a PPO step's batch of experience comes from: the seam between the loop
(engine/trainer.py) and the ways of getting responses.

`Online` (the default, colocated hybrid engine): sync the actor's weights into the rollout
engines, generate the step's responses (and ReMax's greedy baselines), lay them out as this DP
rank's training Batch. Other sources (logged data, a replay buffer, dynamic sampling, a separate
rollout pool) implement the same `collect(trainer, prompts, timings) -> (batch, metrics)`.
"""


class Online:
    def prompts(self, trainer):
        return trainer.loader.next_batch()

    def loader_state(self, trainer):
        return trainer.loader.state_dict()

    def collect(self, trainer, prompts, timings):
        cfg = trainer.cfg
        with trainer._phase("update_weights", timings):
            sync = trainer.sync_weights()  # ends in the generate phase (engine/config/phases.py)
        with trainer._phase("gen", timings):
            batch = trainer.generate(prompts, trainer._sampling(train=True))
        if cfg.algorithm.adv_estimator == "remax":
            with trainer._phase("gen", timings):
                baseline = trainer.generate(prompts, trainer._sampling(train=True, greedy=True), n=1)
            batch["reward_baselines"] = trainer._scores(baseline).repeat_interleave(
                cfg.actor_rollout_ref.rollout.n)
        return batch, {"perf/update_weights_gb": sync.bytes / 1e9}


class Pool:
    """A separate rollout pool (engine/rollout/pool.py). With `off_policy_steps` k = 1, step
    s+1 is requested before step s trains, so the pool generates it meanwhile from the weights of
    update s-1: staleness 1, logged as rollout/staleness; the old log-probs are recomputed by the
    actor (the trainer turns on_policy_old_log_prob off)."""

    def __init__(self, client, off_policy_steps):
        from collections import deque
        self.client, self.k = client, off_policy_steps
        self.pending = deque()  # (prompts, loader state before they were drawn), oldest first
        self.sent = -1  # the step whose update the pool's weights are from (0: the initial ones)

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
        with trainer._phase("update_weights", timings):
            sent = self.sync(trainer)
        with trainer._phase("gen", timings):
            if step == 1 or step == trainer.first_step + 1:  # the first step asks for k more ahead
                self._request(trainer, self.pending[0][0], step)
                for ahead in range(1, self.k + 1):
                    if step + ahead <= last:
                        self._draw(trainer)
                        self._request(trainer, self.pending[-1][0], step + ahead)
            elif self.k == 0:  # on-policy: this step's prompts, with the weights just sent
                self._request(trainer, self.pending[0][0], step)
            elif step + self.k <= last:  # the step k ahead, generated while this one trains
                self._draw(trainer)
                self._request(trainer, self.pending[-1][0], step + self.k)
            got, version = self.client.receive(trainer.dp_rank, trainer.replica_group)
            self.pending.popleft()
        r = trainer.cfg.actor_rollout_ref.rollout
        from engine.rollout.batches import training_batch
        batch = training_batch(prompts, got, trainer._my_prompts(prompts), r.n, trainer.pad_id, r.prompt_length,
                               r.response_length, raw_chat=trainer.cfg.data.return_raw_chat)
        return batch, {"perf/update_weights_gb": sent / 1e9, "rollout/staleness": float(step - 1 - version)}

    def _request(self, trainer, prompts, step):
        import dataclasses
        sampling = dataclasses.replace(trainer._sampling(train=True), seed=trainer.cfg.actor_rollout_ref.rollout.seed
                                       + 1000003 * (step - 1))  # the seed of its own step
        self.client.request(step, list(prompts.input_ids), list(prompts.indices), sampling, trainer.dp)
