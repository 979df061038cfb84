"""User tools for tests/test_agent_tools.py (loaded by tests/agent_configs/tools.yaml).

Tests: tests/test_agent_tools.py
"""
from engine.agents.tools import Tool


class Reverse(Tool):
    """Schema from the config; behaviour from config['upper']."""

    def call(self, word: str) -> str:
        out = word[::-1]
        return out.upper() if self.config.get("upper") else out


class Weather:
    """Not a Tool subclass: a plain class with its own schema and call()."""
    schema = {"type": "function", "function": {
        "name": "weather", "description": "Today's weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

    def call(self, city: str) -> str:
        return f"sunny in {city}"
