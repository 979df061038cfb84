"""global_profiler (engine/profiler.py): the steps it names, and only those, run under torch's
profiler through the real trainer, each writing a trace whose phases are named ranges and a
table of each phase's time; keys that would profile nothing are refused."""
import gzip
import json
import os

import pytest

from tests.multirank import run_on_ranks
from tests.test_config_acts import DEMO, demo_trainer


def _profiled_fit(tmp):
    t = demo_trainer(["trainer.resume_mode=disable", "trainer.total_training_steps=2",
                      "global_profiler.tool=torch", "global_profiler.steps=[2]",
                      f"global_profiler.save_path={tmp}/profile"], tmp, world=1)
    t.fit()
    return sorted(os.listdir(os.path.join(tmp, "profile")))


def test_the_named_step_is_profiled_phase_by_phase(tmp_path):
    (files,) = run_on_ranks(_profiled_fit, 1, str(tmp_path))
    assert files == ["step2_rank0.json.gz", "step2_rank0.txt"]  # step 2 only, this rank's
    trace = json.load(gzip.open(tmp_path / "profile" / "step2_rank0.json.gz"))
    ranges = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("phase/")}
    assert {"phase/gen", "phase/ref", "phase/update_actor", "phase/update_weights"} <= ranges, ranges
    table = (tmp_path / "profile" / "step2_rank0.txt").read_text()
    rows = {line.split()[0]: float(line.split()[1]) for line in table.splitlines()[2:]
            if line.split() and line.split()[0] in {"gen", "update_actor"}}
    assert rows.keys() == {"gen", "update_actor"} and all(ms > 0 for ms in rows.values()), table
    assert "aten::mm" in table  # the ops table: the update's matmuls


@pytest.mark.parametrize("overrides, key, says", [
    (["global_profiler.tool=torch"], "global_profiler.steps", "name them"),
    (["global_profiler.steps=[2]"], "global_profiler.tool", "set global_profiler.tool=torch"),
    (["global_profiler.tool=torch", "global_profiler.steps=[0]"], "global_profiler.steps", "never runs"),
    (["global_profiler.tool=torch", "global_profiler.steps=[3]", "trainer.total_training_steps=2"],
     "global_profiler.steps", "1..2"),
    (["global_profiler.tool=nsys", "global_profiler.steps=[1]"], "global_profiler.tool", "torch"),
])
def test_a_profiler_that_would_not_run_is_refused(overrides, key, says):
    from engine.config import load_config
    from engine.config.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(DEMO, overrides)
    assert key in str(err.value) and says in str(err.value), str(err.value)


def _profiler(save_path):
    import types

    from engine.profiler import StepProfiler
    return StepProfiler(types.SimpleNamespace(tool="torch", steps=[1], save_path=str(save_path)), rank=0)


def test_a_profiler_that_fails_costs_the_profile_not_the_step(tmp_path, monkeypatch, capsys):
    import torch

    blocked = tmp_path / "a_file"
    blocked.write_text("")  # save_path is a file: the profile cannot be written
    ran = []
    with _profiler(blocked / "profile").step(1):
        ran.append(torch.ones(4).sum())
    assert ran and "step 1 not profiled on rank 0: could not write" in capsys.readouterr().out

    class Unstartable:
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            raise RuntimeError("CUPTI could not be initialised")

    monkeypatch.setattr(torch.profiler, "profile", Unstartable)
    with _profiler(tmp_path / "profile").step(1):
        ran.append(1)
    assert len(ran) == 2 and "could not start it (RuntimeError: CUPTI" in capsys.readouterr().out
    with pytest.raises(ValueError, match="the step's own"):  # the step's errors are its own
        with _profiler(tmp_path / "profile").step(1):
            raise ValueError("the step's own")
    capsys.readouterr()
    with _profiler(tmp_path / "profile").step(2):  # not a profiled step: nothing at all
        ran.append(2)
    assert not (tmp_path / "profile").exists() and capsys.readouterr().out == ""
