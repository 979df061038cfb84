"""Validation of `global_profiler` (engine/profiler.py): a profiler that would never run, or a
step list without a profiler, is refused rather than ignored.

Tests: tests/test_profiler.py
"""
from __future__ import annotations

from engine.config.checks import fail
from engine.config.schema import TridentConfig


def validate_profiler(cfg: TridentConfig) -> None:
    g, total = cfg.global_profiler, cfg.trainer.total_training_steps
    if g.tool is None:
        if g.steps:
            fail("global_profiler.steps", g.steps, "no profiler runs without global_profiler.tool; "
                 "set global_profiler.tool=torch (or remove steps)")
        return
    if not g.steps:
        fail("global_profiler.steps", g.steps, f"global_profiler.tool={g.tool} profiles the training "
             "steps named here; name them, e.g. [2] (or set global_profiler.tool=null)")
    for step in g.steps:
        if step < 1 or (total is not None and step > total):
            fail("global_profiler.steps", g.steps, f"step {step} never runs: the run's steps are 1.."
                 f"{total if total is not None else 'N'}; name steps in that range")
    if not g.save_path:
        fail("global_profiler.save_path", g.save_path, "name the directory the profiles go to")
