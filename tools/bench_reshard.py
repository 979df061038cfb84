"""Benchmark of the hybrid engine's resharding: training layout -> full tensors on every rank.

    python tools/bench_reshard.py --size-mb 200 [--bucket-mb 32] [--world-size 2] [--json F]

At --world-size 4 it also times one weight sync both ways (issue 22): today's full tensors on
every rank vs the transfer plan's delivery (engine/rollout/delivery.py), at train tp=2,pp=2 ->
rollout TP 1 and TP 2, pp=4 -> TP 4 and tp=4 -> TP 4: bytes received per rank, seconds, peak
buffers ("-": nothing to receive, every rank holds its rollout rank's share).

Spawns gloo ranks, builds a llama model of about `--size-mb` (fp32) and times one full reshard
(`parallel.reshard.iter_buckets`, plan cached, consumer that only touches each bucket) from a
TP and from a PP layout. The floor is a plain in-memory copy of the same bytes in one process
(`torch.empty_like` + `copy_` over tensors of the same shapes). Memory: reshard's own count of
the bytes it held at once, and each rank's resident-set high-water mark over its start (glibc's
mmap threshold is fixed at 64 KiB so freed tensors leave the resident set).

Tests: tests/test_benchmark_json.py, tests/test_reshard.py
"""
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 1 << 20


def add_arguments(parser):
    from engine.errors import positive
    parser.add_argument("--size-mb", type=positive(float, "the model size in MiB, e.g. 200"), default=200,
                        help="model size in MiB (fp32)")
    parser.add_argument("--bucket-mb", type=positive(float, "the bucket size in MiB, e.g. 32"), default=32,
                        help="reshard bucket in MiB")
    parser.add_argument("--hidden", type=positive(int, "the hidden size, e.g. 1024"), default=1024)
    parser.add_argument("--vocab", type=positive(int, "the vocabulary size, e.g. 8192"), default=8192)
    parser.add_argument("--world-size", type=int, default=2, choices=(2, 4),
                        help="2: layouts tp=2 and pp=2; 4: also tp=2 x pp=2")
    parser.add_argument("--repeat", type=positive(int, "the number of timed runs, e.g. 2"), default=2,
                        help="timed reshards per layout (best kept)")


