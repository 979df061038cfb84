"""Trident's RL engine: what a PPO step is (config, trainer, workers, algorithms, rollout, rewards).

Tests: tests/test_e2e.py, tests/test_layering.py
"""
