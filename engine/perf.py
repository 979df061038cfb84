"""FLOP accounting and the peak FLOP/s that MFU is measured against.

The peak is *measured* on the device the run uses: the dense-matmul FLOP/s this device reaches
in this process (bf16 on a GPU, the training dtype on a CPU), which makes MFU a ratio of two
measurements taken side by side. The datasheet table is kept for reports and as the GPU
fallback when the measurement cannot run.

Model FLOPs use the parameters a token actually passes through (`param_counts`): for a
mixture-of-experts model that is the routed top-k experts, not all of them, and it is computed
from the HF config, so it does not depend on how the experts are spread over EP ranks.

Tests: tests/test_flops.py, tests/gpu/test_perf_gpu.py, tests/test_trainer_paths.py
"""
import contextlib
import sys
import time
from dataclasses import dataclass

import torch

# Dense bf16 tensor-core datasheet peaks (FLOP/s), by substring of torch.cuda.get_device_name().
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12,
                 "A800": 312e12, "L40S": 362e12, "B200": 2250e12}


def measure_matmul_flops(n=1024, dtype=torch.float32, seconds=1.0, threads=None):
    """Best dense matmul FLOP/s over repeated n x n products (CPU, this process's threads)."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)  # warm-up
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(old)


def measure_cuda_matmul_flops(n=8192, dtype=torch.bfloat16, seconds=1.0, reps=10):
    """Best dense matmul FLOP/s on the current GPU: batches of `reps` n x n products timed with
    CUDA events (kernel launches are asynchronous; only events around a batch time the GPU)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(n, n, dtype=dtype, device=dev)
    b = torch.randn(n, n, dtype=dtype, device=dev)
    out = torch.empty(n, n, dtype=dtype, device=dev)
    torch.mm(a, b, out=out)  # warm-up (cuBLAS heuristics, clocks)
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start.record()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        best = max(best, 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3))
    del a, b, out
    return best


def table_peak_flops(device_name):
    """The datasheet dense bf16 peak of a GPU by name, or None when it is not in the table."""
    for key, value in GPU_PEAK_BF16.items():
        if key in device_name:
            return value
    return None


def peak_flops_per_rank(device, dtype=torch.float32):
    """This rank's peak FLOP/s. On CUDA: a measured bf16 (fp16 when training in fp16) matmul,
    the dtype MFU is conventionally quoted against; the datasheet table if measuring fails.
    On a CPU: a measured matmul in the training dtype."""
    if device == "cuda" and torch.cuda.is_available():
        gpu_dtype = torch.float16 if dtype == torch.float16 else torch.bfloat16
        try:
            return measure_cuda_matmul_flops(dtype=gpu_dtype, seconds=0.5)
        except RuntimeError:  # e.g. out of memory on a device already full
            return table_peak_flops(torch.cuda.get_device_name())
    return measure_matmul_flops(dtype=dtype, seconds=0.5)


