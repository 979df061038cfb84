"""The recording doubles of GPU libraries (tests/fakes: sglang, vllm) made importable for a while.

    with double_on_path("sglang", rollout == "sglang"):
        ...  # `import sglang` finds tests/fakes/sglang

On leaving, tests/fakes leaves sys.path and the double's modules leave sys.modules, so later
tests in the same process (the shared multirank workers, pytest itself) do not find it.

Tests: tests/test_delivery.py, tests/test_moe_ppo.py
"""
import contextlib
import os
import sys

FAKES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakes")


@contextlib.contextmanager
def double_on_path(package: str, when: bool = True):
    if not when:
        yield
        return
    sys.path.insert(0, FAKES)
    try:
        yield
    finally:
        sys.path.remove(FAKES)
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            sys.modules.pop(name)
