"""Every tool that takes a recipe takes its `key=value` overrides before or after its options
(engine/errors.py ArgumentParser): tools/plan.py prints the same plan either way, and the
benchmark's `step`, the Ray launcher and engine.train read the same overrides in the same order."""
import json
import os

import pytest

from engine.errors import ArgumentParser, UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "qwen2_5_7b_gsm8k_ppo.yaml")
OVERRIDES = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
             "actor_rollout_ref.rollout.tensor_model_parallel_size=4"]


def _plan(argv, tmp_path, capsys):
    from tools.plan import main_raising
    out = tmp_path / f"plan{len(list(tmp_path.iterdir()))}.json"
    main_raising(argv + ["--json", str(out)])
    return capsys.readouterr().out, json.loads(out.read_text())


def test_plan_overrides_after_the_options_give_the_same_plan(tmp_path, capsys):
    before = _plan([RECIPE, *OVERRIDES, "--gpus", "16", "--gpu-mem", "141"], tmp_path, capsys)
    after = _plan([RECIPE, "--gpus", "16", "--gpu-mem", "141", *OVERRIDES], tmp_path, capsys)
    split = _plan([RECIPE, OVERRIDES[0], "--gpus", "16", OVERRIDES[1], "--gpu-mem", "141"], tmp_path, capsys)
    plain = _plan([RECIPE, "--gpus", "16", "--gpu-mem", "141"], tmp_path, capsys)
    assert before == after == split
    assert before != plain  # the overrides acted (TP 4, not the recipe's)
    assert before[1] != plain[1]


def test_every_recipe_tool_reads_late_overrides_in_order():
    from engine.launch_ray import parse_args
    from tools import bench_step
    p = ArgumentParser(prog="benchmark step")
    bench_step.add_arguments(p)
    a = p.parse_args(["a=1", "--nproc", "4", "b=2", "--steps", "2", "c=3"])
    assert (a.overrides, a.nproc, a.steps) == (["a=1", "b=2", "c=3"], 4, 2)
    r = parse_args(["r.yaml", "--cpus-per-rank", "2", "a=1", "b=2"])
    assert (r.recipe, r.overrides, r.cpus_per_rank) == ("r.yaml", ["a=1", "b=2"], 2)
    from tools.plan import main_raising
    with pytest.raises(UsageError, match="unrecognized arguments: stray"):
        main_raising([RECIPE, "--gpus", "8", "stray"])  # a word that is no override is still refused


def test_benchmark_step_subcommand_takes_late_overrides(monkeypatch):
    from tools import benchmark, bench_step
    seen = {}
    monkeypatch.setattr(bench_step, "check", lambda args: seen.setdefault("args", args))
    monkeypatch.setitem(benchmark.SUBCOMMANDS, "step", (bench_step.add_arguments, lambda args: {}))
    benchmark.main_raising(["step", "--nproc", "2", "data.train_batch_size=8", "--steps", "1",
                            "trainer.seed=3"])
    assert seen["args"].overrides == ["data.train_batch_size=8", "trainer.seed=3"]
