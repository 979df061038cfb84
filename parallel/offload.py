"""Parameters / gradients / optimizer state out of device memory between phases, and back.

A colocated engine needs the GPU for generation while the training state sits idle. The
tensors themselves stay where they are (Megatron's parameters are views into its contiguous
buffers, the optimizer holds references to them): each distinct *storage* is copied to host
memory and resized to zero bytes, and on reload resized back and refilled, so every view and
reference stays valid. On a CPU-only machine the copy is host to host — nothing is saved, but
the mechanism is the one that runs on GPU (and is what the tests exercise).

Freed storage goes back to torch's caching allocator, not to the device: another process (a
colocated SGLang engine) can use it only after `parallel.device_memory.return_to_device()`,
which engine/rollout/colocated.py calls before the rollout resumes. Every move is reported to
parallel.device_memory (on CPU its simulated allocator keeps the freed bytes reserved).

Tests: tests/test_device_memory.py, tests/gpu/test_device_memory_gpu.py
"""
from typing import Dict, Iterable

import torch

from parallel import device_memory
from parallel.fsdp import local


class Offloader:
    def __init__(self, pin_memory: bool = True):
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._saved: Dict[int, tuple] = {}  # storage key -> (storage, host copy)

    @staticmethod
    def _bytes(storage):
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def offload(self, tensors: Iterable[torch.Tensor], keep: Iterable[torch.Tensor] = ()) -> int:
        """Free the device storage behind `tensors`, except storage shared with `keep` (e.g.
        fp32 parameters that are also the optimizer's main parameters); returns bytes freed."""
        device_memory.observe()  # what is about to be freed was allocated until now
        kept = {t.untyped_storage().data_ptr() for t in keep}
        freed = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._saved or key in kept or storage.nbytes() == 0:
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.pin_memory)
            host.copy_(self._bytes(storage), non_blocking=self.pin_memory)
            if self.pin_memory:
                torch.cuda.current_stream().synchronize()
            self._saved[key] = (storage, host)
            freed += storage.nbytes()
            storage.resize_(0)
        device_memory.observe()
        return freed

    def reload(self) -> int:
        """Give every offloaded storage its memory and contents back."""
        restored = 0
        for storage, host in self._saved.values():
            storage.resize_(host.numel())
            self._bytes(storage).copy_(host, non_blocking=self.pin_memory)
            restored += host.numel()
        if self.pin_memory:
            torch.cuda.current_stream().synchronize()
        self._saved.clear()
        device_memory.observe()
        return restored

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)


def model_params(chunks):
    """The stored parameters (a fully sharded one's local shard: parallel/fsdp.py)."""
    return [local(p) for c in chunks for p in c.parameters()]


def model_grads(chunks):
    """Megatron's gradient buffers (main_grad views) and any plain .grad tensors."""
    out = []
    for p in (p for c in chunks for p in c.parameters()):
        for g in (getattr(p, "main_grad", None), p.grad):
            if g is not None:
                out.append(local(g))
    return out


def optimizer_tensors(optimizer):
    """Every tensor of a Megatron (possibly chained) optimizer's state and main parameters."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for group in inner.param_groups:
            out.extend(local(p) for p in group["params"])
        for state in inner.state.values():
            out.extend(local(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return out
