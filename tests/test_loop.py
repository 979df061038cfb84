"""The loop shell (engine/loop.py) on fake hooks, no model, no process group: the order of its
calls, the validation and checkpoint cadence, the end of a run, resume (step, data position, the
task's state, the metrics log), a refused step's rollback, and a checkpoint without trainer
state."""
import contextlib
import json

import pytest

from engine import faults
from engine.config.schema import TridentConfig
from engine.loop import Loop


class FakeCheckpoints:
    """CheckpointManager's surface: save / resolve / load, keeping (workers, state) per step."""

    def __init__(self):
        self.saved = {}

    def save(self, step, workers, trainer_state, contents=("model", "optimizer", "extra")):
        state = dict(trainer_state) if "extra" in contents else {"step": step}
        self.saved[step] = (sorted(workers), state)
        return f"ckpt/global_step_{step}"

    def resolve(self, resume_mode, resume_from_path=None, verify=None):
        if resume_mode == "disable" or not self.saved:
            return None
        return f"ckpt/global_step_{max(self.saved)}"

    def load(self, path, workers, *, rng_seed=None, **_):
        step = int(path.rsplit("_", 1)[1])
        names, state = self.saved[step]
        assert names == sorted(workers)
        return dict(state)


class FakeLoader:
    def __init__(self):
        self.position = 0

    def next_batch(self):
        self.position += 1
        return self.position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]

    def seek(self, step):
        self.position = step


class Recorder(Loop):
    """Logs each hook it is called through into `events`."""

    def __init__(self, cfg, checkpoints=None, refuse=()):
        super().__init__(cfg, checkpoints=checkpoints)
        self.loader = FakeLoader()
        self.events, self.refuse, self.count = [], set(refuse), 0

    def start(self):
        self.events.append("start")

    def next_batch(self):
        self.events.append("next_batch")
        return self.loader.next_batch()

    def train_step(self, batch):
        self.events.append(f"train_step:{self.step_count}:fault_step={faults.current['step']}")
        self.count += 1
        return {"loss": float(batch), "private": 1.0}

    def after_step(self, metrics):
        metrics.pop("private")
        self.events.append(f"after_step:{self.step_count}")
        return self.step_count in self.refuse

    def rollback(self):
        self.refuse.discard(self.step_count)
        path = self.restore_latest()
        self.events.append(f"rollback->{self.step_count}:{path}")

    def validate(self):
        self.events.append(f"validate:{self.step_count}")
        return {"val/score": float(self.step_count)}

    def workers(self):
        return {"actor": object(), "critic": object()}

    @contextlib.contextmanager
    def checkpoint_phase(self):
        self.events.append(f"enter_checkpoint:{self.step_count}")
        yield
        self.events.append(f"exit_checkpoint:{self.step_count}")

    def save(self):
        self.events.append(f"save:{self.step_count}")
        super().save()

    def extra_state(self):
        return {"count": self.count}

    def load_extra_state(self, state):
        self.events.append(f"load_extra:{state['count']}")
        self.count = state["count"]

    def export_hf(self):
        self.events.append(f"export_hf:{self.step_count}")

    def shutdown(self):
        self.events.append("shutdown")


def _cfg(tmp_path, total, **trainer):
    cfg = TridentConfig()
    t = cfg.trainer
    t.total_training_steps, t.logger, t.log_dir = total, ["jsonl"], str(tmp_path / "logs")
    for key, value in trainer.items():
        setattr(t, key, value)
    return cfg


def _logged(tmp_path):
    return [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]


@pytest.fixture(autouse=True)
def _faults_reset():
    faults.reset()
    yield
    faults.reset()


