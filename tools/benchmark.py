"""Trident benchmarks, one subcommand each.

    python tools/benchmark.py step [--workload tiny|3m|75m|RECIPE] [--baseline] [--json F]
    python tools/benchmark.py reshard [--size-mb 200]
    python tools/benchmark.py kernels [--tokens 4096 --hidden 1024 --vocab 151936] [--json F]
    python tools/benchmark.py pool [--off-policy-steps 0 1 2]   # separate pool at staleness k
    python tools/benchmark.py pool --seeds 1 2 3 --off-policy-steps 0 2 --steps 30  # held-out score
    python tools/benchmark.py attention [--tokens 8192]  # packed attention: SDPA orders on a GPU
    python tools/benchmark.py all                      # every subcommand with its defaults

Adding a subcommand: write `add_<name>_args(parser)` and `run_<name>(args) -> dict` and register
them in SUBCOMMANDS; the returned dict is what `--json` writes.

Tests: tests/test_benchmark_json.py
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# ---------------------------------------------------------------------------------------------
# kernels: naive full-logits log-prob + entropy vs the fused chunked kernel
#
# Memory is measured honestly for CPU: each path runs in a FRESH subprocess, which allocates
# its inputs, records its resident set size (RSS, /proc/self/statm), runs forward + backward,
# and reports the process's peak RSS (getrusage ru_maxrss) minus that baseline. That delta is
# everything the path needed beyond its inputs: logits and their temporaries, autograd saved
# tensors, and the gradients of hidden and weight (the same [V, H] weight gradient in both
# paths, so the ratio understates the fused path's saving on the logits themselves).
# Time: wall and process CPU (user + system, all threads) seconds of forward + backward, the
# minimum over --repeat runs after one warm-up. On a shared machine CPU time is the steadier
# figure; the 1-minute load average is printed beside it.

# naive: full logits + log_softmax; fused: linear_logprob_entropy (any loss: its backward
# recomputes the logits, 4 GEMMs); single: linear_token_loss (per-token losses, what the actor's
# PPO loss uses: gradients made in the forward, 3 GEMMs like naive)
KERNEL_PATHS = ("naive", "fused", "single")


def add_kernels_args(parser):
    parser.add_argument("--tokens", type=positive(int, "the number of tokens, e.g. 4096"), default=4096)
    parser.add_argument("--hidden", type=positive(int, "the hidden size, e.g. 1024"), default=1024)
    parser.add_argument("--vocab", type=positive(int, "the vocabulary size, e.g. 151936"), default=151936)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--temperature", type=positive(float, "a sampling temperature, e.g. 1.0"), default=1.0)
    parser.add_argument("--chunk-tokens", type=positive(int, "tokens per chunk, e.g. 1024"), default=None,
                        help="fused path's tokens per chunk (default: by bytes, see kernels)")
    parser.add_argument("--repeat", type=positive(int, "the number of timed runs, e.g. 2"), default=2,
                        help="timed runs after one warm-up")
    parser.add_argument("--worker", choices=KERNEL_PATHS, help=argparse.SUPPRESS)


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cpu_seconds():
    """User + system CPU time of this process, all threads: unlike wall time, barely moved by
    other jobs competing for the cores (shared machines)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _kernels_worker(args):
    """One path, in this (fresh) process: peak RSS over baseline, times, and checksums."""
    import torch
    from kernels.logprob import linear_logprob_entropy, linear_token_loss, naive_logprob_entropy

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden ** 0.5) \
        .to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    coef_lp = torch.randn(args.tokens, generator=gen)  # a loss that uses both outputs
    coef_ent = torch.randn(args.tokens, generator=gen)
    def loss_of(logprob, entropy, start=0, end=None):
        return (logprob * coef_lp[start:end]).sum() + (entropy * coef_ent[start:end]).sum()

    if args.worker == "naive":
        def step():
            logprob, entropy = naive_logprob_entropy(hidden, weight, labels, args.temperature)
            return logprob, entropy, loss_of(logprob, entropy)
    elif args.worker == "fused":
        def step():
            logprob, entropy = linear_logprob_entropy(hidden, weight, labels, args.temperature,
                                                      chunk_tokens=args.chunk_tokens,
                                                      backend="torch")
            return logprob, entropy, loss_of(logprob, entropy)
    else:
        def step():
            loss, logprob, entropy = linear_token_loss(
                hidden, weight, labels, lambda a, b, lp, ent: loss_of(lp, ent, a, b),
                args.temperature, chunk_tokens=args.chunk_tokens, backend="torch")
            return logprob, entropy, loss
    baseline = _rss_bytes()
    times, cpu_times = [], []
    for _ in range(1 + args.repeat):
        hidden.grad = weight.grad = None
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        logprob, entropy, loss = step()
        loss.backward()
        times.append(time.perf_counter() - start)
        cpu_times.append(_cpu_seconds() - cpu_start)
        sums = float(logprob.sum()), float(entropy.sum())
        del logprob, entropy
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_bytes": peak - baseline, "times_s": times, "time_s": min(times[1:] or times),
            "cpu_times_s": cpu_times, "cpu_time_s": min(cpu_times[1:] or cpu_times),
            "load_avg_1min": os.getloadavg()[0],
            "logprob_sum": sums[0], "entropy_sum": sums[1],
            "grad_hidden_norm": float(hidden.grad.float().norm()),
            "grad_weight_norm": float(weight.grad.float().norm())}


