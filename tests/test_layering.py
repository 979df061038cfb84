"""The code base's shape (issue 21): the layers' arrows only point down, no module reads the
trainer's attributes, no module imports another's private names, and every module says where
its tests are.

Layers, top to bottom (engine/, tools/, parallel/, kernels/; every module must be placed, so a
new one is placed on purpose):

    entry        engine.train, engine.launch_ray, tools
    loop         the trainers and their shell, checkpoints, validation, guards, loading
    experience   engine.experience (sources, the StepContext)
    config       engine.config (schema, load, validate, derive)
    workers / rollout
    models / algorithms / rewards / data / agents (and metrics, their shared vocabulary of names)
    support      batch, errors, faults, phase, perf, lazy_imports: small modules every layer uses
    parallel / kernels

An import inside a function counts as much as one at the top: a deferred upward import is still
an upward arrow.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = [
    ("entry", ("engine.train", "engine.launch_ray", "tools")),
    ("loop", ("engine.trainer", "engine.loop", "engine.offline", "engine.checkpoint", "engine.validation",
              "engine.guards", "engine.loading")),
    ("experience", ("engine.experience",)),
    ("config", ("engine.config",)),
    ("workers / rollout", ("engine.workers", "engine.rollout")),
    ("models / algorithms / rewards / data", ("engine.models", "engine.algorithms", "engine.rewards",
                                              "engine.data", "engine.tasks", "engine.metrics",
                                              "engine.agents")),
    ("support", ("engine.batch", "engine.errors", "engine.faults", "engine.phase", "engine.perf", "engine.profiler",
                 "engine.lazy_imports")),
    ("parallel / kernels", ("parallel", "kernels")),
]
PACKAGES = ("engine", "tools", "parallel", "kernels")


def _modules(packages=PACKAGES):
    out = {}
    for top in packages:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    out[name] = path
    return out


MODULES = _modules()
# The private-name check reads tests/ too (a test importing another test module's helper, or a
# tool's, breaks the rule as much as engine code does); tests are placed in no layer, so they
# stay out of MODULES and the layer checks.
CHECKED_FOR_PRIVATE_NAMES = _modules(PACKAGES + ("tests",))


def _layer(module):
    best = None
    for depth, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (depth, len(p))
    return None if best is None else best[0]


def _resolve(name, modules=MODULES):
    """The repository module `name` names (a module, or the module holding an imported name)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module, path, modules=MODULES, tree=None):
    """[(line, imported module, imported name)] of every import in the file, at any depth."""
    tree = ast.parse(open(path).read()) if tree is None else tree
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in modules else base, None if sub in modules else a.name))
    return out


def test_every_module_is_placed_in_a_layer():
    unplaced = sorted(m for m in MODULES if _layer(m) is None and m not in PACKAGES)
    assert unplaced == [], f"place these in LAYERS (tests/test_layering.py): {unplaced}"