# --------------------------------------------------------------------------------------------
# Parameter counts from a HF config
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a causal LM, by the convention of published figures: embeddings and
    the LM head are included in both, multi-token-prediction (MTP) modules in neither.

    total:     every parameter (a tied embedding / head matrix once).
    active:    the parameters one token passes through: attention, norms, dense MLPs, the
               router, the shared experts and the top-k routed experts of each MoE layer, the
               embedding and the LM head. Dense models: active == total.
    embedding: the input embedding table (vocab x hidden).
    tied:      whether the LM head shares the embedding table.
    """
    total: int
    active: int
    embedding: int
    tied: bool

    @property
    def flop_params(self):
        """Parameters that take part in a matmul per token: `active` without the embedding
        lookup (an index, no FLOPs), with the LM head counted even when tied to it."""
        return self.active - (0 if self.tied else self.embedding)


def _cfg(hf, *names, default=None):
    for name in names:
        value = getattr(hf, name, None)
        if value is not None:
            return value
    return default


def _attention_params(hf):
    h, heads = hf.hidden_size, hf.num_attention_heads
    if _cfg(hf, "kv_lora_rank"):  # multi-latent attention (DeepSeek-V2/V3)
        qk_head = hf.qk_nope_head_dim + hf.qk_rope_head_dim
        q_lora = _cfg(hf, "q_lora_rank")
        # q: down-projection + its norm + up-projection, or one projection without q_lora_rank
        q = h * q_lora + q_lora + q_lora * heads * qk_head if q_lora else h * heads * qk_head
        kv = (h * (hf.kv_lora_rank + hf.qk_rope_head_dim) + hf.kv_lora_rank
              + hf.kv_lora_rank * heads * (hf.qk_nope_head_dim + hf.v_head_dim))
        return q + kv + heads * hf.v_head_dim * h
    head_dim = _cfg(hf, "head_dim", default=h // heads)
    groups = _cfg(hf, "num_key_value_heads", default=heads)
    qkv = (heads + 2 * groups) * head_dim
    out = heads * head_dim * h
    kind = _cfg(hf, "model_type", default="")
    if kind in ("qwen2", "qwen2_moe"):
        qkv_bias, out_bias = qkv, 0  # Qwen2: biases on q, k, v only
    elif _cfg(hf, "attention_bias", default=False):
        qkv_bias, out_bias = qkv, h  # Llama-style attention_bias: q, k, v and o
    else:
        qkv_bias = out_bias = 0
    qk_norm = 2 * head_dim if kind in ("qwen3", "qwen3_moe") else 0
    return h * qkv + qkv_bias + out + out_bias + qk_norm


def _moe_layers(hf):
    """1 for each MoE layer, 0 for a dense one, per the family's own config keys."""
    n = hf.num_hidden_layers
    if not _cfg(hf, "num_experts", "num_local_experts", "n_routed_experts", default=0):
        return [0] * n
    if _cfg(hf, "n_routed_experts"):  # DeepSeek: first_k_dense_replace, then every freq-th
        first, freq = _cfg(hf, "first_k_dense_replace", default=0), _cfg(hf, "moe_layer_freq",
                                                                         default=1)
        return [int(i >= first and i % freq == 0) for i in range(n)]
    dense = set(_cfg(hf, "mlp_only_layers", default=[]) or [])
    step = _cfg(hf, "decoder_sparse_step", default=1)
    return [int(i not in dense and (i + 1) % step == 0) for i in range(n)]


