"""Streaming groups from a separate rollout pool (engine/experience/streaming.py, the pool's side
engine/rollout/streaming.py): through the real trainer on 1 training + 1 pool rank, over-sampling
(data.gen_batch_size) at k = 1 with DAPO's filter and the replay buffer, every step trains exactly
data.train_batch_size whole groups, the surplus is carried and counted (nothing lost: carried in
+ requested = taken + dropped + filtered + carried out), zero-variance groups are filtered;
a LoRA actor on the pool trains as the colocated one does; the plan's arithmetic against hand
counts; the keys' one-line refusals."""
import pytest

from engine.config import ConfigError, load_config
from engine.experience.streaming import top_up, window
from engine.rollout.streaming import chunks, expected
from tests.test_rollout_pool import COMPARED, pool_run, pool_weights
from tests.test_e2e import ROOT

DEMO = f"{ROOT}/recipes/tiny_cpu_demo.yaml"

# prompts in dataset order (data.shuffle=false): group g is dataset row g, trained by replica
# g mod 2; the groups of rows 0, 4, 8, ... score 0 whatever the response (never vary: DAPO's
# filter drops them), the others score by the response's text (they vary)
FILTER_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 4 == 0:
        return 0.0
    return (sum(map(ord, solution_str)) % 97) / 97.0
