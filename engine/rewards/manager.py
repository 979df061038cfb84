"""RewardManager: responses -> per-sample scores -> token-level rewards [B, L].

Each sample's score goes on its last valid response token (the outcome-reward convention the
advantage estimators expect); every other token gets 0. Scores come from a rule reward
(`compute_score(data_source, solution_str, ground_truth, extra_info)`), from a reward model's
per-sequence scores passed in as `model_scores`, or from both added together.

A model's reward may instead be per token (reward_model.token_level): `margin` spreads its
sequence score evenly over the response's valid tokens (engine/rewards/preference.py
margin_token_rewards: the tokens sum to the score); `model_scores` of shape [B, L] are token
rewards already (`implicit`, DPO's) and are added as they are. Either way a row's token rewards
sum to its whole score.

With `num_workers > 0` the rule rewards run in a pool of Ray actors, so slow verifiers (sympy)
do not stall the training process; results come back in the original order.

Tests: tests/test_rewards.py, tests/test_token_rewards.py, tests/test_experience_parts.py,
tests/test_reward_managers.py, tests/test_remote_reward.py
"""
import os

import torch

from engine.rewards import sandbox
from engine.rewards.preference import margin_token_rewards
from engine.rewards.registry import compute_scores, default_compute_score

# verl's reward managers as Trident runs them: 'dapo' is verl's per-sample manager plus the overlong
# penalty, which reward_model.overlong_buffer adds under any manager here; 'prime' is per-sample
# scoring spread over worker processes, which reward_model.num_workers (a Ray pool) is
MANAGERS = ("naive", "batch", "dapo", "prime")
PRIME_NEEDS_WORKERS = ("reward_model.reward_manager='prime' scores in parallel processes: set "
                       "reward_model.num_workers=N (a pool of N scoring processes, e.g. 8), or use "
                       "reward_manager=naive")

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _score_items(compute_score, items):
    if compute_score is default_compute_score:  # batch rewards (sandboxed code) run together
        return compute_scores(items)
    return [compute_score(*item) for item in items]


class _ScoreWorker:
    """Ray actor body: scores a chunk of (data_source, solution_str, ground_truth, extra_info)."""

    def __init__(self, compute_score):
        self.compute_score = compute_score

    def score(self, items):
        return _score_items(self.compute_score, items)


def last_token_index(response_mask):
    """[B] index of each row's last valid token (0 for an empty response)."""
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    return (response_mask.bool() * (positions + 1)).argmax(-1)


def overlong_penalty(lengths, max_response_length, buffer_len, penalty_factor):
    """DAPO's overlong reward shaping (verl's formula): a response longer than
    max_response_length - buffer_len loses (length - that) / buffer_len x penalty_factor; never
    positive."""
    expected = max_response_length - buffer_len
    return torch.clamp(-(lengths.double() - expected) / buffer_len * penalty_factor, max=0.0)


