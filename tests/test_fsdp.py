"""`strategy: fsdp2` (parallel/fsdp.py: Megatron-core's TorchFullyShardedDataParallel): the same
update as `strategy: megatron` at DP 2, with each rank holding half of the parameters; weights
read and written through the sharded layout (iter_global, load_global, the hybrid engine's
sync)."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from engine.config import load_config

from tests.multirank import run_on_ranks
from tests.test_layouts import weight_for
from tests.test_ppo_update import B, R, make_batch, make_configs
from tests.tiny_models import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERL = os.path.join(ROOT, "tests", "verl_configs", "qwen2_5_7b_gsm8k_fsdp2.yaml")
A, RO = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


def _update(strategy, role, tp=1, reshard_after_forward=True, forward_prefetch=False):
    from megatron.core import parallel_state as ps

    from engine.workers.actor import ActorWorker
    from engine.workers.critic import CriticWorker
    from parallel.fsdp import local
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global, load_global, local_shards

    init_mesh(Layout(tp=tp), seed=1)
    hf = tiny_config("llama")
    # distinct, asymmetric clips; several micro-batches accumulate into one step
    actor_cfg, critic_cfg, model_cfg = make_configs(clip_ratio_low=0.15, clip_ratio_high=0.3,
                                                    ppo_micro_batch_size_per_gpu=2)
    meg = dataclasses.replace(actor_cfg.megatron, reshard_after_forward=reshard_after_forward,
                              forward_prefetch=forward_prefetch)
    actor_cfg = dataclasses.replace(actor_cfg, strategy=strategy, megatron=meg)
    critic_cfg = dataclasses.replace(critic_cfg, strategy=strategy, megatron=meg)
    if role == "actor":
        worker = ActorWorker(hf, actor_cfg, model_cfg, response_length=R)
    else:
        worker = CriticWorker(hf, critic_cfg, model_cfg, response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n, shapes[n]))
    loaded = dict(iter_global(worker.chunks))  # what load_global stored, read back
    held = sum(local(p).numel() * local(p).element_size() for c in worker.chunks for p in c.parameters())

    batch = make_batch(hf.vocab_size)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = batch.index_select(list(range(rank * B // dp, (rank + 1) * B // dp)))
    worker.mini_batch_size_per_rank = len(mine)
    if role == "actor":
        first = worker.compute_log_prob(mine, micro_batch_size=3)
        mine["old_log_probs"] = first + mine["noise"] * mine["response_mask"]
        mine["ref_log_prob"] = first - 0.5 * mine["noise"] * mine["response_mask"]
        metrics = worker.update_policy(mine)
    else:
        first = worker.compute_values(mine, micro_batch_size=3)
        mine["values"] = first + mine["noise"] * mine["response_mask"]
        metrics = worker.update_critic(mine)
    return dict(rank=rank, first=first, metrics=metrics, held=held, units=_units(worker),
                loaded_ok=all(torch.equal(t, weight_for(n, t.shape)) for n, t in loaded.items()),
                weights=dict(iter_global(worker.chunks)))


def _units(worker):
    """What torch's FSDP received per layer unit: (reshards after forward, forward-prefetches)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.fsdp import FSDPModule
    out = []
    for m in worker.chunks[0].modules():
        if isinstance(m, FSDPModule) and isinstance(m, TransformerLayer):
            state = m._get_fsdp_state()
            group = state._fsdp_param_group
            out.append((group.post_forward_mesh_info is not None, len(state._states_to_forward_prefetch)))
    return out