def model_config(args):
    """A llama config of about `args.size_mb` MiB: 12 H^2 parameters per layer (GQA 2:1, ffn 3H),
    2 V H for embedding and output layer; a multiple of 4 layers (pp=2, pp=4)."""
    from transformers import LlamaConfig

    h, v = args.hidden, args.vocab
    layers = (args.size_mb * MIB / 4 - 2 * v * h) / (12 * h * h)
    layers = max(4, 4 * round(layers / 4))  # pp=2 and pp=4 split it evenly
    heads = max(2, h // 64)
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads // 2, intermediate_size=3 * h, vocab_size=v,
                      max_position_embeddings=256, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def _time_reshard(chunks, bucket_bytes, repeat):
    import ctypes
    import gc

    import torch.distributed as dist

    from engine.perf import proc_status_bytes
    from parallel.reshard import MemoryCounter, ReshardPlan, iter_buckets

    start = time.perf_counter()
    plan = ReshardPlan.build(chunks)
    plan_s = time.perf_counter() - start
    runs = []
    for _ in range(repeat):
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
        base = proc_status_bytes("VmRSS")
        counter, buckets = MemoryCounter(), 0
        dist.barrier()
        start = time.perf_counter()
        for bucket in iter_buckets(chunks, bucket_bytes, plan=plan, counter=counter):
            buckets += 1
        dist.barrier()
        runs.append(dict(seconds=time.perf_counter() - start, buckets=buckets,
                         counted_peak=counter.peak, rss_peak=proc_status_bytes("VmHWM") - base))
    # time: the best run; memory: the last one (the first may grow the allocator's arenas)
    return dict(runs[-1], seconds=min(r["seconds"] for r in runs), plan_s=plan_s,
                model_bytes=plan.nbytes, shapes=[(t.shape, t.dtype) for t in plan.tensors])


class _Touch:
    """A rollout group that only touches what it is handed (the transfer is what is timed)."""

    def begin_sync(self):
        pass

    def load_slices(self, pieces, tensors, dtype=None, device=None):
        for _, _, t in pieces:
            t.reshape(-1)[:1].sum() if t.is_contiguous() else t[(0,) * t.dim()].item()

    def finish_sync(self):
        pass


def _time_sync(chunks, hf, layout, rollout_tp, bucket_bytes, repeat):
    """One weight sync both ways at `layout` into engines of rollout TP `rollout_tp`: today's
    full tensors on every rank (iter_buckets; a rank receives the model less what it holds)
    and the transfer plan's delivery (engine/rollout/delivery.py; bytes counted as received)."""
    import torch.distributed as dist

    from engine.rollout.delivery import Delivery, transfer_plan_for
    from engine.rollout.topology import rollout_topology
    from parallel.reshard import ReshardPlan, iter_buckets
    from parallel.shards import local_shards

    world = dist.get_world_size()
    held = sum(p.numel() * p.element_size() for p, _ in local_shards(chunks))
    plan = ReshardPlan.build(chunks)
    delivery = Delivery(transfer_plan_for(hf, layout, rollout_topology(world, world, rollout_tp), chunks,
                                          bucket_bytes / MIB), chunks)
    today, planned = [], []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        for _bucket in iter_buckets(chunks, bucket_bytes, plan=plan):
            pass
        dist.barrier()
        today.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        stats = delivery.run(_Touch())
        dist.barrier()
        planned.append(time.perf_counter() - start)
    return dict(today_s=min(today), planned_s=min(planned), today_recv=plan.nbytes - held,
                planned_recv=stats.received, planned_local=stats.local, planned_peak=stats.peak_bytes,
                rounds=stats.rounds)


def _copy_floor(shapes, repeat):
    """Seconds to copy every tensor once in memory (destination allocated per tensor, as
    reshard does), best of `repeat`."""
    import torch

    sources = [torch.randn(shape).to(dtype) for shape, dtype in shapes]
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for src in sources:
            torch.empty_like(src).copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def _worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import gc

    import torch
    import torch.distributed as dist

    from engine.models.builder import build_model
    from parallel.mesh import Layout, destroy_mesh, init_mesh

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    layouts = {"tp=2": Layout(tp=2), "pp=2": Layout(pp=2)}
    if world == 4:
        layouts["tp=2,pp=2"] = Layout(tp=2, pp=2)
    hf = model_config(args)
    results = {}
    for name, layout in layouts.items():
        init_mesh(layout)
        chunks = build_model(hf)
        results[name] = _time_reshard(chunks, int(args.bucket_mb * MIB), args.repeat)
        del chunks
        gc.collect()
        destroy_mesh()
    if world == 4:  # weight sync: today's full tensors vs the transfer plan, at three layout pairs
        sync_layouts = {"tp=2,pp=2->R1": (Layout(tp=2, pp=2, world_size=4), 1),
                        "tp=2,pp=2->R2": (Layout(tp=2, pp=2, world_size=4), 2),
                        "pp=4->R4": (Layout(pp=4, world_size=4), 4),
                        "tp=4->R4": (Layout(tp=4, world_size=4), 4)}
        results["sync"] = {}
        for name, (layout, R) in sync_layouts.items():
            init_mesh(layout)
            chunks = build_model(hf)
            results["sync"][name] = _time_sync(chunks, hf, layout, R, int(args.bucket_mb * MIB), args.repeat)
            del chunks
            gc.collect()
            destroy_mesh()
    if rank == 0:
        shapes = next(iter(results.values())).pop("shapes")
        results["copy_s"] = _copy_floor(shapes, args.repeat)
    for r in results.values():
        if isinstance(r, dict):
            r.pop("shapes", None)
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def run(args):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # children inherit it: every tensor over 64 KiB is its own mapping, so RSS tracks live bytes
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 << 10))
    world = args.world_size
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, port, args, queue), nprocs=world, join=True)
    per_rank = dict(queue.get() for _ in range(world))
    copy_s = per_rank[0]["copy_s"]
    bucket = int(args.bucket_mb * MIB)
    report = {"size_mb": args.size_mb, "bucket_mb": args.bucket_mb, "world_size": world,
              "copy_s": copy_s, "layouts": {}}
    model_bytes = None
    for layout in (k for k in per_rank[0] if k not in ("copy_s", "sync")):
        ranks = [per_rank[r][layout] for r in range(world)]
        model_bytes = ranks[0]["model_bytes"]
        seconds = max(r["seconds"] for r in ranks)
        report["layouts"][layout] = dict(
            seconds=seconds, ratio_to_copy=seconds / copy_s, buckets=ranks[0]["buckets"],
            plan_s=max(r["plan_s"] for r in ranks),
            gb_per_s=model_bytes / seconds / 1e9,
            counted_peak_mb=max(r["counted_peak"] for r in ranks) / MIB,
            rss_peak_mb=max(r["rss_peak"] for r in ranks) / MIB)
    report["model_mb"] = model_bytes / MIB
    print(f"reshard: llama {report['model_mb']:.0f} MiB fp32, bucket {args.bucket_mb:g} MiB, "
          f"{world} gloo ranks (CPU); floor: in-memory copy {copy_s:.3f} s "
          f"({model_bytes / copy_s / 1e9:.2f} GB/s)")
    print(f"  {'layout':<11}{'time (s)':>10}{'x copy':>8}{'GB/s':>7}{'buckets':>9}{'plan (s)':>10}"
          f"{'peak counted':>14}{'peak RSS':>10}  (MiB; bucket {args.bucket_mb:g})")
    for layout, r in report["layouts"].items():
        print(f"  {layout:<11}{r['seconds']:>10.3f}{r['ratio_to_copy']:>8.2f}{r['gb_per_s']:>7.2f}"
              f"{r['buckets']:>9}{r['plan_s']:>10.3f}{r['counted_peak_mb']:>14.1f}{r['rss_peak_mb']:>10.1f}")
    print(f"  targets: time <= 3x copy, extra memory <= one bucket ({bucket / MIB:g} MiB)")
    if "sync" in per_rank[0]:
        report["sync"] = {}
        print("weight sync, today (every rank materialises the model) vs the transfer plan "
              "(each rank receives what its rollout TP rank loads):")
        print(f"  {'layout':<15}{'today recv':>11}{'plan recv':>10}{'ratio':>7}{'today (s)':>10}"
              f"{'plan (s)':>9}{'x':>6}{'plan peak':>10}  (MiB per rank, max over ranks)")
        for name in per_rank[0]["sync"]:
            ranks = [per_rank[r]["sync"][name] for r in range(world)]
            r = dict(today_recv_mb=max(x["today_recv"] for x in ranks) / MIB,
                     planned_recv_mb=max(x["planned_recv"] for x in ranks) / MIB,
                     planned_loaded_mb=max(x["planned_recv"] + x["planned_local"] for x in ranks) / MIB,
                     today_s=max(x["today_s"] for x in ranks), planned_s=max(x["planned_s"] for x in ranks),
                     planned_peak_mb=max(x["planned_peak"] for x in ranks) / MIB, rounds=ranks[0]["rounds"])
            r["recv_ratio"] = r["today_recv_mb"] / r["planned_recv_mb"] if r["planned_recv_mb"] else None
            r["time_ratio"] = r["planned_s"] / r["today_s"]
            report["sync"][name] = r
            ratio = f"{r['recv_ratio']:.2f}" if r["recv_ratio"] else "-"
            print(f"  {name:<15}{r['today_recv_mb']:>11.1f}{r['planned_recv_mb']:>10.1f}{ratio:>7}"
                  f"{r['today_s']:>10.3f}{r['planned_s']:>9.3f}{r['time_ratio']:>6.2f}{r['planned_peak_mb']:>10.1f}")
        print(f"  targets: received bytes drop by the rollout TP factor (R); time ratio <= 1; "
              f"peak <= one bucket ({bucket / MIB:g} MiB)")
    return report


def main(argv=None):
    from engine.errors import run_main
    return run_main(_main, argv)


def _main(argv=None):
    from engine.errors import ArgumentParser, check_output_file
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.json:
        check_output_file(args.json, "--json")
    report = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
