"""engine/agents: the tool-call parser, the tools, the runner's error paths and concurrency,
verl's tool and interaction YAML, environments."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from engine.agents import AgentConfigError
from engine.agents.environments import Environment, EnvironmentRunner, load_environment, load_interactions
from engine.agents.parsers import PARSERS, ToolCall, get_parser
from engine.agents.runner import MARKER, ToolCounters, ToolRunner, truncate
from engine.agents.tools import BUILTINS, Tool, calculate, load_tool_config
from engine.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "tests", "agent_configs")
NEVER = threading.Event()  # never set: a tool waiting on it hangs forever


def call(name, **arguments):
    return ToolCall(name, arguments, "")


class Sleepy(Tool):
    name = "sleepy"

    def call(self, seconds=0.5):
        time.sleep(seconds)
        return f"slept {seconds}"


class Hangs(Tool):
    name = "hangs"

    def call(self):
        NEVER.wait()


class Raises(Tool):
    name = "raises"

    def call(self):
        raise RuntimeError("disk on fire")


class Garbage(Tool):
    name = "garbage"

    def call(self, kind="bytes"):
        return {"bytes": b"\xff", "none": None, "dict": {"a": 1}}[kind]


def runner(timeout_s=5.0, **kwargs):
    tools = [Sleepy(), Hangs(), Raises(), Garbage(), BUILTINS["calculator"]()]
    return ToolRunner({t.name: t for t in tools}, timeout_s=timeout_s, **kwargs)


# ---- parser --------------------------------------------------------------------------------

def test_hermes_parses_several_calls_and_the_text_around_them():
    parser = get_parser("hermes")
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n'
            '</tool_call>\n<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    turn = parser.parse(text)
    assert parser.end_tag == "</tool_call>" and turn.errors == []
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("calculator", {"expression": "123*456"}), ("python", {"code": "print(1)"})]
    assert turn.calls[0].raw.startswith("<tool_call>") and turn.calls[0].raw.endswith("</tool_call>")
    assert turn.content == "Let me compute."
    assert parser.parse("The answer is 4.").calls == [] and parser.parse("The answer is 4.").errors == []


@pytest.mark.parametrize("body, expected", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not valid JSON"),
    ('{"arguments": {"expression": "1+1"}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', 'no "name"'),
    ('{"name": "calculator", "arguments": ["1+1"]}', '"arguments" must be a JSON object'),
    ('{"name": "calculator", "arguments": "1+1"}', '"arguments" must be a JSON object'),
    ('["calculator"]', "must be a JSON object"),
])
def test_hermes_malformed_call_is_an_error_not_an_exception(body, expected):
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    turn = get_parser("hermes").parse(f"<tool_call>{body}</tool_call>{good}")
    assert len(turn.errors) == 1 and expected in turn.errors[0] and turn.errors[0].startswith("Error:")
    assert [c.arguments for c in turn.calls] == [{"expression": "2+2"}]  # the good one still runs


def test_hermes_unclosed_and_stray_tags_are_errors():
    parser = get_parser("hermes")
    unclosed = parser.parse('ok <tool_call>{"name": "calculator", "arguments": {}}')
    assert unclosed.calls == [] and "not closed" in unclosed.errors[0]
    stray = parser.parse('ok {"name": "calculator"}</tool_call>')
    assert stray.calls == [] and "without an opening" in stray.errors[0]


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(UserError, match=r"format='pythonic'.*use one of: hermes") as e:
        get_parser("pythonic")
    assert "\n" not in str(e.value) and set(PARSERS) == {"hermes"}


# ---- runner: every failure is an observation ----------------------------------------------

def test_unknown_tool_raising_tool_and_garbage_return_become_error_observations():
    r = runner()
    out = r.run([call("nope"), call("raises"), call("garbage"), call("garbage", kind="none"),
                 call("garbage", kind="dict"), call("sleepy", secs=1), call("calculator", expression="1+2")],
                ["Error: tool call 8 is not valid JSON"])
    assert out[0].startswith("Error: unknown tool 'nope'") and "calculator" in out[0]
    assert out[1] == "Error: tool 'raises' failed: RuntimeError: disk on fire"
    assert out[2:5] == [f"Error: tool 'garbage' returned {t}, not text" for t in ("bytes", "NoneType", "dict")]
    assert out[5].startswith("Error: tool 'sleepy' failed: TypeError")  # an argument call() does not take
    assert out[6] == "3" and out[7] == "Error: tool call 8 is not valid JSON"
    assert r.counters == ToolCounters(calls=8, errors=7, timeouts=0)


def test_hanging_tool_times_out_and_the_runner_keeps_working():
    r = runner(timeout_s=0.5)
    start = time.monotonic()
    handle = r.submit([call("hangs"), call("calculator", expression="6*7")])
    assert not r.poll(handle)  # non-blocking, and the hung call is not done
    out = r.results(handle)
    elapsed = time.monotonic() - start
    assert out == ["Error: tool 'hangs' timed out after 0.5 s", "42"]
    assert 0.45 <= elapsed < 1.5, elapsed
    assert r.poll(handle) and handle.counters == ToolCounters(calls=2, errors=1, timeouts=1)
    start = time.monotonic()  # a later call is not blocked by the abandoned thread
    assert r.run([call("calculator", expression="1+1")]) == ["2"]
    assert time.monotonic() - start < 1.0  # not the hung call's 0.5 s again, nor forever


def test_a_hung_tool_does_not_block_process_exit():
    script = textwrap.dedent("""
        import threading
        from engine.agents.parsers import ToolCall
        from engine.agents.runner import ToolRunner
        from engine.agents.tools import Tool
        class Hangs(Tool):
            name = "hangs"
            def call(self):
                threading.Event().wait()
        r = ToolRunner({"hangs": Hangs()}, timeout_s=0.2)
        print(r.run([ToolCall("hangs", {}, "")])[0], flush=True)
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "timed out after 0.2 s" in done.stdout
    assert time.monotonic() - start < 10


