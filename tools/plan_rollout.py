"""The colocated rollout engine's memory per GPU, as each backend sizes it (tools/plan.py puts it
into the phases of the memory schedule). Both read `actor_rollout_ref.rollout.gpu_memory_utilization`
(u), but not as the same fraction of the same thing. The engines start before the training models,
on a device whose `free at start` is its total memory less tools/plan.py's RESERVE_GIB.

SGLang (mem_fraction_static = u: weights + KV pool, of the memory FREE at engine start;
sglang/srt/mem_cache/kv_cache_configurator.py):
    share    = u x free at start
    KV pool  = share - weights                         (activations live outside the share)

vLLM 0.34 (u of the device's TOTAL memory, for everything the engine allocates;
vllm/v1/worker/utils.py request_memory, vllm/v1/worker/gpu_worker.py determine_available_memory):
    share    = ceil(u x total)                         (refused at start when less is free)
    KV cache = share - weights - activation peak
    activation peak = vLLM's profile run: one forward pass of max_num_batched_tokens tokens
        (B bytes per element, the model's dtype; TP t; only one layer's transients live at a time)
            tokens x B x [2h + ((a + 2g) k_qk + a k_v + 3 f') / t]
        (residual + hidden; QKV and attention output; fc1 2f' + SwiGLU f', f' = f, or for a MoE
        model topk f_expert + f_shared), then the sampler on min(max_num_seqs, tokens) rows of
        full-vocabulary logits, in the model's dtype and twice in fp32 (the warm-up pass):
            rows x V x (B + 8)
    Not counted: memory outside torch that vLLM's own instance adds (its TP group's NCCL buffers,
    cuBLAS workspaces) and, unless enforce_eager, its CUDA graphs: vLLM takes them from the KV
    cache too, so the real cache is somewhat smaller.

KV bytes per token on one GPU (both backends): layers x max(1, g / t) x (k_qk + k_v) x B (KV
heads are replicated when t > g); MLA keeps its latent: layers x (kv_lora + k_rope) x B.

The engine fits when, in every phase it holds its KV cache, its share plus what training keeps
there (reserved) is under the device's capacity, and its KV cache is not empty (SGLang) or holds
one whole sequence, prompt + response (vLLM refuses to start otherwise:
vllm/v1/core/kv_cache_planning.py _check_enough_kv_cache_memory); vLLM also needs its share free
when it starts. `utilization_that_fits` gives the largest u for which all hold.

Tests: tests/test_plan_vllm.py, tests/test_plan.py
"""
import math

VLLM = "vllm"
KEY = "actor_rollout_ref.rollout.gpu_memory_utilization"


