"""The memory schedule (engine/config/phases.py): the rules, the trainer executing it (resident
bytes of each model measured in every phase of real steps), and the planner reading it."""
import os

import pytest

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
GAE = ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4",
       "actor_rollout_ref.actor.use_kl_loss=true"]
OFFLOAD = ["actor_rollout_ref.actor.megatron.param_offload=true",
           "actor_rollout_ref.actor.megatron.optimizer_offload=true",
           "critic.megatron.grad_offload=true", "critic.megatron.optimizer_offload=true",
           "actor_rollout_ref.ref.megatron.param_offload=true"]


def _derive(overrides):
    from engine.config import derive, load_config
    return derive(load_config(DEMO, list(overrides)), 2, dataset_len=1024)


def test_schedule_rules():
    s = _derive(GAE + OFFLOAD).phases
    assert set(s.models) == {"actor", "critic", "ref"}
    # a model's offloaded states come back only where it runs; the rest stays everywhere
    assert s.resident("gen", "actor") == {"grads"}
    assert s.resident("update_weights", "actor") == {"params", "grads"}  # params: the weights are sent
    assert s.resident("update_actor", "actor") == {"params", "grads", "optimizer"}
    assert s.resident("old_log_prob", "actor") == {"params", "grads"}
    assert s.resident("gen", "critic") == {"params"}
    assert s.resident("update_critic", "critic") == {"params", "grads", "optimizer"}
    assert s.resident("values", "critic") == {"params"}
    assert s.resident("ref", "ref") == {"params"} and s.resident("update_actor", "ref") == set()
    assert s.resident("save_checkpoint", "critic") == {"params", "grads", "optimizer"}
    # the rollout: weights for the sync, KV cache only once they are in, nothing while training
    assert s.rollout("update_weights") == {"weights"} and s.rollout("gen") == {"weights", "kv_cache"}
    assert s.rollout("update_actor") == set()
    keep = _derive(GAE + ["actor_rollout_ref.rollout.free_cache_engine=false"]).phases
    assert keep.rollout("update_actor") == {"weights", "kv_cache"}
    none = _derive([]).phases  # nothing offloaded: every state everywhere
    assert all(none.resident(p, "actor") == {"params", "grads", "optimizer"} for p in ("gen", "ref"))


def test_planner_reads_the_same_schedule():
    from tools.plan import estimate

    def plan(extra):
        from engine.config import load_config
        return estimate(load_config(DEMO, GAE + extra), 2, gpu_mem_gib=16, device="cpu")

    kept, off = plan([]), plan(["actor_rollout_ref.actor.megatron.param_offload=true"])
    actor = kept["models"]["actor"]
    # the actor's parameters leave for generation in both the trainer's schedule and the plan
    assert kept["schedule"]["gen"]["actor"] == ["grads", "optimizer", "params"]
    assert off["schedule"]["gen"]["actor"] == ["grads", "optimizer"]
    assert kept["phases"]["gen"] - off["phases"]["gen"] == pytest.approx(actor["weights"])
    assert off["schedule"] == _derive(GAE + ["actor_rollout_ref.actor.megatron.param_offload=true"]).phases.table()
    assert kept["peak_phase"] in kept["phases"] and set(kept["phases"]) >= {"update_weights", "gen", "update_actor"}


def _measured_phases(overrides, tmp):
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed

    cfg = load_config(DEMO, [
        "trainer.logger=[]", "trainer.resume_mode=disable", "trainer.save_freq=-1", "trainer.test_freq=-1",
        f"trainer.default_local_dir={tmp}/ckpt", f"trainer.log_dir={tmp}/logs/{dist.get_rank()}",
        "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", *overrides])
    set_seed(cfg.trainer.seed)
    derived, components = build(cfg, 2)
    t = Trainer(derived, components)
    t.colocated.record = True
    full = {name: w.resident_bytes() for name, w in t.colocated.workers.items()}
    for _ in range(2):
        t.train_step(t.loader.next_batch())
    t.validate()
    t.colocated.enter("save_checkpoint")
    return dict(log=t.colocated.log, full=full, table=derived.phases.table())


def test_trainer_executes_the_schedule(tmp_path):
    every_phase = ["actor_rollout_ref.actor.on_policy_old_log_prob=false"]  # old_log_prob runs too
    for rank, res in enumerate(run_on_ranks(_measured_phases, 2, GAE + OFFLOAD + every_phase, str(tmp_path))):
        phases = [e["phase"] for e in res["log"]]
        assert phases[:8] == ["update_weights", "gen", "reward", "old_log_prob", "ref", "values",
                              "update_critic", "update_actor"]
        assert {"testing", "save_checkpoint"} <= set(phases)
        for entry in res["log"]:
            want = res["table"][entry["phase"]]
            assert entry["rollout"] == want["rollout"], entry["phase"]
            for model, measured in entry["models"].items():
                for state, nbytes in measured.items():
                    full = res["full"][model][state]
                    if state in want[model]:
                        assert nbytes == full > 0 or full == 0, (entry["phase"], model, state)
                    else:
                        assert nbytes == 0, (rank, entry["phase"], model, state, nbytes)
        # the offload switches really freed something in the generate phase
        gen = next(e for e in res["log"] if e["phase"] == "gen")["models"]
        assert gen["actor"]["params"] == 0 and res["full"]["actor"]["params"] > 0
        assert gen["ref"]["params"] == 0 and gen["critic"]["params"] > 0
