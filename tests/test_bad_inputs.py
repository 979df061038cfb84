"""The bad-input corpus (tests/bad_inputs/*.yaml): every entry point, run as a subprocess on a
bad recipe, data file, checkpoint, model config or argument, must print ONE line
`error: <message>` naming the field and the fix, show no traceback, exit non-zero (2 for the
user's mistakes; torchrun itself exits 1 when a worker fails) and leave nothing behind in the
case's directory (no half-written output, no stray logs or checkpoints).

A case (one list item of a YAML file) says:

    id        name of the case (unique)
    cmd       [entry point, args...]; entry points: see ENTRY_POINTS; args may use the
              placeholders {case} (the case's directory, also the working directory), {demo}
              (recipes/tiny_cpu_demo.yaml) and the shared fixtures {tokenizer}, {hf_small},
              {hf_wide}, {mcore_small}, {step_small} (built once per session, on first use)
    files     {relative path: spec} created in {case} first; spec keys: copy (a fixture's
              name; + remove [files]), text (+ encoding), bytes (that many random bytes),
              parquet (rows), json, hf_config ({family, **overrides}: config.json into the
              directory), dir (an empty directory), truncate (N bytes, or {file: N} inside a
              copied directory)
    env       extra environment variables (e.g. WORLD_SIZE=4: rank 0's view of a 4-rank job)
    expect    fragments the error line must contain
    exit      the exit code (default 2)
    allow_new paths (relative to {case}) the command may create (default none)
"""
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "tests", "bad_inputs")
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "engine.train"]
ENTRY_POINTS = {
    "train": [PY, "-m", "engine.train"],
    "torchrun": TORCHRUN,
    "plan": [PY, os.path.join(ROOT, "tools", "plan.py")],
    "convert": [PY, os.path.join(ROOT, "tools", "convert_checkpoint.py")],
    "benchmark": [PY, os.path.join(ROOT, "tools", "benchmark.py")],
    "bench_reshard": [PY, os.path.join(ROOT, "tools", "bench_reshard.py")],
    "prepare_data": [PY, os.path.join(ROOT, "tools", "prepare_data.py")],
    "gpu_report": [PY, os.path.join(ROOT, "tools", "gpu_report.py")],
}
# a Python warning and the source line it quotes (megatron warns on import without TE / Apex)
WARNING = re.compile(r"^\S.*:\d+: \w*Warning: |^  warnings\.warn\(")


def load_cases():
    cases = []
    for path in sorted(glob.glob(os.path.join(CORPUS, "*.yaml"))):
        with open(path) as f:
            for case in yaml.safe_load(f):
                case["category"] = os.path.basename(path)[:-5]
                cases.append(case)
    ids = [c["id"] for c in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return cases


CASES = load_cases()


# -- shared fixtures (built on first use, once per session) ------------------------------------
class Fixtures:
    def __init__(self, root):
        self.root = root
        self.built = {}
        self.lock = threading.RLock()  # cases run two at a time (CaseRunner); a fixture once

    def path(self, name):
        with self.lock:
            if name not in self.built:
                target = os.path.join(self.root, name)
                getattr(self, f"_make_{name}")(target)
                self.built[name] = target
            return self.built[name]

    def _make_tokenizer(self, target):
        from engine.tasks import save_tokenizer
        save_tokenizer(target)

    def _make_hf_small(self, target):
        from tests.test_hf_parity import save_random_model
        from tests.tiny_models import tiny_config
        save_random_model(tiny_config("llama", num_hidden_layers=2), target)

    def _make_hf_wide(self, target):  # the same family and depth, twice as wide: another model size
        from tests.tiny_models import tiny_config
        tiny_config("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128).save_pretrained(target)

    def _make_mcore_small(self, target):
        proc = subprocess.run(ENTRY_POINTS["convert"] + ["hf-to-mcore", "--hf", self.path("hf_small"),
                                                         "--out", target],
                              capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
        assert proc.returncode == 0, proc.stderr[-3000:]

    def _make_step_small(self, target):
        """A complete training checkpoint (manifest, meta.json, actor/) of the small model: a
        checkpoint of another model for the tiny demo recipe."""
        from engine.checkpoint.files import save_safe, write_manifest
        step = os.path.join(target, "global_step_1")
        shutil.copytree(self.path("mcore_small"), os.path.join(step, "actor"),
                        ignore=shutil.ignore_patterns("hf_config", "trident_meta.json"))
        os.makedirs(os.path.join(step, "rng"))
        save_safe({"step": 1}, os.path.join(step, "trainer_state.pt"), "trainer_state")
        with open(os.path.join(step, "meta.json"), "w") as f:
            json.dump(dict(version=2, step=1, layout=dict(world_size=1), optim_sharding="dp_reshardable",
                           workers=dict(actor=dict(optimizer=False, scheduler=False, chunks=1,
                                                   adam_step=None))), f)
        write_manifest(step)


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory):
    return Fixtures(str(tmp_path_factory.mktemp("bad_input_fixtures")))


def _env(extra=None):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra or {})
    return env


_PLACEHOLDER = re.compile(r"\{(case|demo|root|tokenizer|hf_small|hf_wide|mcore_small|step_small)\}")


def _expand(text, case_dir, fixtures):
    def value(m):
        name = m.group(1)
        if name == "case":
            return case_dir
        if name == "demo":
            return os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
        if name == "root":
            return ROOT
        return fixtures.path(name)
    return _PLACEHOLDER.sub(value, str(text))


def _create(case_dir, rel, spec, fixtures):
    path = os.path.join(case_dir, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if "copy" in spec:  # first, so that the keys below can change the copy
        src = fixtures.path(spec["copy"])
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, path)
        for name in spec.get("remove", []):
            target = os.path.join(path, name)
            (shutil.rmtree if os.path.isdir(target) else os.remove)(target)
    if "text" in spec:
        with open(path, "wb") as f:
            f.write(_expand(spec["text"], case_dir, fixtures).encode(spec.get("encoding", "utf-8")))
    if "bytes" in spec:
        with open(path, "wb") as f:
            f.write(random.Random(rel).randbytes(spec["bytes"]))
    if "parquet" in spec:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(spec["parquet"]), path)
    if "json" in spec:
        with open(path, "w") as f:
            json.dump(spec["json"], f)
    if "hf_config" in spec:  # config.json in the directory `path`
        from tests.tiny_models import tiny_config
        kw = dict(spec["hf_config"])
        tiny_config(kw.pop("family", "llama"), **kw).save_pretrained(path)
    if spec.get("dir"):
        os.makedirs(path)
    cuts = spec.get("truncate") or {}
    for name, size in ({"": cuts} if isinstance(cuts, int) else cuts).items():
        with open(os.path.join(path, name) if name else path, "r+b") as f:
            f.truncate(size)
    assert os.path.exists(path), f"file spec {spec} created nothing"


