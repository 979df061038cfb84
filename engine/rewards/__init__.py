"""Rewards: rule scores (gsm8k, math, built-in tasks), reward-model scores, preference pairs,
and the manager that turns them into token-level rewards."""
from engine.rewards.manager import RewardManager
from engine.rewards.registry import default_compute_score, known_data_sources, register_reward

__all__ = ["RewardManager", "default_compute_score", "known_data_sources", "register_reward"]
