"""rollout.name=vllm through the real trainer on 4 CPU ranks (training TP 2, rollout TP 2) against
the recording vLLM double (tests/fakes/vllm): an engine on every rank (SPMD, external_launcher),
each rank's TP worker loading every HF weight once per sync from its own copy, sleep / wake_up
following the memory schedule, generation every rank of a group makes together, with rollout
log-probs the training forward reproduces."""
import math
import os
import sys

import pytest

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKES = os.path.join(ROOT, "tests", "fakes")
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")


def _vllm_step(tmp):
    sys.path.insert(0, FAKES)
    try:
        import torch.distributed as dist
        import vllm
        from megatron.core import parallel_state as ps

        from engine.config import load_config
        from engine.train import build
        from engine.trainer import Trainer, set_seed
        from tests.test_rollout_groups import hf_names
        vllm.RECORDS.clear()
        cfg = load_config(DEMO, [
            "trainer.n_gpus_per_node=4", "trainer.logger=[]", "trainer.resume_mode=disable",
            "trainer.save_freq=-1", "trainer.test_freq=-1", f"trainer.default_local_dir={tmp}/ckpt",
            f"trainer.log_dir={tmp}/logs/{dist.get_rank()}", "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.on_policy_old_log_prob=false",  # the old-log-prob pass runs: the gap metric
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm"])
        set_seed(cfg.trainer.seed)
        derived, components = build(cfg, 4)
        t = Trainer(derived, components)
        built = len(vllm.RECORDS)
        t.colocated.record = True
        metrics = t.train_step(t.loader.next_batch())
        t.colocated.to_training()
        t.rollout.shutdown()
        return dict(records=list(vllm.RECORDS), built=built, log=list(t.colocated.log),
                    dp_rank=ps.get_data_parallel_rank(), hf_names=sorted(hf_names(t)),
                    diff_max=metrics["training/rollout_probs_diff_max"],
                    diff_mean=metrics["training/rollout_probs_diff_mean"])
    finally:
        sys.path.remove(FAKES)
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            sys.modules.pop(name)


def _memory_calls(log):
    """The vLLM calls the memory schedule's transitions ask of the adapter (engine/rollout/vllm.py):
    giving memory back sleeps (level 1) and wakes the weights again if they stay; taking a tag
    back wakes it, weights first. Starts released (engine/train.py's hand_back)."""
    held, calls = set(), []
    for entry in log:
        wanted = set(entry["rollout"])
        if held - wanted:
            calls.append(("sleep", 1))
            if "weights" in wanted:
                calls.append(("wake_up", ["weights"]))
        for tag in ("weights", "kv_cache"):
            if tag in wanted and tag not in held:
                calls.append(("wake_up", [tag]))
        held = wanted
    return calls


def test_vllm_through_the_trainer(tmp_path):
    results = run_on_ranks(_vllm_step, 4, str(tmp_path))
    names = results[0]["hf_names"]
    inits = [e for r in results for e in r["records"] if e["kind"] == "init"]
    # one engine on every rank (SPMD), TP groups the consecutive ranks, same arguments in a group
    assert [(e["rank"], e["args"]["tp_ranks"], e["args"]["tp_rank"]) for e in inits] == [
        (0, [0, 1], 0), (1, [0, 1], 1), (2, [2, 3], 0), (3, [2, 3], 1)]
    for e in inits:
        kw = e["args"]["kwargs"]
        assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "external_launcher"
        assert kw["enable_sleep_mode"] is True and kw["load_format"] == "dummy"
        assert kw["logprobs_mode"] == "processed_logprobs" and kw["seed"] == 0
        assert kw["max_model_len"] > 0 and kw["dtype"] in ("bfloat16", "float32", "float16")
    for r in results:
        records = r["records"]
        # built, then handed back (asleep) before training's models were built
        assert [e["kind"] for e in records[:r["built"]]] == ["init", "sleep"]
        step = records[r["built"]:]
        # every HF weight once per sync, into this rank's own worker, closed by reset_prefix_cache
        loads = [e for e in step if e["kind"] == "load_weights"]
        delivered = [n for e in loads for n in e["args"]["names"]]
        assert sorted(delivered) == names and len(set(delivered)) == len(delivered)
        tp_rank = r["records"][0]["args"]["tp_rank"]
        assert all(e["args"]["tp_rank"] == tp_rank for e in loads)
        assert sum(e["kind"] == "reset_prefix_cache" for e in step) == 1
        kinds = [e["kind"] for e in step]
        assert kinds.index("reset_prefix_cache") > max(i for i, k in enumerate(kinds) if k == "apply_model")
        # sleep / wake_up as the memory schedule moves the rollout's memory over the step
        memory = [(e["kind"], e["args"]["level"] if e["kind"] == "sleep" else e["args"]["tags"])
                  for e in step if e["kind"] in ("sleep", "wake_up")]
        assert memory == _memory_calls(r["log"]) and memory, (memory, r["log"])
        assert kinds.index("generate") < max(i for i, k in enumerate(kinds) if k == "sleep")
        assert kinds[-1] == "shutdown"
        # a TP worker keeps its shard: the column-parallel q_proj's rows halve
        q = next(n for n in names if n.endswith("q_proj.weight"))
        kept = next(e["args"]["kept"][q] for e in loads if q in e["args"]["kept"])
        full = next(e for e in results[0]["records"] if e["kind"] == "load_weights" and q in e["args"]["kept"])
        assert kept == full["args"]["kept"][q]  # same shard shape on every rank
    # both ranks of a group generated the same requests and responses; the groups split the prompts
    gens = {r_i: [e for e in r["records"] if e["kind"] == "generate"] for r_i, r in enumerate(results)}
    assert all(len(g) == 1 for g in gens.values())
    assert gens[0][0]["args"] == gens[1][0]["args"] and gens[2][0]["args"] == gens[3][0]["args"]
    assert gens[0][0]["args"]["prompts"] != gens[2][0]["args"]["prompts"]
    assert all(s is not None for s in gens[0][0]["args"]["seeds"])
    # the training forward reproduces the rollout's log-probs (finite, close)
    for r in results:
        assert math.isfinite(r["diff_max"]) and r["diff_max"] < 1e-4, r["diff_max"]


def test_a_keyword_vllm_does_not_take_is_refused():
    """LLM(**kwargs) passes what it does not take itself to the EngineArgs dataclass: an unknown
    name fails (vllm/entrypoints/llm.py); every name llm_kwargs sends is one the double takes."""
    from tests.doubles import double_on_path
    from engine.rollout.vllm import llm_kwargs
    with double_on_path("vllm"):
        import vllm
        with pytest.raises(TypeError, match="unexpected keyword argument 'enforce_eagerly'"):
            vllm.LLM(model="m", distributed_executor_backend="external_launcher", enforce_eagerly=True)
        from engine.rollout.vllm import USED_API
        sent = set(llm_kwargs("m", enforce_eager=True, enable_chunked_prefill=False, max_model_len=64))
        assert sent <= set(USED_API["LLM"]["__init__"]) | set(USED_API["EngineArgs"])
