"""Trident's RL engine: what a PPO step is (config, trainer, workers, algorithms, rollout, rewards).

Importing it defers what Megatron imports and never uses and makes the garbage collector run
less often during start-up (engine/lazy_imports.py).

Tests: tests/test_e2e.py, tests/test_layering.py, tests/test_lazy_imports.py
"""
from engine import lazy_imports

lazy_imports.install()