class RewardManager:
    """`reward_manager` 'naive' scores sample by sample; 'batch' calls `compute_score` once with
    lists (verl's BatchRewardManager signature); 'dapo' is 'naive' (verl's DAPO manager is the
    per-sample manager with the overlong penalty); 'prime' is 'naive' over the `num_workers` pool
    (verl's PRIME manager scores in a process pool). `remote` (engine/rewards/remote.py, the
    reward_model.url client) scores in place of the rule rewards. `overlong` (reward_model.overlong_buffer)
    adds DAPO's length penalty under any manager, given the configured `max_response_length`."""

    def __init__(self, tokenizer, compute_score=None, num_workers=0, skip_special_tokens=False,
                 reward_manager="naive", overlong=None, max_response_length=None, token_level=None,
                 remote=None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.compute_score = compute_score or default_compute_score
        if reward_manager not in MANAGERS:
            raise ValueError(f"reward_model.reward_manager={reward_manager!r}: use one of {list(MANAGERS)}")
        if reward_manager == "prime" and int(num_workers) <= 0:
            raise ValueError(PRIME_NEEDS_WORKERS)
        if reward_manager == "batch" and compute_score is None:
            raise ValueError("reward_model.reward_manager='batch' needs custom_reward_function.path")
        self.batched = reward_manager == "batch"
        if remote is not None:  # a reward service (engine/rewards/remote.py): batched requests
            self.compute_score, self.batched = remote, True
        if token_level not in (None, "margin", "implicit"):
            raise ValueError(f"reward_model.token_level={token_level!r}: use null, 'margin' or 'implicit'")
        self.token_level = token_level
        self.overlong = overlong if overlong is not None and overlong.enable else None
        if self.overlong is not None and not max_response_length:
            raise ValueError("reward_model.overlong_buffer needs max_response_length")
        self.max_response_length = max_response_length
        self.num_workers = int(num_workers)
        if self.num_workers < 0:
            raise ValueError(f"reward num_workers={num_workers!r} must be >= 0 (0 scores in-process)")
        self._workers = None
        self._started_ray = False

    def _pool(self):
        if self._workers is None:
            import ray
            if not ray.is_initialized():
                # Workers must import engine.rewards by name, as the driver does.
                path = os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
                env = {"PYTHONPATH": path}
                if sandbox.ENV_VAR in os.environ:  # the configured sandbox limits
                    env[sandbox.ENV_VAR] = os.environ[sandbox.ENV_VAR]
                ray.init(num_cpus=self.num_workers, include_dashboard=False, log_to_driver=False,
                         runtime_env={"env_vars": env})
                self._started_ray = True
            actor = ray.remote(num_cpus=1)(_ScoreWorker)
            self._workers = [actor.remote(self.compute_score) for _ in range(self.num_workers)]
        return self._workers

    def score_texts(self, texts, ground_truths, data_sources, extra_infos=None):
        """Per-sample results of compute_score (float or dict), in input order."""
        n = len(texts)
        if not (len(ground_truths) == len(data_sources) == n):
            raise ValueError(f"got {n} responses, {len(ground_truths)} ground truths and "
                             f"{len(data_sources)} data sources; they must match")
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        items = list(zip(data_sources, texts, ground_truths, extra_infos))
        if self.batched:
            results = list(self.compute_score(list(data_sources), list(texts), list(ground_truths), extra_infos))
            if len(results) != n:
                raise ValueError(f"custom_reward_function returned {len(results)} results for {n} samples "
                                 f"(reward_manager=batch: one per sample)")
            return results
        if self.num_workers == 0 or n == 0:
            return _score_items(self.compute_score, items)
        import ray
        workers = self._pool()
        chunk = -(-n // len(workers))
        futures = [w.score.remote(items[i * chunk:(i + 1) * chunk]) for i, w in enumerate(workers)]
        return [result for part in ray.get(futures) for result in part]

    def decode(self, responses, response_mask):
        """Text of each response's valid tokens (the mask), without its final eos.

        Other special tokens stay in the text (unless skip_special_tokens=True): a policy must not
        be able to hide junk such as <pad> or <s> inside an answer that is then scored as clean.
        """
        eos = self.tokenizer.eos_token_id
        rows = []
        for ids, mask in zip(responses, response_mask):
            row = ids[mask.bool()].tolist()
            rows.append(row[:-1] if row and row[-1] == eos else row)
        return self.tokenizer.batch_decode(rows, skip_special_tokens=self.skip_special_tokens)

    def __call__(self, responses, response_mask, ground_truths=None, data_sources=None,
                 extra_infos=None, model_scores=None):
        """(token_level_scores [B, L] float32, reward_extra_info {name: list of B}).

        responses / response_mask: [B, L] right-padded response ids and their validity mask.
        model_scores: optional [B] reward-model scores, added to the rule scores (spread over the
        tokens with token_level='margin'), or [B, L] token rewards added token by token.
        """
        if responses.shape != response_mask.shape:
            raise ValueError(f"responses {tuple(responses.shape)} and response_mask "
                             f"{tuple(response_mask.shape)} must have the same shape")
        batch = responses.shape[0]
        scores = torch.zeros(batch, dtype=torch.float64)
        extra = {}
        if ground_truths is not None:
            texts = self.decode(responses, response_mask)
            results = self.score_texts(texts, ground_truths, data_sources or [None] * batch, extra_infos)
            rule = torch.tensor([float(r["score"] if isinstance(r, dict) else r) for r in results],
                                dtype=torch.float64)
            extra = _extra_fields(results)
            extra["rule_score"] = rule.tolist()
            scores += rule
        model_tokens = None  # [B, L] the model's reward per token, when it is not on the last one
        if model_scores is not None:
            model_scores = model_scores.detach().double().cpu()
            mask = response_mask.cpu().double()
            if model_scores.dim() == 2:
                if model_scores.shape != response_mask.shape:
                    raise ValueError(f"token-level model_scores {tuple(model_scores.shape)} must match the "
                                     f"responses {tuple(response_mask.shape)}")
                model_tokens = model_scores * mask
                model_scores = model_tokens.sum(-1)
            model_scores = model_scores.reshape(-1)
            if model_scores.shape[0] != batch:
                raise ValueError(f"model_scores has {model_scores.shape[0]} entries for {batch} responses")
            if model_tokens is None and self.token_level == "margin":
                model_tokens = margin_token_rewards(mask, mask, margin=model_scores[:, None])[0]
            extra["model_score"] = model_scores.tolist()
            if model_tokens is None:
                scores += model_scores
        if ground_truths is None and model_scores is None:
            raise ValueError("RewardManager needs ground_truths (rule rewards) or model_scores (reward model)")
        if self.overlong is not None:
            penalty = overlong_penalty(response_mask.sum(-1).cpu(), self.max_response_length,
                                       self.overlong.len, self.overlong.penalty_factor)
            extra["overlong_reward"] = penalty.tolist()
            extra["overlong"] = (penalty < 0).tolist()
            scores += penalty
        token_level = torch.zeros(response_mask.shape, dtype=torch.float64)
        token_level[torch.arange(batch), last_token_index(response_mask.cpu())] = scores
        if model_tokens is not None:
            token_level += model_tokens
        extra["score"] = token_level.sum(-1).tolist()
        return token_level.float().to(responses.device), extra

    def close(self):
        if self._workers is not None:
            import ray
            for worker in self._workers:
                ray.kill(worker)
            self._workers = None
            if self._started_ray:
                ray.shutdown()
                self._started_ray = False


def _extra_fields(results):
    """Dict results' fields other than "score", as lists (None where a sample lacks the field)."""
    keys = sorted({k for r in results if isinstance(r, dict) for k in r if k != "score"})
    return {k: [r.get(k) if isinstance(r, dict) else None for r in results] for k in keys}
