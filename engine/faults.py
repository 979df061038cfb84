"""Faults injected on purpose, to prove the guards work (tests; never set in production).

TRIDENT_FAULTS holds a JSON list of faults; each fires where the code asks `fault(kind, ...)`
and every field it names matches (absent fields match anything):

    [{"kind": "nan_loss", "step": 2}]                       the actor's loss is NaN at step 2
    [{"kind": "nan_loss", "every": true}]                   ... at every step
    [{"kind": "nan_loss", "step": 2, "once": true}]         ... the first time step 2 runs only
    [{"kind": "oom", "step": 2, "micro": 1, "rank": 0}]     an out-of-memory in a micro-batch
    [{"kind": "hang", "step": 2, "phase": "update_actor", "rank": 1}]   a rank stops answering
    [{"kind": "kill", "step": 2, "phase": "ref", "rank": 1}]            a rank dies (SIGKILL)
    [{"kind": "kill", "phase": "pool_generate", "call": 2, "incarnation": 0, "rank": 3}]
                    a rollout pool rank dies after its 2nd generation (its replacement does not)

`step` counts training steps from 1; an "oom" fires once per matching place (a retry passes), as
does any fault with "once" (a transient fault: a step re-run after a rollback passes).

Tests: tests/test_faults.py, tests/test_loop.py, tests/test_launch_ray.py
"""
import json
import os
import signal
import time

ENV = "TRIDENT_FAULTS"
_fired = set()
current = {"step": 0}  # the trainer keeps the current step here
_passes = {}  # step -> how many times it has started (a rollback re-runs steps)


class SimulatedOOM(RuntimeError):
    """The CPU stand-in for torch.OutOfMemoryError."""


def _faults():
    text = os.environ.get(ENV)
    return json.loads(text) if text else []


def reset():
    """Forget which faults fired and which steps ran (a process that runs several trainers)."""
    _fired.clear()
    _passes.clear()
    current["step"] = 0


def set_step(step):
    current["step"] = step
    _passes[step] = _passes.get(step, 0) + 1


def fault(kind, **where):
    """The fault of `kind` planned for this place, or None (cheap when none is planned)."""
    if ENV not in os.environ:
        return None
    here = dict(current, rank=int(os.environ.get("RANK", "0")), **where)
    for i, f in enumerate(_faults()):
        if f["kind"] != kind:
            continue
        keys = [k for k in f if k not in ("kind", "every", "once")]
        if f.get("every") and "step" in keys:
            keys.remove("step")
        if all(here.get(k) == f[k] for k in keys):
            if f.get("once") and _passes.get(current["step"], 1) > 1:
                continue  # transient: a re-run of the step passes
            if kind == "oom":
                tag = (i, tuple(sorted(here.items())))
                if tag in _fired:
                    continue
                _fired.add(tag)
            return f
    return None


def act(phase, **where):
    """Hang or die here when planned (trainer phases call this; `where`: more fields to match)."""
    if fault("hang", phase=phase, **where):
        while True:  # a rank that stops answering: its peers time out in their collective
            time.sleep(3600)
    if fault("kill", phase=phase, **where):
        os.kill(os.getpid(), signal.SIGKILL)
