"""torch's profiler over chosen training steps: `global_profiler` (verl's keys).

    global_profiler:
      tool: torch          # null: off
      steps: [2, 5]        # the training steps profiled (1-based, as logged)
      save_path: outputs/profile

Each profiled step writes, on every rank, into save_path:

    step{N}_rank{R}.json.gz   the chrome trace (chrome://tracing, Perfetto); each phase of the step
                              is a range named phase/<name> (verl's timer names: gen, ref,
                              update_actor, ...), the ops and kernels it ran nested in it
    step{N}_rank{R}.txt       each phase's wall and device time, then the ops by self device time
                              (self CPU time without a GPU), the first ROWS

Profiling costs time (the step it watches is slower): the step's timings are logged as measured.

Tests: tests/test_profiler.py
"""
import contextlib
import os

import torch

PHASE_RANGE = "phase/"  # the prefix of a phase's range in the trace (engine/experience/context.py)
ROWS = 40


def phase_range(name: str):
    """The profiler range around a phase; costs nothing measurable when no profiler runs."""
    return torch.profiler.record_function(PHASE_RANGE + name)


class StepProfiler:
    def __init__(self, cfg, rank: int):
        """cfg: the validated `global_profiler` section."""
        self.steps = set(cfg.steps or ()) if cfg.tool == "torch" else set()
        self.save_path = cfg.save_path
        self.rank = rank

    @contextlib.contextmanager
    def step(self, n: int):
        """Profile training step `n` (1-based) if it is one of the configured steps."""
        if n not in self.steps:
            yield
            return
        cuda = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # a profiler that cannot start or write (no CUPTI, a full disk) costs the profile, never
        # the step: one line says so and the run goes on
        try:
            prof = torch.profiler.profile(activities=activities)
            prof.__enter__()
        except Exception as err:  # noqa: BLE001 - any failure of the profiler itself
            self._skipped(n, "start", err)
            yield
            return
        try:
            yield
        finally:
            try:
                if cuda:
                    torch.cuda.synchronize()
                prof.__exit__(None, None, None)
                self._write(prof, n, cuda)
            except Exception as err:  # noqa: BLE001
                self._skipped(n, "write", err)

    def _skipped(self, n, what, err):
        print(f"profiler: step {n} not profiled on rank {self.rank}: could not {what} it "
              f"({type(err).__name__}: {err}); training goes on", flush=True)

    def _write(self, prof, n, cuda):
        os.makedirs(self.save_path, exist_ok=True)
        stem = os.path.join(self.save_path, f"step{n}_rank{self.rank}")
        prof.export_chrome_trace(stem + ".json.gz")
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        with open(stem + ".txt", "w") as f:
            f.write(f"step {n}, rank {self.rank}: phases (ms)\n")
            f.write(phase_table(prof.events()) + "\n\n")
            f.write(f"ops by {sort}\n")
            f.write(prof.key_averages().table(sort_by=sort, row_limit=ROWS) + "\n")
        if self.rank == 0:
            print(f"profiler: step {n} -> {stem}.txt, .json.gz (every rank writes its own)", flush=True)


def phase_table(events) -> str:
    """One line per phase range: its wall time on the host and the device time of what it ran."""
    rows = [(e.name[len(PHASE_RANGE):], e.cpu_time_total / 1e3, e.device_time_total / 1e3)
            for e in events if e.name.startswith(PHASE_RANGE)]
    lines = [f"{'phase':<16} {'wall_ms':>10} {'device_ms':>10}"]
    lines += [f"{name:<16} {wall:>10.1f} {device:>10.1f}" for name, wall, device in rows]
    return "\n".join(lines)
