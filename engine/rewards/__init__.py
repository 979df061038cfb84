"""Rewards: rule scores (gsm8k, math, built-in tasks), reward-model scores, preference pairs,
and the manager that turns them into token-level rewards.

The names below are imported on first use, so that `engine.rewards.sandbox` (which config
validation reads) loads without torch and a bad recipe fails in a fraction of a second.

Tests: tests/test_rewards.py, tests/test_sandbox.py
"""
import importlib

_LAZY = {"RewardManager": "engine.rewards.manager", "default_compute_score": "engine.rewards.registry",
         "known_data_sources": "engine.rewards.registry", "register_reward": "engine.rewards.registry"}

__all__ = ["RewardManager", "default_compute_score", "known_data_sources", "register_reward"]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'engine.rewards' has no attribute {name!r}")
