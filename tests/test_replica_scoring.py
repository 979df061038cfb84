"""Rewards are scored once per model-parallel replica and broadcast to its other ranks: a
non-deterministic scorer (here a custom function returning random numbers, as a sandbox's wall
clock or an LLM judge would be) must not give the TP / PP ranks of one replica, which hold the
same data, different rewards and advantages; and a sandbox must not run TP x PP x CP times."""
import os

import pytest
import torch

from tests.multirank import run_on_ranks

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny_cpu_demo.yaml")

RANDOM_REWARD = '''
import os, random
import torch.distributed as dist
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["TRIDENT_TEST_SCORE_LOG"], "a") as f:  # one line per call
        f.write(f"{dist.get_rank()} {extra_info['index']}\\n")
    return random.random()
'''


def scoring_run(tmp, world):
    """Overrides of the tiny demo for a short scoring run on `world` ranks (4 prompts x 2 samples,
    one mini-batch, no checkpoints, validation or loggers); the reward source is the caller's."""
    return [f"trainer.n_gpus_per_node={world}", "trainer.logger=[]", "trainer.resume_mode=disable",
            "trainer.save_freq=-1", "trainer.test_freq=-1", f"trainer.default_local_dir={tmp}/ckpt",
            f"trainer.log_dir={tmp}/logs", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]


def _scored_steps(tmp, layout, steps=2):
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed

    class Recording(Trainer):
        def compute_advantages(self, batch):
            batch = super().compute_advantages(batch)
            self.seen.append({k: batch[k].clone() for k in ("token_level_scores", "advantages")})
            return batch

    os.environ["TRIDENT_TEST_SCORE_LOG"] = f"{tmp}/calls.txt"
    world = dist.get_world_size()
    cfg = load_config(DEMO, scoring_run(tmp, world) + [f"custom_reward_function.path={tmp}/reward.py", *layout])
    set_seed(cfg.trainer.seed + dist.get_rank())  # as engine.train.main: each rank its own stream
    t = Recording(*build(cfg, world))
    t.seen = []
    for _ in range(steps):
        t.train_step(t.loader.next_batch())
        t.step_count += 1
    t.colocated.to_training()
    t.rollout.shutdown()
    from megatron.core import parallel_state as ps
    return dict(rank=dist.get_rank(), dp_rank=ps.get_data_parallel_rank(), seen=t.seen)


def _check(tmp_path, ranks, samples_per_replica, steps=2):
    by_replica = {}
    for r in ranks:
        by_replica.setdefault(r["dp_rank"], []).append(r)
    for members in by_replica.values():  # every rank of a replica holds the same rewards / advantages
        first = members[0]["seen"]
        for other in members[1:]:
            for a, b in zip(first, other["seen"]):
                assert torch.equal(a["token_level_scores"], b["token_level_scores"])
                assert torch.equal(a["advantages"], b["advantages"])
        assert len({float(s["token_level_scores"].sum()) for s in first}) == steps  # random: they differ
    calls = [line.split() for line in (tmp_path / "calls.txt").read_text().splitlines()]
    # each sample scored exactly once per replica per step, on one rank of the replica
    assert len(calls) == steps * samples_per_replica * len(by_replica)
    scorers = {int(rank) for rank, _ in calls}
    assert len(scorers) == len(by_replica)
    assert {next(r["dp_rank"] for r in ranks if r["rank"] == s) for s in scorers} == set(by_replica)


@pytest.mark.parametrize("layout", ["tensor_model_parallel_size", "pipeline_model_parallel_size"])
def test_ranks_of_one_replica_score_once_and_hold_the_same_rewards(tmp_path, layout):
    """TP 2 or PP 2 on 2 ranks: one replica of two ranks."""
    (tmp_path / "reward.py").write_text(RANDOM_REWARD)
    ranks = run_on_ranks(_scored_steps, 2, str(tmp_path), [f"actor_rollout_ref.actor.megatron.{layout}=2"])
    _check(tmp_path, ranks, samples_per_replica=8)


@pytest.mark.slow  # 4 ranks on the CI's 2 cores; the TP 2 / PP 2 cases above are the fast siblings
def test_dp2_tp2_each_replica_scores_its_own_samples_once(tmp_path):
    """4 ranks, two replicas of TP 2: each replica's first rank scores that replica's samples."""
    (tmp_path / "reward.py").write_text(RANDOM_REWARD)
    tp2 = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",  # 4 sequences per DP rank
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]
    ranks = run_on_ranks(_scored_steps, 4, str(tmp_path), tp2)
    _check(tmp_path, ranks, samples_per_replica=4)
