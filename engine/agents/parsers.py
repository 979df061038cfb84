"""Tool-call parsers: the text of one model turn -> the tool calls in it.

A registry by name (`actor_rollout_ref.rollout.multi_turn.format`, verl's key):

    hermes   Hermes / Qwen2.5 / Qwen3: one or more blocks per turn
             <tool_call>
             {"name": "calculator", "arguments": {"expression": "12*7"}}
             </tool_call>

`parser.parse(text)` never raises: a block that is not JSON, lacks a name, has arguments that
are not an object, or is never closed becomes a short message in `ParsedTurn.errors` (the
model sees it as an error observation, engine/agents/runner.py); the well-formed blocks of the
same turn still run. `parser.end_tag` is the text a turn that calls a tool ends with (the loop
stops generation there).

Tests: tests/test_agent_tools.py
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.agents import AgentConfigError

MAX_ERROR_CHARS = 200  # of the offending text quoted back to the model


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    raw: str  # the whole block as the model wrote it, tags included


@dataclass(frozen=True)
class ParsedTurn:
    calls: list = field(default_factory=list)    # [ToolCall], in the order written
    errors: list = field(default_factory=list)   # [str]: one per malformed block
    content: str = ""                            # the text outside the blocks, stripped


def _quote(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.
    `arguments` may also be a JSON string holding an object (the OpenAI wire form); missing
    arguments mean {}."""
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        calls, errors, outside = [], [], []
        pos, index = 0, 0
        while True:
            start = text.find(self.start_tag, pos)
            stray = text.find(self.end_tag, pos)
            if stray != -1 and (start == -1 or stray < start):
                errors.append(f"Error: '{self.end_tag}' without an opening '{self.start_tag}'; "
                              f"write {self.start_tag}{{\"name\": ..., \"arguments\": {{...}}}}{self.end_tag}")
                outside.append(text[pos:stray])
                pos = stray + len(self.end_tag)
                continue
            if start == -1:
                outside.append(text[pos:])
                break
            outside.append(text[pos:start])
            index += 1
            body_at = start + len(self.start_tag)
            end = text.find(self.end_tag, body_at)
            if end == -1:
                errors.append(f"Error: tool call {index} is not closed with '{self.end_tag}': "
                              f"{_quote(text[body_at:])}")
                break
            raw = text[start:end + len(self.end_tag)]
            call = self._call(text[body_at:end], raw, index)
            (calls if isinstance(call, ToolCall) else errors).append(call)
            pos = end + len(self.end_tag)
        return ParsedTurn(calls, errors, "".join(outside).strip())

    @staticmethod
    def _call(body: str, raw: str, index: int):
        """A ToolCall, or the error message for this block."""
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:
            reason = getattr(e, "msg", None) or type(e).__name__
            return f"Error: tool call {index} is not valid JSON ({reason}): {_quote(body)}"
        if not isinstance(data, dict):
            return (f"Error: tool call {index} must be a JSON object with \"name\" and "
                    f"\"arguments\", got {type(data).__name__}: {_quote(body)}")
        name = data.get("name")
        if not isinstance(name, str) or not name.strip():
            return f"Error: tool call {index} has no \"name\" (a non-empty string): {_quote(body)}"
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                pass  # still a string: refused below
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return (f"Error: tool call {index} ({name}): \"arguments\" must be a JSON object, got "
                    f"{type(arguments).__name__}: {_quote(body)}")
        return ToolCall(name.strip(), arguments, raw)


PARSERS = {"hermes": HermesParser()}


def get_parser(name: str):
    """The parser registered as `name`; an unknown name is a one-line AgentConfigError."""
    parser = PARSERS.get(name)
    if parser is None:
        raise AgentConfigError(f"actor_rollout_ref.rollout.multi_turn.format={name!r} is not a known "
                               f"tool-call parser; use one of: {', '.join(sorted(PARSERS))}")
    return parser
