"""Rollout groups through the real trainer on CPU ranks: one engine per group (the recording
sglang double in tests/fakes, or the CPU backend), the weight hand-off inside a group, and
generation results routed to the DP replicas that train on them."""
import os
import sys

import pytest

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKES = os.path.join(ROOT, "tests", "fakes")
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")


def _trainer(world, overrides, tmp):
    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed
    import torch.distributed as dist

    cfg = load_config(DEMO, [
        f"trainer.n_gpus_per_node={world}", "trainer.logger=[]", "trainer.resume_mode=disable",
        "trainer.save_freq=-1", "trainer.test_freq=-1", f"trainer.default_local_dir={tmp}/ckpt",
        f"trainer.log_dir={tmp}/logs/{dist.get_rank()}", "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", *overrides])
    set_seed(cfg.trainer.seed)
    derived, components = build(cfg, world)
    return Trainer(derived, components)


def _sglang_groups(tmp):
    """4 ranks, training TP 2, rollout TP 2 through the sglang double: records per rank."""
    sys.path.insert(0, FAKES)
    try:
        import sglang
        sglang.RECORDS.clear()
        from megatron.core import parallel_state as ps
        t = _trainer(4, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                         "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                         "actor_rollout_ref.rollout.name=sglang"], tmp)
        prompts = t.loader.next_batch()
        metrics = t.train_step(prompts)  # sync, generate, train: the whole step
        t.ctx.sync_weights()                 # a second sync: every weight again, once
        batch = t.ctx.generate(prompts, t.ctx.sampling(train=True))
        t.colocated.to_training()
        t.rollout.shutdown()
        return dict(records=list(sglang.RECORDS), dp_rank=ps.get_data_parallel_rank(),
                    uids=list(batch["uid"]), indices=list(prompts.indices),
                    inputs=[list(x) for x in prompts.input_ids],
                    responses=batch["responses"].tolist(), mask=batch["response_mask"].tolist(),
                    grad_norm=metrics["actor/grad_norm"], route_bytes=t.rollout.route_bytes,
                    hf_names=sorted(hf_names(t)))
    finally:
        sys.path.remove(FAKES)
        sys.modules.pop("sglang", None)
        for name in [m for m in sys.modules if m.startswith("sglang.")]:
            sys.modules.pop(name)


def hf_names(trainer):
    from engine.models.weights import global_shapes, megatron_to_hf
    import torch
    return [n for name, shape in global_shapes(trainer.hf_config).items()
            for n, _ in megatron_to_hf(trainer.hf_config, name, torch.empty(shape, device="meta"))]


def test_one_sglang_engine_per_group_through_the_trainer(tmp_path):
    results = run_on_ranks(_sglang_groups, 4, str(tmp_path))
    inits = [(r["rank"], e["kwargs"]) for r in results for e in r["records"] if e["kind"] == "init"
             for r in [e]]
    # exactly two engines, on the leaders 0 and 2, placed on their own GPUs, tp_size 2
    assert [rank for rank, _ in inits] == [0, 2]
    assert [kw["base_gpu_id"] for _, kw in inits] == [0, 2]
    assert all(kw["tp_size"] == 2 and "node_rank" not in kw and kw["load_format"] == "dummy"
               for _, kw in inits)
    assert not any(e["kind"] != "init" and e["rank"] not in (0, 2) for r in results for e in r["records"])
    names = results[0]["hf_names"]
    for leader, group in ((0, [0, 1]), (2, [2, 3])):
        records = [e for e in results[leader]["records"]]
        syncs, current = [], None
        for e in records:
            if e["kind"] == "begin_weight_update":
                current = []
            elif e["kind"] == "update_weights_from_tensor":
                current += e["names"]
                # each TP worker reads the copy of its own rank of the group
                assert all(origin == group for origin in e["origins"]), e["origins"]
                assert e["flush_cache"] is False
            elif e["kind"] == "end_weight_update":
                syncs.append(current)
        assert len(syncs) == 2
        for delivered in syncs:  # every weight once per sync per engine
            assert sorted(delivered) == names and len(delivered) == len(set(delivered))
        assert sum(e["kind"] == "generate" for e in records) == 2
    # each DP replica trains on exactly its prompts, with the responses its group's engine made
    generated = {}
    for r in results:
        for e in r["records"]:
            if e["kind"] == "generate":
                generated.update({tuple(p): e["responses"][i * e["n"]:(i + 1) * e["n"]]
                                  for i, p in enumerate(e["prompts"])})
    for r in results:
        shard = slice(r["dp_rank"] * 4, (r["dp_rank"] + 1) * 4)
        assert r["uids"] == [u for u in r["indices"][shard] for _ in range(2)]
        for k, prompt in enumerate(r["inputs"][shard]):
            for j in range(2):
                row = 2 * k + j
                length = sum(r["mask"][row])
                assert r["responses"][row][:length] == generated[tuple(prompt)][j][:length]
    assert results[0]["grad_norm"] > 0


def _cpu_rollout_tp(rollout_tp, tmp):
    import torch.distributed as dist
    t = _trainer(2, [f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}"], tmp)
    prompts = t.loader.next_batch()
    barrier, barriers = dist.barrier, []  # the group of each barrier of the sync (None: the world)

    def counted(group=None, **kwargs):
        barriers.append(None if group is None else dist.get_world_size(group))
        return barrier(group=group, **kwargs)
    dist.barrier = counted
    try:
        t.ctx.sync_weights()
    finally:
        dist.barrier = barrier
    batch = t.ctx.generate(prompts, t.ctx.sampling(train=True))
    holds = t.rollout.engine is not None
    t.colocated.to_training()
    return dict(responses=batch["responses"].tolist(), logps=batch["rollout_log_probs"].tolist(),
                uids=list(batch["uid"]), holds_engine=holds, route_bytes=t.rollout.route_bytes,
                barriers=barriers)


def test_cpu_rollout_tp2_draws_the_same_responses_as_tp1(tmp_path):
    one = run_on_ranks(_cpu_rollout_tp, 2, 1, str(tmp_path))
    two = run_on_ranks(_cpu_rollout_tp, 2, 2, str(tmp_path))
    assert [r["holds_engine"] for r in one] == [True, True]
    assert [r["holds_engine"] for r in two] == [True, False]  # the member holds no rollout model
    # memory moves meet within the engine's group only: an engine per rank waits for no one,
    # a TP 2 engine's two ranks meet around each resume (weights, KV cache), never the world
    assert [r["barriers"] for r in one] == [[], []]
    assert [r["barriers"] for r in two] == [[2, 2, 2, 2]] * 2
    for a, b in zip(one, two):
        assert a["uids"] == b["uids"]
        assert a["responses"] == b["responses"]
        flat = lambda rows: [x for row in rows for x in row]  # noqa: E731
        assert flat(a["logps"]) == pytest.approx(flat(b["logps"]), abs=1e-5)


def _route_bytes(world, tmp):
    t = _trainer(world, ["actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                         "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                         "actor_rollout_ref.rollout.n=4"], tmp)
    prompts = t.loader.next_batch()
    t.ctx.sync_weights()
    t.ctx.generate(prompts, t.ctx.sampling(train=True))
    t.colocated.to_training()
    return t.rollout.route_bytes


def test_routing_traffic_per_rank_does_not_grow_with_the_world(tmp_path):
    two = run_on_ranks(_route_bytes, 2, 2, str(tmp_path))
    four = run_on_ranks(_route_bytes, 4, 4, str(tmp_path))
    # same global batch: a leader sends each replica only its share, so the most any rank moves
    # shrinks with more ranks (an all-gather of every response would give each rank the batch)
    assert max(two) > 0 and max(four) > 0
    assert max(four) <= max(two)