'''


def test_the_plan_keeps_the_pool_ahead_by_the_window_and_no_further():
    # k x B + G groups, capped by what the remaining steps take (the surplus only when filtering)
    assert window(1, 8, 12, remaining=5) == 20 and window(0, 8, 8, remaining=5) == 8
    assert window(2, 8, 8, remaining=2) == 16 and window(1, 8, 12, remaining=1) == 8
    assert window(1, 8, 12, remaining=1, filtering=True) == 12
    assert top_up(5, 20, 2) == 16 and top_up(20, 20, 2) == 0 and top_up(25, 20, 2) == 0


def test_chunks_go_to_the_engines_in_turn_and_each_relay_knows_its_messages():
    assert [list(c) for c in chunks(5, 2)] == [[0, 1], [2, 3], [4]]
    gids = list(range(10, 20))
    owners = [100 + g % 2 for g in gids]  # replica g mod 2, relays 100 and 101
    # chunks of 3: [10 11 12] engine 0, [13 14 15] engine 1, [16 17 18] engine 0, [19] engine 1
    assert expected(gids, owners, 3, 2, 100) == [(0, [10, 12]), (1, [14]), (0, [16, 18])]
    assert expected(gids, owners, 3, 2, 101) == [(0, [11]), (1, [13, 15]), (0, [17]), (1, [19])]


def _cfg(*extra):
    return load_config(DEMO, ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4", *extra])


POOL = ["trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=1", "trainer.n_gpus_per_node=2"]


@pytest.mark.parametrize("extra, words", [
    (["data.gen_batch_size=12"], "data.gen_batch_size=12: over-sampling is read by the separate rollout pool"),
    (POOL + ["data.gen_batch_size=6", "trainer.off_policy_steps=1"], "data.gen_batch_size=6: asks for fewer"),
    (POOL + ["data.gen_batch_size=12"], "data.gen_batch_size=12: with trainer.off_policy_steps=0 every surplus"),
    (POOL + ["data.gen_batch_size=0"], "data.gen_batch_size=0"),
])
def test_gen_batch_size_is_refused_where_it_cannot_act(extra, words):
    with pytest.raises(ConfigError, match=words) as e:
        _cfg(*extra)
    assert "\n" not in str(e.value)


def test_the_pool_takes_replay_dynamic_sampling_and_lora():
    _cfg(*POOL, "algorithm.replay.enable=true", "algorithm.replay.ratio=0.5")
    _cfg(*POOL, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward")
    _cfg(*POOL, "data.gen_batch_size=12", "trainer.off_policy_steps=1")
    _cfg(*POOL, "actor_rollout_ref.model.lora_rank=4")


def test_streaming_over_sampling_with_dapo_filter_and_replay(tmp_path):
    """2 training ranks (DP 2: groups to replicas in turn, kept groups re-sharded, the leftover
    carried) + 1 pool rank; k = 1, B = 8 groups, G = 12 per generation batch, chunks of 2 prompts
    (max_num_seqs 8 / n 4), DAPO's filter on seq_reward and the replay buffer, 3 steps."""
    (tmp_path / "reward.py").write_text(FILTER_REWARD)
    extra = ["trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=1", "trainer.off_policy_steps=1",
             "data.gen_batch_size=12", "actor_rollout_ref.rollout.max_num_seqs=8", "data.shuffle=false",
             "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
             "algorithm.replay.enable=true", "algorithm.replay.ratio=0.5",
             f"custom_reward_function.path={tmp_path}/reward.py", "trainer.save_hf=false"]
    records = pool_run(tmp_path, "stream", 3, extra, steps=3)
    assert [r["step"] for r in records] == [1, 2, 3]
    carried = 0.0
    for r in records:
        # exactly B whole groups of n responses (counted on the batch trained: distinct uids, rows)
        assert r["rollout/groups_taken"] == 8 and r["rollout/samples_taken"] == 8 * 4
        assert r["rollout/groups_carried_in"] == carried  # what the last step left is this one's
        assert (r["rollout/groups_carried_in"] + r["rollout/groups_requested"] == r["rollout/groups_taken"]
                + r["rollout/groups_dropped_stale"] + r["batch/filtered_groups"] + r["rollout/groups_carried"])
        carried = r["rollout/groups_carried"]
        assert r["rollout/stale_samples"] == r["rollout/groups_dropped_stale"] == 0
        assert r["rollout/staleness/max"] == min(r["step"] - 1, 1) and r["actor/grad_norm"] > 0
    # by hand, from the rule above: step 1 asks for k x B + G = 20 groups; replica 0 takes rows
    # 0 2 4 6 | 8 | 10 and keeps 2 6 10, replica 1 takes 1 3 5 7 | 9 | 11 and keeps all six (rounds
    # of ceil(short / 2) each, 9 kept); one group moves to replica 0 and row 11 is carried with
    # the 8 in flight. Step 2 asks for 12 more (to 20), filters rows 12 16 20 and carries 21 with
    # 9 others; step 3 asks for 2 (the last step: B + the surplus), runs replica 0 dry and asks for
    # a generation batch of 12 more (2 batches), filters 24 28 32 and carries 31 with 12 others.
    got = [(r["rollout/groups_requested"], r["batch/filtered_groups"], r["batch/kept_groups"],
            r["batch/rerouted_groups"], r["rollout/groups_carried"], r["batch/num_gen_batches"]) for r in records]
    assert got == [(20, 3, 9, 1, 9, 1), (12, 3, 9, 1, 10, 1), (14, 3, 9, 1, 13, 2)]
    assert all(r["replay/replayed_samples"] > 0 for r in records[1:])  # the buffer is replayed
    assert records[0]["replay/replayed_samples"] == 0


# a 1-rank and a 1 + 1-rank run; the fast siblings: tests/test_lora.py (the merged weights of the
# colocated hand-off, the same lora.merged_buckets) and test_separate_pool_trains_like_colocated
# (tests/test_rollout_pool.py: the pool's sync at k = 0 equals the colocated one)
@pytest.mark.slow
def test_lora_actor_on_the_pool_trains_like_the_colocated_one(tmp_path):
    """LoRA at k = 0: the pool gets the merged weights (W + scale B A) after every update, so a
    1 + 1 rank pool run gives the 1-rank colocated run's steps and weights bit for bit."""
    lora = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.actor.optim.lr=0.05"]
    colocated = pool_run(tmp_path, "colocated", 1, lora, steps=2)
    pool = pool_run(tmp_path, "pool", 2, lora + ["trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=1"],
                steps=2)
    assert [r["step"] for r in colocated] == [r["step"] for r in pool] == [1, 2]
    assert all(r["actor/ppo_kl"] != 0 for r in pool)  # the 2nd mini-batch sees the adapters moved
    for a, b in zip(colocated, pool):
        for key in COMPARED:
            assert a[key] == b[key], (a["step"], key)
    a, b = pool_weights(tmp_path, "colocated", 2), pool_weights(tmp_path, "pool", 2)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


# 1 + 1 ranks, 4 steps; the fast siblings: test_streaming_over_sampling_with_dapo_filter_and_replay
# (the same source through the trainer) and the plan's arithmetic above
@pytest.mark.slow
def test_over_sampled_groups_past_k_versions_are_dropped_and_counted(tmp_path):
    """k = 1, B = 8, G = 12, no filter: by the plan (window k x B + G, capped by the steps left,
    groups taken in id order) step 1 asks for 20 groups of version 0 and trains 8; step 2 asks
    for 8 (v1) and trains 8 of v0; step 3 asks for 4 (v2), finds 4 of v0 two versions behind
    (dropped, counted) and trains 8 of v1; step 4 asks for 4 (v3) and trains 4 of v2 and 4 of
    v3: nothing is left and nothing stale is trained."""
    extra = ["trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=1", "trainer.off_policy_steps=1",
             "data.gen_batch_size=12", "actor_rollout_ref.rollout.max_num_seqs=8", "trainer.save_hf=false",
             "trainer.test_freq=2"]  # validated after step 2, 12 groups in flight: taken first, then kept
    records = pool_run(tmp_path, "stale", 2, extra, steps=4)
    assert ["val/score/mean" in r for r in records] == [False, True, False, True]
    got = [(r["rollout/groups_requested"], r["rollout/groups_dropped_stale"], r["rollout/groups_carried"],
            r["rollout/staleness/max"], r["rollout/stale_samples"]) for r in records]
    assert got == [(20, 0, 12, 0, 0), (8, 0, 12, 1, 0), (4, 4, 4, 1, 16), (4, 0, 0, 1, 0)]
    assert all(r["rollout/groups_taken"] == 8 and r["rollout/samples_taken"] == 32 for r in records)


def test_gen_batch_size_must_split_over_the_replicas():
    from engine.config import derive
    cfg = _cfg("trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=1", "trainer.n_gpus_per_node=3",
               "trainer.off_policy_steps=1", "data.gen_batch_size=13")
    with pytest.raises(ConfigError, match=r"data.gen_batch_size=13: does not split over 2 data-parallel ranks; "
                                          r"make it a multiple of 2 \(e.g. 14\)"):
        derive(cfg, 2, dataset_len=1 << 30)


# 1 + 1 ranks, 2 steps; the fast sibling: test_streaming_over_sampling_with_dapo_filter_and_replay
# (the same wrapper around the streaming source)
@pytest.mark.slow
def test_replay_around_the_whole_batch_pool(tmp_path):
    """The replay buffer around the pool's whole-batch source (k = 0, no over-sampling): step 2
    replays step 1's groups, validation goes through the wrapper to the pool, the pool stops."""
    extra = ["trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=1", "algorithm.replay.enable=true",
             "algorithm.replay.ratio=0.5", "trainer.test_freq=2", "trainer.save_hf=false"]
    records = pool_run(tmp_path, "replay", 2, extra, steps=2)
    assert [r["replay/replayed_samples"] for r in records] == [0, 4 * 4]  # round(0.5 x 8) groups x n
    assert "val/score/mean" in records[1] and "rollout/groups_taken" not in records[1]


# 2 runs of 1 + 1 ranks; the fast sibling: test_streaming_over_sampling_with_dapo_filter_and_replay
@pytest.mark.slow
def test_a_streaming_run_resumes_from_its_checkpoint(tmp_path):
    """A 2-step run saved at its end (the data position: the loader before the oldest batch
    holding a group not yet taken), resumed to step 4: every step trains 8 whole groups."""
    extra = ["trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=1", "trainer.off_policy_steps=1",
             "data.gen_batch_size=12", "actor_rollout_ref.rollout.max_num_seqs=8", "trainer.save_hf=false",
             "trainer.resume_mode=auto", "trainer.save_freq=2"]
    first = pool_run(tmp_path, "resumed", 2, extra, steps=2)
    records = pool_run(tmp_path, "resumed", 2, extra, steps=4)
    assert [r["step"] for r in first] == [1, 2] and [r["step"] for r in records][-2:] == [3, 4]
    assert all(r["rollout/groups_taken"] == 8 and r["rollout/samples_taken"] == 32 for r in records)
