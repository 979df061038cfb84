"""One source of truth: every recipe key acts or is refused, names come from registries, verl's
aliases and arithmetic are read, and the code base keeps its shape (file sizes, no import circle)."""
import ast
import dataclasses
import os
import re
import typing

import pytest
import torch

from engine.config import ConfigError, load_config
from engine.config.load import field_types
from engine.config.schema import TridentConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")

# Keys accepted with one value only; any other is refused with a message (tested below).
REFUSED = {"actor_rollout_ref.hybrid_engine": (False, "only the colocated hybrid engine")}
# Where a key's value is read: the engine, minus the schema, its loading and its range checks.
NOT_READERS = ("engine/config/schema.py", "engine/config/rollout_correction.py", "engine/config/load.py",
               "engine/config/validate.py", "engine/config/validate_experience.py", "engine/config/verl.py",
               "engine/config/schema_sources.py", "engine/config/validate_sources.py")


def config_leaves(cls=TridentConfig, prefix=""):
    for name, tp in field_types(cls).items():
        key = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(tp):
            yield from config_leaves(tp, key)
        else:
            yield key


def _sources():
    out = {}
    for top in ("engine", "parallel", "kernels", "tools"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.relpath(os.path.join(dirpath, f), ROOT)
                if f.endswith(".py") and path not in NOT_READERS:
                    out[path] = open(os.path.join(ROOT, path)).read()
    return out


def test_every_schema_leaf_is_read_or_refused():
    """A key nobody reads is a bug: a new unused key fails here (its attribute name appears
    nowhere in the engine outside the schema), unless it is in REFUSED with a test."""
    sources = _sources()
    unread = []
    for key in config_leaves():
        if key in REFUSED:
            continue
        leaf = key.rsplit(".", 1)[-1]
        pattern = re.compile(r"\." + re.escape(leaf) + r"\b|[\"']" + re.escape(leaf) + r"[\"']")
        if not any(pattern.search(text) for text in sources.values()):
            unread.append(key)
    assert unread == []


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_refused_keys_say_so(key):
    value, message = REFUSED[key]
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, [f"{key}={str(value).lower() if isinstance(value, bool) else value}"])


def test_registry_names_are_the_allowed_values():
    from engine.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from engine.algorithms.losses import LOSS_AGG_MODES, POLICY_LOSSES
    from engine.config import schema
    from engine.rollout.registry import backend_names
    from kernels.kl import KL_KINDS

    assert set(typing.get_args(schema.AdvEstimator)) == set(ADVANTAGE_ESTIMATORS)
    assert set(typing.get_args(schema.PolicyLoss)) == set(POLICY_LOSSES) >= {"vanilla", "gspo"}
    assert set(typing.get_args(schema.LossAggMode)) == set(LOSS_AGG_MODES)
    assert set(typing.get_args(schema.KlEstimator)) == set(KL_KINDS)
    assert set(typing.get_args(schema.RolloutName)) == set(backend_names()) | {"auto"}
    assert set(schema.GROUP_ESTIMATORS) == {"grpo", "rloo", "reinforce_plus_plus_baseline"}
    with pytest.raises(ConfigError, match="'gae'"):  # the message lists the registry's names
        load_config(DEMO, ["algorithm.adv_estimator=ppo"])


