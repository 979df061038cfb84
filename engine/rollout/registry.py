"""The rollout backends by name (`actor_rollout_ref.rollout.name`), and building one.

Each backend registers itself with `engine.rollout.base.register_rollout`; importing this module
imports them all (none imports its GPU library at module level).
"""
from __future__ import annotations

import importlib.util
from typing import Sequence

import torch

import engine.rollout.cpu  # noqa: F401  (registers 'cpu')
import engine.rollout.sglang  # noqa: F401  (registers 'sglang')
from engine.rollout.base import ROLLOUT_BACKENDS, RolloutEngine


def backend_names() -> tuple[str, ...]:
    return tuple(ROLLOUT_BACKENDS)


def backend_class(name: str) -> type:
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r} is unknown; use one of "
                         f"{', '.join(repr(n) for n in ROLLOUT_BACKENDS)} (or 'auto')")
    return ROLLOUT_BACKENDS[name]


def sglang_runs_here() -> bool:
    """SGLang needs CUDA; a test double of the package (tests/fakes) says it runs on CPU."""
    if importlib.util.find_spec("sglang") is None:
        return False
    if torch.cuda.is_available():
        return True
    import sglang
    return bool(getattr(sglang, "TRIDENT_TEST_DOUBLE", False))


def resolve_name(name: str) -> str:
    if name == "auto":
        return "sglang" if torch.cuda.is_available() and sglang_runs_here() else "cpu"
    return name


def check_available(name: str) -> None:
    """One clear error when the backend cannot run on this machine."""
    if name == "sglang" and not sglang_runs_here():
        if not torch.cuda.is_available() and importlib.util.find_spec("sglang") is None:
            raise ValueError("actor_rollout_ref.rollout.name='sglang' needs a CUDA GPU and none is "
                             "visible; use name='cpu' (or 'auto') on this machine")
        if importlib.util.find_spec("sglang") is None:
            raise ValueError("actor_rollout_ref.rollout.name='sglang' needs the sglang package; install "
                             "it with `pip install -e .[gpu]` or use name='cpu'")
        raise ValueError("actor_rollout_ref.rollout.name='sglang' needs a CUDA GPU and none is "
                         "visible; use name='cpu' (or 'auto') on this machine")
    elif name != "sglang" and getattr(backend_class(name), "NEEDS_CUDA", False) and not torch.cuda.is_available():
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r} needs a CUDA GPU and none is visible; "
                         f"use name='cpu' on this machine")


def make_rollout(name: str, hf_config, eos_token_ids: Sequence[int], **cfg) -> RolloutEngine:
    """Build backend `name` ('auto': sglang when it can run, else cpu); `cfg` goes to its
    constructor."""
    name = resolve_name(name)
    backend_class(name)
    check_available(name)
    return ROLLOUT_BACKENDS[name](hf_config, eos_token_ids=eos_token_ids, **cfg)
