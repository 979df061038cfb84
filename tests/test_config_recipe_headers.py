"""The commands a recipe's header tells the reader to run are accepted as written: a tool's
argument parser takes the flags (the tool's own parser, stopped right after parsing, so no data
is written), `-m engine.train RECIPE key=value` loads that recipe with those overrides, and a
`make` target exists in the Makefile."""
import argparse
import glob
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))
STARTS = ("python ", "torchrun ", "make ")


def header_commands(path):
    """The indented command lines of the leading comment block (`\\` continues a line)."""
    commands, pending = [], None
    for line in open(path, encoding="utf-8"):
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if pending is not None:
            pending += " " + text
        elif line[1:].startswith("  ") and text.startswith(STARTS):
            pending = text
        if pending is not None and not pending.endswith("\\"):
            commands.append(pending)
            pending = None
        elif pending is not None:
            pending = pending[:-1]
    return commands


def _words(command):
    # placeholders: "[key=value ...]" and "..." stand for what the reader adds
    command = re.sub(r"\[[^\]]*\]", " ", command)
    return [w for w in shlex.split(command, comments=True) if w != "..."]


class _Parsed(BaseException):
    """Raised by the patched parse_args once the tool's parser accepted the arguments."""


def _parses(tool, argv, monkeypatch, capsys):
    import importlib

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed()
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    module = importlib.import_module(f"tools.{tool}")
    try:
        rc = module.main(argv)
    except _Parsed:
        return None
    except SystemExit as e:
        rc = e.code
    return f"exit {rc}: {capsys.readouterr().err.strip()}"


def _check(words, monkeypatch, capsys):
    from engine.config import load_config
    if words[0] == "make":
        targets = re.findall(r"^([A-Za-z0-9_.-]+):", open(os.path.join(ROOT, "Makefile")).read(), re.M)
        missing = [t for t in words[1:] if "=" not in t and t not in targets]
        return f"no Makefile target {missing}" if missing else None
    if words[0] == "torchrun" or words[1:3] == ["-m", "engine.train"]:
        rest = words[words.index("engine.train") + 1:]
        load_config(os.path.join(ROOT, rest[0]), rest[1:])  # raises ConfigError when it would
        return None
    script = words[1]
    assert script.startswith("tools/") and script.endswith(".py"), script
    if not os.path.isfile(os.path.join(ROOT, script)):
        return f"{script} does not exist"
    return _parses(os.path.basename(script)[:-3], words[2:], monkeypatch, capsys)


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_header_commands_are_accepted(path, monkeypatch, capsys):
    bad = {}
    for command in header_commands(path):
        problem = _check(_words(command), monkeypatch, capsys)
        if problem:
            bad[command] = problem
    assert bad == {}


def test_header_reader_sees_the_commands_and_parse_failures():
    """The reader itself: it finds continued lines, and a flag the tool lacks is reported."""
    graded = header_commands(os.path.join(ROOT, "recipes", "tiny_rm_arith_graded.yaml"))
    assert any("--graded" in c and "--out-dir data/arith_pairs_graded" in c for c in graded)
    assert all(any(c.startswith(s) for s in STARTS) for r in RECIPES for c in header_commands(r))
    assert sum(len(header_commands(r)) for r in RECIPES) >= len(RECIPES)


def test_a_rejected_command_is_reported(monkeypatch, capsys):
    problem = _check(_words("python tools/prepare_data.py gsm8k"), monkeypatch, capsys)
    assert problem is not None and "unrecognized arguments: gsm8k" in problem
    assert _check(_words("python tools/prepare_data.py --builtin arith --out-dir x"), monkeypatch, capsys) is None
