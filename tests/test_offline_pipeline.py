"""The offline-to-online pipeline end to end, as `make demo-offline` runs it (2 CPU ranks):

1. preference pairs of the built-in arith task, chosen = the correct answer (graded: the answer
   > the answer + more > a wrong answer > junk > nothing; tools/prepare_data.py --graded);
2. a reward model trained on them (recipes/tiny_rm_arith_graded.yaml) reaches >= 90% held-out
   pairwise accuracy;
3. GRPO on that reward model's score alone (recipes/tiny_ppo_rm_arith.yaml: rule_reward=false)
   raises the tiny random policy's held-out score, checked by the rule reward (validation).
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def _torchrun(tmp, recipe, name, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "engine.train", os.path.join(ROOT, "recipes", recipe), "trainer.resume_mode=disable",
           f"trainer.log_dir={tmp}/logs/{name}", "trainer.logger=[console,jsonl]", *extra]
    out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return _records(tmp / "logs" / name / "metrics.jsonl")


@pytest.mark.slow
def test_pairs_to_reward_model_to_ppo_on_the_reward_model_alone(tmp_path):
    prep = subprocess.run([sys.executable, os.path.join(ROOT, "tools/prepare_data.py"), "--pairs", "--builtin",
                           "arith", "--graded", "--n-train", "4096", "--seed", "1", "--out-dir",
                           "data/arith_pairs_graded"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr
    rm = _torchrun(tmp_path, "tiny_rm_arith_graded.yaml", "rm")
    accuracy = {r["step"]: r["val/accuracy"] for r in rm if "val/accuracy" in r}
    assert (tmp_path / "checkpoints/tiny_rm_arith_graded/hf/step_768/config.json").exists()
    ppo = _torchrun(tmp_path, "tiny_ppo_rm_arith.yaml", "ppo")
    held_out = {r["step"]: r["val/score/mean"] for r in ppo if "val/score/mean" in r}
    print(f"reward model held-out pairwise accuracy: {accuracy[0]:.3f} -> {accuracy[768]:.3f}; "
          f"PPO on it alone, rule-checked held-out score by step: {held_out}")
    assert accuracy[0] < 0.7 <= 0.9 <= accuracy[768]
    assert held_out[0] < 0.05 and held_out[60] >= held_out[0] + 0.3
    last = ppo[-1]
    # trained by the model's score alone: no rule score was computed in training
    assert "reward_extra/model_score/mean" in last and "reward_extra/rule_score/mean" not in last
    assert last["critic/score/mean"] == pytest.approx(last["reward_extra/model_score/mean"], abs=1e-4)
