"""Loading a user's class: `path/to/file.py:ClassName` or `package.module.ClassName`.

A relative file path is looked up next to the config file that names it first, then in the
working directory. A file is imported once per absolute path (its module is named after the
path, so two files with the same name do not clash). Every failure (no such file, a syntax
error or exception while importing, no such class) is an AgentConfigError whose one line names
`where` (the config file and entry), the spec and the fix.

Tests: tests/test_agent_tools.py
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import threading

from engine.agents import AgentConfigError
from engine.errors import one_line

_LOCK = threading.Lock()


def _import_file(path: str, where: str, spec: str):
    name = "trident_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    with _LOCK:
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException as e:  # noqa: BLE001 - any failure in the user's module is theirs
            del sys.modules[name]
            raise AgentConfigError(f"{where}: importing {path!r} (from {spec!r}) failed: "
                                   f"{type(e).__name__}: {one_line(e)}; fix the file") from e
        return module


def load_class(spec: str, where: str, base_dir: str | None = None) -> type:
    """The class `spec` names. `where` starts every error line (e.g. "tools.yaml: tools[0]")."""
    if not isinstance(spec, str) or not spec.strip():
        raise AgentConfigError(f"{where}: class_name is missing; give `path/to/file.py:ClassName` "
                               "or `package.module.ClassName`")
    spec = spec.strip()
    if ":" in spec:
        file_part, _, cls_name = spec.rpartition(":")
        candidates = [file_part] if os.path.isabs(file_part) else \
            [os.path.join(base_dir, file_part)] * bool(base_dir) + [file_part]
        path = next((os.path.abspath(p) for p in candidates if os.path.isfile(p)), None)
        if path is None:
            raise AgentConfigError(f"{where}: class_name {spec!r}: no file {file_part!r} (looked in "
                                   f"{', '.join(repr(os.path.abspath(p)) for p in candidates)}); "
                                   "give an absolute path or one relative to the config file")
        module = _import_file(path, where, spec)
    else:
        module_name, _, cls_name = spec.rpartition(".")
        if not module_name:
            raise AgentConfigError(f"{where}: class_name {spec!r} is neither `file.py:ClassName` nor "
                                   "`package.module.ClassName`; write one of those")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise AgentConfigError(f"{where}: class_name {spec!r}: module {module_name!r} cannot be "
                                   f"imported ({one_line(e)}); install it, put it on PYTHONPATH, or use "
                                   "`path/to/file.py:ClassName`") from e
        except BaseException as e:  # noqa: BLE001
            raise AgentConfigError(f"{where}: importing {module_name!r} (from {spec!r}) failed: "
                                   f"{type(e).__name__}: {one_line(e)}; fix the module") from e
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_"))
        raise AgentConfigError(f"{where}: class_name {spec!r}: no class {cls_name!r} there "
                               f"(classes found: {', '.join(found) or 'none'}); name one of them")
    return cls


def config_entries(path: str, what: str, top: str, keys: tuple, config_key: str):
    """(base_dir, [(where, entry, config)]) of verl's YAML at `path` (a tool or interaction
    config): a top-level `top:` list of mappings with only `keys`, each `config` a mapping; every
    problem one AgentConfigError line naming the file and the entry (`config_key`: the recipe key
    that names the file)."""
    import yaml
    where = f"{what} config {path}"
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise AgentConfigError(f"{where}: cannot be read ({e.strerror}); fix {config_key}") from e
    except yaml.YAMLError as e:
        raise AgentConfigError(f"{where}: not valid YAML ({one_line(e)})") from e
    listed = ", ".join(keys)
    if not isinstance(data, dict) or not isinstance(data.get(top), list):
        raise AgentConfigError(f"{where}: expected a top-level `{top}:` list of entries with {listed}")
    entries = []
    for i, entry in enumerate(data[top]):
        at = f"{where}: {top}[{i}]"
        if not isinstance(entry, dict):
            raise AgentConfigError(f"{at} is not a mapping; write {' / '.join(keys)}")
        unknown = sorted(set(entry) - set(keys))
        if unknown:
            raise AgentConfigError(f"{at}: unknown key(s) {unknown}; use {listed}")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise AgentConfigError(f"{at}: config must be a mapping")
        entries.append((at, entry, config))
    return os.path.dirname(os.path.abspath(path)), entries
