"""Rule reward for code generation checked by test cases (data_source "code_asserts").

ground_truth: the tests, Python source (e.g. `assert f(2) == 4` lines) or a list of such lines.
The response's code (its last ```python block, or the whole text without one) and the tests
run in one process in the sandbox (engine/rewards/sandbox.py):

    1.0  every test passed: the program ran to the end of the tests and exited 0
    0.0  anything else: a failed assert, an exception, a timeout, a limit hit, no code

A program that exits early (sys.exit(0), os._exit(0)) before the tests ran must not pass: the
harness prints a per-run token, given on stdin and read before the program runs, only after
the tests finished. (In-process, this stops accidents and simple hacks, not a program that
digs the token out of the harness's frame; the sandbox bounds what such a program can do.)

A batch runs through `compute_scores`: up to `reward_model.sandbox.max_concurrency` programs
at once, so N programs that time out cost about N / max_concurrency timeouts, not N.

Tests: tests/test_sandbox.py
"""
import re
import secrets

from engine.rewards import sandbox

DATA_SOURCE = "code_asserts"
SOLUTION_FILE, TESTS_FILE, HARNESS_FILE = "solution.py", "tests.py", "harness.py"

HARNESS = f'''\
import os, sys
def _run():
    token = sys.stdin.readline().strip()
    sys.stdin.close()
    os.close(0)
    scope = {{"__name__": "__main__"}}
    for name in ({SOLUTION_FILE!r}, {TESTS_FILE!r}):
        with open(name) as f:
            source = f.read()
        exec(compile(source, name, "exec"), scope)
    sys.stdout.flush()
    os.write(1, ("\\n" + token + "\\n").encode())
_run()
'''

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The last fenced code block of `text`, or all of it when there is none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def tests_source(ground_truth) -> str:
    if isinstance(ground_truth, (list, tuple)):
        return "\n".join(str(line) for line in ground_truth)
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"data_source={DATA_SOURCE!r}: ground_truth={ground_truth!r} must be the "
                         "tests (Python source with asserts, or a list of assert lines)")
    return ground_truth


def _job(solution_str, ground_truth):
    token = secrets.token_hex(16)
    files = {SOLUTION_FILE: extract_code(solution_str), TESTS_FILE: tests_source(ground_truth),
             HARNESS_FILE: HARNESS}
    return {"files": files, "main": HARNESS_FILE, "stdin": token + "\n"}, token


def _score(result, token):
    lines = result.stdout.rstrip("\n").rsplit("\n", 1)
    passed = result.ok and lines[-1] == token
    return {"score": float(passed), "acc": float(passed), "timeout": float(result.timed_out)}


def compute_scores(items, cfg=None):
    """Scores of (solution_str, ground_truth, extra_info) items, run concurrently, in order."""
    jobs, tokens = zip(*[_job(solution, truth) for solution, truth, _ in items]) if items else ((), ())
    results = sandbox.run_many(list(jobs), cfg)
    return [_score(result, token) for result, token in zip(results, tokens)]


def compute_score(solution_str, ground_truth, extra_info=None, cfg=None):
    return compute_scores([(solution_str, ground_truth, extra_info)], cfg)[0]
