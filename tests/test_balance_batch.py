"""trainer.balance_batch (engine/experience/balance.py): whole prompt groups reordered over the DP
ranks so their token counts are even, every global mini-batch unchanged.

The partition (pure): equal counts per rank and slot class, every unit once, deterministic, a
long-tailed case at its lower bound. The move (2 gloo ranks): every field travels with its rows,
meta stays. The real trainer at DP 2 on long-tailed responses: global_seqlen/max drops to the
mean, and the actor and critic weights after one step equal the unbalanced run's (fp32)."""
import os
import random

import pytest
import torch

from engine.experience.balance import balance_plan, group_size, unit_layout
from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")


def _long_tailed(dp, slots, seed=0, sigma=1.0):
    rng = random.Random(seed)
    return [[int(64 * rng.lognormvariate(0, sigma)) + 1 for _ in range(slots)] for _ in range(dp)]


def _check(plan, costs, classes):
    dp = len(costs)
    used = sorted(u for rows in plan.rows for u in rows)
    assert used == sorted((r, s) for r in range(dp) for s in range(len(classes)))  # each unit once
    for rows in plan.rows:  # the same count of units per rank, each in a slot of its class
        assert len(rows) == len(classes)
        assert all(classes[slot] == classes[s] for slot, (_, s) in enumerate(rows))
    assert plan.after == [sum(costs[r][s] for r, s in rows) for rows in plan.rows]
    assert plan.before == [sum(c) for c in costs]


def _lower_bound(costs):
    """No partition with k units per rank beats the mean, nor any unit plus the k - 1 smallest."""
    flat, k = sorted(sum(costs, [])), len(costs[0])
    return max(sum(flat) / len(costs), flat[-1] + sum(flat[:k - 1]))


def test_units_hold_whole_groups_and_whole_runs_of_every_model():
    # rows per rank, rows per group, each model's rows per mini-batch -> (unit rows, slot classes)
    assert unit_layout(16, 2, [4, 8]) == (4, [0] * 4)  # m = 4 (actor), 2 (critic): lcm(2, 4, 2)
    assert unit_layout(16, 2, [8, 8]) == (2, [0] * 8)  # m = 2: a group is a run
    assert unit_layout(16, 4, [16]) == (4, [0] * 4)  # one mini-batch: whole groups only
    assert unit_layout(12, 3, [3]) == (12, [0])  # m = 4 runs of 4 rows vs groups of 3: all one unit
    # 10 rows in mini-batches of 4 are contiguous chunks (4, 4, 2): a unit keeps its chunk
    assert unit_layout(10, 2, [4]) == (2, [0, 0, 1, 1, 2])


def test_group_size_is_the_uid_run_length():
    assert group_size(["a", "a", "b", "b", "c", "c"]) == 2
    assert group_size([(1, 5), (1, 5), (1, 5)]) == 3
    with pytest.raises(ValueError, match="trainer.balance_batch"):
        group_size(["a", "a", "b"])


@pytest.mark.parametrize("dp,slots,classes", [(2, 8, None), (8, 16, None), (4, 6, [0, 0, 1, 1, 2, 2])])
def test_partition_keeps_counts_and_evens_a_long_tail(dp, slots, classes):
    classes = classes or [0] * slots
    costs = _long_tailed(dp, slots, seed=dp)
    plan = balance_plan(costs, classes)
    _check(plan, costs, classes)
    assert max(plan.after) < max(plan.before)
    if classes == [0] * slots:  # one class: within 3% of what any equal-count partition can do
        assert max(plan.after) <= 1.03 * _lower_bound(costs)
    assert balance_plan(costs, classes) == plan  # deterministic: every rank derives the same plan


def test_a_sorted_long_tail_ends_near_the_mean():
    """The contiguous split's worst case: the longest groups all on the first ranks."""
    flat = sorted(sum(_long_tailed(4, 32, seed=3), []), reverse=True)
    costs = [flat[r * 32:(r + 1) * 32] for r in range(4)]
    plan = balance_plan(costs, [0] * 32)
    _check(plan, costs, [0] * 32)
    mean = sum(plan.before) / 4
    assert max(plan.before) / mean > 2 and max(plan.after) / mean < 1.01
    assert plan.metrics()["global_seqlen/max"] == max(plan.before)
    assert plan.metrics()["global_seqlen/balanced_max"] == max(plan.after)


def test_a_balanced_batch_stays_where_it_is():
    costs = [[5, 1, 3, 3], [3, 3, 1, 5]]
    plan = balance_plan(costs, [0] * 4)
    assert plan.rows == [[(0, s) for s in range(4)], [(1, s) for s in range(4)]]


