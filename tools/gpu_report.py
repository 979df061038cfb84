"""The two ends of `make gpu-check` (tools/gpu_check.sh).

    python tools/gpu_report.py env OUT.json   # what this machine has
    python tools/gpu_report.py report DIR     # DIR/report.json + a table; exit 1 if a check failed

Statuses: pass, fail (with the reason: the step's exit code, a timeout, failed tests), skipped
(with the reason: a missing package, too few GPUs). Each pytest test is a check of its own.

Tests: tests/test_gpu_check.py
"""
import importlib.util
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

OPTIONAL = ("megatron.core", "sglang", "transformer_engine", "apex", "flash_attn", "triton")


def env_report(path):
    import torch
    gpus = [dict(name=torch.cuda.get_device_name(i),
                 memory_gib=round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1))
            for i in range(torch.cuda.device_count())]
    report = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda,
                  gpus=gpus, packages={m: importlib.util.find_spec(m) is not None for m in OPTIONAL})
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))


def _steps(out_dir):
    steps = []
    with open(os.path.join(out_dir, "steps.txt")) as f:
        for line in f:
            name, rc, seconds, rest = line.rstrip("\n").split(" ", 3)
            steps.append((name, rc, int(seconds), rest))
    return steps


def _tail(out_dir, name, lines=3):
    path = os.path.join(out_dir, f"{name}.log")
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return " | ".join(line.strip() for line in f.read().splitlines()[-lines:])


# pytest -v's line per finished test: what remains of a step killed before its junit XML
VERBOSE_LINE = re.compile(r"^\S*?(\w+)\.py::(\S+) (PASSED|FAILED|ERROR|SKIPPED)(?: \((.*)\))?")
VERBOSE_STATUS = {"PASSED": "pass", "FAILED": "fail", "ERROR": "fail", "SKIPPED": "skipped"}


def _pytest_log_checks(out_dir):
    path = os.path.join(out_dir, "pytest.log")
    if not os.path.exists(path):
        return []
    checks = []
    for line in open(path, errors="replace"):
        m = VERBOSE_LINE.match(line)
        if m:
            module, test, status, why = m.groups()
            checks.append(dict(check=f"pytest {module}::{test}", status=VERBOSE_STATUS[status],
                               detail=(why or "") + " (from pytest.log: the step ended before its report)"))
    return checks


def _pytest_checks(out_dir):
    path = os.path.join(out_dir, "pytest.xml")
    if not os.path.exists(path):
        return _pytest_log_checks(out_dir)
    checks = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"pytest {case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            checks.append(dict(check=name, status="fail", detail=(failed.get("message") or "")[:300]))
        elif skipped is not None:
            checks.append(dict(check=name, status="skipped", detail=(skipped.get("message") or "")[:300]))
        else:
            checks.append(dict(check=name, status="pass", detail=f"{float(case.get('time', 0)):.1f}s"))
    return checks


# The GRPO run passes only if the rollout engine and the trainer agree on the numbers: for every
# response token, |p_rollout - p_train| of the token the rollout drew (verl's
# training/rollout_probs_diff_max). Same weights, bf16 on both sides: ~1e-2 is kernel noise; an
# ignored KV cache, a misloaded weight or a mismatched tokenizer gives differences near 1.
PROBS_DIFF_MAX = 0.1
GRPO_STEPS = 2


def _grpo_detail(out_dir):
    path = os.path.join(out_dir, "grpo", "metrics.jsonl")
    if not os.path.exists(path):
        return False, "no metrics.jsonl"
    records = [json.loads(line) for line in open(path) if line.strip()]
    if len(records) < GRPO_STEPS:
        return False, f"{len(records)} step(s) logged, expected {GRPO_STEPS}"
    diffs = [r.get("training/rollout_probs_diff_max") for r in records]
    if any(d is None for d in diffs):
        return False, "no training/rollout_probs_diff_max logged: the rollout's log-probs were not compared"
    worst = max(diffs, key=lambda d: d if d == d else float("inf"))  # a NaN is the worst
    if not worst < PROBS_DIFF_MAX:
        return False, (f"rollout and trainer disagree: training/rollout_probs_diff_max {worst:.3g} "
                       f">= {PROBS_DIFF_MAX} (per step {[round(d, 4) for d in diffs]})")
    last = records[-1]
    return True, (f"{len(records)} steps, rollout_probs_diff_max {worst:.3g} < {PROBS_DIFF_MAX}, "
                  f"score {last.get('critic/score/mean', 0):.3f}, "
                  f"{last.get('perf/throughput', 0):.0f} tok/s/GPU, step {last.get('timing_s/step', 0):.1f}s")


