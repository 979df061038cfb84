"""The StepContext's phase mechanism (engine/experience/context.py): one call moves memory as the
schedule says, times the phase, tells the launcher, the collective watch and the comm timer, and
nested phases hand everything back to the outer one; phase names are one vocabulary.

A recording stand-in replaces the colocated engine (its own behaviour is tested against the real
trainer in tests/test_phases.py and tests/test_device_memory.py); everything else is real.
"""
import ast
import os
import types

import pytest
import torch

from engine.batch import Batch
from engine.config.phases import PHASE_NAMES, PHASES
from engine.experience.context import StepContext
from engine.phase import current_phase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Colocated:
    """Records the memory moves asked of it (the interface StepContext uses)."""

    def __init__(self):
        self.calls = []

    def enter(self, phase):
        self.calls.append(("enter", phase, current_phase()))

    def sync(self):
        self.calls.append(("sync", None, current_phase()))
        return types.SimpleNamespace(bytes=10)

    def rollout_ready(self):
        return True


def _ctx(**kw):
    reward_model = types.SimpleNamespace(rule_reward=True, url=None)
    derived = types.SimpleNamespace(config=types.SimpleNamespace(reward_model=reward_model))
    args = dict(derived=derived, colocated=Colocated(), rollout=None, reward_fn=None, reward_model=None, ref=None,
                actor=None, hf_config=None, loader=None, train_data=None, pad_id=0, eos_ids=[2], dp=1, dp_rank=0,
                rank=0, replicas=[[0]], replica_group=None, total_steps=3)
    args.update(kw)
    return StepContext(**args)


def test_a_phase_moves_memory_times_itself_and_tells_the_launcher_and_the_watch():
    watch, comm = types.SimpleNamespace(phase="startup"), types.SimpleNamespace(phase="other")
    ctx = _ctx(watch=watch, comm=comm)
    timings = ctx.begin_step()
    with ctx.phase("old_log_prob"):
        assert (current_phase(), watch.phase, comm.phase) == ("old_log_prob",) * 3
    assert ctx.colocated.calls == [("enter", "old_log_prob", "old_log_prob")]
    assert list(timings) == ["timing_s/old_log_prob"] and timings["timing_s/old_log_prob"] >= 0
    # between phases: the launcher says training, the watch keeps the last phase a collective ran in
    assert (current_phase(), watch.phase, comm.phase) == ("training", "old_log_prob", "other")


def test_a_phase_counts_its_cpu_seconds_apart_from_its_wall_seconds():
    """perf/cpu_s/<phase>: this process's CPU time, which waiting does not add to (on a shared
    machine, the figure the step benchmark compares beside wall-clock time)."""
    import time
    ctx = _ctx()
    timings = ctx.begin_step()
    with ctx.phase("gen"):
        time.sleep(0.2)
    with ctx.phase("ref"):
        end = time.process_time() + 0.1
        while time.process_time() < end:
            pass
    cpu = ctx.cpu_timings
    assert {k for k in cpu if k.startswith("perf/cpu_s/")} == {"perf/cpu_s/gen", "perf/cpu_s/ref"}
    assert set(timings) == {"timing_s/gen", "timing_s/ref"}
    assert timings["timing_s/gen"] >= 0.2 and cpu["perf/cpu_s/gen"] < 0.05
    assert cpu["perf/cpu_s/ref"] >= 0.1 and timings["timing_s/ref"] >= cpu["perf/cpu_s/ref"] - 0.01
    ctx.begin_step()
    assert ctx.cpu_timings == {}


def test_a_phase_counts_the_page_faults_it_takes():
    """perf/page_faults/<phase>: the pages the phase faulted in, here 8 MiB of fresh anonymous
    memory written once (2 048 pages of 4 KiB), against a phase that touches none."""
    import mmap
    ctx = _ctx()
    ctx.begin_step()
    with ctx.phase("ref"):
        region = mmap.mmap(-1, 8 << 20)
        for offset in range(0, 8 << 20, mmap.PAGESIZE):
            region[offset] = 1
        region.close()
    with ctx.phase("gen"):
        sum(range(1000))
    faults = ctx.cpu_timings
    pages = (8 << 20) // mmap.PAGESIZE
    assert pages <= faults["perf/page_faults/ref"] < pages + 200, faults
    assert faults["perf/page_faults/gen"] < 50, faults


def test_nested_phases_return_memory_and_names_to_the_outer_phase():
    ctx = _ctx()
    timings = ctx.begin_step()
    with ctx.phase("reward"):
        with ctx.phase("ref"):  # an implicit reward model's reference pass
            pass
        assert current_phase() == "reward"
    assert [c[1] for c in ctx.colocated.calls] == ["reward", "ref", "reward"]
    assert set(timings) == {"timing_s/reward", "timing_s/ref"}
    assert timings["timing_s/reward"] >= timings["timing_s/ref"]


def test_the_weight_sync_moves_memory_in_its_own_order_inside_its_phase():
    ctx = _ctx()
    timings = ctx.begin_step()
    assert ctx.sync_weights().bytes == 10
    assert ctx.colocated.calls == [("sync", None, "update_weights")]  # never enter("update_weights")
    with ctx.phase("gen"):
        with ctx.phase("update_weights"):  # a separate pool's send inside its generation
            pass
    assert ctx.colocated.calls[1:] == [("enter", "gen", "gen")]
    assert set(timings) == {"timing_s/update_weights", "timing_s/gen"}


def test_adv_moves_no_memory_and_unknown_phases_are_refused():
    ctx = _ctx()
    with ctx.phase("adv"):
        pass
    assert ctx.colocated.calls == []
    with pytest.raises(ValueError, match="unknown phase 'generate'"):
        with ctx.phase("generate"):
            pass
    assert current_phase() == "training"


def test_scoring_is_the_reward_phase():
    seen = []

    def reward_fn(responses, mask, ground_truths, data_sources, extra_infos, model_scores):
        seen.append(current_phase())
        return responses.float(), {"rule_score": [1.0, 0.0]}

    ctx = _ctx(reward_fn=reward_fn)
    timings = ctx.begin_step()
    batch = Batch({"responses": torch.tensor([[3, 4], [5, 6]]), "response_mask": torch.ones(2, 2)},
                  {"extra_info": [None, None], "ground_truth": ["a", "b"], "data_source": ["x", "x"]})
    extra = ctx.score(batch)
    assert seen == ["reward"] and extra == {"rule_score": [1.0, 0.0]}
    assert torch.equal(batch["token_level_scores"], torch.tensor([[3.0, 4.0], [5.0, 6.0]]))
    assert [c[1] for c in ctx.colocated.calls] == ["reward"] and "timing_s/reward" in timings


def _phase_literals():
    """Every string literal passed to a `.phase(...)` call in the code."""
    found = []
    for top in ("engine", "tools"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in (f for f in files if f.endswith(".py")):
                path = os.path.join(dirpath, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("phase", "enter") \
                            and node.args and isinstance(node.args[0], ast.Constant):
                        found.append((os.path.relpath(path, ROOT), node.args[0].value))
    return found


def test_one_phase_vocabulary():
    """The schedule's phases are verl's timer names; every phase the code names is one of them."""
    assert set(PHASES) <= set(PHASE_NAMES) and set(PHASE_NAMES) - set(PHASES) == {"adv"}
    literals = _phase_literals()
    assert len(literals) > 10
    assert [x for x in literals if x[1] not in PHASE_NAMES] == []
