"""The helpers every validation module shares: one ConfigError naming the key, the value and
the fix (`fail`); range checks (`check_range`); the divisors a key may take (parallel/mesh.py's,
re-exported: one arithmetic for layout and batch messages).

Tests: tests/test_config.py, tests/test_config_keys.py
"""
from __future__ import annotations

import math
import typing
from typing import Any

from engine.config.schema import ConfigError, join_key
from parallel.mesh import divisor_choices, divisors

__all__ = ["fail", "check_range", "divisors", "divisor_choices"]


def fail(key: str, value: Any, fix: str) -> typing.NoReturn:
    raise ConfigError(f"{key}={value!r}: {fix}")


def check_range(obj: Any, prefix: str, name: str, *, gt=None, ge=None, le=None,
                allow=(), optional=False) -> None:
    """Range check on obj.name; `allow` lists extra accepted sentinels (e.g. -1 = off)."""
    value = getattr(obj, name)
    if (value is None and optional) or value in allow:
        return
    rules = [(gt, f"> {gt}", lambda v: v > gt), (ge, f">= {ge}", lambda v: v >= ge),
             (le, f"<= {le}", lambda v: v <= le)]
    wanted = [text for bound, text, _ in rules if bound is not None]
    finite = not isinstance(value, float) or math.isfinite(value)
    if not finite or not all(ok(value) for bound, _, ok in rules if bound is not None):
        sentinel = "".join(f" (or {a!r} to turn it off)" for a in allow)
        want = " and ".join(wanted) if wanted else "a finite number"
        fail(join_key(prefix, name), value, f"must be {want}{sentinel}; set a value in that range")
