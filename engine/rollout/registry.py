"""The rollout backends by name (`actor_rollout_ref.rollout.name`), which one runs, and building one.

Each backend registers itself with `engine.rollout.base.register_rollout`; importing this module
imports them all (none imports its GPU library at module level).

`rollout_backend(name, device, here=...)` is the one place that decides which backend runs for a
config ('auto' resolved, a backend the device cannot run refused) and, with `here`, whether this
machine can run it; `sglang_installed` / `sglang_test_double` / `sglang_runs_here` are the only
answers to "is sglang importable / its CPU double / able to serve here", `vllm_installed` /
`vllm_test_double` / `vllm_runs_here` the same for vllm. Callers: the config's
validation and derivation (engine/config/validate.py, devices.py: also tools/plan.py through
derive), engine/train.py before any model is built, `make_rollout`, and tools/gpu_check.sh's
choice of rollout.

Tests: tests/test_rollout_cpu.py, tests/test_config.py, tests/test_gpu_check.py, tests/test_sglang_double.py,
tests/test_vllm_adapter.py
"""
from __future__ import annotations

import importlib.util
from typing import Sequence

import torch

import engine.rollout.cpu  # noqa: F401  (registers 'cpu')
import engine.rollout.hf  # noqa: F401  (registers 'hf')
import engine.rollout.sglang  # noqa: F401  (registers 'sglang')
import engine.rollout.vllm  # noqa: F401  (registers 'vllm')
from engine.rollout.base import ROLLOUT_BACKENDS, RolloutEngine

KEY = "actor_rollout_ref.rollout.name"


def backend_names() -> tuple[str, ...]:
    return tuple(ROLLOUT_BACKENDS)


def backend_class(name: str) -> type:
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"{KEY}={name!r} is unknown; use one of "
                         f"{', '.join(repr(n) for n in ROLLOUT_BACKENDS)} (or 'auto')")
    return ROLLOUT_BACKENDS[name]


def sglang_installed() -> bool:
    """The sglang package (or tests/fakes' double of it) can be imported here."""
    return importlib.util.find_spec("sglang") is not None


def sglang_test_double() -> bool:
    """tests/fakes/sglang (a recording double that generates on CPU) lets the trainer run its
    SGLang path without a GPU; the real package never says this."""
    if not sglang_installed():
        return False
    import sglang
    return bool(getattr(sglang, "TRIDENT_TEST_DOUBLE", False))


def sglang_runs_here() -> bool:
    """SGLang can serve on this machine: installed, and a CUDA GPU visible (its test double runs
    on CPU). Never imports the real package."""
    return sglang_installed() and (torch.cuda.is_available() or sglang_test_double())


def vllm_installed() -> bool:
    """The vllm package can be imported here (never imports it)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_test_double() -> bool:
    """tests/fakes/vllm (a recording double that generates on CPU) lets the trainer run its vLLM
    path without a GPU; the real package never says this."""
    if not vllm_installed():
        return False
    import vllm
    return bool(getattr(vllm, "TRIDENT_TEST_DOUBLE", False))


def vllm_runs_here() -> bool:
    """vLLM can serve on this machine: installed, and a CUDA GPU visible (its test double runs on
    CPU). Where no CUDA GPU is visible it imports vllm to ask whether it is the double."""
    return vllm_installed() and (torch.cuda.is_available() or vllm_test_double())


def rollout_backend(name: str, device: str = "auto", *, here: bool = False) -> str:
    """The one answer to "which rollout backend runs": rollout.name `name` beside a trainer on
    `device` (trainer.device: 'cuda', 'cpu', or 'auto' while it is not resolved yet).

    'auto' is sglang on 'cuda' (vllm instead where vllm is installed and sglang is not) and cpu on
    'cpu' (and stays 'auto' while the device does). A backend the device cannot run raises
    ValueError naming the key and the fix: sglang, vllm and hf need 'cuda' (SGLang's test double
    runs on CPU, and so does vLLM's). The config layer asks without `here` (a plan may describe another machine); with
    `here`, device 'auto' is this machine's and the machine is checked first: a CUDA GPU visible
    where the backend needs one, the sglang / vllm package installed.
    """
    if here and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "auto" and device != "auto":
        name = _auto_gpu_backend() if device == "cuda" else "cpu"
    if name == "auto":
        return name
    needs_cuda = backend_class(name).NEEDS_CUDA
    if here:
        _check_machine(name, needs_cuda)
    if device == "cpu" and name == "sglang" and not sglang_test_double():
        raise ValueError(f"{KEY}='sglang': SGLang needs a GPU but the trainer runs on cpu (trainer.device); "
                         f"use rollout.name=cpu")
    if device == "cpu" and needs_cuda and name != "sglang" and not (name == "vllm" and vllm_test_double()):
        raise ValueError(f"{KEY}={name!r}: this backend needs a GPU but the trainer runs on cpu "
                         f"(trainer.device); use rollout.name=cpu")
    return name


def _auto_gpu_backend() -> str:
    """'auto' beside a CUDA trainer: sglang, or vllm where only vllm is installed (neither: sglang,
    whose absence `here` reports with the install hint; a plan may describe another machine)."""
    return "vllm" if vllm_installed() and not sglang_installed() else "sglang"


def _check_machine(name: str, needs_cuda: bool) -> None:
    """One clear error when backend `name` cannot run on this machine."""
    if name == "vllm" and not vllm_runs_here():
        raise ValueError(f"{KEY}='vllm' needs vLLM installed (pip install -e .[gpu]) and a CUDA GPU; "
                         f"use 'cpu' here")
    if name == "sglang" and not sglang_runs_here():
        if sglang_installed() or not torch.cuda.is_available():
            raise ValueError(f"{KEY}='sglang' needs a CUDA GPU and none is visible; use name='cpu' "
                             f"(or 'auto') on this machine")
        raise ValueError(f"{KEY}='sglang' needs the sglang package; install it with `pip install -e .[gpu]` "
                         f"or use name='cpu'")
    if name not in ("sglang", "vllm") and needs_cuda and not torch.cuda.is_available():
        raise ValueError(f"{KEY}={name!r} needs a CUDA GPU and none is visible; use name='cpu' on this machine")


def make_rollout(name: str, hf_config, eos_token_ids: Sequence[int], **cfg) -> RolloutEngine:
    """Build backend `name` on this machine ('auto': `rollout_backend`'s choice for this machine's
    device); `cfg` goes to its constructor."""
    name = rollout_backend(name, here=True)
    return ROLLOUT_BACKENDS[name](hf_config, eos_token_ids=eos_token_ids, **cfg)