def param_counts(hf) -> ParamCounts:
    """Total and per-token active parameters of a HF causal-LM config (dense, MoE, MLA)."""
    h, vocab = hf.hidden_size, hf.vocab_size
    gated = 3 * h  # SwiGLU MLP: gate, up, down
    kind = _cfg(hf, "model_type", default="")
    experts = _cfg(hf, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    expert_ffn = hf.intermediate_size if kind == "mixtral" else _cfg(hf, "moe_intermediate_size",
                                                                      default=0)
    shared_ffn = (_cfg(hf, "shared_expert_intermediate_size", default=0)
                  or _cfg(hf, "n_shared_experts", default=0) * expert_ffn)
    shared = gated * shared_ffn + (h if kind == "qwen2_moe" else 0)  # Qwen2-MoE: sigmoid gate
    total = active = 0
    for moe in _moe_layers(hf):
        layer = _attention_params(hf) + 2 * h  # attention + the two pre-norms
        total += layer
        active += layer
        if moe:
            router = experts * h
            total += router + shared + experts * gated * expert_ffn
            active += router + shared + hf.num_experts_per_tok * gated * expert_ffn
        else:
            total += gated * hf.intermediate_size
            active += gated * hf.intermediate_size
    tied = bool(_cfg(hf, "tie_word_embeddings", default=False))
    embed = vocab * h
    ends = h + embed + (0 if tied else embed)  # final norm, embedding, LM head
    return ParamCounts(total=total + ends, active=active + ends, embedding=embed, tied=tied)


def model_flops_params(hf_config):
    """(total parameters, parameters per token that enter matmuls) for MFU: what the trainer
    passes to `step_flops(total, tokens, active_params=...)`."""
    counts = param_counts(hf_config)
    return counts.total, counts.flop_params


def step_flops(n_params, tokens, *, ppo_epochs=1, critic_epochs=1, critic=False, ref=False,
               old_log_prob=True, active_params=None):
    """Model FLOPs of one PPO step: 2 x params per token per forward pass.

    `active_params` (from `model_flops_params`): the parameters one token passes through; used
    instead of `n_params` when given, which is what makes MFU right for MoE models (n_params
    counts every expert; a token runs top-k of them).

    generation (1 forward) + old log-prob (1; none when an on-policy step reuses the update's
    forward) + ref (1) + values (1, with a critic) + actor update (forward + backward = 3 per
    epoch) + critic update (3 per epoch). Attention's s^2 term is
    left out: at RL response lengths of a few thousand tokens it is a few percent for 7B+.
    The critic is counted at the actor's size (its value head replaces the LM head).
    """
    per_token = n_params if active_params is None else active_params
    passes = 1 + (1 if old_log_prob else 0) + (1 if ref else 0) + 3 * ppo_epochs
    if critic:
        passes += 1 + 3 * critic_epochs
    return 2.0 * per_token * tokens * passes


def proc_status_bytes(key):
    """A memory field of /proc/self/status ("VmRSS", "VmHWM", ...) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    raise KeyError(key)


def peak_rss_bytes():
    """This process's peak resident memory (VmHWM). Unlike getrusage's ru_maxrss, it belongs to
    the current address space, so a process spawned by a large parent does not inherit the
    parent's peak through fork + exec."""
    peak = proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class CommTimer:
    """Seconds the training loop spends *blocked* in torch.distributed collectives, per phase,
    and how many of each it issued (`calls[phase][op]`).

    Synchronous collectives count whole; asynchronous ones (Megatron's overlapped gradient
    reduce / parameter gather) count only the time their `wait()` blocks: the call returns a
    handle whose `wait` is timed, so the overlap stays (torch's Work objects take no new
    attributes, and waiting inside the call would serialise what was meant to overlap).
    Comparing a phase with Megatron's overlap switches on and off gives how much communication
    compute hid. Megatron binds some collectives to names of its own at import (the
    distributed optimizer's reduce-scatter and all-gather, `_coalescing_manager`, whose exit or
    `wait()` is where coalesced collectives block): every imported module's alias of a wrapped
    function is replaced too. torch.distributed's own modules keep the originals, so an object
    collective is counted once, not again through the collectives it calls. Not wrapped:
    `isend` / `irecv` (torch's P2POp accepts only its own functions); pipeline sends made with
    `batch_isend_irecv`, `send` and `recv` are.
    """

    OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all",
           "all_to_all_single", "barrier", "monitored_barrier", "_all_gather_base",
           "_reduce_scatter_base", "all_gather_object", "broadcast_object_list",
           "gather_object", "scatter_object_list", "batch_isend_irecv", "send", "recv")
    COALESCING = "_coalescing_manager"
    _active = None  # one timer per process: a new one replaces the last (a second trainer)

    def __init__(self):
        self.seconds = {}
        self.calls = {}
        self.phase = "other"
        self._patched = []  # (namespace, name, original)

    def _add(self, dt):
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + dt

    def _count(self, op):
        ops = self.calls.setdefault(self.phase, {})
        ops[op] = ops.get(op, 0) + 1

    def _wrap(self, fn, op):
        timer = self

        def timed(*args, **kwargs):
            timer._count(op)
            t0 = time.perf_counter()
            try:
                work = fn(*args, **kwargs)
            finally:
                timer._add(time.perf_counter() - t0)
            if isinstance(work, list):  # batch_isend_irecv
                return [_TimedWork(w, timer) if hasattr(w, "wait") else w for w in work]
            return _TimedWork(work, timer) if hasattr(work, "wait") else work
        timed.__wrapped__ = fn
        return timed

    def _wrap_coalescing(self, fn):
        timer = self

        @contextlib.contextmanager
        def timed(*args, **kwargs):
            manager = fn(*args, **kwargs)
            handle = manager.__enter__()
            try:
                yield _TimedWork(handle, timer)
            except BaseException:
                if not manager.__exit__(*sys.exc_info()):
                    raise
            else:
                t0 = time.perf_counter()  # synchronous: the coalesced collectives run here
                try:
                    manager.__exit__(None, None, None)
                finally:
                    timer._add(time.perf_counter() - t0)
        timed.__wrapped__ = fn
        return timed

    def install(self):
        import torch.distributed as dist
        if CommTimer._active is not None and CommTimer._active is not self:
            CommTimer._active.uninstall()
        wrappers = {}
        for name in self.OPS + (self.COALESCING,):
            original = getattr(dist, name, None)
            if original is None:
                continue
            wrappers[id(original)] = (original, self._wrap_coalescing(original)
                                      if name == self.COALESCING else self._wrap(original, name))
        for module in [dist] + [m for n, m in list(sys.modules.items())
                                if m is not None and not n.startswith("torch")]:
            try:
                names = list(vars(module).items())
            except TypeError:
                continue
            for name, value in names:
                if callable(value) and id(value) in wrappers and wrappers[id(value)][0] is value:
                    self._patched.append((module, name, value))
                    setattr(module, name, wrappers[id(value)][1])
        CommTimer._active = self
        return self

    def uninstall(self):
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()
        if CommTimer._active is self:
            CommTimer._active = None


class _TimedWork:
    """A collective's handle whose `wait()` counts as time blocked; everything else is the
    handle's own."""

    def __init__(self, work, timer):
        self._work, self._timer = work, timer

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._timer._add(time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self._work, name)