def test_calls_run_concurrently():
    r = runner()
    start = time.monotonic()
    handle = r.submit([call("sleepy", seconds=0.5)] * 3)
    assert not r.poll(handle) and time.monotonic() - start < 0.3  # submit does not wait
    assert r.results(handle) == ["slept 0.5"] * 3
    assert time.monotonic() - start < 1.2  # one after another: 1.5 s


def test_async_run_leaves_the_event_loop_free():
    import asyncio

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.02)
        task = asyncio.ensure_future(ticker())
        out = await runner().arun([call("sleepy", seconds=0.3)])
        task.cancel()
        return out, ticks
    out, ticks = asyncio.run(main())
    assert out == ["slept 0.3"] and ticks >= 5


@pytest.mark.parametrize("side, expected", [("left", "abcd" + MARKER), ("right", MARKER + "ghij"),
                                            ("middle", "ab" + MARKER + "ij")])
def test_truncation_keeps_the_configured_side(side, expected):
    assert truncate("abcdefghij", 4, side) == expected and truncate("abc", 4, side) == "abc"
    r = ToolRunner({"reverse": Echo()}, max_response_chars=4, truncate_side=side)
    assert r.run([call("reverse", text="abcdefghij")]) == [expected]


class Echo(Tool):
    name = "reverse"

    def call(self, text):
        return text


def test_runner_settings_are_checked():
    with pytest.raises(AgentConfigError, match="truncate_side='top'.*left, middle, right"):
        ToolRunner({}, truncate_side="top")
    assert ToolCounters(1, 2, 3) + ToolCounters(1, 1, 1) == ToolCounters(2, 3, 4)


# ---- built-in tools ------------------------------------------------------------------------

