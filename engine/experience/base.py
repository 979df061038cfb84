"""The experience-source interface: where a PPO step's batch comes from.

A source gets the StepContext (engine/experience/context.py), never the trainer:

    prompts(ctx)                 the next step's prompts (the loader's next batch by default)
    collect(ctx, prompts)        -> (batch, metrics): this DP rank's training Batch for the step's
                                 prompts (prompt-major, rollout.n rows per prompt). A batch that
                                 already holds `token_level_scores` is not scored again (logged
                                 rewards, or a source that needed the scores to choose its rows)
    prepare(ctx, prompts)        runs when the loader makes a batch, in its prefetch thread with
                                 data.dataloader_num_workers > 0
    after_advantages(ctx, batch) may weigh the advantages (truncated IS against the behaviour
                                 policy, PF-PPO's reweighting) and leave tokens out of the policy
                                 update (rejection sampling, veto: `policy_keep`); returns metrics
    loader_state(ctx)            where the data stands for the steps trained so far
    separate / validate(ctx, ids) a separate pool's source validates through the pool
    state_dict() / load_state_dict(state)   the source's own trainer state (a replay buffer)

The sources: online.Online, pool.Pool, streaming.Streaming, logged.Logged,
dynamic_sampling.DynamicSampling, replay.Replay (wraps any of them); sources.build_experience picks one from the config.

Tests: tests/test_experience_parts.py, tests/test_trainer_paths.py, tests/test_streaming.py
"""
from megatron.core import parallel_state as ps

from engine.algorithms.correction import dp_sum, plan_of, rollout_correction


class Source:
    separate = False  # a separate rollout pool generates: the trainer validates through `validate`

    def __init__(self, cfg):
        self.correction = plan_of(cfg.algorithm.rollout_correction)

    def prompts(self, ctx):
        """The next step's prompts."""
        return ctx.loader.next_batch()

    def loader_state(self, ctx):
        """Where the data stands for the steps trained so far."""
        return ctx.loader.state_dict()

    def collect(self, ctx, prompts):
        raise NotImplementedError

    def prepare(self, ctx, prompts):
        pass

    def after_advantages(self, ctx, batch):
        """Rollout correction (algorithm.rollout_correction, engine/algorithms/correction.py): the
        advantages x the truncated IS weight; the tokens rejection sampling or the veto leave out
        as `policy_keep` (the trainer's policy update reads it); in bypass mode the rollout's
        log-probs become the policy loss's old ones. Its metrics on every batch with rollout and
        old log-probs, a correction configured or not."""
        if self.correction.bypass and "rollout_log_probs" not in batch:
            raise ValueError("algorithm.rollout_correction.bypass_mode=true: this step's responses came "
                             "without the rollout policy's log-probs; log them or set bypass_mode=false")
        if "rollout_log_probs" not in batch or "old_log_probs" not in batch:
            return {}
        weights, keep, metrics = rollout_correction(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], self.correction,
            reduce=dp_sum(ps.get_data_parallel_group()))
        if weights is not None:
            batch["advantages"] = batch["advantages"] * weights
        if self.correction.masks:
            batch["policy_keep"] = keep
        if self.correction.bypass:  # after the ratios above, which pi_old gives
            batch["old_log_probs"] = batch["rollout_log_probs"]
        return metrics

    def validate(self, ctx, prompt_ids):
        """A separate pool's responses to the validation prompts (sources with `separate`)."""
        raise NotImplementedError(f"{type(self).__name__} generates with the colocated rollout")

    def finish(self):
        """The run is over (a separate pool's client stops its servers)."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass
