"""The vLLM adapter's contract, checked against vLLM's own source (it cannot run here).

The pinned wheel is downloaded without dependencies into .cache/, read as a zip and parsed
with ``ast`` (never imported). Every name in engine.rollout.vllm.USED_API must exist there, with
the keyword arguments, fields and values the adapter uses.
"""
import ast
import copy
import os
import zipfile

import pytest

from engine.rollout.vllm import USED_API, VLLM_VERSION
from tests.wheels import pinned_wheel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLM_PY = "vllm/entrypoints/llm.py"
SOURCES = {  # class -> the file that defines it
    "LLM": LLM_PY,
    "EngineArgs": "vllm/engine/arg_utils.py",
    "SamplingParams": "vllm/sampling_params.py",
    "TokensPrompt": "vllm/inputs/llm.py",
    "RequestOutput": "vllm/outputs.py",
    "CompletionOutput": "vllm/outputs.py",
    "Logprob": "vllm/logprobs.py",
}


def vllm_wheel() -> str:
    # the wheel is abi3: one platform's wheel has every platform's Python sources
    return pinned_wheel("vllm", VLLM_VERSION, "manylinux_2_28_x86_64", timeout_s=600)


class Wheel:
    """The wheel's Python files, parsed on demand."""

    def __init__(self, path):
        self.zip = zipfile.ZipFile(path)
        self.trees = {}

    def tree(self, path) -> ast.Module:
        if path not in self.trees:
            self.trees[path] = ast.parse(self.zip.read(path).decode("utf-8"), filename=path)
        return self.trees[path]

    def top(self, path, name):
        """The top-level class / def / assignment `name` in `path`, or None."""
        try:
            body = self.tree(path).body
        except KeyError:
            return None
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node
        return None

    def function(self, path, qualname):
        """'f' or 'Class.f' in `path`, or None."""
        owner, _, name = qualname.rpartition(".")
        body = self.top(path, owner).body if owner and self.top(path, owner) else None
        if not owner:
            return self.top(path, name)
        return next((n for n in body or [] if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == name), None)


def parameters(fn) -> tuple:
    """(named parameters, has **kwargs) of a def."""
    a = fn.args
    return {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}, a.kwarg is not None


def annotated_fields(cls: ast.ClassDef) -> set:
    """Annotated names of a class body: the fields of a dataclass, msgspec.Struct or TypedDict."""
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def string_constants(node) -> set:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def exported(wheel: Wheel) -> dict:
    """vllm/__init__.py's lazy exports: name -> 'module:attribute'."""
    node = wheel.top("vllm/__init__.py", "MODULE_ATTRS")
    return {k.value: v.value for k, v in zip(node.value.keys, node.value.values)} if node else {}


def contract_problems(wheel: Wheel, used: dict) -> list:
    """Every name in `used` (shaped like USED_API) that vLLM's source does not have."""
    problems = []
    exports = exported(wheel)
    for name in used["exports"]:
        module, _, attr = exports.get(name, ":").partition(":")
        path = "vllm/" + module.lstrip(".").replace(".", "/") + ".py"
        if name not in exports or wheel.top(path, attr) is None:
            problems.append(f"vllm.{name} is not exported by vllm/__init__.py")
    llm = wheel.top(LLM_PY, "LLM")
    for method, kwargs in used["LLM"].items():
        fn = wheel.function(LLM_PY, f"LLM.{method}") if llm else None
        if fn is None:
            problems.append(f"LLM.{method} does not exist")
            continue
        names, _ = parameters(fn)
        problems += [f"LLM.{method} has no parameter {k!r}" for k in kwargs if k not in names]
    init = wheel.function(LLM_PY, "LLM.__init__")
    if init is None or not parameters(init)[1] or "EngineArgs(" not in ast.unparse(init):
        problems.append("LLM.__init__ no longer passes **kwargs to EngineArgs")
    for cls in ("EngineArgs", "SamplingParams", "TokensPrompt", "CompletionOutput", "Logprob"):
        node = wheel.top(SOURCES[cls], cls)
        fields = annotated_fields(node) if node else set()
        problems += [f"{cls} has no field {k!r}" for k in used[cls] if k not in fields]
    request = wheel.function(SOURCES["RequestOutput"], "RequestOutput.__init__")
    assigned = {n.attr for n in ast.walk(request) if isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Store)} if request else set()
    problems += [f"RequestOutput has no attribute {k!r}" for k in used["RequestOutput"] if k not in assigned]
    for where, values in used["literals"].items():
        path, name = where.split(":")
        node = wheel.top(path, name)
        allowed = string_constants(node.value) if node is not None and "Literal" in ast.unparse(node.value) else set()
        problems += [f"{name} does not allow {v!r}" for v in values if v not in allowed]
    for where, values in used["constants"].items():
        path, name = where.split(":")
        node = wheel.top(path, name)
        have = string_constants(node.value) if node is not None else set()
        problems += [f"{name} has no {v!r}" for v in values if v not in have]
    for where, fragments in used["fragments"].items():
        path, qualname = where.split(":")
        try:
            fn = wheel.function(path, qualname)
        except KeyError:
            fn = None
        if fn is None:
            problems.append(f"{where} does not exist")
            continue
        text = ast.unparse(fn)
        problems += [f"{where} no longer has {f!r}" for f in fragments if f not in text]
    return problems


