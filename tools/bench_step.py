"""PPO/GRPO step throughput: tokens/s per rank, MFU, the phase split and peak memory.

Runs the real trainer (`torchrun -m engine.train`) on a recipe or a named synthetic workload for
warm-up + measured steps and summarises its metrics.jsonl. MFU on CPU is measured against the
dense-matmul FLOP/s each rank reaches in the same run (engine.perf), so it is a ratio of two
measurements, not a datasheet figure. `--baseline` also times a plain transformers loop doing
the same work (generate, log-probs, reference, backward + Adam) for comparison.

    python tools/benchmark.py step --workload 75m --steps 3
    python tools/benchmark.py step --workload 3m --steps 3 --baseline --rounds 3  # median of 3 pairs

Tests: tests/test_benchmark_json.py
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
PHASES = ("gen", "old_log_prob", "ref", "values", "reward", "adv", "update_critic",
          "update_actor", "update_weights")


def _model(hidden, layers, heads, kv, ffn, vocab=20):
    p = "actor_rollout_ref.model.config."
    return [f"{p}hidden_size={hidden}", f"{p}num_hidden_layers={layers}",
            f"{p}num_attention_heads={heads}", f"{p}num_key_value_heads={kv}",
            f"{p}intermediate_size={ffn}", f"{p}vocab_size={vocab}",
            f"{p}max_position_embeddings=512"]


def _shape(prompts, n, response, mini, micro):
    return [f"data.train_batch_size={prompts}", f"actor_rollout_ref.rollout.n={n}",
            f"data.max_response_length={response}", "actor_rollout_ref.rollout.ignore_eos=true",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}"]


def _gpu(hidden, layers, heads, kv, ffn, vocab):
    """One GPU, bf16, the actor alone (no KL: no reference model beside it), Megatron's
    distributed optimizer; rollout.name comes from the caller (sglang, or hf without it)."""
    p = "actor_rollout_ref.actor."
    return _model(hidden, layers, heads, kv, ffn, vocab) + [
        "trainer.device=cuda", f"{p}megatron.params_dtype=bfloat16", f"{p}use_kl_loss=false",
        f"{p}megatron.use_distributed_optimizer=true", f"{p}optim.lr=1e-6",
        "actor_rollout_ref.model.config.max_position_embeddings=1024", "data.max_prompt_length=16"]


# name -> (recipe, overrides); all GRPO on the built-in task, fixed-length responses.
WORKLOADS = {
    "tiny": (DEMO, []),
    "3m": (DEMO, _model(256, 4, 4, 2, 688) + _shape(16, 4, 32, 16, 16)),
    # 128 sequences per step (64 per rank): decoding reads every weight once per token for the
    # whole batch, so a GRPO-sized batch (not a handful of rows) is what keeps generation
    # compute-bound; 16 rows per rank ran generation at about half the matmul rate.
    "75m": (DEMO, _model(768, 12, 12, 4, 2048) + _shape(32, 4, 64, 32, 16)),
    # make gpu-check: the largest dense model whose actor (bf16 weights, fp32 grads, Adam) and
    # rollout share one H200 and run 3 steps in about 3 minutes: 3.8B parameters (Llama-shaped,
    # hidden 3072, 36 layers) x 16 bytes of training state = 61 GB, + activations of 16 x 272
    # tokens per micro-batch, + the rollout's bf16 copy and KV cache
    "gpu": (DEMO, _gpu(3072, 36, 24, 8, 8192, 32000) + _shape(16, 4, 256, 16, 16)),
}


def add_arguments(parser):
    from engine.errors import positive
    parser.add_argument("--workload", default="tiny", help=f"one of {sorted(WORKLOADS)} or a recipe path")
    parser.add_argument("--nproc", type=positive(int, "the number of ranks, e.g. 2"), default=2)
    parser.add_argument("--steps", type=positive(int, "the number of measured steps, e.g. 3"), default=3,
                        help="measured steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--baseline", action="store_true",
                        help="also time a plain transformers loop doing the same work")
    parser.add_argument("--baseline-sync", action="store_true",
                        help="with --baseline: the loop's ranks train one model (each mini-batch's gradients "
                             "all-reduced, as Trident's), not one model each: both sides then pay for data "
                             "parallelism")
    parser.add_argument("--rounds", type=positive(int, "the rounds of Trident and the loop, e.g. 3"), default=1,
                        help="with --baseline: run Trident and the loop this many times, each side first in "
                             "every other round, and report each round's ratios and their median (a machine "
                             "whose speed drifts over minutes moves a single pair's ratio)")
    parser.add_argument("--overlap", action="store_true",
                        help="run with Megatron's overlap switches off and on, side by side, and "
                             "report the time blocked in collectives per phase")
    parser.add_argument("overrides", nargs="*", help="extra key=value recipe overrides")


def with_root(pythonpath):
    """This checkout first, then the caller's path: gpu_check.sh puts megatron-core (from .whl/)
    there, tests put the SGLang double there; replacing it would lose them."""
    return os.pathsep.join([ROOT] + [p for p in (pythonpath or "").split(os.pathsep) if p and p != ROOT])


def run_trainer(recipe, overrides, nproc, steps, log_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=with_root(os.environ.get("PYTHONPATH")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), "-m", "engine.train", recipe, *overrides,
           f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
           "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.resume_mode=disable",
           "trainer.logger=[jsonl]", f"trainer.log_dir={log_dir}",
           f"trainer.n_gpus_per_node={nproc}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()], time.perf_counter() - t0


def summarise(records, warmup):
    measured = [r for r in records if r["step"] > warmup] or records
    med = lambda k: statistics.median(r[k] for r in measured if k in r) if any(k in r for r in measured) else None
    out = {"steps": len(measured),
           "step_s": med("timing_s/step"),
           "tokens_per_s_per_rank": med("perf/throughput"),
           "mfu": med("perf/mfu"),
           "peak_flops_per_rank": med("perf/peak_flops_per_rank"),
           "peak_memory_gb": med("perf/cpu_peak_rss_gb") or med("perf/max_memory_allocated_gb"),
           "tokens_per_step": med("perf/total_num_tokens"),
           "mfu_actor_update": med("perf/mfu/actor_update")}
    out["phases_s"] = {p: med(f"timing_s/{p}") for p in PHASES if med(f"timing_s/{p}") is not None}
    # CPU seconds of rank 0's process per phase: barely moved by other jobs on a shared machine
    out["cpu_step_s"] = med("perf/cpu_s/step")
    out["cpu_phases_s"] = {p: med(f"perf/cpu_s/{p}") for p in PHASES if med(f"perf/cpu_s/{p}") is not None}
    # page faults of rank 0's process per phase: memory handed back to the OS and faulted in again
    out["page_faults"] = {p: med(f"perf/page_faults/{p}") for p in PHASES + ("step",)
                          if med(f"perf/page_faults/{p}") is not None}
    out["comm_s"] = {p: med(f"perf/comm_s/{p}") for p in PHASES + ("other",)
                     if med(f"perf/comm_s/{p}") is not None}
    return out


OVERLAP_KEYS = ("actor_rollout_ref.actor.megatron.overlap_grad_reduce",
                "actor_rollout_ref.actor.megatron.overlap_param_gather")


def compare_overlap(recipe, overrides, args):
    """Blocked-in-collective seconds per phase with overlap off vs on; overlap_ratio is the
    share of the off-run's communication that the on-run hid under compute."""
    runs = {}
    for state in ("false", "true"):
        extra = [f"{k}={state}" for k in OVERLAP_KEYS] + ["trainer.profile_comm=true",
                 "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true"]
        with tempfile.TemporaryDirectory() as tmp:
            records, _ = run_trainer(recipe, overrides + extra, args.nproc,
                                     args.warmup + args.steps, tmp)
        runs[state] = summarise(records, args.warmup)
    off, on = runs["false"]["comm_s"], runs["true"]["comm_s"]
    print(f"\n{'phase':<16}{'comm off (s)':>14}{'comm on (s)':>13}{'overlap_ratio':>15}"
          f"{'step off/on (s)':>18}")
    ratios = {}
    for phase in sorted(set(off) | set(on)):
        a, b = off.get(phase, 0.0), on.get(phase, 0.0)
        ratios[phase] = (1 - b / a) if a > 0 else None
        r = f"{ratios[phase]:.2f}" if ratios[phase] is not None else "-"
        print(f"{phase:<16}{a:14.3f}{b:13.3f}{r:>15}")
    print(f"{'step':<16}{'':14}{'':13}{'':15}{runs['false']['step_s']:9.2f}/{runs['true']['step_s']:.2f}")
    return {"off": runs["false"], "on": runs["true"], "perf/overlap_ratio": ratios}