def kv_bytes_per_token(s, tp: int, dtype_bytes: int) -> int:
    """KV-cache bytes one token takes on one GPU of an engine with TP `tp` (`s`: plan_memory.Shape)."""
    if s.kv_lora:
        return s.layers * (s.kv_lora + s.k_rope) * dtype_bytes
    return s.layers * max(1, s.g // tp) * (s.k_qk + s.k_v) * dtype_bytes


def vllm_activation_peak(s, tp: int, dtype_bytes: int, max_num_batched_tokens: int, max_num_seqs: int) -> float:
    """Peak transient bytes of vLLM's profile run on one GPU (formula in the module docstring)."""
    ffn = s.topk * s.f_expert + s.f_shared if s.experts else s.f
    per_token = 2 * s.h + ((s.a + 2 * s.g) * s.k_qk + s.a * s.k_v + 3 * ffn) / tp
    rows = min(max_num_seqs, max_num_batched_tokens)
    return max_num_batched_tokens * dtype_bytes * per_token + rows * s.vocab * (dtype_bytes + 8)


def engine_memory(backend: str, s, *, utilization: float, total: float, start_free: float, weights: float,
                  tp: int, dtype_bytes: int, max_num_batched_tokens: int, max_num_seqs: int,
                  max_model_len: int) -> dict:
    """One GPU's part of a rollout engine: its share (what it takes when awake), the weights,
    the activation peak it keeps room for (vLLM), the KV cache, and the tokens that cache holds.
    `total` / `start_free`: the device's memory and what is free when the engine starts (0 on a
    CPU plan: no engine memory on a device)."""
    per_token = kv_bytes_per_token(s, tp, dtype_bytes)
    if backend == VLLM:
        share = math.ceil(utilization * total) if total else 0.0
        activations = vllm_activation_peak(s, tp, dtype_bytes, max_num_batched_tokens, max_num_seqs) \
            if total else 0.0
        of, base = "total", total
    else:  # SGLang's model (the CPU and transformers backends are planned as SGLang)
        share, activations, of, base = utilization * start_free, 0.0, "free", start_free
    kv = share - weights - activations if base else 0.0
    return dict(share_per_gpu=share, utilization=utilization, share_of=of, share_base=base,
                start_free=start_free, weights_per_gpu=weights, activation_peak_per_gpu=activations,
                kv_cache_per_gpu=kv, kv_bytes_per_token=per_token,
                kv_tokens=max(0, int(kv // per_token)), max_model_len=max_model_len,
                min_kv_tokens=max_model_len if backend == VLLM else 1)


def utilization_that_fits(mem: dict, training_awake: float, capacity: float):
    """The largest gpu_memory_utilization (2 decimals, rounded down) at which the engine's share
    fits beside `training_awake` (the most training keeps reserved in a phase where the engine
    holds its KV cache) under `capacity`, is free when the engine starts (vLLM), and leaves the
    KV cache its backend needs (`min_kv_tokens`); None when no value does."""
    base = mem["share_base"]
    if not base:
        return None
    room = capacity - training_awake
    if mem["share_of"] == "total":
        room = min(room, mem["start_free"])
    need = mem["weights_per_gpu"] + mem["activation_peak_per_gpu"] + mem["min_kv_tokens"] * mem["kv_bytes_per_token"]
    high, low = min(1.0 if mem["share_of"] == "total" else 0.99, room / base), need / base  # SGLang: u < 1
    high = math.floor(high * 100) / 100
    return high if high >= low and high > 0 else None


def fit_problems(mem: dict, training_awake: float, capacity: float) -> list:
    """Why the engine does not fit ([] when it does), each naming the key and the value that fits."""
    if not mem["share_base"]:
        return []
    gib, u = 1 << 30, mem["utilization"]
    share = mem["share_per_gpu"]
    what = (f"{u:g} x {mem['share_base'] / gib:.2f} GiB "
            f"{'device memory' if mem['share_of'] == 'total' else 'free at engine start'} = {share / gib:.2f} GiB")
    out = []
    if mem["share_of"] == "total" and share > mem["start_free"]:
        out.append(f"{what} is more than the {mem['start_free'] / gib:.2f} GiB free when the engine starts "
                   "(vLLM refuses to start)")
    if share + training_awake > capacity:
        out.append(f"{what} does not fit beside the {training_awake / gib:.2f} GiB training keeps while the "
                   f"engine is awake (capacity {capacity / gib:.2f} GiB)")
    if mem["kv_tokens"] < mem["min_kv_tokens"]:
        out.append(f"its KV cache ({mem['kv_cache_per_gpu'] / gib:.2f} GiB) holds {mem['kv_tokens']} tokens"
                   + (f", less than one sequence of {mem['max_model_len']} (vLLM refuses to start)"
                      if mem["share_of"] == "total" else ""))
    if not out:
        return []
    fit = utilization_that_fits(mem, training_awake, capacity)
    advice = (f"use {KEY}={fit:g}" if fit is not None else
              "no value fits: offload training state (megatron.*_offload), raise rollout TP, or add GPUs")
    return [f"{KEY}={u:g}: {p}; {advice}" for p in out]
