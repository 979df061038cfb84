"""The SGLang adapter's contract, checked against sglang's own source (it cannot run here).

The pinned wheel is downloaded without dependencies into .cache/, read as a zip and parsed
with ``ast`` (never imported). Every name in engine.rollout.sglang.USED_API must exist there.
"""
import ast
import copy
import sys
import zipfile

import pytest

from engine.rollout.sglang import SGLANG_VERSION, USED_API
from tests.wheels import pinned_wheel


ENGINE = "sglang/srt/entrypoints/engine.py"
SERVER_ARGS = "sglang/srt/server_args.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"
TOKENIZER_CONTROL = "sglang/srt/managers/tokenizer_control_mixin.py"


def sglang_wheel() -> str:
    return pinned_wheel("sglang", SGLANG_VERSION, "manylinux_2_34_x86_64")


class SglangSource:
    """Parsed modules of the wheel, by path."""

    def __init__(self, wheel_path):
        self.zip = zipfile.ZipFile(wheel_path)
        self.trees = {}

    def tree(self, path) -> ast.Module:
        if path not in self.trees:
            self.trees[path] = ast.parse(self.zip.read(path).decode("utf-8"), filename=path)
        return self.trees[path]

    def text(self, path) -> str:
        return self.zip.read(path).decode("utf-8")

    def class_def(self, path, name) -> ast.ClassDef:
        for node in self.tree(path).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise LookupError(f"class {name} not found in {path}")


def method_parameters(cls: ast.ClassDef, method: str):
    """(named parameters, has **kwargs) of ``cls.method``, or None when it is missing."""
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method:
            a = node.args
            names = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
            return names, a.kwarg is not None
    return None


def struct_fields(cls: ast.ClassDef) -> set:
    """Annotated class-body names: the fields of a dataclass / msgspec.Struct."""
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def server_args_fields(src: SglangSource) -> set:
    """ServerArgs fields: its own annotations plus those of every namespace listed in
    ``_INPUT_NAMESPACES`` (0.5.21 assembles the msgspec struct from them)."""
    tree = src.tree(SERVER_ARGS)
    fields = struct_fields(src.class_def(SERVER_ARGS, "ServerArgs"))
    imported_from = {alias.name: node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                     for alias in node.names}
    namespaces = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_INPUT_NAMESPACES" for t in node.targets):
            namespaces = [elt.id for elt in node.value.elts]
    for name in namespaces:
        path = imported_from[name].replace(".", "/") + ".py"
        fields |= struct_fields(src.class_def(path, name))
    return fields


