"""pool: a separate rollout pool at staleness k = 0, 1, 2 (trainer.off_policy_steps), side by side.

    python tools/benchmark.py pool [--off-policy-steps 0 1 2] [--steps 6] [--train-ranks 2]
                                   [--pool-ranks 2] [--response-length 128] [--oversample 1.5]
    # measured here (2 shared cores, 2 + 2 ranks, 6 steps, 128 tokens): see the report's ratios

Every run trains recipes/tiny_cpu_demo.yaml on the same ranks (training ranks + a separate pool,
trainer.rollout_pool=separate) with one trainer.off_policy_steps each, and reports the mean
`timing_s/step` over the steps after the first (the first has nothing to overlap with), its ratio
to the k = 0 run's, the seconds a step waited for generation, and the staleness the trainer logged
(the most versions behind of any trained token, per step).
--oversample F streams groups at k >= 1 (engine/experience/streaming.py): data.gen_batch_size =
F x the recipe's train_batch_size (rounded up to the training ranks), so the pool is asked for
more prompts than a step trains; the groups dropped as too stale are counted per run (the k = 0
run stays synchronous: a surplus would be stale at once).

The response lengths are long-tailed: the demo's random model stops at its eos with about the
same small probability at every token (the vocabulary is 20 tokens), so with room for
--response-length tokens the lengths are about geometric: most responses are short and a few per
step run many times the median (`max / mean` is printed per run). A synchronous step waits for its
longest response; at k >= 1 the pool generates the next steps while this one trains, so the tail
is hidden behind training as far as the cores allow: on a machine with fewer cores than ranks both
phases compete for the same cores and the ratios tend to 1.

Tests: tests/test_benchmark_json.py
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import time

from tools import bench_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")


def _staleness(text):
    """argparse type of --off-policy-steps: an integer k >= 0."""
    import argparse
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0; give the staleness bound k, e.g. 2")
    return int(text)


def add_arguments(p):
    from engine.errors import positive
    p.add_argument("--off-policy-steps", type=_staleness, nargs="+",
                   default=[0, 1, 2], help="one run per k (trainer.off_policy_steps); the first is the baseline")
    p.add_argument("--steps", type=positive(int, "the training steps per run, e.g. 6"), default=6)
    p.add_argument("--train-ranks", type=positive(int, "the training ranks, e.g. 2"), default=2)
    p.add_argument("--pool-ranks", type=positive(int, "the rollout pool's ranks, e.g. 2"), default=2)
    p.add_argument("--response-length", type=positive(int, "the most response tokens, e.g. 128"), default=128)
    p.add_argument("--oversample", type=positive(float, "the generation batch over the train batch, e.g. 1.5"),
                   default=1.0, help="data.gen_batch_size = this x train_batch_size at k >= 1")


def gen_batch_size(oversample, train_batch_size, dp):
    """data.gen_batch_size for --oversample: at least the train batch, a multiple of `dp`."""
    want = max(train_batch_size, math.ceil(oversample * train_batch_size))
    return -(-want // dp) * dp


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
    gen = gen_batch_size(args.oversample, _train_batch_size(), args.train_ranks) if k >= 1 else None
    if gen is not None and gen > _train_batch_size():
        cmd.append(f"data.gen_batch_size={gen}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=bench_step.with_root(os.environ.get("PYTHONPATH")))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"the off_policy_steps={k} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(os.path.join(tmp, "logs", name, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    later = records[1:]
    return {"k": k, "steps": len(records), "wall_s": wall, "gen_batch_size": gen,
            "dropped_stale_groups": sum(r.get("rollout/groups_dropped_stale", 0.0) for r in records),
            "step_s": sum(r["timing_s/step"] for r in later) / len(later),
            "gen_s": sum(r.get("timing_s/gen", 0.0) for r in later) / len(later),
            "staleness": [r.get("rollout/staleness/max") for r in records],
            "stale_samples": sum(r.get("rollout/stale_samples", 0.0) for r in records),
            "response_mean": sum(r["response_length/mean"] for r in records) / len(records),
            "response_max": max(r["response_length/max"] for r in records)}


def _train_batch_size():
    from engine.config import load_config
    return load_config(RECIPE, []).data.train_batch_size


def run(args) -> dict:
    from engine.errors import UsageError
    if args.steps < 2:
        raise UsageError(f"--steps {args.steps}: the mean leaves out the first step; give at least 2")
    ks = list(dict.fromkeys(args.off_policy_steps))
    with tempfile.TemporaryDirectory(prefix="bench_pool_") as tmp:
        runs = [_run_one(args, k, tmp) for k in ks]
    base = runs[0]
    for r in runs:
        r["ratio"] = r["step_s"] / base["step_s"]
    report = {"runs": {str(r["k"]): r for r in runs}, "baseline_k": base["k"],
              "cores": os.cpu_count(), "ranks": args.train_ranks + args.pool_ranks}
    print(f"pool: {args.train_ranks} training + {args.pool_ranks} rollout ranks on {os.cpu_count()} cores, "
          f"{args.steps} steps, responses of up to {args.response_length} tokens")
    if args.oversample > 1:
        print(f"  k >= 1 streams groups: data.gen_batch_size={runs[-1]['gen_batch_size']} "
              f"(--oversample {args.oversample}); groups dropped as stale per run: "
              + ", ".join(f"k={r['k']} {r['dropped_stale_groups']:.0f}" for r in runs))
    print(f"  {'k':>3}{'step s':>9}{'x k=' + str(base['k']):>8}{'wait gen s':>12}{'wall s':>9}"
          f"{'resp mean':>11}{'max':>6}  staleness max per step (refused)")
    for r in runs:
        print(f"  {r['k']:>3}{r['step_s']:>9.2f}{r['ratio']:>8.3f}{r['gen_s']:>12.2f}{r['wall_s']:>9.1f}"
              f"{r['response_mean']:>11.1f}{r['response_max']:>6.0f}  {r['staleness']} ({r['stale_samples']:.0f})")
    tails = ", ".join("k={} {:.1f}x".format(r["k"], r["response_max"] / max(r["response_mean"], 1e-9)) for r in runs)
    print(f"  step time relative to k={base['k']} over steps 2..{args.steps}; response length max / mean: {tails}")
    return report