def test_slot_classes_are_kept():
    """Units of a class only trade with units of that class (a contiguous chunk's mini-batch)."""
    costs = [[100, 90, 1, 1], [1, 1, 80, 70]]
    plan = balance_plan(costs, [0, 0, 1, 1])
    _check(plan, costs, [0, 0, 1, 1])
    assert max(plan.after) < max(plan.before)


def test_offline_tasks_refuse_it_and_ppo_reads_it():
    from engine.config import ConfigError, load_config
    base = ["actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=false"]
    with pytest.raises(ConfigError, match="trainer.balance_batch=True: a PPO key"):
        load_config(DEMO, ["trainer.task=dpo", "trainer.balance_batch=true", *base])
    assert load_config(DEMO, ["trainer.balance_batch=true"]).trainer.balance_batch is True
    assert load_config(DEMO, []).trainer.balance_batch is False  # verl's default is true; ours is off


# -- the move, on 2 gloo ranks ----------------------------------------------------------------------
def _move_on_ranks(lengths):
    import torch.distributed as dist

    from engine.batch import Batch
    from engine.experience.balance import balance_batch
    rank = dist.get_rank()
    mine = lengths[rank]
    rows = len(mine)
    mask = torch.zeros(rows, 40, dtype=torch.long)
    for i, n in enumerate(mine):
        mask[i, :n] = 1
    uid = [f"p{rank}-{i // 2}" for i in range(rows)]
    batch = Batch({"attention_mask": mask, "input_ids": torch.arange(rows * 40).view(rows, 40) + 1000 * rank},
                  {"uid": uid, "ground_truth": [u + "!" for u in uid]}, meta={"rank": rank})
    out, metrics = balance_batch(batch, [4], dist.group.WORLD)
    return dict(uid=list(out["uid"]), truth=list(out["ground_truth"]), ids=out["input_ids"],
                tokens=out["attention_mask"].sum(-1).tolist(), step_row=out["step_row"].tolist(),
                meta=out.meta, metrics=metrics, before_meta=batch.meta, before_keys=batch.keys())


def test_every_field_moves_with_its_rows_and_meta_stays():
    lengths = [[30, 30, 20, 20, 30, 28, 25, 25], [2, 2, 3, 3, 1, 1, 4, 4]]  # rank 0 holds the long tail
    ranks = run_on_ranks(_move_on_ranks, 2, lengths)
    tokens = [sum(r["tokens"]) for r in ranks]
    m = ranks[0]["metrics"]
    assert m == ranks[1]["metrics"]
    assert (m["global_seqlen/max"], m["global_seqlen/min"]) == (sum(lengths[0]), sum(lengths[1]))
    assert m["global_seqlen/balanced_max"] == max(tokens) < m["global_seqlen/max"]
    assert m["global_seqlen/mean"] == sum(tokens) / 2
    assert sorted(u for r in ranks for u in r["uid"]) == sorted(f"p{k}-{g}" for k in (0, 1) for g in range(4)
                                                                for _ in range(2))
    for k, r in enumerate(ranks):
        assert r["meta"] == {"rank": k} and "step_row" not in r["before_keys"]  # the input untouched
        assert [u + "!" for u in r["uid"]] == r["truth"]
        for i in range(0, 8, 2):  # groups whole, each row with its own fields
            assert r["uid"][i] == r["uid"][i + 1]
        for i, row in enumerate(r["step_row"]):
            src, j = divmod(row, 8)
            assert r["tokens"][i] == lengths[src][j]
            assert int(r["ids"][i, 0]) == 1000 * src + 40 * j
            # m = 2 mini-batches of 4 rows: a row keeps its place (its mini-batch) in every run
            assert i % 2 == j % 2


