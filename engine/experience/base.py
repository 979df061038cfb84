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
                                 policy, PF-PPO's reweighting); returns metrics
    loader_state(ctx)            where the data stands for the steps trained so far
    state_dict() / load_state_dict(state)   the source's own trainer state (a replay buffer)

The sources: online.Online, pool.Pool, logged.Logged, dynamic_sampling.DynamicSampling,
replay.Replay (wraps any of them); sources.build_experience picks one from the config.

Tests: tests/test_experience_parts.py, tests/test_trainer_paths.py
"""
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.algorithms.correction import correction_metrics, rollout_is_weights


class Source:
    def __init__(self, cfg):
        self.correction = cfg.algorithm.rollout_correction

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

    def finish(self):
        """The run is over (a separate pool's client stops its servers)."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass
