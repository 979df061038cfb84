"""Online experience: sync the actor's weights into the colocated rollout engines, generate
this step's responses (and ReMax's greedy baselines), lay them out as this DP rank's Batch.

Tests: tests/test_trainer_paths.py, tests/test_e2e.py
"""
from engine.experience.base import Source


class Online(Source):
    def collect(self, ctx, prompts):
        sync = ctx.sync_weights()  # ends in the gen phase's memory (engine/config/phases.py)
        return self.generate(ctx, prompts), sync.metrics()

    def generate(self, ctx, prompts, sampling=None):
        """This DP rank's Batch of the prompts' responses (collective), with ReMax's baselines."""
        cfg = ctx.cfg
        with ctx.phase("gen"):
            batch = ctx.generate(prompts, sampling or ctx.sampling(train=True))
        if cfg.algorithm.adv_estimator == "remax":
            with ctx.phase("gen"):
                baseline = ctx.generate(prompts, ctx.sampling(train=True, greedy=True), n=1)
            batch["reward_baselines"] = ctx.sequence_scores(baseline).repeat_interleave(
                cfg.actor_rollout_ref.rollout.n)
        return batch
