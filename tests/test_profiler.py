"""global_profiler (engine/profiler.py): the steps it names, and only those, run under torch's
profiler through the real trainer, each writing a trace whose phases are named ranges and a
table of each phase's time; keys that would profile nothing are refused."""
import gzip
import json
import os

import pytest

from tests.multirank import run_on_ranks
from tests.test_config_acts import DEMO, _trainer


def _profiled_fit(tmp):
    t = _trainer(["trainer.resume_mode=disable", "trainer.total_training_steps=2",
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
