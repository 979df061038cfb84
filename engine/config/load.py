"""Loading: YAML (1.2 floats) and dotted `key=value` overrides onto the typed schema.

Tests: tests/test_config.py, tests/test_config_keys.py, tests/test_config_paths.py
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import logging
import operator
import os
import difflib
import functools
import re
import typing
from typing import Any, Literal, Optional

import yaml

from engine.config import verl
from engine.config.schema import ALIASES, MOVED_KEYS, ConfigError, TridentConfig, join_key
from engine.config.validate import validate

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# YAML (with YAML 1.2 floats: PyYAML alone reads `1e-3` as a string)
# --------------------------------------------------------------------------------------------

_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


for _cls in (_Loader, _Dumper):  # the dumper needs it too, so it quotes strings like '1e-3'
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: not valid YAML{at}: {problem}; fix the syntax there") from None


def _read_recipe(path) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f"recipe {str(path)!r} does not exist; pass the path of a recipe YAML "
                          "file (e.g. recipes/tiny_cpu_demo.yaml)") from None
    except IsADirectoryError:
        raise ConfigError(f"recipe {str(path)!r} is a directory; pass a recipe YAML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"recipe {str(path)!r} is not UTF-8 text (byte {e.start}); pass a recipe "
                          "YAML file") from None


# --------------------------------------------------------------------------------------------
# Loading: mappings and overrides onto typed dataclasses
# --------------------------------------------------------------------------------------------

class _Loading:
    """What one load met besides values: a line per key that cannot be taken (`problems`) and a
    note per verl key read as, or ignored in favour of, what Trident does (`notes`)."""

    def __init__(self, root: TridentConfig):
        self.root, self.problems, self.notes = root, {}, {}

    def forget(self, key: str) -> None:
        """An override sets `key` again: what the file said about it (or below it) is gone."""
        for table in (self.problems, self.notes):
            for k in [k for k in table if k == key or k.startswith(key + ".")]:
                del table[k]

    def check(self) -> None:
        """Every key that cannot be taken, in one error: one line each (a recipe brought from verl
        has several such keys, and fixing them one run at a time costs a launch each); one
        problem keeps its plain one-line message."""
        lines = list(self.problems.values())
        if len(lines) == 1:
            raise ConfigError(lines[0])
        if lines:
            error = ConfigError(f"{len(lines)} keys of this recipe need changing, one per line:\n"
                                + "\n".join(f"  {line}" for line in lines))
            error.lines = lines  # engine/errors.py report() prints them one per line
            raise error

    def log_notes(self, keep: Optional[list] = None) -> None:
        if keep is not None:
            keep.extend(self.notes.values())
        else:
            log_notes(self.notes.values())


def log_notes(notes: typing.Iterable[str]) -> None:
    """The notes of a load (verl's keys read as Trident's, or ignored): one log line each, rank 0."""
    if os.environ.get("RANK", "0") == "0":  # one note per job, not per rank
        for note in notes:
            log.warning("%s", note)


def load_config(path: Optional[str] = None, overrides: typing.Sequence[str] = (),
                notes: Optional[list] = None) -> TridentConfig:
    """Defaults <- YAML file (if any) <- `a.b.c=value` overrides, then `validate`. The notes on
    verl's keys are logged, or appended to `notes` for the caller to log once its own checks pass
    (engine/train.py: a job that stops at a later check shows its error alone)."""
    cfg = TridentConfig()
    loading = _Loading(cfg)
    if path is not None:
        data = _parse_yaml(_read_recipe(path), str(path))
        if data is not None:
            _merge(cfg, data, "", loading)
    for override in overrides:
        apply_override(cfg, override, loading)
    loading.check()
    _expand_user(cfg)
    validate(cfg)
    loading.log_notes(notes)
    return cfg


def from_dict(data: dict) -> TridentConfig:
    """Build and validate a config from a nested mapping (missing keys take defaults)."""
    cfg = TridentConfig()
    loading = _Loading(cfg)
    _merge(cfg, data, "", loading)
    loading.check()
    _expand_user(cfg)
    validate(cfg)
    loading.log_notes()
    return cfg


_PATH_KEYS = ("path", "tokenizer_path", "train_files", "val_files", "default_local_dir",
              "resume_from_path", "log_dir")


def _expand_user(obj: Any) -> None:
    """`~/models/X` in a path key means the home directory, as in a shell (recipes use it)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _expand_user(value)
        elif f.name in _PATH_KEYS and isinstance(value, str):
            setattr(obj, f.name, os.path.expanduser(value))
        elif f.name in _PATH_KEYS and isinstance(value, list):
            setattr(obj, f.name, [os.path.expanduser(v) if isinstance(v, str) else v for v in value])


