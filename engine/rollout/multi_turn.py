"""Multi-turn rollouts: a trajectory alternates model turns and observations (tool results,
environment turns) until the model answers, a limit is reached or the environment ends it.

Token in, token out: a trajectory is token ids from start to end. Each model turn's ids and
log-probs are the engine's own; an observation is rendered and tokenised on its own (by the
`Actor`) and appended; the history is never re-tokenised. The response carries a loss mask
(1 = model token, 0 = observation) and the turn boundaries.

Trajectories do not wait for each other: an observation is computed in a worker thread while
the engine keeps generating the turns of every trajectory that is ready; one still waiting for
its tools simply sits out the engine's next call. The Actor turns every failure of a tool or an
environment into an observation (engine/agents/): nothing a tool does can crash or hang the
loop, and `Actor.timeout_s` bounds how long a trajectory waits.

Sampling: turn t of sample j of prompt key k draws from its own stream (the CPU backend seeds
per (seed, key, sample); the key here is (k, j, t)), so a trajectory samples the same way in
any batch, on any rollout layout.

Tests: tests/test_multi_turn.py
"""
from __future__ import annotations

import asyncio
import concurrent.futures as futures
import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import torch

from engine.rollout.base import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams

# why a trajectory ended (metrics: multi_turn/ended/<reason>)
ENDINGS = ("answer", "env_done", "length", "max_assistant_turns", "max_user_turns", "abort")


@dataclass(frozen=True)
class Observation:
    """What follows a model turn: `ids` appended with loss mask 0 (None: nothing; the trajectory
    ends when `done`), and what the tools did (for the metrics)."""
    ids: Optional[list[int]] = None
    done: bool = False
    by_environment: bool = False  # the environment ended it (not the model's answer)
    reward: float = 0.0        # an environment's (summed over its turns)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0


class Actor(Protocol):
    """Answers a model turn (engine/agents builds one from the tools / environment config)."""
    timeout_s: float

    def start(self, trajectory: "Trajectory") -> Observation:
        """Before the first turn, when `needs_start`: an environment's first observation (ids
        None: none)."""

    def act(self, trajectory: "Trajectory", text: str, called: bool) -> Observation:
        """`text`: the turn decoded; `called`: it ended at the tool-call end tag."""


@dataclass(frozen=True)
class Limits:
    response_length: int                       # tokens of the whole response (model + observations)
    max_assistant_turns: Optional[int] = None
    max_user_turns: Optional[int] = None


@dataclass
class Trajectory:
    key: int
    sample: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # where each model turn starts in `tokens`
    observations: int = 0
    reward: float = 0.0
    ended: Optional[str] = None
    pending: Optional[futures.Future] = None
    tools: Counter = field(default_factory=Counter)

    @property
    def turns(self) -> int:
        return len(self.starts)

    def append(self, ids, log_probs, model: bool):
        self.tokens += ids
        self.mask += [1 if model else 0] * len(ids)
        self.log_probs += log_probs if model else [0.0] * len(ids)


def cut_at(ids: Sequence[int], tag: Sequence[int]) -> Optional[int]:
    """The end (exclusive) of the first occurrence of `tag` in `ids`, or None."""
    n = len(tag)
    if not n:
        return None
    for i in range(len(ids) - n + 1):
        if list(ids[i:i + n]) == list(tag):
            return i + n
    return None


def turn_key(t: Trajectory) -> int:
    return hash((int(t.key), t.sample, t.turns)) & ((1 << 62) - 1)


@dataclass
class MultiTurnOutput(RolloutOutput):
    loss_masks: list = field(default_factory=list)       # per row: 1 = model token
    turn_starts: list = field(default_factory=list)      # per row: each model turn's start
    stats: list = field(default_factory=list)            # per row: turns, observations, tools, ending


