"""engine.rewards.sandbox + the code_asserts reward: hostile programs are stopped, scored 0, and
leave nothing behind; correct ones score 1; a batch runs concurrently within its bound.

Real subprocesses, real limits. Every hostile program is written so that, were its limit
missing, it would pass its asserts (the socket test shows this with network=True), so a
broken limit fails the test instead of passing it quietly.
"""
import os
import socket
import tempfile
import textwrap
import time

import psutil
import pytest

from engine.rewards import code, sandbox
from engine.rewards.registry import compute_scores, default_compute_score
from engine.tasks import make_rows

FAST = dict(timeout_s=2.0, cpu_s=1, memory_mb=256, max_file_mb=8, max_procs=8)


def _isolations():
    out = ["process"]
    if sandbox.isolation(sandbox.SandboxConfig(**FAST)).kind == "namespace":
        out.insert(0, "namespace")
    return out


@pytest.fixture(params=_isolations())
def cfg(request):
    return sandbox.SandboxConfig(isolation=request.param, **FAST)


def _sandbox_dirs():
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("trident-sandbox-")}


def _sandbox_user_pids(cfg):
    uid, _, _ = sandbox.sandbox_uid(cfg)
    if uid is None:
        return set()
    return {p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid}


@pytest.fixture
def clean(cfg):
    """Checks, after the test, that the runs left no process and no directory behind."""
    dirs, mine = _sandbox_dirs(), {p.pid for p in psutil.Process().children(recursive=True)}
    users = _sandbox_user_pids(cfg)
    sessions = []
    yield sessions
    assert _sandbox_dirs() == dirs, "a sandbox directory was left behind"
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in mine]
    assert not left, f"processes left: {left}"
    assert _sandbox_user_pids(cfg) <= users, "processes of the sandbox user were left"
    table = sandbox.process_table()  # zombies included: none may be left to init either
    for sid in sessions:
        assert not [pid for pid, (_, s, _) in table.items() if s == sid], f"session {sid} survives"


def _score(program, tests, cfg, sessions):
    """code_asserts score of `program`, with the run's session recorded for `clean`."""
    real = sandbox.run

    def recording(*args, **kwargs):
        result = real(*args, **kwargs)
        sessions.append(result.pid)
        recording.result = result
        return result
    sandbox.run = recording
    try:
        score = code.compute_score(f"```python\n{textwrap.dedent(program)}```", tests, cfg=cfg)
    finally:
        sandbox.run = real
    return score, recording.result


def test_correct_program_scores_one(cfg, clean):
    score, result = _score("def square(x):\n    return x * x\n",
                           "assert square(3) == 9\nassert square(-2) == 4", cfg, clean)
    assert score == {"score": 1.0, "acc": 1.0, "timeout": 0.0}, result
    wrong, _ = _score("def square(x):\n    return x + x\n", "assert square(3) == 9", cfg, clean)
    assert wrong["score"] == 0.0


def test_endless_loop_is_stopped(cfg, clean):
    """Busy: the CPU limit (or the wall clock, on a loaded machine) stops it."""
    score, result = _score("def f():\n    while True:\n        pass\n", "assert f() is None", cfg, clean)
    assert score["score"] == 0.0 and result.returncode != 0
    assert result.duration_s < cfg.timeout_s + 1.0


def test_sleeper_is_stopped_at_the_wall_clock_timeout(cfg, clean):
    """Idle: no CPU limit helps, the wall-clock timeout does."""
    score, result = _score("import time\ndef f():\n    time.sleep(60)\n", "assert f() is None",
                           cfg, clean)
    assert score == {"score": 0.0, "acc": 0.0, "timeout": 1.0}
    assert result.timed_out and cfg.timeout_s <= result.duration_s < cfg.timeout_s + 1.0


def test_fork_bomb_is_contained_and_killed(cfg, clean):
    program = """
        import os, time
        def bomb():
            end = time.time() + 10
            while time.time() < end:  # never gives up: forks again whenever a slot frees
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.01)
            return True
    """
    score, result = _score(program, "assert bomb()", cfg, clean)
    assert score["score"] == 0.0 and result.timed_out


def test_process_limit_counts_every_process(cfg, clean):
    """max_procs=8: the reaper, the program and 6 children; the 7th fork fails."""
    program = """
        import os, time
        def spawn(n):
            for i in range(n):
                try:
                    if os.fork() == 0:
                        time.sleep(30)
                        os._exit(0)
                except OSError:
                    return i
            return n
    """
    score, result = _score(program, "assert spawn(50) == 50", cfg, clean)
    assert score["score"] == 0.0
    score, result = _score(program, "n = spawn(50)\nprint('forked', n)\nassert 0 < n <= 6", cfg, clean)
    assert score["score"] == 1.0, result


def test_ten_gigabytes_are_refused(cfg, clean):
    # bytes(n) is calloc'ed: untouched pages, so a missing limit would not fill the machine
    score, result = _score("def big():\n    return len(bytes(10 * 2**30))\n",
                           "assert big() == 10 * 2**30", cfg, clean)
    assert score["score"] == 0.0 and "MemoryError" in result.stderr, result


def test_huge_file_is_stopped(cfg, clean):
    program = """
        def write():
            with open("big.bin", "wb") as f:
                for _ in range(256):
                    f.write(b"x" * 2**20)
            return True
    """
    score, result = _score(program, "assert write()", cfg, clean)
    assert score["score"] == 0.0
    assert result.returncode != 0 and not result.timed_out, result


