"""A separate rollout pool (trainer.rollout_pool=separate, engine/rollout/pool.py) through the real
trainer: 2 training + 2 rollout ranks give the colocated run's steps; one-step off-policy keeps the
number of updates and logs staleness 1."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.test_e2e import ROOT, TINY

COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/kl_loss",
            "actor/grad_norm", "response_length/mean")


def _run(tmp_path, name, nproc, extra, steps=3):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "engine.train", os.path.join(ROOT, "recipes/tiny_cpu_demo.yaml"), *TINY,
           f"trainer.total_training_steps={steps}", f"trainer.experiment_name={name}", "trainer.test_freq=-1",
           "trainer.save_freq=-1", "trainer.save_hf=true", f"trainer.n_gpus_per_node={nproc}",
           f"trainer.default_local_dir={tmp_path}/ckpt/{name}", f"trainer.log_dir={tmp_path}/logs/{name}", *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (tmp_path / "logs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _weights(tmp_path, name, step):
    from safetensors.torch import load_file
    out = {}
    for f in sorted((tmp_path / "ckpt" / name / "hf" / f"step_{step}").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


POOL = ["trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=2"]


def test_separate_pool_trains_like_colocated(tmp_path):
    colocated = _run(tmp_path, "colocated", 2, [])
    pool = _run(tmp_path, "pool", 4, POOL)
    for a, b in zip(colocated, pool):  # the same responses (keyed sampling), log-probs, updates
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
        assert b["rollout/staleness"] == 0
    a, b = _weights(tmp_path, "colocated", 3), _weights(tmp_path, "pool", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_step_off_policy(tmp_path):
    records = _run(tmp_path, "offpolicy", 4, POOL + ["trainer.off_policy_steps=1"], steps=4)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # one update per step, none lost
    assert [r["rollout/staleness"] for r in records] == [0, 1, 1, 1]
    assert all(r["actor/grad_norm"] > 0 and "timing_s/old_log_prob" in r for r in records)
