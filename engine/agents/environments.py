"""Environments: user turns and a final reward (a game, a checker, a simulated user).

    class Environment:
        def __init__(self, config: dict | None = None)
        def reset(self, prompt: str) -> Optional[str]                      # a first observation
        def step(self, action: str) -> (Optional[str], float, bool)     # observation, reward, done

One instance per trajectory: `EnvironmentSpec.make()` builds a fresh one from the class and its
config. A user class is loaded from `path/to/file.py:Class` or `package.module.Class`
(`load_environment`), or from verl's interaction config YAML (`multi_turn.interaction_config_path`),
read as it is:

    interaction:
      - name: guess                   # optional: defaults to the class name, less "Interaction"
        class_name: games.py:Guess
        config: {low: 1, high: 100}

Run time never raises: `EnvironmentRunner.reset` / `.step` run the user's method in a daemon
thread under `timeout_s`; an exception, a timeout or a malformed return (not
(str | None, finite number, bool)) becomes an error observation with reward 0 and done=True,
counted in `EnvironmentCounters`.

Tests: tests/test_agent_tools.py
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, fields
from typing import NamedTuple, Optional


from engine.agents import AgentConfigError
from engine.agents.runner import call_with_timeout, describe_exception
from engine.agents.user_code import config_entries, load_class
from engine.errors import one_line


class Environment:
    """Subclass and write `step` (and `reset` when the first turn needs an observation)."""

    def __init__(self, config: Optional[dict] = None):
        self.config = dict(config or {})

    def reset(self, prompt: str) -> Optional[str]:
        return None

    def step(self, action: str):
        raise NotImplementedError


@dataclass(frozen=True)
class EnvironmentSpec:
    name: str
    cls: type
    config: dict = field(default_factory=dict)

    def make(self):
        """A fresh instance for one trajectory (a failing constructor raises AgentConfigError):
        `cls(config=...)` when __init__ takes `config` (or **kwargs), else `cls(**config)`."""
        try:
            params = inspect.signature(self.cls).parameters
            if "config" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
                return self.cls(config=dict(self.config))
            return self.cls(**self.config)
        except Exception as e:  # noqa: BLE001 - the user's constructor
            raise AgentConfigError(f"environment {self.name!r}: constructing {self.cls.__name__} raised "
                                   f"{type(e).__name__}: {one_line(e)}; fix the class or its config") from e


def _check_class(cls: type, where: str) -> type:
    if not callable(getattr(cls, "step", None)):
        raise AgentConfigError(f"{where}: {cls.__name__} has no step(action) method; subclass "
                               "engine.agents.environments.Environment and write step()")
    return cls


def load_environment(spec: str, config: Optional[dict] = None, name: Optional[str] = None,
                     where: str = "environment", base_dir: Optional[str] = None) -> EnvironmentSpec:
    cls = _check_class(load_class(spec, where, base_dir), where)
    return EnvironmentSpec(name or _default_name(cls), cls, dict(config or {}))


def _default_name(cls: type) -> str:
    name = cls.__name__
    return (name[:-len("Interaction")] if name.endswith("Interaction") and name != "Interaction" else name).lower()


def load_interactions(path: str) -> dict:
    """{name: EnvironmentSpec} from verl's interaction config YAML at `path`."""
    base_dir, entries = config_entries(path, "interaction", "interaction", ("name", "class_name", "config"),
                                       "actor_rollout_ref.rollout.multi_turn.interaction_config_path")
    out = {}
    for at, entry, config in entries:
        name = entry.get("name")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise AgentConfigError(f"{at}: name must be a non-empty string")
        spec = load_environment(entry.get("class_name"), config, name, at, base_dir)
        if spec.name in out:
            raise AgentConfigError(f"{at}: a second interaction named {spec.name!r}; give each its own name")
        out[spec.name] = spec
    return out


@dataclass
class EnvironmentCounters:
    """Summable counts for the metrics: steps taken, error observations, timeouts."""
    steps: int = 0
    errors: int = 0
    timeouts: int = 0

    def __add__(self, other: "EnvironmentCounters") -> "EnvironmentCounters":
        return EnvironmentCounters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class StepResult(NamedTuple):
    """(observation, reward, done, error): also unpacks as a tuple."""
    observation: Optional[str]
    reward: float
    done: bool
    error: bool = False


class EnvironmentRunner:
    """Calls an environment's methods so that nothing it does can crash or hang the caller."""

    def __init__(self, timeout_s: float = 30.0):
        if not timeout_s or timeout_s <= 0:
            raise AgentConfigError(f"environment timeout_s={timeout_s!r}: must be a number of seconds > 0")
        self.timeout_s = float(timeout_s)
        self.counters = EnvironmentCounters()

    def _error(self, env, what: str, status: str, value) -> StepResult:
        self.counters.errors += 1
        name = type(env).__name__
        if status == "timeout":
            self.counters.timeouts += 1
            return StepResult(f"Error: environment {name} {what} timed out after {self.timeout_s:g} s", 0.0, True, True)
        if status == "raised":
            return StepResult(f"Error: environment {name} {what} failed: {describe_exception(value)}",
                              0.0, True, True)
        return StepResult(f"Error: environment {name} {what} returned {value}", 0.0, True, True)

    def reset(self, env, prompt: str) -> StepResult:
        """The first observation (done=False), or an error one (done=True). A class without
        `reset` has no first observation."""
        if not callable(getattr(env, "reset", None)):
            return StepResult(None, 0.0, False)
        status, value = call_with_timeout(lambda: env.reset(prompt), self.timeout_s, "env-reset")
        if status != "ok":
            return self._error(env, "reset", status, value)
        if value is not None and not isinstance(value, str):
            return self._error(env, "reset", "bad", f"{type(value).__name__}, not text or None")
        return StepResult(value, 0.0, False)

    def step(self, env, action: str) -> StepResult:
        self.counters.steps += 1
        status, value = call_with_timeout(lambda: env.step(action), self.timeout_s, "env-step")
        if status != "ok":
            return self._error(env, "step", status, value)
        if not isinstance(value, (tuple, list)) or len(value) != 3:
            return self._error(env, "step", "bad", f"{type(value).__name__}, not (observation, reward, done)")
        observation, reward, done = value
        if observation is not None and not isinstance(observation, str):
            return self._error(env, "step", "bad", f"an observation of type {type(observation).__name__}")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return self._error(env, "step", "bad", f"reward {reward!r}, not a finite number")
        if not isinstance(done, bool) and type(done).__name__ != "bool_":
            return self._error(env, "step", "bad", f"done {done!r}, not a bool")
        if observation is not None:
            observation = observation.encode("utf-8", "replace").decode("utf-8")
        return StepResult(observation, float(reward), bool(done))