# -- the real trainer at DP 2 -----------------------------------------------------------------------
# 16 prompts x 2 responses, GAE with a critic; per rank 16 rows: actor mini-batches of 4 rows (m = 4,
# shuffled), critic's of 8 (m = 2), so units of lcm(2, 4, 2) = 4 rows (2 groups)
STEP = ["algorithm.adv_estimator=gae", "algorithm.gamma=0.9", "algorithm.lam=0.8",
        "data.train_batch_size=16", "data.max_response_length=32", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.shuffle=true",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_mini_batch_size=8",
        "critic.ppo_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]
# response lengths by the prompt's place in the step: a long tail, the longest on DP rank 0
LENGTHS = [32, 30, 16, 11, 8, 32, 5, 5, 4, 3, 3, 3, 2, 2, 2, 2]


def _long_tail_generation(t, prompts):
    """The rollout's responses cut or padded to LENGTHS (digits, no end token): lengths we choose."""
    import dataclasses
    place = {int(k): p for p, k in enumerate(prompts.indices)}
    digits = t.tokenizer.convert_tokens_to_ids(list("0123456789"))
    generate = t.ctx.run_engine

    def run(engine, prompt_ids, sampling, keys):
        out = generate(engine, prompt_ids, sampling, keys)
        n = sampling.n
        responses, log_probs = [], []
        for r in range(len(out.responses)):
            key = int(keys[r // n])
            length = LENGTHS[place[key]]
            responses.append([digits[(key * 7 + r * 3 + j) % 10] for j in range(length)])
            log_probs.append([-2.0] * length)
        return dataclasses.replace(out, responses=responses, log_probs=log_probs,
                                   finish_reasons=["length"] * len(responses))
    t.ctx.run_engine = run


def _one_step(balance, tmp):
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed
    from parallel.shards import iter_global
    cfg = load_config(DEMO, [
        "trainer.n_gpus_per_node=2", "trainer.logger=[]", "trainer.resume_mode=disable",
        "trainer.save_freq=-1", "trainer.test_freq=-1", f"trainer.default_local_dir={tmp}/ckpt",
        f"trainer.log_dir={tmp}/logs/{dist.get_rank()}", f"trainer.balance_batch={str(balance).lower()}", *STEP])
    set_seed(cfg.trainer.seed)
    t = Trainer(*build(cfg, 2))
    prompts = t.loader.next_batch()
    _long_tail_generation(t, prompts)
    seen = {}
    update = t.actor.update_policy

    def spy(batch, **kw):
        seen.update(tokens=int(batch["attention_mask"].sum()), uid=list(batch["uid"]),
                    advantages=batch["advantages"].clone(), response_mask=batch["response_mask"].clone())
        return update(batch, **kw)
    t.actor.update_policy = spy
    metrics = t.train_step(prompts)
    t.colocated.to_training()
    t.rollout.shutdown()
    out = dict(metrics=metrics, seen=seen)
    if dist.get_rank() == 0:
        out["actor"] = {n: w.clone() for n, w in iter_global(t.actor.chunks)}
        out["critic"] = {n: w.clone() for n, w in iter_global(t.critic.chunks)}
    return out


def test_the_trainer_balances_dp_ranks_and_updates_as_unbalanced(tmp_path):
    plain = run_on_ranks(_one_step, 2, False, str(tmp_path / "plain"))
    even = run_on_ranks(_one_step, 2, True, str(tmp_path / "even"))
    before = [r["seen"]["tokens"] for r in plain]
    after = [r["seen"]["tokens"] for r in even]
    assert sum(before) == sum(after)
    m = even[0]["metrics"]
    assert "global_seqlen/max" not in plain[0]["metrics"]
    mean = m["global_seqlen/mean"]
    assert (m["global_seqlen/max"], m["global_seqlen/min"]) == (max(before), min(before))
    assert m["global_seqlen/minmax_diff"] == max(before) - min(before)
    assert (m["global_seqlen/balanced_max"], m["global_seqlen/balanced_min"]) == (max(after), min(after))
    assert m["global_seqlen/max"] / mean > 1.3 and m["global_seqlen/balanced_max"] / mean < 1.05
    assert "timing_s/balance_batch" in m
    # the same groups (whole: a uid on one rank), the same advantages for each
    for runs in (plain, even):
        assert not set(runs[0]["seen"]["uid"]) & set(runs[1]["seen"]["uid"])
    adv = [{(u, i % 2): (a, mk) for r in runs for i, (u, a, mk) in
            enumerate(zip(r["seen"]["uid"], r["seen"]["advantages"], r["seen"]["response_mask"]))}
           for runs in (plain, even)]
    assert adv[0].keys() == adv[1].keys() and len(adv[0]) == 32
    for k, (a, mk) in adv[0].items():
        assert torch.equal(mk, adv[1][k][1])
        torch.testing.assert_close(adv[1][k][0], a, rtol=0, atol=1e-5)
    diffs = {}
    for model in ("actor", "critic"):
        ref, got = plain[0][model], even[0][model]
        assert ref.keys() == got.keys() and ref
        diffs[model] = max(float((ref[n] - got[n]).abs().max()) for n in ref)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-5, msg=f"{model} {n}")
        assert plain[0]["metrics"][f"{model}/grad_norm"] > 1e-3  # a real update, not a zero one
    for k in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "critic/advantages/mean"):
        assert even[0]["metrics"][k] == pytest.approx(plain[0]["metrics"][k], rel=1e-4, abs=1e-6), k
    print(f"tokens per DP rank: before {before} (max/mean {max(before) / mean:.3f}), "
          f"after {after} (max/mean {max(after) / mean:.3f}); max |weight difference| {diffs}")