def print_table(name, summary, per_step=None):
    print(f"\n== step benchmark: {name} ==")
    if per_step:
        print(f"{'step':>4} {'step_s':>8} {'tok/s/rank':>11} {'mfu':>6}")
        for r in per_step:
            print(f"{r['step']:>4} {r.get('timing_s/step', 0):8.2f} {r.get('perf/throughput', 0):11.1f} "
                  f"{r.get('perf/mfu', 0):6.3f}")
    print(f"median step {summary['step_s']:.2f} s | {summary['tokens_per_s_per_rank']:.1f} tokens/s/rank | "
          f"MFU {summary['mfu'] or 0:.3f} (actor update {summary.get('mfu_actor_update') or 0:.3f}) "
          f"of a measured {(summary['peak_flops_per_rank'] or 0) / 1e9:.1f} "
          f"GFLOP/s per rank | peak memory {summary['peak_memory_gb'] or 0:.2f} GB/rank")
    total = sum(summary["phases_s"].values()) or 1.0
    print("phases: " + ", ".join(f"{k} {v:.2f}s ({100 * v / total:.0f}%)"
                                 for k, v in summary["phases_s"].items()))
    if summary.get("page_faults"):
        print("page faults (rank 0): " + ", ".join(f"{k} {v:.0f}" for k, v in summary["page_faults"].items()))