@pytest.fixture(scope="module")
def wheel():
    return Wheel(vllm_wheel())


def test_adapter_uses_only_names_that_exist_in_vllm(wheel):
    assert contract_problems(wheel, USED_API) == []


def test_checker_catches_wrong_names(wheel):
    broken = copy.deepcopy(USED_API)
    broken["exports"].append("Engine")
    broken["LLM"]["generate"].append("return_logprob")
    broken["LLM"]["update_weights_from_tensor"] = []
    broken["EngineArgs"].append("mem_fraction_static")
    broken["SamplingParams"].append("max_new_tokens")
    broken["TokensPrompt"].append("input_ids")
    broken["RequestOutput"].append("meta_info")
    broken["CompletionOutput"].append("output_token_logprobs")
    broken["Logprob"].append("token_id")
    broken["literals"]["vllm/config/model.py:LogprobsMode"].append("logprobs")
    broken["literals"]["vllm/model_executor/model_loader/__init__.py:LoadFormats"].append("dummy_dtensor")
    broken["constants"]["vllm/v1/executor/abstract.py:SLEEP_TAGS"].append("cuda_graph")
    broken["constants"]["vllm/v1/engine/__init__.py:FINISH_REASON_STRINGS"].append("eos")
    where = "vllm/v1/engine/parallel_sampling.py:ParentRequest._get_child_sampling_params"
    broken["fragments"][where] = ["seed + 1"]
    broken["fragments"]["vllm/v1/worker/gpu_worker.py:Worker.nowhere"] = []
    assert contract_problems(wheel, broken) == [
        "vllm.Engine is not exported by vllm/__init__.py",
        "LLM.generate has no parameter 'return_logprob'",
        "LLM.update_weights_from_tensor does not exist",
        "EngineArgs has no field 'mem_fraction_static'",
        "SamplingParams has no field 'max_new_tokens'",
        "TokensPrompt has no field 'input_ids'",
        "CompletionOutput has no field 'output_token_logprobs'",
        "Logprob has no field 'token_id'",
        "RequestOutput has no attribute 'meta_info'",
        "LogprobsMode does not allow 'logprobs'",
        "LoadFormats does not allow 'dummy_dtensor'",
        "FINISH_REASON_STRINGS has no 'eos'",
        "SLEEP_TAGS has no 'cuda_graph'",
        f"{where} no longer has 'seed + 1'",
        "vllm/v1/worker/gpu_worker.py:Worker.nowhere does not exist"]


def test_parsed_sets_are_not_trivially_small(wheel):
    # a parse that found nothing would make every check above vacuous
    engine_args = annotated_fields(wheel.top(SOURCES["EngineArgs"], "EngineArgs"))
    assert {"model", "tensor_parallel_size", "enable_sleep_mode"} <= engine_args and len(engine_args) > 100
    assert {"LLM", "SamplingParams", "TokensPrompt"} <= set(exported(wheel))
    assert len(string_constants(wheel.top("vllm/model_executor/model_loader/__init__.py", "LoadFormats").value)) > 5


def test_adapter_builds_exactly_the_declared_names():
    """What the adapter hands vLLM stays inside USED_API: LLM kwargs are LLM.__init__'s checked
    parameters or EngineArgs fields, sampling kwargs are SamplingParams fields."""
    from engine.rollout.base import SamplingParams
    from engine.rollout.vllm import llm_kwargs, sampling_kwargs

    kwargs = llm_kwargs("/m", max_model_len=4096, record_routing=True)
    assert set(kwargs) == set(USED_API["LLM"]["__init__"]) | set(USED_API["EngineArgs"])
    sampling = sampling_kwargs(SamplingParams(n=2, ignore_eos=True, seed=1), [2], seed=5)
    assert set(sampling) == set(USED_API["SamplingParams"])


def test_the_pin_agrees_with_setup_py():
    """setup.py's "gpu" extra installs the vLLM this contract was checked against."""
    from engine.rollout.vllm import VLLMRollout

    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    extras = next(kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "extras_require")
    gpu = next(v for k, v in zip(extras.keys, extras.values) if getattr(k, "value", None) == "gpu")
    assert f"vllm=={VLLM_VERSION}" in string_constants(gpu)
    assert f"vllm=={VLLM_VERSION}" in VLLMRollout.__doc__
