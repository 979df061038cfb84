"""Every rank resumes its own RNG: after Trainer.resume each rank draws what it would have drawn
had the run never stopped (and not rank 0's numbers); at another world size every rank is
reseeded deterministically from (seed, rank, step), with a warning."""
import logging
import os
import random

import numpy as np
import torch

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")


def _draws():
    return [random.random(), float(np.random.rand()), *torch.rand(2).tolist()]


def _trainer_resumes_each_ranks_rng(tmp):
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed

    rank = dist.get_rank()
    cfg = load_config(DEMO, [
        "trainer.logger=[]", "trainer.resume_mode=auto", "trainer.save_freq=1",
        "trainer.test_freq=-1", f"trainer.default_local_dir={tmp}/ckpt",
        f"trainer.log_dir={tmp}/logs/{rank}", "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    set_seed(cfg.trainer.seed)
    derived, components = build(cfg, dist.get_world_size())
    t = Trainer(derived, components)
    set_seed(cfg.trainer.seed + rank)  # what engine.train.main does: a stream per rank
    _draws()
    t.step_count = 3
    t.save()
    uninterrupted = _draws()
    set_seed(1234)  # the restarted processes: any state, the same on every rank
    t.step_count = 0
    t.resume()
    resumed = _draws()
    t.rollout.shutdown()
    return dict(uninterrupted=uninterrupted, resumed=resumed, step=t.step_count)


def test_each_rank_resumes_its_own_rng_through_the_trainer(tmp_path):
    ranks = run_on_ranks(_trainer_resumes_each_ranks_rng, 2, str(tmp_path))
    assert [r["step"] for r in ranks] == [3, 3]
    for r in ranks:
        assert r["resumed"] == r["uninterrupted"]
    assert ranks[0]["resumed"][0] != ranks[1]["resumed"][0]
    assert all(a != b for a, b in zip(ranks[0]["resumed"], ranks[1]["resumed"]))


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _save_per_rank_rng(tmp):
    import torch.distributed as dist

    from engine.checkpoint import CheckpointManager
    from engine.trainer import set_seed

    set_seed(100 + dist.get_rank())
    CheckpointManager(tmp).save(5, {}, {"step": 5})
    return _draws()


def _load_on_one_rank(tmp):
    from engine.checkpoint import CheckpointManager

    manager, handler = CheckpointManager(tmp), _Collect()
    logging.getLogger("engine.checkpoint.manager").addHandler(handler)
    try:
        out = []
        for scramble in (7, 8):  # whatever state the process had: the same reseeded draws
            random.seed(scramble)
            torch.manual_seed(scramble)
            manager.load(manager.latest(), {}, rng_seed=1)
            out.append(_draws())
        manager.load(manager.latest(), {}, rng_seed=2)
        out.append(_draws())
    finally:
        logging.getLogger("engine.checkpoint.manager").removeHandler(handler)
    return out, handler.messages


def test_another_world_size_reseeds_every_rank_deterministically(tmp_path):
    saved = run_on_ranks(_save_per_rank_rng, 2, str(tmp_path))
    (first, again, other_seed), messages = run_on_ranks(_load_on_one_rank, 1, str(tmp_path))[0]
    assert first == again and first != other_seed
    assert first != saved[0] and first != saved[1]  # no rank's saved state is copied
    assert any("saved on 2 ranks, this run has 1" in m and "reseeded" in m for m in messages)
