"""make demo-agent: a tiny policy learns to use the calculator (issue 24).

1. SFT (recipes/tiny_sft_tools.yaml) on conversations that call the calculator for 3-digit x
   3-digit products, beyond a tiny model's reach alone; its HF export is the RL start.
2. GRPO with multi-turn rollouts and the calculator (recipes/tiny_agent_grpo.yaml).
The random model is evaluated the same way (one step of the GRPO recipe from random init).

Printed: held-out accuracy (greedy, validation's score: 1 for the exact product) and the valid
tool-call rate (calls that ran without an error, over the step's sampled trajectories) before
SFT, after SFT and after RL. About 2 minutes on 2 CPU ranks.

    python tools/demo_agent.py [--out checkpoints/demo_agent] [--sft-steps 400] [--rl-steps 20]

Tests: tests/test_make_targets.py (slow: the demo itself), tests/test_sft.py,
tests/test_multi_turn_trainer.py
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_MODEL = ("{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
             "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 104, max_position_embeddings: 256, "
             "rms_norm_eps: 1.0e-6, rope_theta: 10000.0, tie_word_embeddings: false, hidden_act: silu}")


def torchrun(recipe, out, name, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "engine.train", os.path.join(ROOT, "recipes", recipe), "trainer.resume_mode=disable",
           "trainer.logger=[console,jsonl]", f"trainer.default_local_dir={out}/{name}",
           f"trainer.log_dir={out}/{name}/logs", *overrides]
    print(f"== {name}: {' '.join(cmd[6:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    with open(os.path.join(out, name, "logs", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def valid_rate(record):
    calls = record.get("multi_turn/tool_calls/mean", 0.0)
    return (calls - record.get("multi_turn/tool_errors/mean", 0.0)) / calls if calls else 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="checkpoints/demo_agent")
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--rl-steps", type=int, default=20)
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    before = torchrun("tiny_agent_grpo.yaml", out, "before_sft", "actor_rollout_ref.model.path=null",
                      f"actor_rollout_ref.model.config={SFT_MODEL}", "data.max_prompt_length=32",
                      "trainer.total_training_steps=1", "trainer.test_freq=1")
    torchrun("tiny_sft_tools.yaml", out, "sft", f"trainer.total_training_steps={args.sft_steps}",
             f"trainer.save_freq={args.sft_steps}", f"trainer.test_freq={args.sft_steps}")
    model = os.path.join(out, "sft", "hf", f"step_{args.sft_steps}")
    rl = torchrun("tiny_agent_grpo.yaml", out, "rl", f"actor_rollout_ref.model.path={model}",
                  f"trainer.total_training_steps={args.rl_steps}", f"trainer.test_freq={args.rl_steps}")
    val = [r for r in rl if "val/score/mean" in r]
    steps = [r for r in rl if "multi_turn/tool_calls/mean" in r]
    rows = [("before SFT (random init)", before[0]["val/score/mean"], valid_rate(before[-1])),
            (f"after SFT ({args.sft_steps} steps)", val[0]["val/score/mean"], valid_rate(steps[0])),
            (f"after GRPO ({args.rl_steps} steps)", val[-1]["val/score/mean"], valid_rate(steps[-1]))]
    print("\nstage                          held-out accuracy   valid tool-call rate")
    for stage, acc, rate in rows:
        print(f"{stage:30s} {acc:17.3f}   {rate:20.3f}")
    return rows


if __name__ == "__main__":
    main()