def _describe(recipe, overrides):
    """'3.81B params (hidden 3072 x 36 layers)' for the report."""
    try:
        from engine.config import load_config
        from engine.perf import param_counts
        from engine.loading import load_hf_config
        hf = load_hf_config(load_config(recipe, [o for o in overrides if "=" in o]).actor_rollout_ref.model)
        return (f"{param_counts(hf).total / 1e9:.2f}B params (hidden {hf.hidden_size} x "
                f"{hf.num_hidden_layers} layers)")
    except Exception as e:  # a description only: never fail the benchmark for it
        return f"? ({e})"


def check(args):
    """UserError for an unknown workload, or a recipe / overrides that would fail to load,
    before any trainer is launched."""
    from engine.config import load_config
    from engine.errors import UsageError
    if args.workload not in WORKLOADS and not os.path.isfile(args.workload):
        raise UsageError(f"--workload {args.workload!r} is neither a workload ({', '.join(sorted(WORKLOADS))}) "
                         "nor a recipe file; pick one of those or give a recipe path")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup} must be >= 0")
    if args.baseline_sync and not args.baseline:
        raise UsageError("--baseline-sync changes the plain loop: add --baseline or drop --baseline-sync")
    if args.rounds > 1 and not args.baseline:
        raise UsageError(f"--rounds {args.rounds} alternates Trident with the plain loop: add --baseline "
                         "or drop --rounds")
    recipe, base = WORKLOADS.get(args.workload, (args.workload, []))
    load_config(recipe, base + list(args.overrides) + [f"trainer.n_gpus_per_node={args.nproc}"])