def test_no_network(cfg, clean):
    """A connection to a port this test listens on fails inside the sandbox, and succeeds with
    network=True (so the program would pass if the network were reachable)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]
        program = f"""
            import socket
            def talk():
                with socket.create_connection(("127.0.0.1", {port}), timeout=1) as s:
                    s.sendall(b"hello")
                return True
        """
        blocked, result = _score(program, "assert talk()", cfg, clean)
        assert blocked["score"] == 0.0
        assert "Network is unreachable" in result.stderr or "network access is disabled" in result.stderr
        import dataclasses
        allowed, result = _score(program, "assert talk()", dataclasses.replace(cfg, network=True), clean)
        assert allowed["score"] == 1.0, result


def test_exiting_before_the_tests_does_not_pass(cfg, clean):
    for program in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n",
                    "def f():\n    raise SystemExit(0)\n"):
        score, _ = _score(program, "f()\nassert False", cfg, clean)
        assert score["score"] == 0.0, program


def test_files_stay_in_the_run_directory_which_is_removed(cfg, clean):
    program = """
        import os, tempfile
        def where():
            with open("note.txt", "w") as f:
                f.write("x")
            return os.getcwd(), os.environ["HOME"], tempfile.gettempdir()
    """
    score, result = _score(program, "cwd, home, tmp = where()\nassert cwd == home == tmp\n"
                           "print(cwd)", cfg, clean)
    assert score["score"] == 1.0, result
    assert result.stdout.splitlines()[0].startswith(os.path.join(tempfile.gettempdir(), "trident-sandbox-"))


def test_a_batch_runs_concurrently_within_its_bound(clean, cfg):
    """4 programs that sleep past the timeout and a correct one, 2 at a time: the runs overlap
    two by two (never more), and the batch takes about 2 timeouts, not 4."""
    import dataclasses
    import threading
    cfg = dataclasses.replace(cfg, timeout_s=1.5, max_concurrency=2)
    sleeper = ("code_asserts", "import time\ntime.sleep(60)\n", "assert True", None)
    items = [("arith", "7", "7", None), sleeper, sleeper,
             ("code_asserts", "def one():\n    return 1\n", "assert one() == 1", None), sleeper, sleeper]
    real, spans, lock = sandbox.run, [], threading.Lock()

    def timed(*args, **kwargs):
        start = time.monotonic()
        result = real(*args, **kwargs)
        with lock:
            spans.append((start, time.monotonic()))
            clean.append(result.pid)
        return result
    sandbox.configure(cfg)  # how the trainer's configuration reaches the registered reward
    sandbox.run = timed
    try:
        start = time.monotonic()
        results = compute_scores(items)
        elapsed = time.monotonic() - start
    finally:
        sandbox.run = real
        os.environ.pop(sandbox.ENV_VAR, None)
    assert [r["score"] for r in results] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert [r["timeout"] for r in results[1:]] == [1.0, 1.0, 0.0, 1.0, 1.0]
    peak = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert peak == 2, spans
    assert elapsed < 4 * cfg.timeout_s, elapsed  # one at a time would take at least 4 timeouts


def test_builtin_code_task_references_pass():
    """Every problem of the built-in code task is solved by its reference solution."""
    rows = [row for level in range(3) for row in make_rows("code", 4, seed=1, difficulty=level)]
    items = [(row["data_source"], f"```python\n{row['extra_info']['reference']}```",
              row["reward_model"]["ground_truth"], row["extra_info"]) for row in rows]
    assert [r["score"] for r in compute_scores(items)] == [1.0] * len(rows)
    single = default_compute_score(*items[0])
    assert single["score"] == 1.0
    assert items[0][0] == code.DATA_SOURCE


def test_bad_config_is_named():
    with pytest.raises(ValueError, match=r"reward_model.sandbox.timeout_s=0: must be a number > 0"):
        sandbox.SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['timeout'\]"):
        sandbox.config_from({"timeout": 3})
    with pytest.raises(ValueError, match="isolation='jail'"):
        sandbox.SandboxConfig(isolation="jail")
    with pytest.raises(ValueError, match="ground_truth=''"):
        code.compute_score("def f(): pass", "")


def test_isolation_is_reported():
    info = sandbox.isolation(sandbox.SandboxConfig())
    assert info.network in ("namespace", "prelude") and info.kind in ("namespace", "process")
    assert info.kind in info.describe()
    assert sandbox.isolation(sandbox.SandboxConfig(network=True)).network == "allowed"
    if os.geteuid() == 0:  # root ignores RLIMIT_NPROC: programs must run as another user
        assert "uid 0" not in info.user


def _ascii_tokenizer():
    """A character-level tokenizer over printable ASCII and newline (the built-in one has no letters)."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<unk>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def test_reward_manager_scores_code_rows():
    """Token ids -> text -> sandbox -> a 1 on the last token of the correct response only."""
    import torch

    from engine.rewards import RewardManager
    tok = _ascii_tokenizer()
    rows = make_rows("code", 2, seed=5, difficulty=0)
    texts = [f"```python\n{rows[0]['extra_info']['reference']}```", "def nothing():\n    pass\n"]
    encoded = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    length = max(map(len, encoded)) + 2
    ids = torch.full((2, length), tok.pad_token_id)
    mask = torch.zeros(2, length, dtype=torch.long)
    for i, seq in enumerate(encoded):
        ids[i, :len(seq)], mask[i, :len(seq)] = torch.tensor(seq), 1
    rewards, extra = RewardManager(tok)(ids, mask, [r["reward_model"]["ground_truth"] for r in rows],
                                        [r["data_source"] for r in rows], [r["extra_info"] for r in rows])
    assert extra["score"] == [1.0, 0.0]
    assert rewards[0, len(encoded[0]) - 1] == 1.0 and rewards.sum() == 1.0