def to_dict(cfg: TridentConfig) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: TridentConfig) -> str:
    return yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def apply_override(cfg: TridentConfig, override: str, loading: Optional[_Loading] = None) -> None:
    """Set one `dotted.key=value` in place; the value is parsed as YAML (1e-3, true, [1,2], null).
    Alone (no `loading`), a key that cannot be taken raises at once."""
    key, sep, text = override.partition("=")
    key = key.strip().lstrip("+")  # verl/Hydra habit: `+key=value`; every key here is in the schema
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r} must look like section.key=value, "
                          f"e.g. actor_rollout_ref.actor.kl_loss_coef=0.002")
    value = _parse_yaml(text, f"override {override!r}")
    alone = loading is None
    loading = _Loading(cfg) if alone else loading
    loading.forget(ALIASES[key][0] if key in ALIASES else key)
    loading.forget(key)
    try:
        if verl.handles(key):
            _verl(key, value, loading)
        else:
            _set_path(cfg, key.split("."), value, "", loading)
    except ConfigError as e:
        loading.problems[key] = str(e)
    if alone:
        loading.check()
        loading.log_notes()


def _alias(key: str, loading: _Loading):
    """The schema path a verl alias stands for (engine.config.schema.ALIASES), with a note."""
    target, note = ALIASES[key]
    loading.notes[key] = f"config: {key} is verl's name; {note} (read as {target})"
    return target


def _verl(key: str, value: Any, loading: _Loading) -> None:
    """A verl key engine/config/verl.py answers for: read as Trident's key(s), noted, or refused."""
    for answer in verl.resolve(key, value, in_schema=key in all_keys()):
        if answer.kind == "refuse":
            loading.problems[answer.key] = answer.line
            continue
        if answer.line:
            loading.notes[answer.key] = answer.line
        for target in answer.targets or ((answer.key,) if answer.kind == "accept" else ()):
            try:
                _set_path(loading.root, target.split("."), answer.value, "", loading)
            except ConfigError as e:
                loading.problems[answer.key] = str(e)


def _merge(obj: Any, data: Any, prefix: str, loading: _Loading) -> None:
    """Each key's problem is recorded (`loading.problems`) and the rest read on."""
    if data is None:  # an empty YAML section (`critic:`) keeps its defaults
        return
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'the config'}={data!r}: expected a mapping of "
                          f"{type(obj).__name__} keys")
    for name, value in data.items():
        key = join_key(prefix, str(name))
        try:
            if key in ALIASES:
                _set_path(loading.root, _alias(key, loading).split("."), value, "", loading)
            elif verl.handles(key):
                _verl(key, value, loading)
            else:
                tp = _field_type(type(obj), str(name), key)
                if dataclasses.is_dataclass(tp):
                    _merge(getattr(obj, name), value, key, loading)
                else:
                    setattr(obj, name, _convert(value, tp, key))
        except ConfigError as e:
            loading.problems[key] = str(e)