def test_no_import_points_up_a_layer():
    upward = []
    for module, path in MODULES.items():
        mine = _layer(module)
        for line, target, _ in _imports(module, path):
            target = _resolve(target)
            if target is None or target in PACKAGES:
                continue
            theirs = _layer(target)
            if mine is not None and theirs is not None and theirs < mine:
                upward.append(f"{module}:{line} ({LAYERS[mine][0]}) -> {target} ({LAYERS[theirs][0]})")
    assert upward == []


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _private_uses(module, path, modules, source=None):
    """Another repository module's private names that `module` uses: imported (`from m import
    _x`, at any depth) or read off a module it imported (`m._x`, `pkg.m._x`)."""
    tree = ast.parse(open(path).read() if source is None else source)
    out, bound = [], {}  # bound: a local name -> the repository module it names
    for line, target, name in _imports(module, path, modules, tree):
        owner = _resolve(target, modules)
        if name and _private(name) and owner not in (None, module):
            out.append(f"{module}:{line} imports {target}.{name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                bound[local] = a.name if a.asname else local
        elif isinstance(node, ast.ImportFrom):
            for line, target, name in _imports(module, path, modules, ast.Module([node], [])):
                if name is None:  # `from pkg import submodule`
                    asname = next(a.asname for a in node.names if target.endswith("." + a.name))
                    bound[asname or target.rpartition(".")[2]] = target
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                owner = ".".join([bound[value.id], *reversed(chain)])
                if owner in modules and owner != module:
                    out.append(f"{module}:{node.lineno} reads {owner}.{node.attr}")
    return out


def test_no_module_imports_another_modules_private_names():
    """engine/, tools/, parallel/, kernels/ and tests/: no module imports another's `_name` or
    reads `module._name` off one it imported; a helper others use is public where it is defined."""
    private = []
    for module, path in CHECKED_FOR_PRIVATE_NAMES.items():
        private += _private_uses(module, path, CHECKED_FOR_PRIVATE_NAMES)
    assert private == []


def test_the_private_name_check_sees_tests_and_tools():
    planted = ("from tests.test_layouts import _weight_for, weight_for\n"
               "def f():\n    from tools.plan import _report\n"
               "from tools import plan as p\nimport engine.faults\nfrom . import multirank\n"
               "p._main([])\nengine.faults._where['step']\nmultirank._POOLS.clear()\n"
               "from engine.rollout.group import recv_object as _recv\n_recv.x\n")
    found = _private_uses("tests.test_planted", os.path.join(ROOT, "tests", "test_planted.py"),
                          CHECKED_FOR_PRIVATE_NAMES, source=planted)
    assert sorted(f.split(" ", 1)[1] for f in found) == [
        "imports tests.test_layouts._weight_for", "imports tools.plan._report",
        "reads engine.faults._where", "reads tests.multirank._POOLS", "reads tools.plan._main"]


def _trainer_reads(tree):
    """Attribute reads of a trainer object: a parameter or variable named `trainer` that is not
    the config's trainer section, or a name bound to `Trainer(...)` (calling its fit() is what
    the entry does)."""
    bound, reads = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            bound |= {a.arg for a in node.args.args + node.args.kwonlyargs if a.arg == "trainer"}
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "id", None) == "Trainer":
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                and node.attr != "fit":
            reads.append((node.lineno, f"{node.value.id}.{node.attr}"))
        if isinstance(node, ast.Attribute) and node.attr == "trainer" and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            reads.append((node.lineno, "self.trainer"))
    return reads


def test_no_module_but_the_trainer_reads_the_trainers_attributes():
    reads = []
    for module, path in MODULES.items():
        if module == "engine.trainer":
            continue
        reads += [f"{module}:{line} {what}" for line, what in _trainer_reads(ast.parse(open(path).read()))]
    assert reads == []


def test_the_trainer_check_sees_a_module_that_takes_the_trainer():
    planted = ast.parse("def collect(trainer, prompts):\n    return trainer._sampling()\n"
                        "def main(d, c):\n    t = Trainer(d, c)\n    t.fit()\n    return t.step_count\n")
    assert sorted(w for _, w in _trainer_reads(planted)) == ["t.step_count", "trainer._sampling"]


def test_every_module_names_its_tests():
    """A module's docstring ends with `Tests: tests/...` naming files that exist (a package's
    __init__ and tools' scripts included), so a reader finds a module's tests."""
    missing, gone = [], []
    for module, path in MODULES.items():
        doc = ast.get_docstring(ast.parse(open(path).read())) or ""
        lines = [ln for ln in doc.strip().splitlines() if ln.strip()]
        tail = " ".join(lines[-3:]) if lines else ""
        if "Tests:" not in tail:
            missing.append(module)
            continue
        named = tail.split("Tests:", 1)[1].replace(",", " ").split()
        gone += [f"{module}: {t}" for t in named if t.startswith("tests/")
                 and not os.path.exists(os.path.join(ROOT, t.rstrip(".")))]
    assert gone == []
    assert missing == [], f"{len(missing)} modules without a Tests: line"