def test_calculator_is_exact_and_refuses_everything_but_arithmetic():
    assert calculate("123*456") == "56088"
    assert calculate("(987654321 * 123456789) - 7**3 // 2 % 5") == str(987654321 * 123456789 - 7**3 // 2 % 5)
    assert calculate("-2**3 + 7/2") == "-4.5"
    for bad, message in [("__import__('os').system('true')", "Call is not allowed"),
                         ("().__class__", "not allowed"), ("x + 1", "Name is not allowed"),
                         ("9**9**9", "more than 1000 digits"), ("2**100000", "more than 1000 digits"),
                         ("1/0", "division by zero"), ("2^3", "write **"), ("1e308*10", "not a finite"),
                         ("(" * 300 + "1" + ")" * 300, "Error"), ("1+", "not an arithmetic expression")]:
        out = calculate(bad)
        assert out.startswith("Error:") and message in out, (bad, out)
    assert BUILTINS["calculator"]().call(expression="2**10") == "1024"


def test_python_tool_runs_in_the_sandbox():
    tool = BUILTINS["python"]({"timeout_s": 5})
    assert tool.call(code="print(6*7)") == "42\n"
    out = tool.call(code="import sys\nprint('partial')\nsys.exit('boom')")
    assert out == "partial\n\nstderr:\nboom\n\nexit code 1"
    # the sandbox's network isolation reaches the tool's programs
    net = tool.call(code="import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)")
    assert "exit code 1" in net and "Error" in net


# ---- verl's tool config --------------------------------------------------------------------

def test_verl_tool_config_is_read_as_it_is():
    tools = load_tool_config(os.path.join(CONFIGS, "tools.yaml"))
    assert sorted(tools) == ["calculator", "code_interpreter", "reverse", "weather"]
    assert tools["code_interpreter"].schema["function"]["parameters"]["required"] == ["code"]
    assert tools["code_interpreter"].sandbox.timeout_s == 5  # verl's default_timeout
    assert tools["calculator"].schema["function"]["name"] == "calculator"
    assert tools["weather"].schema["function"]["description"] == "Today's weather in a city."
    out = ToolRunner(tools, timeout_s=10).run([
        call("reverse", word="abc"), call("weather", city="Oslo"), call("code_interpreter", code="print(1+1)")])
    assert out == ["CBA", "sunny in Oslo", "2\n"]


@pytest.mark.parametrize("text, message", [
    ("tools: {}", "top-level `tools:` list"),
    ("tools: [{class_name: nope.py:X}]", "tools[0]: class_name 'nope.py:X': no file"),
    ("tools: [{class_name: user_tools.py:Missing}]",
     "no class 'Missing' there (classes found: Reverse, Tool, Weather)"),
    ("tools: [{class_name: verl.tools.gsm8k_tool.Gsm8kTool}]", "module 'verl.tools.gsm8k_tool' cannot be imported"),
    ("tools: [{class_name: user_tools.py:Reverse, tool_schema: {type: function, function: {description: x}}}]",
     "tools[0]: tool_schema.function.name is missing; write tool_schema"),
    ("tools: [{class_name: calculator, config: {type: mcp}}]", "only native tools"),
    ("tools: [{class_name: calculator}, {class_name: calculator}]", "tools[1]: a second tool named 'calculator'"),
    ("tools: [{class_name: calculator, shema: {}}]", "unknown key(s) ['shema']"),
    ("tools: [{class_name: python, config: {memory_mb: 1}}]", "memory_mb"),
    ("tools: [{class_name: broken.py:X}]", "importing"),
    ("tools: [\n  - a\n b", "not valid YAML"),
])
def test_tool_config_errors_name_the_file_the_entry_and_the_fix(tmp_path, text, message):
    (tmp_path / "user_tools.py").write_text(open(os.path.join(CONFIGS, "user_tools.py")).read())
    (tmp_path / "broken.py").write_text("raise ImportError('no numpy here')\n")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(AgentConfigError) as e:
        load_tool_config(str(path))
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"tool config {path}") and message in str(e.value), str(e.value)


# ---- environments --------------------------------------------------------------------------

def test_verl_interaction_config_is_read_and_environments_play():
    specs = load_interactions(os.path.join(CONFIGS, "interactions.yaml"))
    assert sorted(specs) == ["echo", "guess"] and specs["guess"].config == {"secret": 7, "max_tries": 3}
    envs = EnvironmentRunner(timeout_s=5)
    game = specs["guess"].make()
    assert envs.reset(game, "q").observation == "Guess a number for: q"
    assert envs.step(game, "3")[:3] == ("higher", 0.0, False)
    assert envs.step(game, "7")[:3] == ("correct", 1.0, True)
    echo = specs["echo"].make()
    assert envs.reset(echo, "q").observation is None  # a plain class without reset
    assert envs.step(echo, "hi")[:3] == ("you said hi", 0.0, False)
    assert envs.counters.errors == 0 and envs.counters.steps == 3


class Broken(Environment):
    def step(self, action):
        if action == "raise":
            raise KeyError("state")
        if action == "hang":
            NEVER.wait()
        return {"tuple": ("obs", 1.0), "reward": ("obs", float("nan"), False), "obs": (3, 1.0, True),
                "done": ("obs", 1.0, "yes")}[action]


@pytest.mark.parametrize("action, message", [
    ("raise", "step failed: KeyError: 'state'"), ("hang", "step timed out after 0.3 s"),
    ("tuple", "not (observation, reward, done)"), ("reward", "not a finite number"),
    ("obs", "observation of type int"), ("done", "not a bool")])
def test_environment_errors_end_the_trajectory_with_an_error_observation(action, message):
    envs = EnvironmentRunner(timeout_s=0.3)
    start = time.monotonic()
    result = envs.step(Broken(), action)
    assert time.monotonic() - start < 1.3
    assert result.observation.startswith("Error: environment Broken") and message in result.observation
    assert (result.reward, result.done, result.error) == (0.0, True, True)
    assert envs.counters.errors == 1 and envs.counters.timeouts == (action == "hang")


def test_environment_loading_errors(tmp_path):
    with pytest.raises(AgentConfigError, match="interaction\\[0\\]: .*no step\\(action\\) method"):
        (tmp_path / "e.py").write_text("class E:\n    pass\n")
        (tmp_path / "i.yaml").write_text("interaction:\n  - {name: e, class_name: e.py:E}\n")
        load_interactions(str(tmp_path / "i.yaml"))
    spec = load_environment(f"{CONFIGS}/user_envs.py:GuessInteraction", {"secret": 1})
    assert spec.name == "guess"
    with pytest.raises(AgentConfigError, match="top-level `interaction:` list"):
        (tmp_path / "j.yaml").write_text("interactions: []\n")
        load_interactions(str(tmp_path / "j.yaml"))