def test_verl_aliases_and_arithmetic(caplog):
    with caplog.at_level("WARNING"):
        cfg = load_config(DEMO, ["data.use_sequence_packing=false",
                                 "actor_rollout_ref.actor.entropy_from_logits_with_chunking=false",
                                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096*3",
                                 "actor_rollout_ref.actor.optim.lr=1e-6*2"])
    assert cfg.actor_rollout_ref.model.use_remove_padding is False
    assert cfg.actor_rollout_ref.model.use_fused_kernels is False
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 12288
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(2e-6)
    assert "data.use_sequence_packing is verl's name" in caplog.text
    with pytest.raises(ConfigError, match="use // for integer division"):
        load_config(DEMO, ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096/3"])
    with pytest.raises(ConfigError, match="arithmetic like 4096"):
        load_config(DEMO, ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4k"])


def test_overlong_buffer_follows_dapo(tmp_path):
    """reward_model.overlong_buffer: -(len - (max_len - buffer)) / buffer x factor, never > 0."""
    from engine.config.schema import OverlongBufferConfig
    from engine.rewards.manager import RewardManager
    from engine.tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = OverlongBufferConfig(enable=True, len=4, penalty_factor=0.5)
    lengths = [2, 6, 7, 8]  # max 8, penalty from 4 tokens on
    mask = torch.tensor([[1] * n + [0] * (8 - n) for n in lengths])
    responses = torch.full((4, 8), tok.eos_token_id)
    on = RewardManager(tok, overlong=cfg, max_response_length=8)
    off = RewardManager(tok)
    args = dict(ground_truths=["x"] * 4, data_sources=["arith"] * 4)
    with_penalty, extra = on(responses, mask, **args)
    without, _ = off(responses, mask, **args)
    want = [min(-(n - (8 - 4)) / 4 * 0.5, 0.0) for n in lengths]
    assert extra["overlong_reward"] == pytest.approx(want)
    assert (with_penalty.sum(-1) - without.sum(-1)).tolist() == pytest.approx(want)
    with pytest.raises(ConfigError, match="overlong_buffer.len"):
        load_config(DEMO, ["reward_model.overlong_buffer.enable=true"])


def test_custom_reward_function_per_sample_and_batched(tmp_path):
    from engine.rewards.custom import load_custom_reward
    from engine.rewards.manager import RewardManager
    from engine.tasks import build_tokenizer

    path = tmp_path / "my_reward.py"
    path.write_text("CALLS = []\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    CALLS.append('one')\n"
                    "    return {'score': float(len(solution_str)), 'prompt': (extra_info or {}).get('raw_prompt')}\n"
                    "def batched(data_sources, solution_strs, ground_truths, extra_infos):\n"
                    "    CALLS.append('batch')\n"
                    "    return [10.0 * len(s) for s in solution_strs]\n")
    tok = build_tokenizer()
    responses = torch.tensor([tok.encode("12")[:2] + [tok.eos_token_id], tok.encode("3")[:1] + [0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    fn = load_custom_reward(str(path), "compute_score")
    naive = RewardManager(tok, compute_score=fn)
    lengths = [float(len(t)) for t in naive.decode(responses, mask)]
    scores, extra = naive(responses, mask, ground_truths=["", ""], data_sources=["any", "any"],
                          extra_infos=[{"raw_prompt": "p0"}, {"raw_prompt": "p1"}])
    assert scores.sum(-1).tolist() == lengths and extra["prompt"] == ["p0", "p1"]
    batch = RewardManager(tok, compute_score=load_custom_reward(str(path), "batched"), reward_manager="batch")
    got = batch(responses, mask, ground_truths=["", ""], data_sources=["a", "a"])[0].sum(-1).tolist()
    assert got == [10 * n for n in lengths]
    with pytest.raises(ValueError, match="custom_reward_function.name='nope'"):
        load_custom_reward(str(path), "nope")
    with pytest.raises(ConfigError, match="custom_reward_function.path"):
        load_config(DEMO, ["custom_reward_function.path=/no/such.py"])
    with pytest.raises(ConfigError, match="reward_manager"):
        load_config(DEMO, ["reward_model.reward_manager=batch"])


def test_no_engine_file_over_500_lines():
    long = {p: n for p, text in _sources().items() if p.startswith("engine/")
            and (n := text.count("\n")) > 500}
    assert long == {}


def _imports(text, modules):
    """Modules of this repository imported at module level (not inside functions); `from pkg
    import submodule` imports the submodule."""
    out = set()
    for node in ast.parse(text).body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in subs if n in modules] or [node.module]
        out |= {n for n in names if n in modules}
    return out


def test_import_graph_has_no_circle():
    modules = {}
    for path, text in _sources().items():
        if path.startswith("tools/"):
            continue
        name = path[:-3].replace("/", ".").removesuffix(".__init__")
        modules[name] = text
    graph = {m: _imports(t, modules) for m, t in modules.items()}
    state, cycle = {}, []

    def visit(m, stack):
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                cycle.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"
    for m in graph:
        if m not in state:
            visit(m, [m])
    assert cycle == []
    # the layering the design states: parallel knows nothing of engine, kernels nothing of either
    assert not any(i.startswith("engine") for m, deps in graph.items() if m.startswith("parallel") for i in deps)
    assert not any(i.split(".")[0] in ("engine", "parallel") for m, deps in graph.items()
                   if m.startswith("kernels") for i in deps)
