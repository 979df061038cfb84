"""Tools a policy can call: the `Tool` base, the built-ins and verl's tool config YAML.

A tool has a `name`, an OpenAI-style `schema`
({"type": "function", "function": {"name", "description", "parameters"}}, what the chat
template shows the model through `tools=`) and `call(**arguments) -> str`. `call` may raise,
hang or return garbage: engine/agents/runner.py turns each of those into an error observation.

Built-ins (BUILTINS):
    calculator   arithmetic through `ast`: numbers, + - * / // % **, unary signs, parentheses;
                 bounded exponents and result sizes; anything else is refused with a message
    python       runs `code` in the sandbox (engine/rewards/sandbox.py): stdout, then stderr,
                 the exit code or the timeout; its `config` takes SandboxConfig's keys

verl's tool config, read as it is (`multi_turn.tool_config_path`):

    tools:
      - class_name: calculator            # a built-in, `file.py:Class` or `package.module.Class`
        config: {type: native}            # given to the class; verl's `type: mcp` is refused
        tool_schema:                      # optional when the class has its own schema
          type: function
          function: {name: calc, description: ..., parameters: {...}}

verl's SandboxFusionTool class name maps to the `python` built-in (same `code` argument); its
service keys (sandbox_fusion_url, ...) are ignored, default_timeout / memory_limit_mb act.

Tests: tests/test_agent_tools.py
"""
from __future__ import annotations

import ast
import inspect
import math
import operator


from engine.agents import AgentConfigError
from engine.agents.user_code import config_entries, load_class
from engine.errors import one_line
from engine.rewards import sandbox


class Tool:
    """Subclass and set `name`, `description`, `parameters` (JSON schema of the arguments) or
    `schema` (the whole OpenAI dict), and write `call`. `config` is the YAML entry's `config`;
    a `tool_schema` given there replaces the class's."""
    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        self.config = dict(config or {})
        if tool_schema is not None:
            self.schema = tool_schema
            self.name = tool_schema["function"]["name"]
        elif getattr(type(self), "schema", None) is None:
            self.schema = {"type": "function", "function": {
                "name": self.name, "description": self.description, "parameters": self.parameters}}
        else:
            self.name = self.name or self.schema["function"]["name"]

    def call(self, **arguments) -> str:
        raise NotImplementedError


# ---- calculator ----------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 500
MAX_RESULT_DIGITS = 1000
MAX_RESULT_BITS = int(MAX_RESULT_DIGITS * math.log2(10)) + 1
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Refused(Exception):
    pass


