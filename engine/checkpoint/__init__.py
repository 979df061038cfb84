"""Checkpoints of a run: manager.py (CheckpointManager: save / load / resolve / verify),
files.py (manifest, fsync, safe pickles, collective helpers, the errors), state.py (what a
worker and a rank hold: model, optimizer, RNG, and the checks on them).

Tests: tests/test_checkpoint.py, tests/test_checkpoint_verify.py, tests/test_resume_rng.py
"""
from engine.checkpoint.files import CheckpointError, NonFiniteError, resume_path_problem
from engine.checkpoint.manager import CheckpointManager
from engine.checkpoint.state import reseed_rng

__all__ = ["CheckpointError", "CheckpointManager", "NonFiniteError", "reseed_rng",
           "resume_path_problem"]
