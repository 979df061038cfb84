"""Recipe sections for data and rewards from outside Trident: a user's dataset class (verl's
`data.custom_cls`) and a reward service (`reward_model.url`, `reward_model.remote.*`). Part of
the schema (engine/config/schema.py nests them); their checks are engine/config/validate_sources.py.

Tests: tests/test_data_sources.py, tests/test_remote_reward.py, tests/test_config_keys.py
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

RemoteMode = Literal["json", "openai"]
OnFailure = Literal["zero", "skip", "stop"]

DEFAULT_JUDGE_PROMPT = ("Rate the response to the question from 0 to 10 (10: correct and complete).\n"
                        "Question: {prompt}\nReference answer: {ground_truth}\nResponse: {response}\n"
                        "Reply with the number only.")


@dataclass
class CustomClsConfig:
    """verl's data.custom_cls: a dataset class from a Python file (engine/data/sources.py says the
    interface: cls(data_files, tokenizer, config) -> a sequence of row dicts)."""
    path: Optional[str] = None
    name: Optional[str] = None


@dataclass
class RemoteRewardConfig:
    """How reward_model.url is called (engine/rewards/remote.py)."""
    # json: POST {"samples": [...]} -> {"scores": [...]}; openai: a chat-completions judge, one
    # request per sample, its reply's number (score_regex) / score_scale is the score
    mode: RemoteMode = "json"
    batch_size: int = 16  # samples per request (json mode)
    max_concurrency: int = 8  # requests in flight at once (per model replica)
    timeout_s: float = 30.0  # per attempt
    max_retries: int = 2  # attempts after the first, with backoff_s x 2^k between them
    backoff_s: float = 0.5
    # a sample whose request failed every attempt: scored 0 (zero), scored 0 and trained on by no
    # gradient (skip: its advantages are zeroed), or the run stops with one line (stop)
    on_failure: OnFailure = "stop"
    model: Optional[str] = None  # openai: the judge model's name (required there)
    prompt_template: str = DEFAULT_JUDGE_PROMPT  # openai: {prompt}, {response}, {ground_truth}
    score_regex: str = r"-?\d+(?:\.\d+)?"  # openai: the reply's last match is the score
    score_scale: float = 10.0  # openai: score = number / score_scale
    max_tokens: int = 16  # openai: the judge's reply length
    api_key_env: Optional[str] = None  # the environment variable holding a bearer token (never the key)