def _compare(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


_FSDP2_ACTOR = []  # the default FSDP2 actor update at DP 2, read by two tests below


def _fsdp2_update(role):
    if role != "actor":
        return run_on_ranks(_update, 2, "fsdp2", role)
    if not _FSDP2_ACTOR:
        _FSDP2_ACTOR.append(run_on_ranks(_update, 2, "fsdp2", "actor"))
    return _FSDP2_ACTOR[0]


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_fsdp2_gives_megatrons_update_at_dp2_with_half_the_parameters(role):
    meg = run_on_ranks(_update, 2, "megatron", role)
    fsdp = _fsdp2_update(role)
    assert all(r["loaded_ok"] for r in fsdp)  # load_global wrote each rank's shard
    for m, f in zip(meg, fsdp):
        assert torch.allclose(m["first"], f["first"], atol=1e-6)  # forward before the update
        for key, value in m["metrics"].items():
            assert f["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        # the update moved the weights, and moved them the same way
        start = {n: weight_for(n, t.shape) for n, t in m["weights"].items()}
        assert _compare(m["weights"], start) > 1e-4
        assert _compare(m["weights"], f["weights"]) < 1e-5
        # DP 2: every parameter's rows split over the two ranks
        assert f["held"] * 2 == m["held"]
        assert f["units"] == [(True, 0)] * 4 and m["units"] == []


def test_fsdp_config_keys_reach_torchs_units_and_keep_the_update():
    """reshard_after_forward=false / forward_prefetch=true (verl's fsdp_config): each layer keeps
    its gathered weights until backward and prefetches the next one (the last: none)."""
    base = _fsdp2_update("actor")
    tuned = run_on_ranks(_update, 2, "fsdp2", "actor", 1, False, True)
    for b, t in zip(base, tuned):
        assert t["units"] == [(False, 1), (False, 1), (False, 1), (False, 0)]
        assert _compare(b["weights"], t["weights"]) < 1e-6


def _resume(tmp, saved_with, loaded_with, load_optimizer=True, dtype="float32"):
    """One step, save; a fresh worker (other weights) of `loaded_with` loads it, and both take
    the same second step (tests/test_checkpoint.py's resume, across strategies)."""
    from engine.checkpoint import CheckpointManager
    from parallel.mesh import Layout, init_mesh
    from tests.test_checkpoint import actor_weights, make_actor, ppo_step

    init_mesh(Layout(), seed=1)
    original = make_actor(strategy=saved_with, dtype=dtype)
    ppo_step(original, seed=3)
    manager = CheckpointManager(tmp)
    manager.save(1, {"actor": original}, dict(global_steps=1))
    at_save = actor_weights(original)
    ppo_step(original, seed=4)
    restored = make_actor(weight_salt="-other", strategy=loaded_with, dtype=dtype)
    try:
        manager.load(manager.resolve("auto"), {"actor": restored}, load_optimizer=load_optimizer)
    except Exception as e:  # noqa: BLE001 - the refusal's message is the result
        return dict(error=f"{type(e).__name__}: {e}")
    loaded = actor_weights(restored)
    ppo_step(restored, seed=4)
    return dict(at_save=at_save, loaded=loaded, continued=actor_weights(original),
                resumed=actor_weights(restored))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: Megatron's fp32 main copies
def test_an_fsdp2_checkpoint_resumes_exactly(tmp_path, dtype):
    for res in run_on_ranks(_resume, 2, str(tmp_path), "fsdp2", "fsdp2", dtype=dtype):
        assert "error" not in res, res.get("error")
        assert all(torch.equal(res["loaded"][n], t) for n, t in res["at_save"].items())
        assert all(torch.equal(res["resumed"][n], t) for n, t in res["continued"].items())


@pytest.mark.parametrize("saved_with, loaded_with", [("fsdp2", "megatron"), ("megatron", "fsdp2")])
def test_a_checkpoints_weights_cross_strategies_and_its_optimizer_state_is_refused(tmp_path, saved_with,
                                                                                 loaded_with):
    weights_only = run_on_ranks(_resume, 2, str(tmp_path / "a"), saved_with, loaded_with, False)
    for res in weights_only:
        assert "error" not in res, res.get("error")
        assert all(torch.equal(res["loaded"][n], t) for n, t in res["at_save"].items())
    for res in run_on_ranks(_resume, 2, str(tmp_path / "b"), saved_with, loaded_with):
        assert res["error"].startswith("CheckpointError: ") and "stored differently" in res["error"]
        assert f"saved with strategy {'megatron' if saved_with == 'megatron' else 'fsdp / fsdp2'}" in res["error"]


def _critic(strategy, salt=""):
    from engine.workers.critic import CriticWorker
    from parallel.shards import load_global, local_shards

    _, critic_cfg, model_cfg = make_configs()
    worker = CriticWorker(tiny_config("llama"), dataclasses.replace(critic_cfg, strategy=strategy),
                          model_cfg, response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n + salt, shapes[n]))
    return worker


def _critic_checkpoint(tmp):
    """The value head (split along hidden under fsdp2) and every other weight: fsdp2 -> fsdp2
    with the optimizer, fsdp2 -> megatron weights only."""
    from megatron.core import parallel_state as ps

    from engine.checkpoint import CheckpointManager
    from parallel.mesh import Layout, init_mesh
    from tests.test_checkpoint import actor_weights

    init_mesh(Layout(), seed=1)
    saved = _critic("fsdp2")
    batch = make_batch(saved.hf_config.vocab_size)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = batch.index_select(list(range(rank * B // dp, (rank + 1) * B // dp)))
    saved.mini_batch_size_per_rank = len(mine)
    mine["values"] = saved.compute_values(mine, micro_batch_size=3) + mine["noise"] * mine["response_mask"]
    saved.update_critic(mine)
    manager = CheckpointManager(tmp)
    manager.save(1, {"critic": saved}, dict(global_steps=1))
    out = dict(at_save=actor_weights(saved))
    for strategy, with_optimizer in (("fsdp2", True), ("megatron", False)):
        fresh = _critic(strategy, salt="-other")
        manager.load(manager.resolve("auto"), {"critic": fresh}, load_optimizer=with_optimizer)
        out[strategy] = actor_weights(fresh)
    return out


def test_a_critic_checkpoint_holds_the_value_head_whole_across_strategies(tmp_path):
    for res in run_on_ranks(_critic_checkpoint, 2, str(tmp_path)):
        assert "value_head.weight" in res["at_save"]
        for strategy in ("fsdp2", "megatron"):
            assert res[strategy].keys() == res["at_save"].keys()
            for name, tensor in res["at_save"].items():
                assert torch.equal(res[strategy][name], tensor), (strategy, name)


QWEN = os.path.join(ROOT, "recipes", "qwen2_5_7b_gsm8k_ppo.yaml")


def test_the_planner_divides_a_fully_sharded_model_over_dp():
    """Qwen2.5-7B on 8 GPUs at TP 2 (DP 4): the actor's weights, gradients and optimizer state per
    rank under fsdp2 against the written formula, next to megatron's (its distributed optimizer
    shards only the optimizer state)."""
    from tools.plan import estimate
    plans = {s: estimate(load_config(QWEN, [f"{A}.strategy={s}", "critic.strategy=megatron"]), 8,
                         gpu_mem_gib=80, device="cuda")["models"]["actor"]
             for s in ("megatron", "fsdp2")}
    meg, full = plans["megatron"], plans["fsdp2"]
    p, dp = meg["params"], 4
    assert full["params"] == p and full["strategy"] == "fsdp2"
    unit = full["weights"] - p * 2 / dp  # one unit gathered whole (bf16)
    assert 0 < unit < p * 2 / 8  # a layer or the vocabulary projection, far below the model
    assert meg["weights"] == p * 2 and meg["grads"] == p * 4
    assert full["grads"] == pytest.approx(p * 4 / dp + unit)
    assert full["optimizer"] == pytest.approx(meg["optimizer"]) == pytest.approx(12 * p / dp)


@pytest.mark.parametrize("overrides, key, fix", [
    ([f"{A}.megatron.pipeline_model_parallel_size=2"], f"{A}.megatron.pipeline_model_parallel_size",
     "without pipeline stages"),
    ([f"{A}.megatron.overlap_grad_reduce=true"], f"{A}.megatron.overlap_grad_reduce", "FSDP overlaps"),
    ([f"{A}.megatron.use_distributed_optimizer=false"], f"{A}.megatron.use_distributed_optimizer",
     "always shards the optimizer state"),
    (["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.ref.megatron.param_offload=false"],
     f"{A}.strategy", "LoRA adapters train under strategy megatron"),
    (["critic.megatron.overlap_param_gather=true"], "critic.megatron.overlap_param_gather", "FSDP overlaps"),
    ([f"{A}.megatron.fusions={{gradient_accumulation_fusion: true}}"],
     f"{A}.megatron.fusions.gradient_accumulation_fusion", "no gradient buffer to accumulate into"),
])
def test_what_fsdp2_does_not_run_with_is_refused_by_key(overrides, key, fix):
    from engine.config import ConfigError
    with pytest.raises(ConfigError) as info:
        load_config(VERL, [f"{RO}.name=cpu", "trainer.n_gpus_per_node=2", *overrides])
    assert str(info.value).startswith(key + "=") and fix in str(info.value)


def test_fsdp_only_keys_are_refused_under_megatron():
    from engine.config import ConfigError
    with pytest.raises(ConfigError, match=f"{A}.megatron.forward_prefetch=True: only read with {A}.strategy fsdp"):
        load_config(VERL, [f"{RO}.name=cpu", f"{A}.strategy=megatron", f"{A}.megatron.forward_prefetch=true"])


def test_the_verl_recipe_trains_two_steps_with_fsdp2_on_two_ranks(tmp_path):
    """tests/verl_configs' FSDP2 + vLLM recipe as written, with this machine's backend and ranks."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "engine.train", VERL, f"{RO}.name=cpu", "trainer.n_gpus_per_node=2",
           f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs",
           "trainer.logger=[console,jsonl]"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # both models updated, every figure finite
        assert r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))


@pytest.mark.slow  # 4 ranks, ~30 s; the DP 2 case above is the fast one
def test_fsdp2_with_tensor_parallel_gives_megatrons_update():
    meg = run_on_ranks(_update, 4, "megatron", "actor", 2)
    fsdp = run_on_ranks(_update, 4, "fsdp2", "actor", 2)
    for m, f in zip(meg, fsdp):
        assert torch.allclose(m["first"], f["first"], atol=1e-6)
        assert _compare(m["weights"], f["weights"]) < 1e-5
        assert f["held"] * 2 == m["held"]
