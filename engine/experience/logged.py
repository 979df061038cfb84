"""Offline PPO / GRPO from logged responses (`data.offline_path`, read by engine/data/logged.py):
no generation, no reward computation; the step's prompts are answered by the responses and
rewards someone logged. With algorithm.rollout_correction.rollout_is the update weighs each token
by min(pi_old / mu, rollout_is_threshold) against the logged behaviour log-probs
(engine/algorithms/correction.py).

The loader's prefetch thread (data.dataloader_num_workers) lays out the next step's Batch while
the current one trains (`Logged.prepare`). The layout is the rollout's
(engine/rollout/batches.training_batch) and the reward sits on the last response token, as the
reward manager puts it.

Tests: tests/test_offline_ppo.py, tests/test_experience_parts.py
"""
import threading

import torch

from engine.experience.base import Source
from engine.rewards.manager import last_token_index


class Logged(Source):
    """The step's logged groups as this DP rank's Batch; `token_level_scores` from the log, and
    `rollout_log_probs` the behaviour policy's when logged."""

    def prepare(self, ctx, prompts):
        prompts.meta["experience"] = self._layout(ctx, prompts)
        prompts.meta["prepared_in"] = threading.current_thread().name  # the prefetch thread, or main

    def collect(self, ctx, prompts):
        batch = prompts.meta.pop("experience", None)
        if batch is None:  # a batch the loader did not prepare
            batch = self._layout(ctx, prompts)
        return batch, {}

    @staticmethod
    def _layout(ctx, prompts):
        data = ctx.train_data
        rows = ctx.my_rows(prompts)
        got, scores = {}, []
        for i in rows:
            log = data.logged(prompts.indices[i])
            lps = log["log_probs"] or [[0.0] * len(t) for t in log["responses"]]
            got[i] = (log["responses"], lps, None, None, None)
            scores += log["scores"]
        batch = ctx.layout(prompts, got, rows=rows)
        if not data.has_log_probs:  # no behaviour policy logged: nothing to correct against
            batch = batch.select([k for k in batch.keys() if k != "rollout_log_probs"])
        mask = batch["response_mask"]
        token_scores = torch.zeros(mask.shape, dtype=torch.float32)
        token_scores[torch.arange(len(scores)), last_token_index(mask)] = torch.tensor(scores)
        batch["token_level_scores"] = token_scores
        return batch