def _benchmark_detail(out_dir):
    path = os.path.join(out_dir, "benchmark.json")
    if not os.path.exists(path):
        return {}, "no benchmark.json"
    b = json.load(open(path))
    detail = (f"{b.get('model', '?')}: {b.get('tokens_per_s_per_rank') or 0:.0f} tok/s/GPU, "
              f"MFU step {b.get('mfu') or 0:.3f}, actor update {b.get('mfu_actor_update') or 0:.3f}, "
              f"peak {b.get('peak_memory_gb') or 0:.1f} GB")
    return b, detail


def _attention_detail(out_dir):
    path = os.path.join(out_dir, "attention.json")
    if not os.path.exists(path):
        return {}, "no attention.json"
    a = json.load(open(path))
    ms, ratios = a.get("ms_per_call", {}), a.get("ratios", {})
    detail = ", ".join(f"{case} {ms.get(case + '/trident', 0):.2f} ms ({ratios.get(case, 0):.2f}x cuDNN first)"
                       for case in ("varied", "fixed"))
    return a, f"packed fwd+bwd: {detail}"


def report(out_dir):
    checks, extra = [], {}
    for name, rc, seconds, rest in _steps(out_dir):
        if rc == "skipped":
            checks.append(dict(check=name, status="skipped", detail=rest, seconds=0))
            continue
        limit = int(rest)
        status = "pass" if rc == "0" else "fail"
        detail = f"{seconds}s"
        if rc in ("124", "137"):
            detail = f"timed out after {limit}s"
        elif rc != "0":
            detail = f"exit {rc}: {_tail(out_dir, name)}"
        if name == "pytest":
            tests = _pytest_checks(out_dir)
            checks += tests
            if rc == "5":  # pytest: no tests collected / all deselected
                status, detail = "skipped", "no gpu tests collected"
            elif rc == "1" and tests:
                detail = f"{sum(t['status'] == 'fail' for t in tests)} test(s) failed"
        if name == "grpo" and rc == "0":
            ok, detail = _grpo_detail(out_dir)
            status = "pass" if ok else "fail"
        if name == "benchmark" and rc == "0":
            extra["benchmark"], detail = _benchmark_detail(out_dir)
        if name == "attention" and rc == "0":
            extra["attention"], detail = _attention_detail(out_dir)
        checks.append(dict(check=name, status=status, detail=detail, seconds=seconds))
    env = json.load(open(os.path.join(out_dir, "env.json"))) if os.path.exists(
        os.path.join(out_dir, "env.json")) else {}
    result = dict(env=env, checks=checks, **extra,
                  summary={s: sum(c["status"] == s for c in checks) for s in ("pass", "fail", "skipped")})
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(result, f, indent=1)
    width = max(len(c["check"]) for c in checks) if checks else 10
    print(f"\n{'check':<{width}}  status   detail")
    for c in checks:
        print(f"{c['check']:<{width}}  {c['status']:<7}  {c['detail']}")
    s = result["summary"]
    print(f"\ngpu-check: {s['pass']} passed, {s['fail']} failed, {s['skipped']} skipped "
          f"-> {os.path.join(out_dir, 'report.json')}")
    return 1 if s["fail"] else 0


USAGE = "usage: tools/gpu_report.py env OUT.json | report DIR"


def main(argv):
    if __package__ in (None, ""):  # run as a script: make the repository importable
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from engine.errors import run_main
    return run_main(_main, argv)


def _main(argv):
    from engine.errors import UsageError, check_output_file
    if len(argv) == 2 and argv[0] == "env":
        check_output_file(argv[1], "env OUT.json:")
        env_report(argv[1])
        return 0
    if len(argv) == 2 and argv[0] == "report":
        if not os.path.isfile(os.path.join(argv[1], "steps.txt")):
            raise UsageError(f"report {argv[1]!r}: no steps.txt there; pass the output directory of "
                             "tools/gpu_check.sh (gpu-check/)")
        return report(argv[1])
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    raise UsageError(f"{' '.join(argv) or 'no arguments'}: {USAGE}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
