"""A separate rollout pool (trainer.rollout_pool=separate, engine/rollout/pool.py) through the real
trainer: 2 training + 2 rollout ranks give the colocated run's steps bit for bit (k = 0); k-step
off-policy keeps the number of updates and trains no token more than k versions behind; SGLang
engines (the recording double in tests/fakes, whose TP workers are processes joining the group as
sglang's do) get the weights over the update group."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.test_e2e import ROOT, TINY

COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/kl_loss",
            "actor/grad_norm", "response_length/mean")


FAKES = os.path.join(ROOT, "tests", "fakes")


def pool_run(tmp_path, name, nproc, extra, steps=3, sglang=False):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if sglang:
        extra = [*extra, "actor_rollout_ref.rollout.name=sglang"]
        env.update(PYTHONPATH=os.pathsep.join([ROOT, FAKES]), TRIDENT_FAKE_SGLANG_LOG=str(tmp_path / f"{name}.sglang"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "engine.train", os.path.join(ROOT, "recipes/tiny_cpu_demo.yaml"), *TINY,
           f"trainer.total_training_steps={steps}", f"trainer.experiment_name={name}", "trainer.test_freq=-1",
           "trainer.save_freq=-1", "trainer.save_hf=true", f"trainer.n_gpus_per_node={nproc}",
           f"trainer.default_local_dir={tmp_path}/ckpt/{name}", f"trainer.log_dir={tmp_path}/logs/{name}", *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (tmp_path / "logs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def pool_weights(tmp_path, name, step):
    from safetensors.torch import load_file
    out = {}
    for f in sorted((tmp_path / "ckpt" / name / "hf" / f"step_{step}").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


POOL = ["trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=2"]


# a score that depends on which prompt's ground truth a response is paired with, and on the text
PAIRING_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return ((31 * sum(map(ord, solution_str)) + sum(map(ord, str(ground_truth)))) % 97) / 97.0
'''


@pytest.fixture(scope="module")
def colocated_and_pool(tmp_path_factory):
    """One colocated run (2 ranks) and one on a separate pool (2 training + 2 rollout ranks) of
    the same 3 steps, read by the training comparison and the validation one: both validate
    before training and after step 3 with val_kwargs.n=3 sampled responses per prompt, scored by
    PAIRING_REWARD. Returns (root, colocated records, pool records)."""
    tmp = tmp_path_factory.mktemp("pool")
    (tmp / "reward.py").write_text(PAIRING_REWARD)
    v = "actor_rollout_ref.rollout.val_kwargs"
    val = ["trainer.test_freq=3", "trainer.val_before_train=true", f"{v}.n=3", f"{v}.do_sample=true",
           f"{v}.temperature=1.0",
           f"custom_reward_function.path={tmp}/reward.py", "data.val_batch_size=null"]
    return tmp, pool_run(tmp, "colocated", 2, val), pool_run(tmp, "pool", 4, POOL + val)


def test_separate_pool_trains_like_colocated(colocated_and_pool):
    tmp, colocated, pool = colocated_and_pool
    colocated, pool = ([r for r in records if r["step"] > 0] for records in (colocated, pool))
    assert [r["step"] for r in colocated] == [r["step"] for r in pool] == [1, 2, 3]
    for a, b in zip(colocated, pool):  # the same responses (keyed sampling), log-probs, updates
        for key in COMPARED:  # bit for bit: k = 0 is the synchronous step
            assert a[key] == b[key], (a["step"], key)
        assert b["rollout/staleness"] == b["rollout/staleness/max"] == b["rollout/stale_samples"] == 0
        assert b["rollout/staleness/hist/0"] == 1.0 and "rollout/staleness/hist/1" not in b
    a, b = pool_weights(tmp, "colocated", 3), pool_weights(tmp, "pool", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_staleness(records, k, steps):
    """One update per step, none lost; from the versions recorded on every trained token: step s
    trains tokens exactly min(s - 1, k) versions behind (the pool works up to k steps ahead,
    nothing older than k), the histogram all in that bin, nothing refused."""
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        behind = min(r["step"] - 1, k)
        assert r["rollout/staleness"] == behind  # the batch's weights
        assert r["rollout/staleness/min"] == r["rollout/staleness/max"] == r["rollout/staleness/mean"] == behind
        assert [r[f"rollout/staleness/hist/{j}"] for j in range(k + 1)] == [float(j == behind) for j in range(k + 1)]
        assert r["rollout/stale_samples"] == 0
        assert r["actor/grad_norm"] > 0 and "timing_s/old_log_prob" in r  # recomputed, not reused


def _off_policy(tmp_path, k, nproc, steps):
    pool = ["trainer.rollout_pool=separate", f"trainer.rollout_pool_ranks={nproc // 2}"]
    records = pool_run(tmp_path, f"offpolicy{k}", nproc, pool + [f"trainer.off_policy_steps={k}"], steps=steps)
    _check_staleness(records, k, steps)


def test_two_steps_off_policy(tmp_path):
    """k = 2 on 1 training + 1 pool rank: steps 1, 2, 3 train tokens 0, 1, 2 versions behind."""
    _off_policy(tmp_path, 2, 2, 3)


# 4 and 2 ranks under torchrun; the fast sibling: test_two_steps_off_policy
@pytest.mark.slow
@pytest.mark.parametrize("k, nproc, steps", [(1, 4, 3), (4, 2, 6)])
def test_k_step_off_policy(tmp_path, k, nproc, steps):
    """k = 1 on 2 training + 2 pool ranks (the metrics reduced over DP), k = 4 on 1 + 1."""
    _off_policy(tmp_path, k, nproc, steps)


def _records(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / f"{name}.sglang").read_text().splitlines()]


def _syncs(records, rank):
    """Per weight sync of the engine on `rank`: {HF name: digest} (each name loaded once)."""
    out = []
    for e in records:
        if e["rank"] != rank:
            continue
        if e["kind"] == "begin_weight_update":
            out.append({})
        elif e["kind"].startswith("update_weights_from_"):
            assert not set(e["digests"]) & set(out[-1]), "a weight loaded twice in one sync"
            out[-1].update(e["digests"])
    return out


SGLANG_TP2 = ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"]


def test_sglang_pool_gets_weights_over_the_update_group(tmp_path, sglang_colocated_run):
    """2 training + 2 pool ranks, one SGLang engine of TP 2 fed by training rank 0 (rank 1 feeds
    none): the same steps, weights and per-sync engine weights as the colocated run's CUDA-IPC
    hand-off (tests/conftest.py's sglang_colocated_run: the same settings, colocated), with the
    group set up once and no tensor crossing the bridge."""
    root, colocated = sglang_colocated_run
    pool = pool_run(tmp_path, "pool", 4, POOL + SGLANG_TP2, sglang=True)
    assert [r["step"] for r in colocated] == [r["step"] for r in pool] == [1, 2, 3]
    for a, b in zip(colocated, pool):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
    a, b = pool_weights(root, "colocated", 3), pool_weights(tmp_path, "pool", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    records = [e for e in _records(tmp_path, "pool") if e["kind"] != "memory"]  # the device budget's
    assert {e["rank"] for e in records} == {2}  # the engine's leader (pool rank 0 = launched rank 2)
    kinds = [e["kind"] for e in records]
    assert kinds[:2] == ["init", "init_weights_update_group"] and kinds.count("init_weights_update_group") == 1
    join = records[1]
    assert (join["rank_offset"], join["world_size"], join["backend"]) == (1, 3, "gloo")  # sender + 2 workers
    assert "update_weights_from_tensor" not in kinds
    assert all(e["workers"] == 2 and e["flush_cache"] is False and e["group_name"] == join["group_name"]
               for e in records if e["kind"] == "update_weights_from_distributed")
    assert kinds[-2:] == ["destroy_weights_update_group", "shutdown"]
    # every sync loads every weight once, and the engine holds what the colocated engine held
    reference = _syncs(_records(root, "colocated"), 0)
    got = _syncs(records, 2)
    assert len(got) == len(reference) == 3 and got == reference


# 3 ranks under torchrun; the fast siblings: the groups' plan (one sender, several engines:
# test_update_groups_spread_engines_over_the_training_ranks) and an update group through the
# trainer (test_sglang_pool_gets_weights_over_the_update_group)
@pytest.mark.slow
def test_one_training_rank_feeds_two_engines_with_one_broadcast(tmp_path):
    """1 training + 2 pool ranks of TP 1: both engines join training rank 0's group (offsets 1
    and 2 of 3) and receive the same weights at every sync."""
    pool_run(tmp_path, "fanout", 3, POOL, steps=2, sglang=True)
    records = _records(tmp_path, "fanout")
    joins = sorted((e["rank"], e["rank_offset"], e["world_size"], e["group_name"])
                   for e in records if e["kind"] == "init_weights_update_group")
    assert joins == [(1, 1, 3, "trident-weights-0"), (2, 2, 3, "trident-weights-0")]
    first, second = _syncs(records, 1), _syncs(records, 2)
    assert len(first) == 2 and first == second and all(len(s) == len(first[0]) > 0 for s in first)


def test_update_groups_spread_engines_over_the_training_ranks():
    from engine.rollout.update_group import UpdateGroup, feeder, update_groups
    # 3 engines of TP 2 on 2 training ranks: rank 0 feeds engines 0 and 1 in one group of 5
    assert update_groups([10, 12, 14], [2, 2, 2], 2) == [
        UpdateGroup(sender=0, name="trident-weights-0", world_size=5, engines=((10, 1), (12, 3))),
        UpdateGroup(sender=1, name="trident-weights-1", world_size=3, engines=((14, 1),))]
    # fewer engines than training ranks: spread out (ranks 0 and 4 of 8, on different nodes)
    assert [g.sender for g in update_groups([8, 9], [1, 1], 8)] == [0, 4]
    # every item has exactly one feeder, and the feeders are as even as can be
    counts = [sum(feeder(i, 16, 6) == j for i in range(16)) for j in range(6)]
    assert sum(counts) == 16 and max(counts) - min(counts) <= 1


def test_a_worker_that_never_joins_is_named_with_the_address_and_the_wait():
    from engine.rollout.update_group import open_as_sender, sender_address
    address, port = sender_address()
    with pytest.raises(RuntimeError, match=rf"trident-weights-0: waited 2 s at {address}:{port} for 1 SGLang"):
        open_as_sender(address, port, 2, "trident-weights-0", "gloo", timeout_s=2)


def test_pool_validation_with_several_samples_per_prompt_scores_them_against_their_prompt(
        colocated_and_pool):
    """val_kwargs.n=3 sampled: the pool's validation gives the colocated run's scores (each
    response scored against its own prompt's ground truth, n per prompt counted)."""
    _, colocated, pool = colocated_and_pool
    a = [r for r in colocated if "val/score/mean" in r]
    b = [r for r in pool if "val/score/mean" in r]
    assert len(a) == len(b) == 2  # before training and after step 3
    for x, y in zip(a, b):
        assert x["val/score/mean"] == pytest.approx(y["val/score/mean"], rel=1e-9), (x, y)
    assert len({round(r["val/score/mean"], 9) for r in a}) == 2  # the update moved the responses


# 2 ranks, 4 steps of long responses; the fast siblings: tests/test_partial_rollouts.py (the
# engine's pause / continue, a straddling response's two versions) and test_two_steps_off_policy
@pytest.mark.slow
def test_partial_rollouts_through_the_pool(tmp_path):
    """trainer.partial_rollout at k = 2: weights announced while the pool generates pause it and it
    goes on from its tokens. Whether a pause falls inside a generation depends on timing (here
    the pool decodes one prompt's 4 rows at a time, so it is usually still generating step 3 when
    step 2's weights come: seen [0, 0, 4, 4] straddling samples); what must hold every time: one
    update per step, nothing refused, no trained token more than k versions behind."""
    pool = ["trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=1", "trainer.off_policy_steps=2",
            "trainer.partial_rollout=true", "data.max_response_length=48",
            "actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.max_num_seqs=1"]
    records = pool_run(tmp_path, "partial", 2, pool, steps=4)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["rollout/stale_samples"] == 0 and r["rollout/staleness/max"] <= min(r["step"] - 1, 2)
        assert sum(r[f"rollout/staleness/hist/{j}"] for j in range(3)) == pytest.approx(1.0)
        assert r["actor/grad_norm"] > 0
    print("samples straddling an update per step:", [r["rollout/partial_samples"] for r in records])


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_partial_rollouts_through_the_pool_on_sglang(tmp_path, tp):
    """The same through SGLang (the recording double; the engine-level checks of versions and
    log-probs: tests/test_partial_rollouts.py). Every pause is sglang's abort mode, and every
    request it cut short is sent again as prompt + exactly the tokens it answered (nothing
    discarded, nothing made twice); a pause that cut responses short shows as straddling samples.
    At rollout TP 2 the engine's leader alone drives it (the other pool rank only follows)."""
    pool = ["trainer.rollout_pool=separate", f"trainer.rollout_pool_ranks={tp}", "trainer.off_policy_steps=2",
            "trainer.partial_rollout=true", "data.max_response_length=48",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
            "actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.max_num_seqs=1"]
    records = pool_run(tmp_path, "partial", 1 + tp, pool, steps=4, sglang=True)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["rollout/stale_samples"] == 0 and r["rollout/staleness/max"] <= min(r["step"] - 1, 2)
    log = [json.loads(line) for line in (tmp_path / "partial.sglang").read_text().splitlines()]
    assert [e["kwargs"]["tp_size"] for e in log if e["kind"] == "init"] == [tp]  # one engine, on the leader
    assert {e["mode"] for e in log if e["kind"] == "pause_generation"} <= {"abort"}
    sent = [e for e in log if e["kind"] in ("generate", "async_generate")]
    cut = 0
    for e, after in zip(sent, sent[1:]):
        n, params = e["n"], e["sampling_params"]
        budget = lambda r: (params[r // n] if isinstance(params, list) else params)["max_new_tokens"]  # noqa: E731
        paused = [e["prompts"][r // n] + e["responses"][r] for r, a in enumerate(e["aborts"] or [])
                  if a is not None and len(e["responses"][r]) < budget(r)]
        if paused:
            assert after["prompts"] == paused and after["n"] == 1
            cut += 1
    print("generations cut short:", cut, "straddling samples per step:",
          [r["rollout/partial_samples"] for r in records])
    assert (cut > 0) == (sum(r["rollout/partial_samples"] for r in records) > 0)
