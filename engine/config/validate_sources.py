"""Validation of data and rewards from outside Trident (engine/config/schema_sources.py): a user's
dataset class, HF dataset splits, a reward service, and verl's reward managers as Trident runs
them. One ConfigError naming key, value and fix each.

Tests: tests/test_data_sources.py, tests/test_remote_reward.py, tests/test_reward_managers.py
"""
from __future__ import annotations

import dataclasses
import os
import re
from urllib.parse import urlparse

from engine.config.checks import check_range, fail
from engine.config.schema import ConfigError, TridentConfig
from engine.config.schema_sources import RemoteRewardConfig


def validate_sources(cfg: TridentConfig) -> None:
    _custom_cls(cfg)
    rm = cfg.reward_model
    if rm.reward_manager == "prime" and rm.num_workers <= 0:
        from engine.rewards.manager import PRIME_NEEDS_WORKERS
        raise ConfigError(PRIME_NEEDS_WORKERS)
    if rm.url is None:
        for f in dataclasses.fields(RemoteRewardConfig):
            value = getattr(rm.remote, f.name)
            if value != getattr(RemoteRewardConfig(), f.name):
                fail(f"reward_model.remote.{f.name}", value, "acts only with reward_model.url (a reward "
                     "service); set the url or remove it")
        return
    _remote(cfg)


def _custom_cls(cfg: TridentConfig) -> None:
    d, p = cfg.data, "data.custom_cls"
    for key in ("train_split",):
        if not getattr(d, key):
            fail(f"data.{key}", getattr(d, key), "name the split to read, e.g. 'train'")
    c = d.custom_cls
    if c.path is None:
        if c.name is not None:
            fail(f"{p}.name", c.name, f"acts only with {p}.path (the Python file defining it); set both")
        return
    if not os.path.isfile(os.path.expanduser(c.path)):
        fail(f"{p}.path", c.path, "no such file; give the Python file defining the dataset class")
    if not c.name:
        fail(f"{p}.name", c.name, "name the dataset class in that file (cls(data_files, tokenizer, config) "
             "-> row dicts, engine/data/sources.py)")
    if d.builtin_task is not None or d.offline_path is not None:
        key = "data.builtin_task" if d.builtin_task is not None else "data.offline_path"
        fail(f"{p}.path", c.path, f"{key} is set too; use one source of prompts")


def _remote(cfg: TridentConfig) -> None:
    rm, r, p = cfg.reward_model, cfg.reward_model.remote, "reward_model.remote"
    url = urlparse(rm.url)
    if url.scheme not in ("http", "https") or not url.netloc:
        fail("reward_model.url", rm.url, "give the service's http(s) address, e.g. http://127.0.0.1:8000/score")
    for name, bound in (("batch_size", 1), ("max_concurrency", 1), ("max_retries", 0), ("max_tokens", 1)):
        check_range(r, p, name, ge=bound)
    check_range(r, p, "timeout_s", gt=0.0)
    check_range(r, p, "backoff_s", ge=0.0)
    check_range(r, p, "score_scale", gt=0.0)
    if cfg.custom_reward_function.path is not None:
        fail("reward_model.url", rm.url, "custom_reward_function.path is set too; a sample is scored by one "
             "of them: remove one")
    if rm.reward_manager in ("batch", "prime"):
        fail("reward_model.reward_manager", rm.reward_manager, "the reward service batches its own requests "
             "(reward_model.remote.batch_size, max_concurrency); use naive (or dapo)")
    if rm.num_workers > 0:
        fail("reward_model.num_workers", rm.num_workers, "the reward service's requests run in threads "
             "(reward_model.remote.max_concurrency), not in the rule rewards' pool; set 0")
    if not rm.rule_reward:
        fail("reward_model.rule_reward", False, "the reward service scores in the rule rewards' place; set "
             "rule_reward=true (or remove reward_model.url)")
    if r.mode == "openai":
        if not cfg.data.return_raw_chat:
            fail("data.return_raw_chat", False, "a judge (reward_model.remote.mode=openai) reads the prompt: "
                 "set data.return_raw_chat=true")
        if not r.model:
            fail(f"{p}.model", r.model, "mode=openai sends a chat-completions request: name the judge model")
        try:
            r.prompt_template.format(prompt="", response="", ground_truth="")
        except (KeyError, IndexError, ValueError) as e:
            fail(f"{p}.prompt_template", r.prompt_template, f"bad placeholder ({e}); use {{prompt}}, "
                 "{response} and {ground_truth}")
        try:
            re.compile(r.score_regex)
        except re.error as e:
            fail(f"{p}.score_regex", r.score_regex, f"not a regular expression ({e})")
    if r.api_key_env is not None and not os.environ.get(r.api_key_env):
        fail(f"{p}.api_key_env", r.api_key_env, "that environment variable is not set; export it (the bearer "
             "token) or remove the key")