def run(generate: Callable[[list, SamplingParams, list], RolloutOutput], prompt_ids: Sequence[Sequence[int]],
        sampling: SamplingParams, keys: Sequence[int], *, actor: Actor, decode: Callable[[list], str],
        end_tag: Sequence[int], limits: Limits, workers: int = 8) -> MultiTurnOutput:
    """`sampling.n` trajectories per prompt (prompt-major rows, like RolloutOutput), each driven
    to its end. `generate(prompt_ids, sampling, keys)`: one engine call (n=1 per row) serving the
    turns of every trajectory that is ready."""
    trajs = _trajectories(prompt_ids, sampling, keys)
    pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="multi-turn")
    try:
        _start(trajs, actor, pool)
        while any(t.ended is None for t in trajs):
            ready = [t for t in trajs if t.ended is None and t.pending is None]
            if ready:
                budgets = [limits.response_length - len(t.tokens) for t in ready]
                turn = dataclasses.replace(sampling, n=1, max_new_tokens=max(budgets))
                out = generate([t.prompt + t.tokens for t in ready], turn, [turn_key(t) for t in ready])
                for t, budget, ids, lps, reason in zip(ready, budgets, out.responses, out.log_probs,
                                                       out.finish_reasons):
                    _take_turn(t, budget, ids, lps, reason, actor, decode, end_tag, limits, pool)
            else:
                waiting = [t.pending for t in trajs if t.pending is not None]
                futures.wait(waiting, timeout=actor.timeout_s + 5.0, return_when=futures.FIRST_COMPLETED)
            for t in trajs:
                if t.pending is not None and t.pending.done():
                    _observe(t, _result(t.pending), limits)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return _output(trajs, len(prompt_ids), sampling.n)


def run_concurrent(agenerate, run_async, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                   keys: Sequence[int], *, actor: Actor, decode: Callable[[list], str], end_tag: Sequence[int],
                   limits: Limits, workers: int = 8) -> MultiTurnOutput:
    """`run` for an engine that serves concurrent requests (RolloutEngine.ASYNC_GENERATE): each
    trajectory is a coroutine sending its own turns (`await agenerate([ids], sampling, [key])`)
    and awaiting its observation from the thread pool; `run_async` runs them all on the engine's
    event loop. A trajectory's turns and samples draw as in `run` (same keys and budgets)."""
    trajs = _trajectories(prompt_ids, sampling, keys)
    pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="multi-turn")

    async def drive(t: Trajectory):
        if t.pending is not None:  # the environment's reset
            await asyncio.wait([asyncio.wrap_future(t.pending)])
            _observe(t, _result(t.pending), limits)
        while t.ended is None:
            budget = limits.response_length - len(t.tokens)
            turn = dataclasses.replace(sampling, n=1, max_new_tokens=budget)
            out = await agenerate([t.prompt + t.tokens], turn, [turn_key(t)])
            _take_turn(t, budget, out.responses[0], out.log_probs[0], out.finish_reasons[0], actor, decode,
                       end_tag, limits, pool)
            if t.pending is not None:
                await asyncio.wait([asyncio.wrap_future(t.pending)])
                _observe(t, _result(t.pending), limits)

    async def every():
        await asyncio.gather(*(drive(t) for t in trajs))
    try:
        _start(trajs, actor, pool)
        run_async(every())
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return _output(trajs, len(prompt_ids), sampling.n)


def _start(trajs, actor, pool):
    """Each trajectory's first observation (an environment's reset), computed in the pool. Only
    for an actor that has one: a pending no-op would split the first turns over several calls."""
    if getattr(actor, "needs_start", False):
        for t in trajs:
            t.pending = pool.submit(actor.start, t)


def _trajectories(prompt_ids, sampling, keys):
    return [Trajectory(int(k), j, list(p)) for p, k in zip(prompt_ids, keys) for j in range(sampling.n)]


def _output(trajs, prompts: int, n: int) -> MultiTurnOutput:
    finish = {"length": FINISH_LENGTH, "abort": FINISH_ABORT}
    return MultiTurnOutput(
        prompt_index=[i for i in range(prompts) for _ in range(n)],
        responses=[t.tokens for t in trajs], log_probs=[t.log_probs for t in trajs],
        finish_reasons=[finish.get(t.ended, FINISH_STOP) for t in trajs],
        loss_masks=[t.mask for t in trajs], turn_starts=[t.starts for t in trajs],
        stats=[dict(turns=t.turns, observations=t.observations, ended=t.ended, reward=t.reward,
                    model_tokens=sum(t.mask), observation_tokens=len(t.mask) - sum(t.mask), **t.tools)
               for t in trajs])


