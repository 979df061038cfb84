"""What Megatron imports at its own import that a run never uses, deferred: ~3.5 s of CPU per
process (measured: `import engine.train, engine.trainer` 8.7 s -> 5.2 s user+sys), paid by every
rank and every test worker.

- `megatron.core.jit.jit_fuser` is `torch.compile`, applied as a decorator to ~30 fusion
  functions at import: the first call of `torch.compile` imports TorchDynamo and Inductor (~2 s)
  before anything is compiled. Without CUDA, the decorator here compiles a function at its first
  call instead, as torch.compile itself would (no fusion runs on a CPU: engine.models.builder.
  fusion_flags); with CUDA, Megatron's decorator is left as it is.
- `megatron.core.timers` and Megatron's inference context import wandb and TensorBoard for
  their own loggers (Megatron's `Timers.write`, its inference logging), which Trident does not
  call: they see those packages as absent while they import. Our loggers (engine/metrics.py)
  import them themselves when the recipe names them.

- The collector: the imports and the built run create ~0.5M objects that live as long as the
  process; at Python's default young-generation threshold (700 allocations) the collector runs
  ~1000 times over them while they are made, 10-20 % of a rank's start-up CPU, and a process
  that keeps a large heap (a test session, its worker pools) pays a full walk of it at every
  older-generation collection. `install()` raises that threshold (YOUNG_THRESHOLD; measured: a
  3-step 2-rank demo run 13.4 -> 12.6 s wall; `import engine.train` 786 -> 32 collections); the steps' own
  garbage is collected by `return_to_device`'s explicit collections, and
  `parallel.device_memory.freeze_long_lived` takes the built run out of the collector's reach.

`install()` runs when the `engine` package is imported (engine/__init__.py), before any Megatron
import of ours; tests/__init__.py imports `engine` first for test modules that import Megatron
before it (ruff sorts third-party imports first).

Tests: tests/test_lazy_imports.py
"""
import functools
import gc
import importlib.abc
import sys

YOUNG_THRESHOLD = 20_000  # allocations between two young-generation collections (Python: 700)

# module -> packages hidden from it while it executes
_HIDDEN = {
    "megatron.core.timers": ("wandb", "torch.utils.tensorboard"),
    "megatron.core.inference.contexts.dynamic_context": ("wandb",),
}
_JIT = "megatron.core.jit"


def compile_at_first_call(compile_fn):
    """A decorator like `compile_fn` (torch.compile's decorator form: `fn` or keywords only)
    whose compiling happens at the decorated function's first call."""
    def decorate(fn=None, **kwargs):
        if fn is None:
            return lambda f: decorate(f, **kwargs)
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn, **kwargs)
            return compiled(*args, **kw)
        return call
    return decorate


def _after_jit(module):
    import torch
    if not torch.cuda.is_available():
        module.jit_fuser = compile_at_first_call(module.jit_fuser)


def _hiding(exec_module, hidden):
    def run(module):
        absent = [name for name in hidden if name not in sys.modules]
        for name in absent:
            sys.modules[name] = None  # `import name` raises ImportError
        try:
            exec_module(module)
        finally:
            for name in absent:
                if sys.modules.get(name, 0) is None:
                    del sys.modules[name]
    return run


def _after(exec_module, then):
    def run(module):
        exec_module(module)
        then(module)
    return run


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the modules above through the other finders and wraps their loader's exec_module
    (the loader stays the file loader: inspect and torch.compile read the source through it)."""

    def find_spec(self, name, path, target=None):
        if name != _JIT and name not in _HIDDEN:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module
        spec.loader.exec_module = (_after(exec_module, _after_jit) if name == _JIT
                                   else _hiding(exec_module, _HIDDEN[name]))
        return spec


def install():
    """The collector's young threshold raised, the finder installed. Idempotent; the finder does
    nothing for modules already imported."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