def _set_path(obj: Any, parts: list[str], value: Any, prefix: str, loading: _Loading) -> None:
    name, rest = parts[0], parts[1:]
    key = join_key(prefix, name)
    if not prefix and ".".join(parts) in ALIASES:
        parts = _alias(".".join(parts), loading).split(".")
        name, rest, key = parts[0], parts[1:], parts[0]
    tp = _field_type(type(obj), name, key)
    if not rest:
        if dataclasses.is_dataclass(tp):
            _merge(getattr(obj, name), value, key, loading)
        else:
            setattr(obj, name, _convert(value, tp, key))
    elif dataclasses.is_dataclass(tp):
        _set_path(getattr(obj, name), rest, value, key, loading)
    elif _strip_optional(tp) is dict:  # free-form dicts (model.config, override_config) take sub-keys
        new = copy.deepcopy(getattr(obj, name)) or {}
        node = new
        for part in rest[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[rest[-1]] = value
        setattr(obj, name, new)
    else:
        raise ConfigError(f"{key} is a {_describe(tp)}, not a section: cannot set "
                          f"{join_key(key, '.'.join(rest))}; set {key}=VALUE")


@functools.cache
def field_types(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _field_type(cls: type, name: str, key: str) -> Any:
    hints = field_types(cls)
    if name not in hints:
        raise ConfigError(_unknown_key_message(key, cls))
    return hints[name]


@functools.cache
def all_keys() -> tuple[str, ...]:
    """Every dotted key of the schema (sections and leaves)."""
    out = []

    def walk(cls, prefix):
        for name, tp in field_types(cls).items():
            key = join_key(prefix, name)
            out.append(key)
            if dataclasses.is_dataclass(tp):
                walk(tp, key)
    walk(TridentConfig, "")
    return tuple(out)


def _unknown_key_message(key: str, cls: type) -> str:
    if key in MOVED_KEYS:
        return f"unknown config key {key!r}: in this engine it is {MOVED_KEYS[key]!r}"
    parent, _, leaf = key.rpartition(".")
    siblings = list(field_types(cls))
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return f"unknown config key {key!r}; did you mean {join_key(parent, close[0])!r}?"
    elsewhere = [k for k in all_keys() if k.rpartition(".")[2] == leaf]  # right name, wrong section
    if elsewhere:
        return f"unknown config key {key!r}; did you mean {' or '.join(repr(k) for k in elsewhere[:3])}?"
    # never the section's whole key list (30 names hide the one line that matters)
    return (f"unknown config key {key!r}: no key of that name in {parent or 'the top level'!r} nor "
            f"elsewhere; remove it (the keys: {cls.__name__} in engine/config/schema.py)")


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = _strip_optional(tp)
        return f"{_describe(inner)} or null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"list of {_describe(args[0])}"
    if tp is float:
        return "float (a number)"
    return getattr(tp, "__name__", str(tp))


_ARITHMETIC = re.compile(r"[0-9][0-9_.eE\s+\-*/()]*")


def _arithmetic(text: str, key: str, want: type):
    """`4096*3`-style integer (or float) arithmetic in a numeric key: + - * // / ( ) only."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Div: operator.truediv}

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        raise ValueError(node)
    try:
        result = ev(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        raise ConfigError(f"{key}={text!r}: not a number; write a number or integer arithmetic with "
                          f"+ - * // and parentheses, e.g. 4096*3") from None
    if want is int and not (isinstance(result, int) or float(result).is_integer()):
        raise ConfigError(f"{key}={text!r} = {result} is not an integer; use // for integer division")
    return int(result) if want is int else float(result)


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; ints become floats for float keys; `4096*3`
    arithmetic is evaluated for numeric keys."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (int, float) and isinstance(value, str) and _ARITHMETIC.fullmatch(value.strip()):
        return _arithmetic(value.strip(), key, tp)
    if tp is Any:
        return copy.deepcopy(value)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        return _convert(value, _strip_optional(tp), key)
    if value is None:
        raise ConfigError(f"{key}=null is not allowed: expected {_describe(tp)}")
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise ConfigError(f"{key}={value!r} is not allowed: use one of "
                          + ", ".join(repr(a) for a in args))
    if origin is list:
        if isinstance(value, str) and args[0] is str:
            value = [value]  # `data.train_files=a.parquet`
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} has the wrong type: expected {_describe(tp)}, "
                              f"got {type(value).__name__}; write a list like [a, b]")
        return [_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          dict: lambda v: isinstance(v, dict)}[tp]
    if not ok(value):
        numeric_text = tp in (int, float) and isinstance(value, str)
        hint = ("; quote it to make it a string" if tp is str else
                "; write a number (arithmetic like 4096*3 works)" if numeric_text else "")
        raise ConfigError(f"{key}={value!r} has the wrong type: expected {_describe(tp)}, "
                          f"got {type(value).__name__}{hint}")
    if tp is float:
        return float(value)
    return copy.deepcopy(value)