def _take_turn(t, budget, ids, lps, reason, actor, decode, end_tag, limits, pool):
    """Append one model turn (cut at the tool-call end tag and the budget); end the trajectory or
    submit its observation to the pool."""
    ids, lps = list(ids)[:budget], list(lps)[:budget]
    end = cut_at(ids, end_tag)
    called = end is not None
    if called:  # the turn ends at the tool-call end tag: what the model sampled after it is dropped
        ids, lps = ids[:end], lps[:end]
    t.starts.append(len(t.tokens))
    t.append(ids, lps, model=True)
    if reason == FINISH_ABORT:
        t.ended = "abort"
    elif not called and (reason == FINISH_LENGTH or len(t.tokens) >= limits.response_length):
        t.ended = "length"
    elif limits.max_assistant_turns is not None and t.turns >= limits.max_assistant_turns and called:
        t.ended = "max_assistant_turns"  # its calls would have no turn to answer them
    elif called and limits.max_user_turns is not None and t.observations >= limits.max_user_turns:
        t.ended = "max_user_turns"
    else:
        t.pending = pool.submit(actor.act, t, decode(ids), called)


def _result(future: futures.Future) -> Observation:
    try:
        return future.result(timeout=0)
    except Exception:  # noqa: BLE001 - an Actor's own bug ends the trajectory, never the run
        return Observation(ids=None, done=True, tool_errors=1)


def _observe(t: Trajectory, obs: Observation, limits: Limits):
    t.pending = None
    t.reward += obs.reward
    t.tools.update(tool_calls=obs.tool_calls, tool_errors=obs.tool_errors, tool_timeouts=obs.tool_timeouts)
    if obs.ids:
        room = limits.response_length - len(t.tokens)
        t.append(list(obs.ids)[:room], None, model=False)
        t.observations += 1
        if len(obs.ids) >= room:
            t.ended = "length"
            return
    if obs.done:
        t.ended = "env_done" if obs.by_environment else "answer"
    elif not obs.ids and t.turns:  # (before the first turn: an environment with nothing to say)
        t.ended = "answer"
    elif limits.max_assistant_turns is not None and t.turns >= limits.max_assistant_turns:
        t.ended = "max_assistant_turns"


def multi_turn_metrics(stats) -> dict:
    """Per-trajectory counts of a multi-turn rollout (engine/rollout/multi_turn.py) as means over
    this shard's trajectories: verl's num_turns/*, the tools' calls / errors / timeouts, model
    vs observation tokens, and the share of trajectories each limit (or answer) ended."""
    if stats is None or len(stats) == 0:
        return {}
    n = len(stats)

    def mean(key):
        return sum(float(s.get(key, 0)) for s in stats) / n
    turns = [s["turns"] for s in stats]
    out = {"num_turns/mean": mean("turns"), "num_turns/max": float(max(turns)),
           "num_turns/min": float(min(turns))}
    for key in ("tool_calls", "tool_errors", "tool_timeouts", "observations", "model_tokens",
                "observation_tokens"):
        out[f"multi_turn/{key}/mean"] = mean(key)
    for ending in ENDINGS:
        out[f"multi_turn/ended/{ending}"] = sum(s["ended"] == ending for s in stats) / n
    return out


def last_turn_mask(response_mask):
    """The last run of model tokens of each row of a [rows, length] mask: a trajectory's final turn,
    what a rule reward reads (engine/experience/scoring.py, engine/validation.py)."""
    m = response_mask.long()
    starts = (m[:, 1:] > m[:, :-1]).long()  # 0 -> 1 steps: where a later turn begins
    turn = torch.cat([m[:, :1], starts], dim=1).cumsum(-1)
    return m * (turn == turn.max(dim=1, keepdim=True).values).long()
