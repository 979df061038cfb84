"""Tools and environments for multi-turn rollouts (issue 24 items 3 and 4), below the rollout
layer: the multi-turn loop (engine/rollout/multi_turn.py) calls these; nothing here imports the
trainer, the loop, the experience sources or the workers.

    parsers.py       the model's text -> tool calls (registry; `hermes` first)
    tools.py         Tool, the built-ins (`calculator`, `python`), user tools, verl's tool YAML
    runner.py        ToolRunner: calls run concurrently, each under a timeout; every failure
                     becomes an error observation string
    environments.py  Environment (reset / step), user environments, verl's interaction YAML
    user_code.py     loading a user's class from `file.py:Class` or `package.module.Class`
    render.py        token in, token out: the ids a chat template puts for observations

`AgentConfigError` (a UserError: reported as one line naming the file, the entry and the fix)
is raised for mistakes in a tool / interaction config or a user class; nothing a tool or an
environment does at run time raises.

Tests: tests/test_agent_tools.py, tests/test_agent_render.py
"""
from engine.errors import UserError


class AgentConfigError(UserError):
    """A tool / interaction config, a parser name or a user class that cannot be used."""
