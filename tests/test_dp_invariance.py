"""A whole PPO step (rollout, rewards, values, advantages, critic and actor updates) gives the
same result at DP 1 and DP 2: same seed, same data, GAE with a critic. What could make it
depend on the DP size: whitening over a shard instead of the global batch, mini-batches made
of other global rows, token means of shards averaged as if equal-sized."""
import os

import pytest
import torch

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
# 8 prompts x 2 responses; 2 mini-batches per step for actor and critic (per rank: 8 rows at
# DP 1, 4 at DP 2), actor mini-batches shuffled, 2 micro-batches per mini-batch at DP 1
STEP = ["algorithm.adv_estimator=gae", "algorithm.gamma=0.9", "algorithm.lam=0.8",
        "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.shuffle=true",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]
INVARIANT_METRICS = ("critic/advantages/mean", "critic/returns/mean", "critic/values/mean",
                     "critic/score/mean", "critic/vf_loss", "critic/vf_clipfrac",
                     "critic/grad_norm", "actor/pg_loss", "actor/ppo_kl", "actor/kl_loss",
                     "actor/entropy", "actor/grad_norm", "response_length/mean")


def _one_step(world, tmp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed
    from parallel.shards import iter_global

    class Recording(Trainer):
        def compute_advantages(self, batch):
            batch = super().compute_advantages(batch)
            self.seen = {k: batch[k].clone() for k in ("advantages", "returns", "values",
                                                          "response_mask")}
            self.seen["uid"] = list(batch["uid"])
            return batch

    cfg = load_config(DEMO, [
        f"trainer.n_gpus_per_node={world}", "trainer.logger=[]", "trainer.resume_mode=disable",
        "trainer.save_freq=-1", "trainer.test_freq=-1", f"trainer.default_local_dir={tmp}/ckpt",
        f"trainer.log_dir={tmp}/logs/{dist.get_rank()}", *STEP])
    set_seed(cfg.trainer.seed)
    derived, components = build(cfg, world)
    t = Recording(derived, components)
    metrics = t.train_step(t.loader.next_batch())
    t.colocated.to_training()
    t.rollout.shutdown()
    out = dict(dp_rank=ps.get_data_parallel_rank(), seen=t.seen,
               metrics={k: metrics[k] for k in INVARIANT_METRICS})
    if dist.get_rank() == 0:  # DP replicas hold the same full weights (TP 1)
        out["actor"] = {n: w.clone() for n, w in iter_global(t.actor.chunks)}
        out["critic"] = {n: w.clone() for n, w in iter_global(t.critic.chunks)}
    return out


def _in_prompt_order(results):
    """The DP ranks' rows concatenated in DP-rank order: the step's prompt order."""
    ranks = sorted(results, key=lambda r: r["dp_rank"])
    seen = {k: torch.cat([r["seen"][k] for r in ranks])
            for k in ("advantages", "returns", "values", "response_mask")}
    seen["uid"] = [u for r in ranks for u in r["seen"]["uid"]]
    return seen


def test_a_whole_step_is_the_same_at_dp1_and_dp2(tmp_path):
    one = run_on_ranks(_one_step, 1, 1, str(tmp_path / "dp1"))
    two = run_on_ranks(_one_step, 2, 2, str(tmp_path / "dp2"))
    a, b = _in_prompt_order(one), _in_prompt_order(two)
    assert a["uid"] == b["uid"] and len(set(a["uid"])) == 8
    diffs = {}
    for key in ("values", "returns", "advantages"):
        diffs[key] = float((a[key] - b[key]).abs().max())
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5, msg=key)
    # whitened over the global batch: mean 0, unbiased std 1 over all valid tokens of both ranks
    assert torch.equal(a["response_mask"], b["response_mask"])  # the same responses
    adv, valid = a["advantages"], a["response_mask"].bool()
    assert float(adv[valid].mean()) == pytest.approx(0, abs=1e-5)
    assert float(adv[valid].std()) == pytest.approx(1, abs=1e-4)
    # ... which a shard's own statistics would not give: the ranks' shards differ
    half = [(adv[:8][valid[:8]]), adv[8:][valid[8:]]]
    assert max(abs(float(h.mean())) for h in half) > 1e-2
    for model in ("actor", "critic"):
        ref, got = one[0][model], two[0][model]
        assert ref.keys() == got.keys() and ref
        diffs[model] = max(float((ref[n] - got[n]).abs().max()) for n in ref)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-5, msg=f"{model} {n}")
    for r in two:
        for k, v in one[0]["metrics"].items():
            assert r["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    print("DP1 vs DP2 max |difference|:", diffs)


def _mini_batches_as_global_rows(n_global, size_global, shuffle):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from engine.workers.template import mini_batch_rows
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = n_global // dp
    out = []
    for epoch in range(2):
        local = mini_batch_rows(n, size_global // dp, epoch=epoch, shuffle=shuffle, seed=7)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [[rank * n + i for i in rows] for rows in local])
        out.append([sorted(sum((g[k] for g in gathered), [])) for k in range(len(local))])
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_mini_batches_hold_the_same_global_rows_at_any_dp_size(shuffle):
    one = run_on_ranks(_mini_batches_as_global_rows, 1, 24, 6, shuffle)[0]
    two = run_on_ranks(_mini_batches_as_global_rows, 2, 24, 6, shuffle)[0]
    assert one == two
    for epoch in one:
        assert len(epoch) == 4 and sorted(sum(epoch, [])) == list(range(24))
    if shuffle:  # a fresh draw per epoch, and not the unshuffled split
        assert one[0] != one[1]
        assert one[0] != run_on_ranks(_mini_batches_as_global_rows, 1, 24, 6, False)[0][0]
