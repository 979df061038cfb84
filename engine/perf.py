"""FLOP accounting and the peak FLOP/s that MFU is measured against.

On a GPU the peak is the vendor's dense bf16 figure; on a CPU there is no honest datasheet
number, so the peak is *measured*: the dense-matmul FLOP/s this machine reaches in this run,
which makes MFU a ratio of two measurements taken side by side.
"""
import time

import torch

# Dense bf16 tensor-core peaks (FLOP/s), by substring of torch.cuda.get_device_name().
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


def peak_flops_per_rank(device, dtype=torch.float32):
    if device == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in GPU_PEAK_BF16.items():
            if key in name:
                return value
        return None
    return measure_matmul_flops(dtype=dtype, seconds=0.5)


def step_flops(n_params, tokens, *, ppo_epochs=1, critic_epochs=1, critic=False, ref=False,
               old_log_prob=True):
    """Model FLOPs of one PPO step: 2 x params per token per forward pass.

    generation (1 forward) + old log-prob (1; none when an on-policy step reuses the update's
    forward) + ref (1) + values (1, with a critic) + actor update (forward + backward = 3 per
    epoch) + critic update (3 per epoch). Attention's s^2 term is
    left out: at RL response lengths of a few thousand tokens it is a few percent for 7B+.
    """
    passes = 1 + (1 if old_log_prob else 0) + (1 if ref else 0) + 3 * ppo_epochs
    if critic:
        passes += 1 + 3 * critic_epochs
    return 2.0 * n_params * tokens * passes


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
    """Seconds the training loop spends *blocked* in torch.distributed collectives, per phase.

    Synchronous collectives count whole; asynchronous ones (Megatron's overlapped gradient
    reduce / parameter gather) count only the time their `wait()` blocks. Comparing a phase
    with Megatron's overlap switches on and off gives how much communication compute hid.
    """

    OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "broadcast", "all_to_all_single", "barrier", "_all_gather_base", "_reduce_scatter_base")

    def __init__(self):
        self.seconds = {}
        self.phase = "other"
        self._originals = {}

    def _add(self, dt):
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + dt

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            work = fn(*args, **kwargs)
            self._add(time.perf_counter() - t0)
            if work is not None and hasattr(work, "wait"):
                wait = work.wait

                def timed_wait(*a, **k):
                    t1 = time.perf_counter()
                    try:
                        return wait(*a, **k)
                    finally:
                        self._add(time.perf_counter() - t1)
                try:
                    work.wait = timed_wait
                except AttributeError:  # C++ Work objects may not take attributes: time it now
                    t1 = time.perf_counter()
                    wait()
                    self._add(time.perf_counter() - t1)
            return work
        return timed

    def install(self):
        import torch.distributed as dist
        for name in self.OPS:
            if hasattr(dist, name) and name not in self._originals:
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(self._originals[name]))
        return self

    def uninstall(self):
        import torch.distributed as dist
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()