def run(args):
    recipe, base = WORKLOADS.get(args.workload, (args.workload, []))
    overrides = base + list(args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        records, wall = run_trainer(recipe, overrides, args.nproc, args.warmup + args.steps, tmp)
    summary = summarise(records, args.warmup)
    summary.update(workload=args.workload, nproc=args.nproc, wall_s=wall, model=_describe(recipe, overrides))
    print_table(args.workload, summary, records)
    if args.overlap:
        summary["overlap"] = compare_overlap(recipe, overrides, args)
    if args.baseline:
        from tools.bench_baseline import run_baseline

        def trident():
            with tempfile.TemporaryDirectory() as tmp:
                return summarise(run_trainer(recipe, overrides, args.nproc, args.warmup + args.steps, tmp)[0],
                                 args.warmup)

        rounds = [compare_baseline(ours, base) for ours, base in paired_runs(
            args.rounds, summary, trident,
            lambda: run_baseline(recipe, overrides, args.nproc, args.warmup + args.steps,
                                 grad_sync=args.baseline_sync))]
        summary.update(rounds[0])
        print_comparison(summary)
        if args.rounds > 1:
            summary.update(rounds=[{k: r[k] for k in ("ratios", "cpu_ratios", "speedup_vs_transformers",
                                                      "cpu_speedup_vs_transformers") if k in r} for r in rounds],
                           median_ratios=median_ratios(rounds))
            print_rounds(summary)
    return summary


def paired_runs(rounds, first, trident, loop):
    """[(Trident's result, the loop's)] per round; round 0 pairs `first` (Trident's run so far)
    with a loop run after it. ABBA: odd rounds run the loop first, so a machine speeding up or
    slowing down over the rounds favours each side in turn."""
    pairs = []
    for r in range(rounds):
        if r % 2:
            base = loop()
            pairs.append((trident(), base))
        else:
            pairs.append((trident() if r else first, loop()))
    return pairs


def median_ratios(rounds) -> dict:
    """Per phase (and "step"), the median over rounds of each ratio kind (wall, cpu), None where
    no round has one."""
    out = {}
    for kind, step_key in (("ratios", "speedup_vs_transformers"), ("cpu_ratios", "cpu_speedup_vs_transformers")):
        if not all(kind in r for r in rounds):
            continue
        table = {p: [r[kind][p] for r in rounds if r[kind].get(p) is not None] for p in rounds[0][kind]}
        table["step"] = [r[step_key] for r in rounds]
        out[kind] = {p: statistics.median(v) if v else None for p, v in table.items()}
    return out


def show_ratio(r):
    return "-" if r is None else f"{r:.2f}x"


def print_rounds(summary):
    """One line per round (step ratios), then every phase's median ratio."""
    print(f"\n{len(summary['rounds'])} rounds (Trident first, then the loop first, in turn), step ratio wall / cpu: "
          + ", ".join(f"{show_ratio(r['speedup_vs_transformers'])} / {show_ratio(r.get('cpu_speedup_vs_transformers'))}"
                      for r in summary["rounds"]))
    med = summary["median_ratios"]
    print(f"{'median':<16}" + "".join(f"{p:>16}" for p in med["ratios"]))
    for kind in med:
        print(f"{kind:<16}" + "".join(f"{show_ratio(v):>16}" for v in med[kind].values()))


# the phases both sides time; Trident's other phases (reward, adv, ...) fall in "other"
BASELINE_PHASES = ("gen", "old_log_prob", "ref", "update_actor", "update_weights")


def _side_by_side(ours, ours_step, base, base_step):
    """(baseline seconds, Trident seconds, ratios) per compared phase, `other` the rest."""
    phases = {p: base.get(p, 0.0) for p in BASELINE_PHASES if p in ours or p in base}
    phases["other"] = max(base_step - sum(phases.values()), 0.0)
    trident = {p: ours.get(p, 0.0) for p in phases if p != "other"}
    trident["other"] = max(ours_step - sum(trident.values()), 0.0)
    ratio = lambda b, t: b / t if t > 0 else None  # noqa: E731
    return phases, trident, {p: ratio(phases[p], trident[p]) for p in phases}


def compare_baseline(summary, base):
    """The plain loop's seconds per phase beside Trident's and their ratios, baseline seconds
    over Trident's (Trident's speed relative to the loop's: > 1 is faster). A phase one side
    does not run is 0 s there; its ratio is None where Trident's time is 0, and 0 where only
    Trident runs it (the weight hand-off: the loop generates with the model it trains). The
    same by CPU seconds (`cpu_ratios`) when both sides measured them: on a shared machine the
    wall-clock ratios move with the other jobs, the CPU ones much less."""
    phases, trident, ratios = _side_by_side(summary["phases_s"], summary["step_s"], base, base["step"])
    out = {"baseline_step_s": base["step"], "speedup_vs_transformers": base["step"] / summary["step_s"],
           "baseline": {"step_s": base["step"], "phases_s": phases},
           "ratios": ratios, "compared_phases_s": trident}
    if summary.get("cpu_step_s") and "cpu/step" in base:
        cpu_base = {k[4:]: v for k, v in base.items() if k.startswith("cpu/")}
        phases, trident, ratios = _side_by_side(summary["cpu_phases_s"], summary["cpu_step_s"],
                                                cpu_base, cpu_base["step"])
        out["baseline"].update(cpu_step_s=cpu_base["step"], cpu_phases_s=phases)
        out.update(cpu_ratios=ratios, compared_cpu_phases_s=trident,
                   cpu_speedup_vs_transformers=cpu_base["step"] / summary["cpu_step_s"])
    if "threads" in base:  # intra-op threads per rank (the trainer's: parallel/cpu.py)
        out["baseline"]["threads"] = int(base["threads"])
    if "grad_sync" in base:  # the loop's ranks trained one model (--baseline-sync)
        out["baseline"]["grad_sync"] = bool(base["grad_sync"])
        out["baseline"]["same_weights"] = bool(base.get("same_weights"))
    faults = {k[7:]: v for k, v in base.items() if k.startswith("faults/")}
    if faults:
        out["baseline"]["page_faults"] = faults
    return out


def print_comparison(summary):
    base, ours, cpu = summary["baseline"]["phases_s"], summary["compared_phases_s"], "cpu_ratios" in summary
    faults, base_faults = summary.get("page_faults", {}), summary["baseline"].get("page_faults", {})
    if "grad_sync" in summary["baseline"]:
        print("\nthe loop: " + ("one model over the ranks, gradients all-reduced per mini-batch"
                              if summary["baseline"]["grad_sync"] else "one model per rank, no gradient sync"))
    print(f"\n{'phase':<16}{'trident (s)':>12}{'baseline (s)':>14}{'ratio':>8}"
          + (f"{'cpu trident':>13}{'cpu baseline':>14}{'cpu ratio':>10}" if cpu else "")
          + "   (ratio: baseline / Trident seconds, > 1: Trident faster)")
    for p in base:
        row = f"{p:<16}{ours[p]:12.3f}{base[p]:14.3f}{show_ratio(summary['ratios'][p]):>8}"
        if cpu:
            row += (f"{summary['compared_cpu_phases_s'][p]:13.3f}"
                    f"{summary['baseline']['cpu_phases_s'][p]:14.3f}{show_ratio(summary['cpu_ratios'][p]):>10}")
        print(row)
    row = (f"{'step':<16}{summary['step_s']:12.3f}{summary['baseline_step_s']:14.3f}"
           f"{show_ratio(summary['speedup_vs_transformers']):>8}")
    if cpu:
        row += (f"{summary['cpu_step_s']:13.3f}{summary['baseline']['cpu_step_s']:14.3f}"
                f"{show_ratio(summary['cpu_speedup_vs_transformers']):>10}")
    print(row)
    if faults and base_faults:
        print("page faults per step (rank 0), trident / loop: " + ", ".join(
            f"{p} {faults.get(p, 0):.0f} / {base_faults.get(p, 0):.0f}" for p in list(base) + ["step"]
            if p != "other"))
