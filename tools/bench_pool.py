"""pool: a separate rollout pool at staleness k = 0, 1, 2 (trainer.off_policy_steps), side by side.

    python tools/benchmark.py pool [--off-policy-steps 0 1 2] [--steps 6] [--train-ranks 2]
                                   [--pool-ranks 2] [--response-length 128] [--oversample 1.5]
                                   [--partial-rollout]
    # measured here (2 shared cores, 2 + 2 ranks, 6 steps, 128 tokens): see the report's ratios
    python tools/benchmark.py pool --seeds 1 2 3 --off-policy-steps 0 2 --steps 30
    # the held-out score per seed and k (validated after the last step), mean and spread
    python tools/benchmark.py pool --seeds 1 2 3 --off-policy-steps 0 2 --steps 80 \
        actor_rollout_ref.actor.ppo_mini_batch_size=32 \
        algorithm.rollout_correction.bypass_mode=true   # key=value words: every run
    # measured here (2 + 2 ranks, 6 min): k=0 0.7891 / 0.6094 / 0.3609, k=2 0.9062 / 0.6641 / 0.8594
    # (mean 0.81, above k=0's range); with truncated IS at 2 instead k=2 fell to 0.18 (k=0 0.56)

--partial-rollout: the runs at k >= 1 pause their generations for new weights and go on from the
tokens they have (trainer.partial_rollout), so a long response is not held to old weights.

--seeds: one run per (k, seed) of the demo with the key=value overrides (its own response length unless
--response-length is given), each seed setting trainer.seed, actor_rollout_ref.rollout.seed and
actor_rollout_ref.actor.megatron.seed (the model's initialisation); the held-out set is the same
for every run (data.seed is kept). It prints every run's held-out score (val/score/mean after the
last step), each k's mean, spread (max - min) and standard deviation, and whether each k's mean lies
below, within or above the baseline k's seed-to-seed range [min, max].

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


def _whole(what):
    """argparse type: an integer >= 0; `what` says what it is, e.g. "the staleness bound k, e.g. 2"."""
    def parse(text):
        import argparse
        if not text.isdigit():
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0; give {what}")
        return int(text)
    return parse


def add_arguments(p):
    from engine.errors import positive
    p.add_argument("--off-policy-steps", type=_whole("the staleness bound k, e.g. 2"), nargs="+",
                   default=[0, 1, 2], help="one run per k (trainer.off_policy_steps); the first is the baseline")
    p.add_argument("--steps", type=positive(int, "the training steps per run, e.g. 6"), default=6)
    p.add_argument("--train-ranks", type=positive(int, "the training ranks, e.g. 2"), default=2)
    p.add_argument("--pool-ranks", type=positive(int, "the rollout pool's ranks, e.g. 2"), default=2)
    p.add_argument("--response-length", type=positive(int, "the most response tokens, e.g. 128"), default=None,
                   help="default 128; with --seeds the demo's own (recipes/tiny_cpu_demo.yaml)")
    p.add_argument("--partial-rollout", action="store_true",
                   help="runs at k >= 1 pause generations for new weights (trainer.partial_rollout)")
    p.add_argument("--seeds", type=_whole("a seed, e.g. 1"), nargs="+", default=None,
                   help="held-out score per seed and k, mean and spread (one run per pair)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="recipe overrides for every run (e.g. a rollout correction, the lr)")
    p.add_argument("--oversample", type=positive(float, "the generation batch over the train batch, e.g. 1.5"),
                   default=1.0, help="data.gen_batch_size = this x train_batch_size at k >= 1")


def gen_batch_size(oversample, train_batch_size, dp):
    """data.gen_batch_size for --oversample: at least the train batch, a multiple of `dp`."""
    want = max(train_batch_size, math.ceil(oversample * train_batch_size))
    return -(-want // dp) * dp


def _run_one(args, k, tmp, seed=None):
    nproc = args.train_ranks + args.pool_ranks
    name = f"off_policy_{k}" + ("" if seed is None else f"_seed_{seed}")
    length = args.response_length or (None if seed is not None else 128)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "engine.train", RECIPE, "trainer.resume_mode=disable", "trainer.save_freq=-1",
           # --seeds: validated after the last step (test_freq: every `steps` and at the last)
           f"trainer.test_freq={-1 if seed is None else args.steps}", "trainer.val_before_train=false",
           "trainer.logger=[jsonl]",
           f"trainer.total_training_steps={args.steps}", f"trainer.experiment_name={name}",
           f"trainer.n_gpus_per_node={nproc}", "trainer.rollout_pool=separate",
           f"trainer.rollout_pool_ranks={args.pool_ranks}", f"trainer.off_policy_steps={k}",
           f"trainer.log_dir={tmp}/logs/{name}", f"trainer.default_local_dir={tmp}/ckpt/{name}"]
    if length is not None:
        cmd.append(f"data.max_response_length={length}")
    if args.partial_rollout and k >= 1:
        cmd.append("trainer.partial_rollout=true")
    if seed is not None:
        cmd += [f"trainer.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}",
                f"actor_rollout_ref.actor.megatron.seed={seed}"]
    cmd += list(getattr(args, "overrides", None) or [])
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
            "response_max": max(r["response_length/max"] for r in records),
            "partial_samples": sum(r.get("rollout/partial_samples", 0.0) for r in records),
            "seed": seed, "val_score": next((r["val/score/mean"] for r in reversed(records)
                                             if "val/score/mean" in r), None)}


def _train_batch_size():
    from engine.config import load_config
    return load_config(RECIPE, []).data.train_batch_size


def run(args) -> dict:
    from engine.errors import UsageError
    if args.steps < 2:
        raise UsageError(f"--steps {args.steps}: the mean leaves out the first step; give at least 2")
    ks = list(dict.fromkeys(args.off_policy_steps))
    if args.seeds:
        return run_seeds(args, ks)
    args.response_length = args.response_length or 128
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
    if args.partial_rollout:
        print("  samples straddling a weight update (partial rollouts): "
              + ", ".join(f"k={r['k']} {r['partial_samples']:.0f}" for r in runs))
    return report


def spread(scores) -> dict:
    """mean, min, max, spread (max - min) and standard deviation (n - 1) of a k's scores."""
    n = len(scores)
    mean = sum(scores) / n
    std = (sum((x - mean) ** 2 for x in scores) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return {"mean": mean, "min": min(scores), "max": max(scores), "spread": max(scores) - min(scores), "std": std}


def run_seeds(args, ks) -> dict:
    """The held-out score of one run per (k, seed), side by side."""
    seeds = list(dict.fromkeys(args.seeds))
    with tempfile.TemporaryDirectory(prefix="bench_pool_seeds_") as tmp:
        runs = {k: [_run_one(args, k, tmp, seed=s) for s in seeds] for k in ks}
    base = ks[0]
    table = {}
    for k, rs in runs.items():
        scores = [r["val_score"] for r in rs]
        table[str(k)] = dict(spread(scores), scores={str(r["seed"]): r["val_score"] for r in rs},
                             step_s=sum(r["step_s"] for r in rs) / len(rs),
                             staleness_max=max((x for r in rs for x in r["staleness"] if x is not None), default=0),
                             stale_samples=sum(r["stale_samples"] for r in rs))
    b = table[str(base)]
    for row in table.values():
        row["mean_within_baseline_range"] = b["min"] <= row["mean"] <= b["max"]
        # above the range is no loss of accuracy: "within" alone would call it a miss
        row["mean_vs_baseline_range"] = ("below" if row["mean"] < b["min"] else
                                         "above" if row["mean"] > b["max"] else "within")
        row["seeds_within_baseline_range"] = sum(b["min"] <= x <= b["max"] for x in row["scores"].values())
    print(f"pool --seeds: {args.train_ranks} training + {args.pool_ranks} rollout ranks, {args.steps} steps, "
          f"held-out score (val/score/mean after the last step) per seed"
          + (", partial rollouts at k >= 1" if args.partial_rollout else ""))
    print(f"  {'k':>3}" + "".join(f"{'seed ' + str(s):>10}" for s in seeds)
          + f"{'mean':>9}{'spread':>9}{'std':>8}{'step s':>8}  against k={base}'s [min, max]")
    for k in ks:
        row = table[str(k)]
        print(f"  {k:>3}" + "".join(f"{row['scores'][str(s)]:>10.4f}" for s in seeds)
              + f"{row['mean']:>9.4f}{row['spread']:>9.4f}{row['std']:>8.4f}{row['step_s']:>8.2f}"
              f"  mean {row['mean_vs_baseline_range']}, "
              f"{row['seeds_within_baseline_range']}/{len(seeds)} seeds within")
    print(f"  k={base}'s seed-to-seed range: [{b['min']:.4f}, {b['max']:.4f}]")
    return {"seeds": table, "baseline_k": base, "steps": args.steps, "cores": os.cpu_count(),
            "ranks": args.train_ranks + args.pool_ranks}
