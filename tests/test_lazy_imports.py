"""engine/lazy_imports.py: what Megatron imports and never uses stays unimported in a fresh
process that imports the engine, the packages hidden from Megatron are importable afterwards
(our own loggers import them), the deferred compile decorator compiles once, at first call, and
the collector runs rarely while the imports build their objects."""
import json
import os
import subprocess
import sys

import torch

from engine.lazy_imports import compile_at_first_call

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import gc, json, sys
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
import engine, megatron.core
from megatron.core import timers
from megatron.core.fusions import fused_bias_gelu
before = {m: m in sys.modules for m in ("torch._dynamo", "torch._inductor", "wandb", "torch.utils.tensorboard")}
import wandb
from torch.utils.tensorboard import SummaryWriter
print(json.dumps(dict(before=before, megatron_wandb=timers.wandb is None,
                      wandb_loaded=hasattr(wandb, "init"), writer=SummaryWriter.__name__,
                      deferred=hasattr(fused_bias_gelu.bias_gelu, "__wrapped__"),
                      collections=len(collections))))
"""


def test_a_fresh_engine_process_skips_megatrons_unused_imports_and_keeps_them_importable():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    cuda = torch.cuda.is_available()  # with CUDA, Megatron's torch.compile decorator is kept
    assert got["before"] == {"torch._dynamo": cuda, "torch._inductor": cuda, "wandb": False,
                             "torch.utils.tensorboard": False}
    assert got["megatron_wandb"]  # Megatron's own logger saw no wandb
    # hidden only while Megatron imported: ours import them afterwards, for real
    assert got["wandb_loaded"] and got["writer"] == "SummaryWriter"
    # Megatron's fusions hold the deferred decorator (calling one would compile it: ~40 s on a CPU)
    assert got["deferred"] != cuda
    # the collector ran a few dozen times over these imports, not ~900 (Python's threshold of 700)
    assert got["collections"] < 150, got["collections"]


def test_compile_at_first_call_compiles_once_with_the_keywords_given():
    calls = []

    def compile_fn(fn, **kw):
        calls.append((fn.__name__, kw))
        return lambda *a, **k: fn(*a, **k) * 10

    def square(x):
        return x * x

    plain = compile_at_first_call(compile_fn)(square)
    keyed = compile_at_first_call(compile_fn)(dynamic=True)(square)
    assert calls == [] and plain.__name__ == "square"
    assert [plain(3), plain(4)] == [90, 160]
    assert [keyed(2)] == [40]
    assert calls == [("square", {}), ("square", {"dynamic": True})]