def test_fresh_run_calls_the_hooks_in_order_on_cadence(tmp_path):
    cfg = _cfg(tmp_path, 5, test_freq=2, save_freq=2, save_hf=True)
    ckpt = FakeCheckpoints()
    loop = Recorder(cfg, ckpt)
    assert loop.fit() == 5
    step = ["next_batch", "train_step:{}:fault_step={}", "after_step:{}"]

    def steps(k):
        return [step[0], step[1].format(k - 1, k), step[2].format(k)]
    expected = (["start", "validate:0"] + steps(1) + steps(2)
                + ["validate:2", "save:2", "enter_checkpoint:2", "exit_checkpoint:2"] + steps(3) + steps(4)
                + ["validate:4", "save:4", "enter_checkpoint:4", "exit_checkpoint:4"] + steps(5)
                + ["validate:5", "save:5", "enter_checkpoint:5", "exit_checkpoint:5",
                   "export_hf:5", "shutdown"])
    assert loop.events == expected
    assert loop.first_step == 0
    # what a checkpoint holds: step, data position, the task's state, through workers()
    assert ckpt.saved[4] == (["actor", "critic"], {"step": 4, "loader": {"position": 4}, "count": 4})
    records = _logged(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in records if "val/score" in r] == [0, 2, 4, 5]
    assert all("private" not in r for r in records)


def test_no_validation_before_training_no_saves_no_export(tmp_path):
    cfg = _cfg(tmp_path, 3, test_freq=-1, save_freq=-1, val_before_train=True, save_hf=False)
    loop = Recorder(cfg, FakeCheckpoints())
    loop.fit()
    assert not [e for e in loop.events if e.split(":")[0] in ("validate", "save", "export_hf")]
    assert loop.events[-1] == "shutdown"
    # no checkpoint manager: save() writes nothing, resume starts fresh
    loop = Recorder(_cfg(tmp_path, 2, save_freq=1), None)
    loop.fit()
    assert "enter_checkpoint:1" not in loop.events and "save:1" in loop.events


def test_resume_continues_from_the_last_checkpoint(tmp_path):
    ckpt = FakeCheckpoints()
    Recorder(_cfg(tmp_path, 4, test_freq=2, save_freq=2), ckpt).fit()
    loop = Recorder(_cfg(tmp_path, 6, test_freq=2, save_freq=2), ckpt)
    assert loop.fit() == 6
    # resumed at 4: the task's state restored before start(); no validation before training
    assert loop.events[:3] == ["load_extra:4", "start", "next_batch"]
    assert loop.first_step == 4 and loop.count == 6 and loop.loader.position == 6
    assert "train_step:4:fault_step=5" in loop.events
    assert not any(e.startswith("train_step:3") for e in loop.events)
    assert [r["step"] for r in _logged(tmp_path)] == [0, 1, 2, 3, 4, 5, 6]


def test_refused_step_is_logged_rolled_back_and_retrained(tmp_path):
    cfg = _cfg(tmp_path, 4, test_freq=1, save_freq=2)
    loop = Recorder(cfg, FakeCheckpoints(), refuse={3})
    assert loop.fit() == 4
    at3 = loop.events.index("after_step:3")
    # refused: no validation, no save, straight to the rollback to step 2 (data position too)
    assert loop.events[at3 + 1:at3 + 5] == ["enter_checkpoint:3", "load_extra:2", "exit_checkpoint:2",
                                            "rollback->2:ckpt/global_step_2"]
    assert loop.events.count("train_step:2:fault_step=3") == 2  # step 3 runs again
    assert loop.loader.position == 4
    # the refused step's record is cut with the rollback; the re-run step logs once
    assert [r["step"] for r in _logged(tmp_path)] == [0, 1, 2, 3, 4]


def test_refused_step_without_a_rollback_fails_loudly(tmp_path):
    class NoRollback(Recorder):
        rollback = Loop.rollback
    with pytest.raises(NotImplementedError, match="no rollback"):
        NoRollback(_cfg(tmp_path, 2), None, refuse={1}).fit()


def test_checkpoint_without_trainer_state_seeks_the_data_to_the_step(tmp_path):
    ckpt = FakeCheckpoints()
    cfg = _cfg(tmp_path, 2, save_freq=2)
    cfg.actor_rollout_ref.actor.checkpoint.save_contents = ["model", "optimizer"]
    Recorder(cfg, ckpt).fit()
    assert ckpt.saved[2][1] == {"step": 2}
    loop = Recorder(_cfg(tmp_path, 3, save_freq=-1), ckpt)
    loop.resume()
    assert loop.step_count == 2 and loop.loader.position == 2 and loop.count == 0
    assert not any(e.startswith("load_extra") for e in loop.events)
