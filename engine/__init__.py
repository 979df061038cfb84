"""Trident's RL engine: what a PPO step is (config, trainer, workers, algorithms, rollout, rewards)."""
