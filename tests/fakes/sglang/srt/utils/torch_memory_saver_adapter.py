"""The SGLang double's device memory: weights and KV cache held per GPU against the device's
budget, shared with the training processes through parallel.device_memory's simulated devices
(active when TRIDENT_DEVICE_MEMORY_DIR is set; otherwise nothing is counted).

What it mirrors (sglang 0.5.21, torch_memory_saver):
- The engine's GPUs: one scheduler per TP rank, on base_gpu_id + i of its node; an engine of
  `nnodes` nodes holds tp_size / nnodes GPUs on each (sglang/srt/entrypoints/engine.py). Here
  the device of the leader's rank and the next ones (one device per rank).
- KV pool sizing at start: `pre` = the free memory before the weights load, the minimum over
  the TP ranks (sglang/srt/distributed/bootstrap.py measure_pre_model_load_memory, through
  sglang/srt/utils/common.py get_available_gpu_memory, which reads torch.cuda.mem_get_info);
  after the weights, the pool gets what is free then less pre x (1 - mem_fraction_static), and
  an engine whose weights leave nothing is refused with a ValueError
  (sglang/srt/mem_cache/kv_cache_configurator.py _profile_available_bytes). So
  weights + pool = mem_fraction_static x what was free when the engine started.
- Weights: every parameter in the engine's dtype, split over TP (load_format='dummy' still
  allocates them).
- release / resume by tag (sglang/srt/managers/scheduler_components/weight_updater.py, tags
  None = all): pausing an allocation that is not active or resuming one that is not paused ends
  the scheduler (torch_memory_saver csrc/core.cpp pause / resume; the tag bookkeeping of
  weight_updater.py raises too); resuming maps new physical memory with cuMemCreate, and a
  device that cannot give it ends the scheduler with CUDA_ERROR_OUT_OF_MEMORY (csrc/utils.h
  cu_mem_create). Here each of these raises RuntimeError. 'cuda_graph' holds no bytes here.
"""
import os

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2, "float": 4}
TAGS = ("weights", "kv_cache")  # in resume order (weight_updater.py resumes weights first)


def _param_count(model_path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


class EngineMemory:
    """The engine's holdings on each of its GPUs: {tag: bytes} and which tags are active."""

    def __init__(self, kwargs):
        from parallel.device_memory import ledger
        self.book = ledger()
        self.kv_pool_bytes = self.weights_bytes = self.pre = None
        self.active = {}
        if self.book is None:
            return
        tp, nodes = kwargs["tp_size"], kwargs.get("nnodes", 1)
        first = int(os.environ.get("RANK", "0"))
        self.devices = list(range(first, first + tp // nodes))
        self.owner = f"sglang-{os.getpid()}-{id(self)}"
        fraction = kwargs["mem_fraction_static"]
        self.pre = min(self.book.free(d) for d in self.devices)
        self.weights_bytes = _param_count(kwargs["model_path"]) * DTYPE_BYTES[kwargs["dtype"]] // tp
        self.bytes = {"weights": self.weights_bytes, "kv_cache": 0}
        self._take(["weights"])
        available = min(self.book.free(d) for d in self.devices)
        rest = available - self.pre * (1 - fraction)
        if rest <= 0:
            self.release(["weights"])
            raise ValueError(f"sglang double: the weights ({self.weights_bytes} B per GPU) leave no memory for "
                             f"the KV cache under mem_fraction_static={fraction} ({available} B free of "
                             f"{self.pre} B free at start); raise mem_fraction_static or free the devices first")
        self.kv_pool_bytes = self.bytes["kv_cache"] = int(rest)
        self._take(["kv_cache"])

    def _publish(self):
        held = sum(self.bytes[t] for t, on in self.active.items() if on)
        for d in self.devices:
            self.book.hold(d, self.owner, held)

    def _take(self, tags):
        for tag in tags:
            for d in self.devices:
                if self.book.free(d) < self.bytes[tag]:
                    raise RuntimeError(
                        f"[torch_memory_saver.cpp] cu_mem_create has CUDA_ERROR_OUT_OF_MEMORY (sglang double): "
                        f"{tag} needs {self.bytes[tag]} B on device {d}, which has {self.book.free(d)} B free "
                        f"(held: {self.book.held(d)})")
            self.active[tag] = True
            self._publish()

    @staticmethod
    def _tags(tags):
        return [t for t in TAGS if tags is None or len(tags) == 0 or t in tags]

    def release(self, tags):
        if self.book is None:
            return
        for tag in self._tags(tags):
            if not self.active.get(tag):
                raise RuntimeError(f"[torch_memory_saver.cpp] Cannot pause allocation that is not active "
                                   f"(sglang double): tag={tag}")
            self.active[tag] = False
        self._publish()

    def resume(self, tags):
        if self.book is None:
            return
        tags = self._tags(tags)
        for tag in tags:
            if self.active.get(tag):
                raise RuntimeError(f"[torch_memory_saver.cpp] Cannot resume allocation that is not paused "
                                   f"(sglang double): tag={tag}")
        self._take(tags)

    def shutdown(self):
        if self.book is not None:
            self.active = {}
            self._publish()
