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
"""
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


def build_experience(cfg):
    """The source a config asks for (the modules import this one: imported here)."""
    if cfg.data.offline_path is not None:
        from engine.experience_offline import Logged
        source = Logged(cfg)
    elif cfg.algorithm.filter_groups.enable:
        from engine.dynamic_sampling import DynamicSampling
        source = DynamicSampling(cfg)
    else:
        source = Online(cfg)
    if cfg.algorithm.replay.enable:
        from engine.replay import Replay
        source = Replay(cfg, source)
    return source
