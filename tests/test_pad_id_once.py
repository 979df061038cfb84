"""The pad id is decided once per run (engine.train.prepare: engine.data.pad_token_id) and
handed to everything that pads (Components.pad_id, the workers, the rollout engines); no other
module asks the tokenizer for it. tests/test_pad_token.py runs a whole step on that id."""
import ast
import os
import re

import engine.data
import engine.tasks
from engine.config import load_config
from engine.train import prepare
from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
# the only modules that ask the tokenizer
BUILDERS = {"engine/train.py", "engine/offline/build.py"}  # a PPO run's and a reward-model / DPO run's


def test_prepare_decides_the_pad_id_once(monkeypatch):
    calls = []
    decide = engine.data.pad_token_id
    monkeypatch.setattr(engine.data, "pad_token_id", lambda tok: calls.append(tok) or decide(tok))
    made = engine.tasks.build_tokenizer

    def without_pad():
        tok = made()
        tok.pad_token = None
        return tok
    monkeypatch.setattr(engine.tasks, "build_tokenizer", without_pad)
    prepared = prepare(load_config(DEMO, ["trainer.n_gpus_per_node=1"]), 1)
    assert len(calls) == 1 and prepared.pad_id == prepared.tokenizer.eos_token_id is not None


def test_only_the_builder_asks_the_tokenizer_for_the_pad_id():
    askers = set()
    for top in ("engine", "tools"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.relpath(os.path.join(dirpath, f), ROOT)
                text = open(os.path.join(ROOT, path)).read() if f.endswith(".py") else ""
                if re.search(r"(?<!def )\bpad_token_id\(", text):
                    askers.add(path)
    assert askers == BUILDERS
    # there: prepare, and build_rollout when no pad id is given (a pool rank, tests)
    tree = ast.parse(open(os.path.join(ROOT, "engine/train.py")).read())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "pad_token_id"]
    assert len(calls) == 2


def _rollout_with_pad(pad_id):
    from engine.config import derive
    from engine.loading import load_hf_config, load_tokenizer
    from engine.train import build_rollout

    def asked(tok):
        raise AssertionError("build_rollout asked the tokenizer although it was given the pad id")
    cfg = load_config(DEMO, ["trainer.n_gpus_per_node=1"])
    tok = load_tokenizer(cfg)
    d = derive(cfg, 1, dataset_len=1 << 30)
    hf_config = load_hf_config(cfg.actor_rollout_ref.model, vocab_size=len(tok))
    decide = engine.data.pad_token_id
    engine.data.pad_token_id = asked  # the worker process is shared by later tests: restore it
    try:
        rollout = build_rollout(d.config, d.rollout_topology, hf_config, tok, dp_rank=0, pad_id=pad_id)
    finally:
        engine.data.pad_token_id = decide
    try:
        return rollout.engine.pad_token_id
    finally:
        rollout.shutdown()


def test_the_rollout_engines_take_the_pad_id_they_are_given():
    assert run_on_ranks(_rollout_with_pad, 1, 7) == [7]
