"""pool: a separate rollout pool, on-policy vs one-step off-policy, side by side.

    python tools/benchmark.py pool [--steps 6] [--train-ranks 2] [--pool-ranks 2] [--response-length 32]
    # measured here (2 cores, --response-length 128): 1 + 1 ranks 0.616x, 2 + 2 ranks 0.939x

Both runs train recipes/tiny_cpu_demo.yaml on the same ranks (training ranks + a separate pool,
trainer.rollout_pool=separate), one with trainer.off_policy_steps=0, one with 1, and report the
mean `timing_s/step` over the steps after the first (the first step has nothing to overlap with)
and the off-policy / on-policy ratio. Off-policy wins by overlapping the pool's generation of
step t+1 with the training of step t, so it needs spare cores: on a machine with fewer cores than
ranks both phases compete for the same cores and the ratio tends to 1.

Tests: tests/test_benchmark_json.py
"""
import json
import os
import subprocess
import sys
import tempfile
import time

from tools import bench_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")


def add_arguments(p):
    from engine.errors import positive
    p.add_argument("--steps", type=positive(int, "the training steps per run, e.g. 6"), default=6)
    p.add_argument("--train-ranks", type=positive(int, "the training ranks, e.g. 2"), default=2)
    p.add_argument("--pool-ranks", type=positive(int, "the rollout pool's ranks, e.g. 2"), default=2)
    p.add_argument("--response-length", type=positive(int, "the response tokens, e.g. 32"), default=32)


def _run_one(args, k, tmp):
    nproc = args.train_ranks + args.pool_ranks
    name = f"off_policy_{k}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "engine.train", RECIPE, "trainer.resume_mode=disable", "trainer.save_freq=-1",
           "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
           f"trainer.total_training_steps={args.steps}", f"trainer.experiment_name={name}",
           f"trainer.n_gpus_per_node={nproc}", "trainer.rollout_pool=separate",
           f"trainer.rollout_pool_ranks={args.pool_ranks}", f"trainer.off_policy_steps={k}",
           f"data.max_response_length={args.response_length}", f"trainer.log_dir={tmp}/logs/{name}",
           f"trainer.default_local_dir={tmp}/ckpt/{name}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=bench_step.with_root(os.environ.get("PYTHONPATH")))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"the off_policy_steps={k} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(os.path.join(tmp, "logs", name, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    later = [r["timing_s/step"] for r in records[1:]]
    return {"steps": len(records), "step_s": sum(later) / len(later), "wall_s": wall,
            "staleness": [r.get("rollout/staleness") for r in records],
            "gen_s": sum(r.get("timing_s/gen", 0.0) for r in records[1:]) / len(later)}


def run(args) -> dict:
    if args.steps < 2:
        from engine.errors import UsageError
        raise UsageError(f"--steps {args.steps}: the mean leaves out the first step; give at least 2")
    with tempfile.TemporaryDirectory(prefix="bench_pool_") as tmp:
        on, off = _run_one(args, 0, tmp), _run_one(args, 1, tmp)
    report = {"on_policy": on, "off_policy": off, "ratio": off["step_s"] / on["step_s"],
              "cores": os.cpu_count(), "ranks": args.train_ranks + args.pool_ranks}
    print(f"pool: {args.train_ranks} training + {args.pool_ranks} rollout ranks on {os.cpu_count()} cores, "
          f"{args.steps} steps, responses of {args.response_length} tokens")
    print(f"  {'':<14}{'step s':>9}{'wait for gen s':>16}{'run wall s':>12}  staleness")
    for label, r in (("on-policy", on), ("off-policy 1", off)):
        print(f"  {label:<14}{r['step_s']:>9.2f}{r['gen_s']:>16.2f}{r['wall_s']:>12.1f}  {r['staleness']}")
    print(f"  off-policy / on-policy step time: {report['ratio']:.3f} (steps 2..{args.steps})")
    return report