def _listing(case_dir):
    out = set()
    for folder, dirs, files in os.walk(case_dir):
        for name in dirs + files:
            out.add(os.path.relpath(os.path.join(folder, name), case_dir))
    return out


def _params():
    """`make test` runs the first case of each (file, entry point); the rest are marked slow
    (`make test-all` runs the whole corpus: 89 subprocesses, ~3.5 min on 2 cores)."""
    seen, params = set(), []
    for c in CASES:
        key = (c["category"], c["cmd"][0])
        marks = [pytest.mark.slow] if key in seen else []
        seen.add(key)
        params.append(pytest.param(c, id=f"{c['category']}-{c['id']}", marks=marks))
    return params


class CaseRunner:
    """Runs the session's selected cases ahead of their tests, two at a time in corpus order (a
    torchrun case, two ranks, alone): each case is one short subprocess, mostly a single
    process's imports, so one at a time left a core idle. A test waits for its case's result."""

    def __init__(self, cases, fixtures, tmp_path_factory):
        self.fixtures, self.tmp = fixtures, tmp_path_factory
        self.free, self.cond = 2, threading.Condition()
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.futures = {c["id"]: self.pool.submit(self._run, c) for c in cases}

    def result(self, case):
        return self.futures[case["id"]].result()

    def _run(self, case):
        cores = 2 if case["cmd"][0] == "torchrun" else 1
        with self.cond:
            self.cond.wait_for(lambda: self.free >= cores)
            self.free -= cores
        try:
            return run_case(case, self.fixtures, str(self.tmp.mktemp("case") / "case"))
        finally:
            with self.cond:
                self.free += cores
                self.cond.notify_all()


def run_case(case, fixtures, case_dir):
    """(cmd, finished process, listing before, listing after) of one case run in `case_dir`."""
    os.makedirs(case_dir)
    for rel, spec in (case.get("files") or {}).items():
        _create(case_dir, rel, spec, fixtures)
    before = _listing(case_dir)
    entry, *args = case["cmd"]
    cmd = ENTRY_POINTS[entry] + [_expand(a, case_dir, fixtures) for a in args]
    env = _env({k: _expand(v, case_dir, fixtures) for k, v in (case.get("env") or {}).items()})
    proc = subprocess.run(cmd, cwd=case_dir, env=env, capture_output=True, text=True,
                          timeout=case.get("timeout", 300))
    return cmd, proc, before, _listing(case_dir)


@pytest.fixture(scope="session")
def runner(request, fixtures, tmp_path_factory):
    selected = [item.callspec.params["case"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_bad_input"]
    runner = CaseRunner(selected, fixtures, tmp_path_factory)
    yield runner
    runner.pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("case", _params())
def test_bad_input(case, runner):
    cmd, proc, before, after = runner.result(case)
    entry = case["cmd"][0]
    report = f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"

    assert proc.returncode == case.get("exit", 2), report
    assert "Traceback" not in proc.stdout, report
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, report  # one line, printed once per job (rank 0)
    line = errors[0]
    assert line.startswith("error: "), report
    for fragment in case["expect"]:
        assert fragment in line, f"{fragment!r} not in the error line\n{report}"
    lines = [x for x in proc.stderr.splitlines() if x.strip() and not WARNING.match(x)]
    assert lines[0] == line, f"the error is not the first thing on stderr\n{report}"
    if entry == "torchrun":  # torchrun's own dump follows, with its traceback of the launcher
        assert "Traceback" not in proc.stderr[:proc.stderr.index(line)], report
        assert "ChildFailedError" in proc.stderr and line in proc.stderr.split("Root Cause")[-1], report
    else:
        assert "Traceback" not in proc.stderr, report
    new = after - before
    allowed = {os.path.normpath(p) for p in case.get("allow_new", [])}
    assert {p for p in new if not any(p == a or p.startswith(a + os.sep) for a in allowed)} == set(), \
        f"left behind: {sorted(new)}\n{report}"