def run_kernels(args):
    if args.worker:
        return _kernels_worker(args)
    results = {}
    for path in KERNEL_PATHS:
        cmd = [sys.executable, os.path.abspath(__file__), "kernels", "--worker", path,
               "--tokens", str(args.tokens), "--hidden", str(args.hidden),
               "--vocab", str(args.vocab), "--dtype", args.dtype,
               "--temperature", str(args.temperature), "--repeat", str(args.repeat)]
        if args.chunk_tokens:
            cmd += ["--chunk-tokens", str(args.chunk_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{path} worker failed (rc={proc.returncode}; a kill -9 usually "
                               f"means out of memory):\n{proc.stderr[-4000:]}")
        results[path] = json.loads(proc.stdout.strip().splitlines()[-1])
    naive = results["naive"]
    from kernels.logprob import default_chunk_tokens
    report = {
        "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
                  "dtype": args.dtype, "temperature": args.temperature,
                  "chunk_tokens": args.chunk_tokens or default_chunk_tokens(args.vocab, "cpu")},
        **results,
    }
    for path in KERNEL_PATHS[1:]:
        r = results[path]
        report[path + "_ratios"] = {
            "memory": r["peak_bytes"] / naive["peak_bytes"],
            "time": r["time_s"] / naive["time_s"],
            "cpu_time": r["cpu_time_s"] / naive["cpu_time_s"],
            "max_checksum_rel_diff": max(
                abs(r[k] - naive[k]) / max(abs(naive[k]), 1e-12)
                for k in ("logprob_sum", "entropy_sum", "grad_hidden_norm", "grad_weight_norm"))}
    gib = 1 << 30
    print(f"kernels: tokens={args.tokens} hidden={args.hidden} vocab={args.vocab} "
          f"{args.dtype} chunk_tokens={report['shape']['chunk_tokens']} (forward+backward, CPU)")
    print(f"  {'path':<8}{'peak mem (GiB)':>16}{'wall (s)':>10}{'cpu (s)':>10}{'load':>7}"
          f"{'mem ratio':>11}{'wall ratio':>12}{'cpu ratio':>11}{'checksums':>11}")
    for path in KERNEL_PATHS:
        r, q = results[path], report.get(path + "_ratios")
        ratios = (f"{q['memory']:>11.3f}{q['time']:>12.3f}{q['cpu_time']:>11.3f}"
                  f"{q['max_checksum_rel_diff']:>11.1e}" if q else "")
        print(f"  {path:<8}{r['peak_bytes'] / gib:>16.3f}{r['time_s']:>10.2f}"
              f"{r['cpu_time_s']:>10.2f}{r['load_avg_1min']:>7.1f}{ratios}")
    print("  targets: memory <= 0.1, time <= 1.0 x naive. fused = linear_logprob_entropy (any "
          "loss); single = linear_token_loss (per-token losses: the actor's PPO path)")
    return report


# ---------------------------------------------------------------------------------------------

from engine.errors import ArgumentParser, check_output_file, positive, run_main  # noqa: E402
from tools import bench_attention, bench_pool, bench_reshard, bench_step  # noqa: E402  (ROOT is on sys.path above)

SUBCOMMANDS = {
    "step": (bench_step.add_arguments, bench_step.run),
    "reshard": (bench_reshard.add_arguments, bench_reshard.run),
    "kernels": (add_kernels_args, run_kernels),
    "pool": (bench_pool.add_arguments, bench_pool.run),
    "attention": (bench_attention.add_arguments, bench_attention.run),
}


def main(argv=None):
    return run_main(main_raising, argv)


def main_raising(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, _) in SUBCOMMANDS.items():
        p = sub.add_parser(name)
        add_args(p)
        p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p = sub.add_parser("all", help="run every subcommand with its defaults")
    p.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)

    if getattr(args, "worker", None):  # a child process of a subcommand: JSON on stdout
        print(json.dumps(SUBCOMMANDS[args.command][1](args)))
        return
    if args.json:
        check_output_file(args.json, "--json")
    if args.command == "step":
        bench_step.check(args)  # the workload and its recipe, before any run
    if args.command == "all":
        results = {name: run(sub.choices[name].parse_args([]))
                   for name, (_, run) in SUBCOMMANDS.items()}
    else:
        results = SUBCOMMANDS[args.command][1](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
