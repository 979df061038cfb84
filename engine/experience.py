"""Where a PPO step's batch of experience comes from: the seam between the loop
(engine/trainer.py) and the ways of getting responses.

`Online` (the default, colocated hybrid engine): sync the actor's weights into the rollout
engines, generate the step's responses (and ReMax's greedy baselines), lay them out as this DP
rank's training Batch. Other sources (logged data, a replay buffer, dynamic sampling, a separate
rollout pool) implement the same `collect(trainer, prompts, timings) -> (batch, metrics)`.
"""


class Online:
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
