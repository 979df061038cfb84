"""Packed (THD) attention, forward + backward, under two SDPA priority orders side by side: the
local core attention's (flash / memory-efficient first: engine/models/local_modules.py
CUDA_SDPA_ORDER) and cuDNN first (what torch 2.11 chose on the H200).

cuDNN's attention builds an execution plan per new shape and reuses it for a shape it has seen,
so both kinds of batch run: `varied`, new sequence lengths at every call (RL micro-batches), and
`fixed`, the same lengths at every call (a benchmark with fixed-length responses). The order only
matters on CUDA; on the CPU both rows run torch's own CPU kernels (a check of the plumbing).

    python tools/benchmark.py attention [--tokens 8192 --heads 16 --kv-heads 4 --head-dim 128]

Tests: tests/test_benchmark_json.py
"""
import statistics
import time

CASES = ("varied", "fixed")


def add_arguments(parser):
    from engine.errors import positive
    parser.add_argument("--tokens", type=positive(int, "tokens per call, e.g. 8192"), default=8192)
    parser.add_argument("--heads", type=positive(int, "query heads, e.g. 16"), default=16)
    parser.add_argument("--kv-heads", type=positive(int, "key / value heads, e.g. 4"), default=4)
    parser.add_argument("--head-dim", type=positive(int, "the head size, e.g. 128"), default=128)
    parser.add_argument("--longest", type=positive(int, "the longest sequence, e.g. 1024"), default=1024)
    parser.add_argument("--calls", type=positive(int, "timed calls per row, e.g. 20"), default=20)
    parser.add_argument("--row-seconds", type=positive(float, "seconds per row, e.g. 6"), default=6.0,
                        help="a row stops after this long (at least 3 timed calls): cuDNN's plan "
                             "builds for new lengths can take far longer than the attention")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")


def _lengths(tokens, longest, gen):
    """Random sequence lengths in [1, longest] summing to `tokens`."""
    import torch
    out, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(1, longest + 1, (1,), generator=gen)))
        out.append(n)
        left -= n
    return out


def _orders():
    from torch.nn.attention import SDPBackend

    from engine.models.local_modules import CUDA_SDPA_ORDER
    return {"trident": CUDA_SDPA_ORDER,
            "cudnn_first": [SDPBackend.CUDNN_ATTENTION] + [b for b in CUDA_SDPA_ORDER
                                                           if b != SDPBackend.CUDNN_ATTENTION]}


def run(args):
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from engine.models.local_modules import CoreAttention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    config = type("Config", (), dict(kv_channels=args.head_dim, attention_dropout=0.0))
    gen = torch.Generator().manual_seed(0)
    shape = lambda heads: (args.tokens, heads, args.head_dim)  # noqa: E731
    q, k, v = (torch.randn(shape(h), generator=gen).to(device, dtype).requires_grad_()
               for h in (args.heads, args.kv_heads, args.kv_heads))
    grad = torch.randn(args.tokens, args.heads * args.head_dim, generator=gen).to(device, dtype)
    fixed = _lengths(args.tokens, args.longest, gen)

    def params(lengths):
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).to(device)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    results, counts, warmup = {}, {}, {}
    for case in CASES:
        for order, backends in _orders().items():
            attention = CoreAttention(config, 1, AttnMaskType.causal).train()
            attention.sdpa_order = backends
            # the varied case draws its lengths from the same seed for both orders
            draw = torch.Generator().manual_seed(1)
            times, began = [], time.perf_counter()
            for call in range(1 + args.calls):  # the first call warms up
                lengths = fixed if case == "fixed" else _lengths(args.tokens, args.longest, draw)
                sync()
                start = time.perf_counter()
                attention(q, k, v, packed_seq_params=params(lengths)).backward(grad)
                sync()
                if call:
                    times.append(time.perf_counter() - start)
                else:
                    warmup[f"{case}/{order}"] = (time.perf_counter() - start) * 1e3
                if len(times) >= 3 and time.perf_counter() - began > args.row_seconds:
                    break
            results[f"{case}/{order}"] = statistics.median(times) * 1e3
            counts[f"{case}/{order}"] = len(times)
            # each row as it ends: a step killed at its time limit still shows the rows it ran
            print(f"  row {case}/{order}: median {results[f'{case}/{order}']:.2f} ms of {len(times)} "
                  f"calls, warm-up call {warmup[f'{case}/{order}']:.0f} ms", flush=True)
    report = {"device": device, "dtype": args.dtype, "tokens": args.tokens, "heads": args.heads,
              "kv_heads": args.kv_heads, "head_dim": args.head_dim, "longest": args.longest,
              "calls": counts, "ms_per_call": results, "warmup_ms": warmup,
              "ratios": {case: results[f"{case}/trident"] / results[f"{case}/cudnn_first"]
                         for case in CASES}}
    print(f"attention: {args.tokens} tokens packed, {args.heads}/{args.kv_heads} heads x "
          f"{args.head_dim}, {args.dtype}, on {device}; forward + backward, median per row")
    print(f"  {'case':<8}{'trident (ms)':>14}{'cudnn first (ms)':>18}{'ratio':>8}")
    for case in CASES:
        print(f"  {case:<8}{results[case + '/trident']:>14.2f}{results[case + '/cudnn_first']:>18.2f}"
              f"{report['ratios'][case]:>8.3f}")
    print("  ratio < 1: Trident's order is faster. On the CPU the order does not apply.")
    return report
