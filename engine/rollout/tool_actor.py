"""The multi-turn loop's Actor (engine/rollout/multi_turn.py) for verl's `rollout.multi_turn`
config: a turn that ends at the tool-call end tag is parsed by the configured format, its calls
run by the ToolRunner (each under the timeout; every failure an error observation) and the
results rendered by the chat template as the tool turn's ids (engine/agents); a turn without a
call is the model's answer: it ends the trajectory, or, with an interaction (environment), is
the environment's action and its reply the next observation.

`multi_turn_generate(...)` is the StepContext's `run_engine` for a multi-turn run: one engine's
generate call per turn of every ready trajectory, the whole trajectories returned.

Tests: tests/test_multi_turn.py
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

from engine.rollout.multi_turn import Limits, Observation, run, run_concurrent
from parallel.cpu import suspended


class ToolActor:
    def __init__(self, runner, parser, render: Callable[[list], list], environments=None,
                 env_runner=None, decode_prompt: Optional[Callable[[list], str]] = None):
        """`render(messages, model_ended_with_eos) -> ids`: tool / user messages as the chat
        template appends them (with the next assistant header) after a model turn that ended at
        the tool-call end tag or before any turn (False) or at an eos (True); `environments`: a
        factory of one environment per trajectory (None: an answer ends the trajectory)."""
        self.runner, self.parser, self.render = runner, parser, render
        self.environments, self.env_runner = environments, env_runner
        self.decode_prompt = decode_prompt
        self.timeout_s = runner.timeout_s
        self._envs, self._lock = {}, threading.Lock()
        self.needs_start = environments is not None  # else no first observation to wait for

    def act(self, trajectory, text: str, called: bool) -> Observation:
        if called:
            turn = self.parser.parse(text)
            handle = self.runner.submit(turn.calls, turn.errors)
            results = self.runner.results(handle)
            c = handle.counters
            return Observation(ids=self.render([{"role": "tool", "content": r} for r in results], False),
                               tool_calls=c.calls, tool_errors=c.errors, tool_timeouts=c.timeouts)
        if self.environments is None:
            return Observation(done=True)
        env = self._environment(trajectory)
        result = self.env_runner.step(env, text)
        ids = self.render([{"role": "user", "content": result.observation}], True) if result.observation else None
        return Observation(ids=ids, done=bool(result.done), by_environment=True, reward=float(result.reward))

    def start(self, trajectory) -> Observation:
        """Before the first model turn: the environment's `reset(prompt)` observation as a user
        turn (the prompt's empty assistant turn closed first), or nothing. A reset that fails
        ends the trajectory with its error observation (the model never acts on a broken one)."""
        if self.environments is None:
            return Observation()
        env = self.environments()
        prompt = self.decode_prompt(trajectory.prompt) if self.decode_prompt else ""
        result = self.env_runner.reset(env, prompt)
        with self._lock:
            self._envs[(trajectory.key, trajectory.sample)] = env
        ids = self.render([{"role": "user", "content": result.observation}], False) if result.observation else None
        return Observation(ids=ids, done=bool(result.done), by_environment=True)

    def _environment(self, trajectory):
        with self._lock:
            return self._envs[(trajectory.key, trajectory.sample)]


def multi_turn_generate(engine_generate, actor_factory: Callable[[], ToolActor], *, decode, end_tag,
                        limits: Limits, workers: int = 8):
    """run_engine(engine, prompt_ids, sampling, keys) for a multi-turn run (engine_generate: the
    single call it wraps). A fresh Actor per call: environments live for one rollout. An engine
    serving concurrent requests (ASYNC_GENERATE: SGLang) gets each trajectory's turns as requests
    of their own; the others one generate call per round of ready trajectories."""
    def run_engine(engine, prompt_ids, sampling, keys):
        common = dict(actor=actor_factory(), decode=decode, end_tag=end_tag, limits=limits, workers=workers)
        if getattr(engine, "ASYNC_GENERATE", False):
            with suspended():  # the engine runs no Megatron code (as engine_generate)
                return run_concurrent(engine.agenerate, engine.run_async, prompt_ids, sampling, keys, **common)
        return run(lambda p, s, k: engine_generate(engine, p, s, k), prompt_ids, sampling, keys, **common)
    return run_engine


def tools_of(mt) -> dict:
    """{name: Tool}: verl's tool config YAML, or the built-ins (calculator, python)."""
    from engine.agents.tools import BUILTINS, load_tool_config
    if mt.tool_config_path:
        return load_tool_config(mt.tool_config_path)
    return {name: cls() for name, cls in BUILTINS.items()}


def from_config(mt, tokenizer, response_length: int, eos_ids, engine_generate):
    """The StepContext's run_engine for `actor_rollout_ref.rollout.multi_turn` (enable=true)."""
    from engine.agents.environments import EnvironmentRunner, load_interactions
    from engine.agents.parsers import get_parser
    from engine.agents.render import observation_ids
    from engine.agents.runner import ToolRunner

    parser, tools = get_parser(mt.format), tools_of(mt)
    schemas = [t.schema for t in tools.values()]
    specs = load_interactions(mt.interaction_config_path) if mt.interaction_config_path else {}
    if len(specs) > 1:  # verl picks one per sample from its data; one environment per run here
        from engine.agents import AgentConfigError
        raise AgentConfigError(f"actor_rollout_ref.rollout.multi_turn.interaction_config_path="
                               f"{mt.interaction_config_path!r} names {len(specs)} interactions "
                               f"({', '.join(sorted(specs))}); keep one")
    spec = next(iter(specs.values()), None)

    def render(messages, model_ended_with_eos):
        return observation_ids(tokenizer, messages, tools=schemas, model_ended_with_eos=model_ended_with_eos,
                               eos_ids=eos_ids)

    def actor():
        return ToolActor(ToolRunner(tools, timeout_s=mt.tool_timeout_s,
                                    max_response_chars=mt.max_tool_response_length,
                                    truncate_side=mt.tool_response_truncate_side), parser, render,
                         environments=spec.make if spec else None,
                         env_runner=EnvironmentRunner(mt.tool_timeout_s) if spec else None,
                         decode_prompt=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    end_tag = list(tokenizer.encode(parser.end_tag, add_special_tokens=False))
    limits = Limits(response_length, mt.max_assistant_turns, mt.max_user_turns)
    return multi_turn_generate(engine_generate, actor, decode=lambda ids: tokenizer.decode(ids),
                               end_tag=end_tag, limits=limits)