def contract_problems(src: SglangSource, used_api: dict) -> list:
    """Every name in ``used_api`` that sglang's source does not have."""
    problems = []
    init = src.text("sglang/__init__.py")
    if "Engine" not in {n.id for n in ast.walk(ast.parse(init)) if isinstance(n, ast.Name)}:
        problems.append("sglang.Engine is not exported by sglang/__init__.py")
    engine = src.class_def(ENGINE, "Engine")
    for method, kwargs in used_api["Engine"].items():
        params = method_parameters(engine, method)
        if params is None:
            problems.append(f"Engine.{method} does not exist")
            continue
        names, _ = params
        problems += [f"Engine.{method} has no parameter {k!r}" for k in kwargs if k not in names]
    init_params = method_parameters(engine, "__init__")
    if init_params is None or not init_params[1]:
        problems.append("Engine.__init__ no longer takes **kwargs for ServerArgs")
    fields = server_args_fields(src)
    problems += [f"ServerArgs has no field {k!r}" for k in used_api["ServerArgs"] if k not in fields]
    sampling_fields = struct_fields(src.class_def(SAMPLING, "SamplingParams"))
    problems += [f"SamplingParams has no field {k!r}" for k in used_api["SamplingParams"] if k not in sampling_fields]
    manager_strings = {n.value for n in ast.walk(src.tree(TOKENIZER_MANAGER))
                       if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    problems += [f"meta_info key {k!r} is never written by the tokenizer manager"
                 for k in used_api["meta_info"] if k not in manager_strings]
    for module, names in used_api["imports"].items():
        defined = module_names(src, module)
        if defined is None:
            problems.append(f"module {module} does not exist")
            continue
        problems += [f"{module} has no {n!r}" for n in names if n not in defined]
    lst = src.class_def("sglang/srt/model_executor/model_runner_components/weight_updater.py",
                        "LocalSerializedTensor")
    problems += [f"LocalSerializedTensor has no field {k!r}" for k in used_api["LocalSerializedTensor"]
                 if k not in struct_fields(lst)]
    constants = {n.value for n in ast.walk(src.tree("sglang/srt/constants.py"))
                 if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    problems += [f"memory tag {k!r} is not one of sglang's GPU memory types"
                 for k in used_api["memory_tags"] if k not in constants]
    problems += success_problems(src, used_api["returns_success"])
    problems += update_group_problems(src, used_api["update_group"])
    problems += pause_problems(src, used_api)
    problems += fragment_problems(src, used_api["routed_experts"])
    problems += fragment_problems(src, used_api["fp8"])
    problems += fragment_problems(src, used_api["finish_reasons"])
    problems += fragment_problems(src, used_api["sharded_load"])
    problems += fragment_problems(src, used_api["event_loop"])
    engine_strings = {n.value for n in ast.walk(src.tree(ENGINE))
                      if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    problems += [f"environment variable {k!r} is never read by the engine"
                 for k in used_api["env"] if k not in engine_strings]
    return problems


def _function(src: SglangSource, path: str, qualname: str):
    """The def of ``qualname`` ('f' or 'Class.f') in ``path``, or None."""
    body = src.tree(path).body
    *owner, name = qualname.split(".")
    if owner:
        try:
            body = src.class_def(path, owner[0]).body
        except LookupError:
            return None
    return next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None)


def success_problems(src: SglangSource, methods) -> list:
    """Engine.m must return the tokenizer manager's m, annotated -> Tuple[bool, str]."""
    problems = []
    for m in methods:
        engine = _function(src, ENGINE, f"Engine.{m}")
        calls = {n.func.attr for n in ast.walk(engine) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute)} if engine else set()
        manager = _function(src, TOKENIZER_CONTROL, f"TokenizerControlMixin.{m}")
        returns = ast.unparse(manager.returns) if manager is not None and manager.returns else ""
        if m not in calls or returns.replace(" ", "") != "Tuple[bool,str]":
            problems.append(f"Engine.{m} does not answer (success, message)")
    return problems


def update_group_problems(src: SglangSource, functions: dict) -> list:
    problems = []
    for where, names in functions.items():
        path, qualname = where.split(":")
        node = _function(src, path, qualname)
        if node is None:
            problems.append(f"{where} does not exist")
            continue
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        used |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        problems += [f"{where} no longer uses {n!r}" for n in names if n not in used]
    return problems


def fragment_problems(src: SglangSource, functions: dict) -> list:
    """"file:Class.function" -> source fragments its unparsed body must contain (a shape rule)."""
    problems = []
    for where, fragments in functions.items():
        path, qualname = where.split(":")
        node = _function(src, path, qualname)
        text = ast.unparse(node) if node is not None else ""
        problems += [f"{where} no longer has {f!r}" for f in fragments if f not in text]
    return problems


def pause_problems(src: SglangSource, used_api: dict) -> list:
    """The pause / continue requests' fields, the pause mode among the Literal of `mode`, and
    where they act (partial rollouts: SGLangRollout.abort_requests / continue_generation)."""
    path = "sglang/srt/managers/io_struct.py"
    problems = []
    for name, fields in used_api["pause_requests"].items():
        try:
            cls = src.class_def(path, name)
        except LookupError:
            problems.append(f"{path} has no {name}")
            continue
        problems += [f"{name} has no field {f!r}" for f in fields if f not in struct_fields(cls)]
        if name == "PauseGenerationReqInput":
            mode = next((n for n in cls.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "mode"),
                        None)
            if mode is None or repr(used_api["pause_mode"]) not in ast.unparse(mode.annotation):
                problems.append(f"PauseGenerationReqInput.mode takes no {used_api['pause_mode']!r}")
    return problems + fragment_problems(src, used_api["partial_rollouts"])


def module_names(src: SglangSource, module: str):
    """Top-level names a module defines or imports (None when the module is not in the wheel)."""
    base = module.replace(".", "/")
    for path in (base + ".py", base + "/__init__.py"):
        try:
            tree = src.tree(path)
        except KeyError:
            continue
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        return names
    return None


@pytest.fixture(scope="module")
def source():
    return SglangSource(sglang_wheel())


def test_adapter_uses_only_names_that_exist_in_sglang(source):
    assert contract_problems(source, USED_API) == []


def test_checker_catches_wrong_names(source):
    broken = copy.deepcopy(USED_API)
    broken["Engine"]["generate"].append("return_log_prob")
    broken["Engine"]["update_weights_from_tensors"] = []
    broken["ServerArgs"].append("gpu_memory_utilization")
    broken["SamplingParams"].append("seed")
    broken["meta_info"].append("output_logprobs")
    broken["imports"]["sglang.srt.utils.common"].append("LocalSerializedTensor")
    broken["imports"]["sglang.srt.weight_sync.nowhere"] = ["x"]
    broken["LocalSerializedTensor"].append("tensors")
    broken["memory_tags"].append("kvcache")
    broken["env"].append("SGLANG_BLOCK_NONZERO_CHILDREN")
    broken["returns_success"].append("flush_cache")  # sglang's flush_cache answers otherwise
    broken["update_group"]["sglang/srt/utils/common.py:init_custom_process_group"].append("HashStore")
    broken["update_group"]["sglang/srt/utils/common.py:init_update_group"] = []
    broken["routed_experts"]["sglang/srt/state_capturer/base.py:BaseTopkCapturer.get_topk"] = ["[start_len:seqlen]"]
    problems = contract_problems(source, broken)
    assert problems == ["Engine.generate has no parameter 'return_log_prob'",
                        "Engine.update_weights_from_tensors does not exist",
                        "ServerArgs has no field 'gpu_memory_utilization'",
                        "SamplingParams has no field 'seed'",
                        "meta_info key 'output_logprobs' is never written by the tokenizer manager",
                        "sglang.srt.utils.common has no 'LocalSerializedTensor'",
                        "module sglang.srt.weight_sync.nowhere does not exist",
                        "LocalSerializedTensor has no field 'tensors'",
                        "memory tag 'kvcache' is not one of sglang's GPU memory types",
                        "Engine.flush_cache does not answer (success, message)",
                        "sglang/srt/utils/common.py:init_custom_process_group no longer uses 'HashStore'",
                        "sglang/srt/utils/common.py:init_update_group does not exist",
                        "sglang/srt/state_capturer/base.py:BaseTopkCapturer.get_topk no longer has "
                        "'[start_len:seqlen]'",
                        "environment variable 'SGLANG_BLOCK_NONZERO_CHILDREN' is never read by the engine"]


def test_server_args_fields_are_read_from_the_namespaces(source):
    # the assembled field set is large; a parse that found only ServerArgs' own body would not be
    fields = server_args_fields(source)
    assert {"model_path", "tp_size", "mem_fraction_static", "log_level"} <= fields and len(fields) > 100


def test_adapter_builds_exactly_the_declared_arguments():
    from engine.rollout.base import SamplingParams
    from engine.rollout.sglang import engine_kwargs, parse_result, sampling_dict

    placement = dict(nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:4000")
    kwargs = engine_kwargs("/m", "bfloat16", "dummy", 16, 0.6, 4096, 0, False, False, max_num_seqs=256,
                           base_gpu_id=0, placement=placement)
    assert sorted(kwargs) == sorted(USED_API["ServerArgs"])
    assert kwargs["mem_fraction_static"] == 0.6 and kwargs["tp_size"] == 16
    assert kwargs["max_running_requests"] == 256 and kwargs["node_rank"] == 1
    assert kwargs["chunked_prefill_size"] == 4096 and kwargs["enable_memory_saver"] is True
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        engine_kwargs("/m", "bfloat16", "dummy", 1, 1.5, 4096, 0, False, False)
    params = sampling_dict(SamplingParams(n=2, temperature=0.7, top_k=5, max_new_tokens=9, seed=3,
                                          stop_token_ids=(7,)), eos_token_ids=[2], seed=3)
    # the sampling's own seed is not sent: sglang reads sampling_seed only in deterministic mode
    assert "sampling_seed" not in sampling_dict(SamplingParams(seed=3), [2])
    assert sorted(params) == sorted(set(USED_API["SamplingParams"]) - {"ignore_eos"})
    assert sampling_dict(SamplingParams(ignore_eos=True), [2])["ignore_eos"] is True
    assert params["stop_token_ids"] == [2, 7] and params["sampling_seed"] == 3
    assert sampling_dict(SamplingParams(do_sample=False, temperature=0.7), [2])["temperature"] == 0.0

    import base64
    import numpy as np
    routing = np.arange(4 * 3 * 2, dtype=np.int32)  # 3 prompt + 2 response tokens -> 4 positions
    result = {"meta_info": {"output_token_logprobs": [(-0.5, 11, None), (-1.5, 2, None)],
                            "finish_reason": {"type": "stop", "matched": 2},
                            "routed_experts": base64.b64encode(routing.tobytes()).decode()}}
    tokens, logps, finish, routed = parse_result(result, prompt_len=3, routing_top_k=2)
    assert (tokens, logps, finish) == ([11, 2], [-0.5, -1.5], "stop")
    assert routed.shape == (4, 3, 2) and routed.flatten().tolist() == routing.tolist()
    # one row per hidden layer (dense ones included): a model of another depth is refused
    assert parse_result(result, prompt_len=3, routing_top_k=2, routing_layers=3)[3].shape == (4, 3, 2)
    with pytest.raises(ValueError, match="4 hidden layers"):
        parse_result(result, prompt_len=3, routing_top_k=2, routing_layers=4)


def test_update_group_sender_uses_torch_names_that_exist():
    """The sender's end of the weight-update group (engine/rollout/update_group.py) against the
    installed torch: the names, the group constructor's parameters, and the environment variable
    that turns torch's tcp:// rendezvous into torchrun's agent store."""
    import importlib
    import inspect

    from engine.rollout.update_group import AGENT_STORE_ENV, TORCH_API
    for module in ("torch.distributed", "torch.distributed.distributed_c10d"):
        mod = importlib.import_module(module)
        assert [n for n in TORCH_API[module] if not hasattr(mod, n)] == [], module
    helper = importlib.import_module("torch.distributed.distributed_c10d")._new_process_group_helper
    assert set(TORCH_API["_new_process_group_helper"]) <= set(inspect.signature(helper).parameters)
    assert AGENT_STORE_ENV in inspect.getsource(sys.modules["torch.distributed.rendezvous"])


def test_fp8_parameters_are_checked_against_the_wheel(source):
    """The FP8 linears' parameters the double expects (tests/fakes/sglang/srt/layers/quantization/
    fp8.py) are read from sglang's own Fp8LinearMethod; a renamed scale would be reported."""
    assert contract_problems(source, USED_API) == []
    broken = copy.deepcopy(USED_API)
    where = "sglang/srt/layers/quantization/fp8.py:Fp8LinearMethod.create_fp8_weight_"
    broken["fp8"][where] = ["register_parameter('weight_scale', scale_inv)"]
    assert contract_problems(source, broken) == [
        f"{where} no longer has \"register_parameter('weight_scale', scale_inv)\""]
