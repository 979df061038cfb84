"""End to end: `torchrun -m engine.train` on 2 CPU ranks with each advantage estimator, and a
run killed mid-step that resumes to the same metrics and weights as an uninterrupted one."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = [
    "data.max_response_length=4", "data.train_batch_size=8", "data.val_batch_size=16",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "trainer.logger=[console,jsonl,tensorboard]", "trainer.val_before_train=false",
]


def launch_demo(tmp_path, name, extra, steps):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "engine.train", os.path.join(ROOT, "recipes/tiny_cpu_demo.yaml"), *TINY,
           f"trainer.total_training_steps={steps}", f"trainer.experiment_name={name}",
           f"trainer.default_local_dir={tmp_path}/ckpt/{name}",
           f"trainer.log_dir={tmp_path}/logs/{name}", *extra]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def run_demo(tmp_path, name, extra=(), steps=3, timeout=300):
    proc = launch_demo(tmp_path, name, extra, steps)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out, read_records(tmp_path, name)


def read_records(tmp_path, name):
    path = tmp_path / "logs" / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# One GRPO run serves several tests (tests/conftest.py's grpo_run): the estimator test's grpo case,
# the uninterrupted run the killed run must match, and test_launch_ray's torchrun side.
GRPO_RUN = ["algorithm.adv_estimator=grpo", "trainer.save_freq=2", "trainer.test_freq=4",
            "trainer.save_hf=true", "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true"]
GRPO_STEPS = 4


@pytest.mark.parametrize("estimator,extra", [
    ("grpo", []),  # the shared GRPO_RUN
    # on-policy: no old-log-prob pass; ~17 s, in make test-all (RLOO's formula: tests/test_advantages.py)
    pytest.param("rloo", ["actor_rollout_ref.actor.ppo_mini_batch_size=8"], marks=pytest.mark.slow),
    ("gae", ["critic.ppo_micro_batch_size_per_gpu=4", "algorithm.use_kl_in_reward=true",
             "algorithm.kl_ctrl.type=adaptive", "actor_rollout_ref.actor.use_kl_loss=false"]),
])
def test_each_estimator_runs_its_steps_with_its_metrics_and_validation(tmp_path, request, estimator, extra):
    if estimator == "grpo":  # the recipe's estimator: the shared GRPO run (4 steps, validation at 4)
        root, out, records = request.getfixturevalue("grpo_run")
        steps = GRPO_STEPS
    else:
        root, steps = tmp_path, 3
        out, records = run_demo(tmp_path, estimator, [f"algorithm.adv_estimator={estimator}",
                                                      "trainer.save_freq=-1", "trainer.test_freq=3",
                                                      *extra], steps=steps)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    last = records[-1]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy",
                "actor/grad_norm", "timing_s/gen", "timing_s/update_actor", "timing_s/step",
                "perf/throughput", "perf/mfu", "response_length/mean", "val/score/mean"):
        assert key in last, key
    if estimator == "gae":
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/values/mean",
                    "actor/reward_kl_penalty"):
            assert key in last, key
    assert all(r["actor/grad_norm"] > 0 for r in records)
    # one mini-batch per step without KL in the reward: the update's forward gives old log-probs
    assert ("timing_s/old_log_prob" in last) == (estimator != "rloo")
    assert f"step {steps}/{steps}" in out  # the console progress line
    tb = list((root / "logs" / estimator).glob("events.out.tfevents.*"))
    assert tb, "TensorBoard event file missing"


def _process_or_none(pid):
    import psutil
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _wait_for(predicate, timeout, proc):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy",
            "actor/kl_loss", "actor/grad_norm", "actor/lr", "response_length/mean")


def _kill_after_checkpoint(tmp_path, name, extra, steps, step):
    """Launch a run and SIGKILL it (launcher and every worker) as soon as the step-`step`
    checkpoint appears, i.e. during the next step."""
    proc = launch_demo(tmp_path, name, extra, steps=steps)
    ckpt = tmp_path / "ckpt" / name / f"global_step_{step}"
    assert _wait_for(ckpt.exists, 240, proc), f"the step-{step} checkpoint never appeared"
    # within ~20 ms; torchrun starts its workers in sessions of their own, so every
    # descendant is killed, not just the launcher's process group
    import psutil
    victims = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs([p for p in map(_process_or_none, victims) if p], timeout=30)


def test_killed_run_resumes_to_the_same_metrics_and_weights(tmp_path, grpo_run):
    """A run SIGKILLed during step 3 (after the step-2 checkpoint) and resumed gives, at step 4,
    the same metrics and bit-identical weights as a run that was never interrupted (the shared
    GRPO run: same settings)."""
    common = GRPO_RUN
    straight_root, _, straight = grpo_run

    _kill_after_checkpoint(tmp_path, "killed", common, steps=4, step=2)
    assert not (tmp_path / "ckpt" / "killed" / "hf" / "step_4").exists()
    out, resumed = run_demo(tmp_path, "killed", common + ["trainer.resume_mode=auto"], steps=4)
    assert "resumed from" in out and "at step 2" in out, out[-2000:]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # records after the checkpoint redone
    for a, b in zip(straight[2:], resumed[2:]):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)

    from safetensors.torch import load_file
    def weights(root, name):
        out = {}
        for f in sorted((root / "ckpt" / name / "hf" / "step_4").glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out
    a, b = weights(straight_root, "grpo"), weights(tmp_path, "killed")
    assert a.keys() == b.keys() and a
    import torch
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_exact_kl_loss_and_reward_train(tmp_path):
    """kl_loss_type=full (the reference's hidden states kept from its pass, linear_full_kl in the
    actor's loss) and the exact KL in the reward (kl_penalty=full: the reference pass runs
    first, the old-log-prob pass computes it) through torchrun: finite metrics, and a KL > 0
    once the actor has moved away from the reference (it starts as a copy of it)."""
    _, records = run_demo(tmp_path, "full_kl", [
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=full",
        "actor_rollout_ref.actor.kl_loss_coef=0.1", "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=full", "trainer.save_freq=-1", "trainer.test_freq=-1"], steps=2)
    assert [r["step"] for r in records] == [1, 2]
    import math
    for r in records:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    # step 1's first mini-batch is the reference itself (KL 0); the second one is not
    assert records[0]["actor/kl_loss"] >= 0 and records[1]["actor/kl_loss"] > 0
    assert records[0]["actor/reward_kl_penalty"] == 0 < records[1]["actor/reward_kl_penalty"]


@pytest.mark.slow  # 38 s; resume itself is test_killed_run_resumes_to_the_same_metrics_and_weights
def test_kl_guard_state_resumes_exactly(tmp_path):
    """The KL guard fires at every step (a ceiling below any KL): its coefficient grows x1.2 per
    step and drives the KL loss. Killed after the step-2 checkpoint (two steps before the end:
    slack for a loaded machine) and resumed, the run gives the uninterrupted run's
    kl_guard/kl_coef and actor/kl_coef at every step."""
    common = ["trainer.save_freq=2", "trainer.test_freq=-1", "algorithm.kl_guard.enable=true",
              "algorithm.kl_guard.kl_ceiling=1e-12"]
    _, straight = run_demo(tmp_path, "straight", common, steps=4)
    coef = [0.001 * 1.2 ** k for k in range(5)]  # actor.kl_loss_coef 0.001, raised every step
    assert [r["kl_guard/action"] for r in straight] == [1, 1, 1, 1]
    assert [r["kl_guard/kl_coef"] for r in straight] == pytest.approx(coef[1:], rel=1e-12)
    assert [r["actor/kl_coef"] for r in straight] == pytest.approx(coef[:4], rel=1e-12)

    _kill_after_checkpoint(tmp_path, "killed", common, steps=4, step=2)
    out, resumed = run_demo(tmp_path, "killed", common + ["trainer.resume_mode=auto"], steps=4)
    assert "resumed from" in out and "at step 2" in out, out[-2000:]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        for key in ("kl_guard/kl_coef", "actor/kl_coef", "kl_guard/action"):
            assert b[key] == a[key], (a["step"], key)
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)
