"""Lets megatron-core run on CPU with the gloo backend (tests, the CPU demo).

megatron-core assumes CUDA in a handful of places (see shared/MEGATRON-ON-CPU.md). This module
is the one place that redirects them. `enable()` is idempotent and is called by `parallel.mesh`
only when the device is the CPU; `suspended()` lets code that runs no Megatron (the rollout
engine's decoding loop) skip the per-op cost of the function mode.

What it changes, and why:
- the model-parallel RNG tracker keeps CPU generator states (dropout/init forks) instead of CUDA ones;
- `torch.cuda.current_device/synchronize/Stream/Event/stream` answer harmlessly on CPU;
- a TorchFunctionMode maps `device="cuda"` arguments, `Tensor.cuda()` and `.to("cuda")` to the CPU
  (megatron's schedules and buffers create tensors on "cuda" literally);
- `Tensor.type()` with no argument answers the `torch.cuda.*` name, since the distributed
  optimizer checks parameter types by their CUDA type strings;
- TE-only symbols that megatron imports optimistically are set to "absent";
- apex's `fused_weight_gradient_mlp_cuda` (gradient_accumulation_fusion) gets a CPU stand-in: a
  linear layer's weight gradient is added straight into the DDP buffer's main_grad by one addmm
  (no weight-sized temporary, no separate add pass);
- `DeviceMesh.from_group(group, "cuda")` (Megatron's TorchFullyShardedDataParallel names the
  device literally) builds a CPU mesh;
- glibc keeps freed memory for reuse instead of handing it back to the OS, as the CUDA caching
  allocator does: otherwise every micro-batch re-faults its activations page by page.

Tests: tests/test_cpu_compat.py, tests/test_layouts.py
"""
import contextlib
import ctypes
import importlib
import os

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_MODE = None


def threads_per_process(environ, cores):
    """Intra-op threads for one process: the node's cores shared by every process launched on
    it (torchrun's LOCAL_WORLD_SIZE: a separate rollout pool's ranks count too). More threads
    than cores leave OpenMP's spinning workers fighting over them."""
    procs = int(environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", "1")))
    return max(1, (cores or 1) // procs)


def is_enabled():
    return _ENABLED


def _is_cuda_device(device):
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)) \
                and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class _NoOpStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NoOpEvent(_NoOpStream):
    def record(self, *args, **kwargs):
        pass

    def elapsed_time(self, other):
        return 0.0


def _install_rng_tracker():
    """Megatron's RNG tracker forks CUDA generator states; on CPU it forks the CPU generator."""
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            # Like the CUDA tracker, minus its "CPU state changed" warning: here the forked
            # generator *is* the CPU generator.
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
    mp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mp_random.CudaRNGStatesTracker = CpuRNGStatesTracker  # a force_reset re-creates ours


def _patch_torch_cuda():
    cuda = torch.cuda
    # The CPU device itself (not an index): autograd runs backward functions outside the
    # function mode below (the mode is off while it dispatches `backward`), and megatron's
    # backward passes allocate with `device=torch.cuda.current_device()`.
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpEvent
    cuda.current_stream = lambda *a, **k: _NoOpStream()
    cuda.default_stream = lambda *a, **k: _NoOpStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_device = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.get_device_capability = lambda *a, **k: (0, 0)


def _patch_tensor_type():
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)  # may come back through the function mode, already renamed
            if self.is_sparse or name.startswith("torch.cuda."):
                return name
            return name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


def _patch_device_mesh():
    from torch.distributed.device_mesh import DeviceMesh
    original = DeviceMesh.from_group

    def from_group(group, device_type, *args, **kwargs):
        return original(group, "cpu" if _is_cuda_device(device_type) else device_type, *args, **kwargs)
    DeviceMesh.from_group = staticmethod(from_group)


def _disable_absent_te():
    """megatron marks some TE symbols present when only its extension module imports."""
    try:
        importlib.import_module("transformer_engine.pytorch")
        return
    except Exception:
        pass
    for module, attr, value in [("megatron.core.transformer.moe.moe_utils", "te_general_gemm", None),
                                ("megatron.core.transformer.multi_latent_attention", "HAVE_TE", False)]:
        try:
            setattr(importlib.import_module(module), attr, value)
        except ImportError:
            pass


class _WgradAccumulate:
    """apex's fused_weight_gradient_mlp_cuda for CPU tensors: main_grad += grad_output^T input,
    in place, nothing returned, as apex/csrc/megatron/fused_weight_gradient_dense.cpp's
    wgrad_gemm_accum_fp32 / _fp16 (input, d_output, d_weight). Megatron's
    LinearWithGradAccumulationAndAsyncCommunication.backward (tensor_parallel/layers.py) calls it
    with 2-D `total_input` [tokens, in], `grad_output` [tokens, out] and main_grad [out, in]."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        if total_input.dtype == grad_output.dtype == main_grad.dtype:
            main_grad.addmm_(grad_output.t(), total_input)
        else:  # bf16 / fp16 activations into an fp32 buffer
            main_grad.add_(grad_output.t().matmul(total_input))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def _provide_wgrad_accumulation():
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    if not getattr(layers, "_grad_accum_fusion_available", False):
        layers.fused_weight_gradient_mlp_cuda = _WgradAccumulate
        layers._grad_accum_fusion_available = True


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory(environ=os.environ) -> bool:
    """Make glibc keep freed memory in the process, as c10/cuda/CUDACachingAllocator.cpp keeps
    freed blocks: RSS stays at its peak, and the next micro-batch reuses mapped pages.

    By default glibc unmaps blocks above a (dynamic, <= 32 MiB) threshold and trims the heap's
    free top above twice that, so each step re-faulted its activations: ~17 000 page faults per
    update phase of the 3m benchmark workload per rank, 0-1 with this. A user's own MALLOC_*
    settings win. True when applied."""
    if any(name in environ for name in MALLOC_ENV):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): its allocator's own policy stays
        return False
    return bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) and libc.mallopt(M_MMAP_THRESHOLD, 32 << 20))


@contextlib.contextmanager
def suspended():
    """A block without the device-rewriting function mode (a no-op when CPU mode is off).

    The mode is a Python call on every torch op: ~15 % of a small model's decoding time here,
    ~5 % of a Megatron model's forward. For code that names no CUDA device: the rollout
    engine's decoding loop, the model's forward (engine/workers/base.py), not Megatron's
    schedules and buffers, which do."""
    if not _ENABLED or torch._C._len_torch_function_stack() == 0:
        yield
        return
    top = torch._C._pop_torch_function_stack()
    if top is not _MODE:  # another mode is on top: leave the stack as it is
        torch._C._push_on_torch_function_stack(top)
        yield
        return
    try:
        yield
    finally:
        torch._C._push_on_torch_function_stack(top)


def enable():
    """Make megatron-core usable on CPU for the rest of this process. Idempotent."""
    global _ENABLED, _MODE
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("parallel.cpu.enable() is for CPU-only processes; a CUDA device is present")
    _patch_torch_cuda()
    _patch_tensor_type()
    _install_rng_tracker()
    _disable_absent_te()
    _provide_wgrad_accumulation()
    _patch_device_mesh()
    keep_freed_memory()
    _MODE = _CudaToCpu()
    _MODE.__enter__()
    _ENABLED = True
