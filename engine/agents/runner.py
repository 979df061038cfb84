"""Running tool calls: concurrently, each under a timeout, every failure an observation.

    runner = ToolRunner(tools, timeout_s=30.0, max_response_chars=256, truncate_side="middle")
    handle = runner.submit(parsed.calls, parsed.errors)   # returns at once; the calls run
    runner.poll(handle)          # non-blocking: True once every call finished or timed out
    runner.results(handle)       # [str]: one per call, then one per parse error (blocks until
                                 # poll would say True: at most timeout_s after submit)
    handle.counters              # ToolCounters(calls, errors, timeouts) of this handle
    runner.run(calls, errors)    # submit + results;  await runner.arun(...) in asyncio code

Each call runs in its own daemon thread, started at submit. A call that raises, returns
anything but a string, names an unknown tool or is still running `timeout_s` after submit
yields an "Error: ..." string, never an exception: a timed-out thread is abandoned (daemon: it
neither blocks later calls nor the process's exit; Python cannot kill a thread, so a tool that
must stop its work, like the sandboxed `python`, bounds itself). Every result is truncated to
`max_response_chars` keeping the `truncate_side` part (verl's tool_response_truncate_side:
left keeps the start, right the end, middle both ends).

`call_with_timeout` is the same machinery for one function (environments use it).

Tests: tests/test_agent_tools.py
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, Optional, Sequence

from engine.agents import AgentConfigError

logger = logging.getLogger(__name__)

TRUNCATE_SIDES = ("left", "middle", "right")
MARKER = "...(truncated)..."
MAX_REPORTED_CHARS = 300  # of an exception message shown to the model


@dataclass
class ToolCounters:
    """Summable (`a + b`) counts for the metrics: calls (including malformed ones), error
    observations (timeouts and malformed calls included), timeouts."""
    calls: int = 0
    errors: int = 0
    timeouts: int = 0

    def __add__(self, other: "ToolCounters") -> "ToolCounters":
        return ToolCounters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class Pending:
    """One function running in a daemon thread, with a deadline."""

    def __init__(self, fn: Callable[[], object], timeout_s: float, name: str = "agent-call"):
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.value, self.error = None, None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn):
        try:
            self.value = fn()
        except BaseException as e:  # noqa: BLE001 - reported as an observation
            self.error = e
        finally:
            self._done.set()

    def ready(self) -> bool:
        return self._done.is_set() or time.monotonic() >= self.deadline

    def wait(self) -> str:
        """"ok" (see .value), "raised" (see .error) or "timeout"; waits until ready()."""
        self._done.wait(max(0.0, self.deadline - time.monotonic()))
        if not self._done.is_set():
            return "timeout"
        return "ok" if self.error is None else "raised"


def call_with_timeout(fn: Callable[[], object], timeout_s: float, name: str = "agent-call"):
    """(status, value_or_exception): `fn()` in a daemon thread, given up on after `timeout_s`."""
    pending = Pending(fn, timeout_s, name)
    status = pending.wait()
    return status, (pending.error if status == "raised" else pending.value)


def describe_exception(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return text if len(text) <= MAX_REPORTED_CHARS else text[:MAX_REPORTED_CHARS] + "..."


def truncate(text: str, max_chars: Optional[int], side: str = "middle") -> str:
    """`text` cut to `max_chars` characters of its own (plus MARKER) keeping the `side` part."""
    if max_chars is None or len(text) <= max_chars:
        return text
    if side == "left":
        return text[:max_chars] + MARKER
    if side == "right":
        return MARKER + text[len(text) - max_chars:]
    head = (max_chars + 1) // 2
    return text[:head] + MARKER + text[len(text) - (max_chars - head):]


@dataclass
class Handle:
    """What submit returns; read it through the runner."""
    slots: list                       # per call: (tool name, Pending or a ready error string)
    parse_errors: list
    counters: ToolCounters = field(default_factory=ToolCounters)
    _results: Optional[list] = None


class ToolRunner:
    def __init__(self, tools: Mapping[str, object], timeout_s: float = 30.0,
                 max_response_chars: Optional[int] = 256, truncate_side: str = "middle"):
        if truncate_side not in TRUNCATE_SIDES:
            raise AgentConfigError(f"actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side="
                                   f"{truncate_side!r}: use one of {', '.join(TRUNCATE_SIDES)}")
        if not timeout_s or timeout_s <= 0:
            raise AgentConfigError(f"tool timeout_s={timeout_s!r}: must be a number of seconds > 0")
        if max_response_chars is not None and max_response_chars <= 0:
            raise AgentConfigError(f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length="
                                   f"{max_response_chars!r}: must be > 0")
        self.tools = dict(tools)
        self.timeout_s = float(timeout_s)
        self.max_response_chars = max_response_chars
        self.truncate_side = truncate_side
        self.counters = ToolCounters()  # every handle's, once its results are read
        self._lock = threading.Lock()

    def submit(self, calls: Sequence, parse_errors: Sequence[str] = ()) -> Handle:
        """Start every call (ToolCall-like: .name, .arguments) now; never blocks or raises."""
        slots = []
        for call in calls:
            name = getattr(call, "name", None)
            tool = self.tools.get(name) if isinstance(name, str) else None
            if tool is None:
                known = ", ".join(sorted(self.tools)) or "none"
                slots.append((name, f"Error: unknown tool {name!r}; the tools are: {known}"))
                continue
            arguments = getattr(call, "arguments", None)
            if not isinstance(arguments, dict):
                slots.append((name, f"Error: tool {name!r}: arguments must be a JSON object"))
                continue
            slots.append((name, Pending(lambda t=tool, a=dict(arguments): t.call(**a), self.timeout_s,
                                        name=f"tool-{name}")))
        return Handle(slots, [str(e) for e in parse_errors])

    def poll(self, handle: Handle) -> bool:
        """True once results(handle) would return without waiting."""
        return all(isinstance(p, str) or p.ready() for _, p in handle.slots)

    def results(self, handle: Handle) -> list:
        """One observation string per call, then one per parse error (cached: read twice, counted
        once)."""
        if handle._results is not None:
            return list(handle._results)
        out, counters = [], ToolCounters(calls=len(handle.slots) + len(handle.parse_errors))
        for name, pending in handle.slots:
            text = pending if isinstance(pending, str) else self._observe(name, pending, counters)
            counters.errors += text.startswith("Error:")
            out.append(text)
        out += handle.parse_errors
        counters.errors += len(handle.parse_errors)
        handle._results = [truncate(t, self.max_response_chars, self.truncate_side) for t in out]
        handle.counters = counters
        with self._lock:
            self.counters = self.counters + counters
        return list(handle._results)

    @staticmethod
    def _observe(name: str, pending: Pending, counters: ToolCounters) -> str:
        status = pending.wait()
        if status == "timeout":
            counters.timeouts += 1
            logger.warning("tool %r timed out after %.1f s; its thread is abandoned", name, pending.timeout_s)
            return f"Error: tool {name!r} timed out after {pending.timeout_s:g} s"
        if status == "raised":
            return f"Error: tool {name!r} failed: {describe_exception(pending.error)}"
        value = pending.value
        if not isinstance(value, str):
            return f"Error: tool {name!r} returned {type(value).__name__}, not text"
        # lone surrogates (e.g. from bytes decoded with surrogateescape) cannot be tokenised
        return value.encode("utf-8", "replace").decode("utf-8")

    def run(self, calls: Sequence, parse_errors: Sequence[str] = ()) -> list:
        return self.results(self.submit(calls, parse_errors))

    async def arun(self, calls: Sequence, parse_errors: Sequence[str] = (), poll_s: float = 0.01) -> list:
        """run() for asyncio code: the event loop keeps running while the tools do."""
        handle = self.submit(calls, parse_errors)
        while not self.poll(handle):
            await asyncio.sleep(poll_s)
        return self.results(handle)