def _check_size(value):
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
        raise _Refused(f"the result has more than {MAX_RESULT_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise _Refused("the result is not a finite number")
    return value


def _power(base, exponent):
    if isinstance(exponent, int) and isinstance(base, int) and exponent > 0 and abs(base) > 1 \
            and (abs(base).bit_length() - 1) * exponent > MAX_RESULT_BITS:
        raise _Refused(f"the result has more than {MAX_RESULT_DIGITS} digits")
    if abs(exponent) > 10_000 and not (isinstance(base, (int, float)) and abs(base) in (0, 1)):
        raise _Refused("the exponent is too large (at most 10000)")
    return base ** exponent


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        return _check_size(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise _Refused("'^' is not a power here; write ** (2**10)")
    raise _Refused(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text, or an "Error: ..." line."""
    if not isinstance(expression, str):
        return f"Error: expression must be a string, got {type(expression).__name__}"
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"Error: the expression is longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval"))
        if isinstance(value, complex):
            raise _Refused("the result is a complex number")
        return str(value)
    except SyntaxError as e:
        return f"Error: not an arithmetic expression ({e.msg})"
    except ZeroDivisionError:
        return "Error: division by zero"
    except (_Refused, OverflowError, ValueError, TypeError) as e:
        return f"Error: {e}"
    except (RecursionError, MemoryError):
        return "Error: the expression is nested too deeply"


class Calculator(Tool):
    name = "calculator"
    description = ("Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and "
                   "parentheses, e.g. (123*456) - 7**3.")
    parameters = {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": "the expression, e.g. 123*456"}}}

    def call(self, expression: str = None, **unexpected) -> str:
        if unexpected:
            return f"Error: unexpected argument(s) {sorted(unexpected)}; give only \"expression\""
        if expression is None:
            return "Error: missing argument \"expression\""
        return calculate(expression)


# ---- python (sandboxed) --------------------------------------------------------------------

_VERL_SANDBOX_KEYS = {"default_timeout": "timeout_s", "memory_limit_mb": "memory_mb"}
_VERL_IGNORED = {"type", "sandbox_fusion_url", "num_workers", "rate_limit", "enable_global_rate_limit",
                 "default_language"}


class Python(Tool):
    name = "python"
    description = "Run a Python program in a sandbox (no network) and see its stdout and stderr."
    parameters = {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string", "description": "the program; print what you want to see"}}}

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema)
        settings = {_VERL_SANDBOX_KEYS.get(k, k): v for k, v in self.config.items() if k not in _VERL_IGNORED}
        try:
            self.sandbox = sandbox.config_from(settings)
        except (TypeError, ValueError) as e:
            raise AgentConfigError(f"python tool config: {one_line(e)}") from e

    def call(self, code: str = None, **unexpected) -> str:
        if unexpected:
            return f"Error: unexpected argument(s) {sorted(unexpected)}; give only \"code\""
        if not isinstance(code, str):
            return "Error: \"code\" must be a string holding a Python program"
        result = sandbox.run({"main.py": code}, "main.py", cfg=self.sandbox)
        parts = [result.stdout] if result.stdout else []
        if result.stderr:
            parts.append(f"stderr:\n{result.stderr}")
        if result.timed_out:
            parts.append(f"Error: the program timed out after {self.sandbox.timeout_s:g} s")
        elif result.returncode != 0:
            parts.append(f"exit code {result.returncode}")
        return "\n".join(parts) if parts else "(no output)"


BUILTINS = {"calculator": Calculator, "python": Python}
VERL_CLASSES = {"verl.tools.sandbox_fusion_tools.SandboxFusionTool": Python}


# ---- verl's tool config --------------------------------------------------------------------

def _check_schema(schema, where: str) -> dict:
    fix = "write tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}"
    if not isinstance(schema, dict) or schema.get("type", "function") != "function" \
            or not isinstance(schema.get("function"), dict):
        raise AgentConfigError(f"{where}: tool_schema is not an OpenAI function schema; {fix}")
    function = schema["function"]
    if not isinstance(function.get("name"), str) or not function["name"].strip():
        raise AgentConfigError(f"{where}: tool_schema.function.name is missing; {fix}")
    if not isinstance(function.get("parameters", {}), dict):
        raise AgentConfigError(f"{where}: tool_schema.function.parameters must be a mapping (a JSON "
                               "schema of the arguments); " + fix)
    return {"type": "function", **schema}


def make_tool(cls: type, config: dict, tool_schema: dict | None, where: str) -> Tool:
    """An instance of a user's (or built-in) tool class, given `config` and `tool_schema` when its
    constructor takes them."""
    if not callable(getattr(cls, "call", None)):
        raise AgentConfigError(f"{where}: {cls.__name__} has no call(**arguments) method; subclass "
                               "engine.agents.tools.Tool and write call()")
    try:
        params = inspect.signature(cls).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        kwargs = {k: v for k, v in (("config", config), ("tool_schema", tool_schema))
                  if takes_any or k in params}
        tool = cls(**kwargs)
    except AgentConfigError as e:
        raise AgentConfigError(f"{where}: {e}") from e
    except Exception as e:  # noqa: BLE001 - the user's constructor
        raise AgentConfigError(f"{where}: {cls.__name__}(config=...) raised {type(e).__name__}: "
                               f"{one_line(e)}; fix the class or its config") from e
    if tool_schema is not None and "tool_schema" not in kwargs:
        tool.schema, tool.name = tool_schema, tool_schema["function"]["name"]
    schema = getattr(tool, "schema", None)
    tool.schema = _check_schema(schema, f"{where} ({cls.__name__})")
    tool.name = tool.schema["function"]["name"]
    return tool


def load_tool_config(path: str) -> dict:
    """{name: Tool} from verl's tool config YAML at `path`."""
    base_dir, entries = config_entries(path, "tool", "tools", ("class_name", "config", "tool_schema"),
                                       "actor_rollout_ref.rollout.multi_turn.tool_config_path")
    tools = {}
    for at, entry, config in entries:
        if config.get("type", "native") != "native":
            raise AgentConfigError(f"{at}: config.type={config['type']!r}: only native tools run "
                                   "here (no MCP); write a Tool class or use a built-in")
        schema = entry.get("tool_schema")
        if schema is not None:
            schema = _check_schema(schema, at)
        spec = entry.get("class_name")
        cls = BUILTINS.get(spec) or VERL_CLASSES.get(spec) or load_class(spec, at, base_dir)
        tool = make_tool(cls, config, schema, at)
        if tool.name in tools:
            raise AgentConfigError(f"{at}: a second tool named {tool.name!r}; give each tool its own "
                                   "tool_schema.function.name")
        tools[tool.name] = tool
    return tools
