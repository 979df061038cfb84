"""This process's memory on its accelerator, as the other processes on that device see it.

A colocated rollout engine (SGLang) runs in processes of its own that allocate through the
driver (torch_memory_saver's cuMemCreate), so what it can take is what the *device* has free,
not what torch in the training process has free. Storage freed by parallel/offload.py goes back
to torch's caching allocator and stays reserved by this process until `empty_cache()`:
`return_to_device()` is the call that hands it back (engine/rollout/colocated.py makes it before the
rollout resumes its weights and its KV cache).

On CUDA every figure is torch's: `torch.cuda.memory_reserved` / `memory_allocated`,
`torch.cuda.mem_get_info` (what the device can still give any process), `torch.cuda.empty_cache`.

On a CPU there is no caching allocator; one is simulated when TRIDENT_DEVICE_MEMORY_DIR is set
(tests): the device of rank r is the directory <dir>/<r> (one device per rank, as under
torchrun), in which every process using it keeps one file with the bytes it reserves; the
device holds TRIDENT_DEVICE_MEMORY_BYTES. The training process's allocated bytes are its models'
states on the device (the workers given to `track`), its reserved bytes the most it allocated
since the last `empty_cache()` - freed bytes stay reserved, as in torch's allocator. The SGLang
double (tests/fakes/sglang) holds its weights and KV cache in the same directories.

Tests: tests/test_device_memory.py, tests/gpu/test_device_memory_gpu.py, tests/test_sglang_double.py
"""
import gc
import json
import os
import weakref

import torch

DIR_ENV, BYTES_ENV = "TRIDENT_DEVICE_MEMORY_DIR", "TRIDENT_DEVICE_MEMORY_BYTES"


class Ledger:
    """The simulated devices: one directory per device, one file per process holding memory."""

    def __init__(self, root: str, capacity: int):
        self.root, self.capacity = root, int(capacity)

    def _path(self, device: int, owner: str):
        return os.path.join(self.root, str(device), owner)

    def hold(self, device: int, owner: str, nbytes: int) -> None:
        os.makedirs(os.path.join(self.root, str(device)), exist_ok=True)
        tmp = self._path(device, f".{owner}.tmp")
        with open(tmp, "w") as f:
            json.dump(int(nbytes), f)
        os.replace(tmp, self._path(device, owner))  # readers never see half a file

    def held(self, device: int) -> dict:
        """{owner: bytes} of every process holding memory on `device`."""
        folder = os.path.join(self.root, str(device))
        out = {}
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            if not name.startswith("."):
                try:
                    with open(os.path.join(folder, name)) as f:
                        out[name] = json.load(f)
                except (FileNotFoundError, ValueError):  # replaced while read: taken as empty
                    out[name] = 0
        return out

    def free(self, device: int) -> int:
        return self.capacity - sum(self.held(device).values())


def ledger():
    """The simulated devices, or None (CUDA, or a CPU run without the simulation)."""
    root = os.environ.get(DIR_ENV)
    if not root or torch.cuda.is_available():
        return None
    if BYTES_ENV not in os.environ:
        raise RuntimeError(f"{DIR_ENV} is set but {BYTES_ENV} (bytes per simulated device) is not")
    return Ledger(root, int(os.environ[BYTES_ENV]))


def this_device() -> int:
    """The device of this rank: its GPU's index on CUDA, else the rank (one device per rank)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else int(os.environ.get("RANK", "0"))


class _Simulated:
    """The caching allocator of this process, on CPU (module docstring)."""

    def __init__(self):
        self.workers, self.allocated, self.reserved = [], 0, 0

    def measure(self):
        alive = [w() for w in self.workers]
        return sum(sum(w.resident_bytes().values()) for w in alive if w is not None)

    def observe(self, book):
        self.allocated = self.measure()
        self.reserved = max(self.reserved, self.allocated)
        book.hold(this_device(), f"train-{os.getpid()}", self.reserved)


_SIM = _Simulated()


def track(*workers) -> None:
    """The models this process keeps on its device (engine/train.py build(); each has
    `resident_bytes()`): the simulated allocator's allocated bytes. Replaces earlier ones."""
    _SIM.workers = [weakref.ref(w) for w in workers if w is not None]
    _SIM.reserved = 0
    observe()


def observe() -> None:
    """Simulation only: note what the tracked models hold now (parallel/offload.py calls it
    around every move, so each peak is seen before its storage is freed)."""
    book = ledger()
    if book is not None:
        _SIM.observe(book)


def empty_cache() -> None:
    """Give the memory cached by this process's allocator back to the device."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        return
    book = ledger()
    if book is not None:
        _SIM.observe(book)
        _SIM.reserved = _SIM.allocated
        book.hold(this_device(), f"train-{os.getpid()}", _SIM.reserved)


def reserved() -> int:
    """Bytes this process holds on its device (in use or cached)."""
    if torch.cuda.is_available():
        return torch.cuda.memory_reserved()
    return _SIM.reserved if ledger() is not None else 0


def allocated() -> int:
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    return _SIM.allocated if ledger() is not None else 0


def free() -> int:
    """Bytes the device can still give any process (None on a CPU without the simulation)."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    book = ledger()
    return None if book is None else book.free(this_device())


def freeze_long_lived() -> int:
    """Move every object alive now (modules, configs, datasets, imported libraries: ~0.5M in a
    trainer) out of the collector's reach, so the full collection of `return_to_device` (twice
    a step) scans only what came after: 0.4 s -> under 1 ms on the 3m workload. Call it once the
    run is built; returns how many objects are frozen. Whatever was frozen is never collected
    as a cycle, which is what long-lived objects never need."""
    gc.collect()  # start-up garbage goes first, not into the frozen generation
    gc.freeze()
    return gc.get_freeze_count()


def return_to_device() -> dict:
    """Collect garbage and empty the cache, so another process can take what training freed;
    returns what the device has then ({free, reserved, allocated} bytes, free None when unknown)."""
    gc.collect()  # a dropped tensor still referenced by a cycle holds its block
    empty_cache()
    return dict(free=free(), reserved=reserved(), allocated=allocated())
