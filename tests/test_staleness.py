"""Bounded staleness (trainer.off_policy_steps = k, engine/experience/staleness.py): per-token
policy versions travel with the batch, samples more than k versions behind are refused and
counted, and the staleness metrics equal a count written out here. The pool runs through the
real trainer are in tests/test_rollout_pool.py."""
import random

import pytest
import torch

from engine.batch import Batch
from engine.config import ConfigError, load_config
from engine.experience.staleness import refuse_stale, staleness_metrics
from engine.rollout.batches import VERSIONS, training_batch, with_versions
from tests.test_config_keys import DEMO


def _batch(rng, rows=6, length=7, current=9):
    """Random versions (some tokens old), masks with padding (-1) and masked observation tokens."""
    versions = torch.full((rows, length), -1, dtype=torch.long)
    mask = torch.zeros(rows, length, dtype=torch.long)
    for r in range(rows):
        n = rng.randint(1, length)
        start = current - rng.randint(0, 4)
        for t in range(n):  # a partial rollout: later tokens of newer versions
            versions[r, t] = min(current, start + t // 3)
            mask[r, t] = int(rng.random() > 0.2)
    return Batch(tensors={VERSIONS: versions, "response_mask": mask})


def _reference(batch, current, k):
    """Per row the oldest trained token's versions behind, and which rows are kept (plain loops)."""
    behind, keep = [], []
    for vs, ms in zip(batch[VERSIONS].tolist(), batch["response_mask"].tolist()):
        ages = [current - v for v, m in zip(vs, ms) if m and v >= 0]
        behind.append(ages)
        keep.append(not ages or max(ages) <= k)
    return behind, keep


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_samples_older_than_k_are_refused_and_counted(k):
    rng = random.Random(k)
    for _ in range(20):
        batch = _batch(rng)
        ages, keep = _reference(batch, 9, k)
        before = batch["response_mask"].clone()
        refused = refuse_stale(batch, 9, k)
        assert refused == keep.count(False)
        for r, kept in enumerate(keep):  # a refused sample trains no token; the others unchanged
            want = before[r] if kept else torch.zeros_like(before[r])
            assert torch.equal(batch["response_mask"][r], want)
        m = staleness_metrics(batch, 9, k, refused)
        trained = [a for row, kept in zip(ages, keep) if kept for a in row]
        assert m["rollout/stale_samples"] == refused
        assert m["rollout/partial_samples"] == sum(len(set(row)) > 1 for row, kept in zip(ages, keep) if kept)
        assert m["rollout/staleness/max"] == (max(trained) if trained else 0) <= k
        assert m["rollout/staleness/min"] == (min(trained) if trained else 0)
        assert m["rollout/staleness/mean"] == pytest.approx(sum(trained) / len(trained) if trained else 0)
        for j in range(k + 1):
            assert m[f"rollout/staleness/hist/{j}"] == pytest.approx(trained.count(j) / len(trained)
                                                                     if trained else 0)
        assert f"rollout/staleness/hist/{k + 1}" not in m


def test_a_masked_old_token_does_not_refuse_its_sample():
    """A multi-turn observation token (response_mask 0) is not trained: its version is no reason."""
    batch = Batch(tensors={VERSIONS: torch.tensor([[3, 0, 3, -1]]), "response_mask": torch.tensor([[1, 0, 1, 0]])})
    assert refuse_stale(batch, 3, 0) == 0 and batch["response_mask"].tolist() == [[1, 0, 1, 0]]
    assert refuse_stale(batch, 4, 0) == 1 and batch["response_mask"].tolist() == [[0, 0, 0, 0]]


class _Prompts:
    input_ids = [[5, 6], [7]]
    indices = [10, 11]
    ground_truths = ["a", "b"]
    data_sources = ["d", "d"]
    extra_infos = [{}, {}]


def test_token_versions_travel_with_the_batch():
    """A pool's shares carry per-token versions: the batch holds them beside the rollout log-probs
    (-1 on padding, cut at the response length); shares without them (colocated) add no key."""
    got = {0: ([[1, 2, 3]], [[-0.1, -0.2, -0.3]], None, None, None),
           1: ([[4, 5, 6, 7, 8]], [[-0.4] * 5], None, None, None)}
    plain = training_batch(_Prompts, got, [0, 1], 1, 0, 3, 4)
    assert VERSIONS not in plain
    stamped = {0: with_versions(got[0], [[2, 2, 3]]), 1: with_versions(got[1], [[1, 1, 2, 2, 3]])}
    batch = training_batch(_Prompts, stamped, [0, 1], 1, 0, 3, 4)
    assert batch[VERSIONS].tolist() == [[2, 2, 3, -1], [1, 1, 2, 2]]
    for key in plain.keys():  # nothing else changes
        assert torch.equal(plain[key], batch[key]) if isinstance(plain[key], torch.Tensor) else True
    assert with_versions(got[0][:2], [[1]])[2:] == (None, None, None, [[1]])


def test_off_policy_steps_takes_any_k_with_a_pool_and_refuses_a_negative_one():
    pool = ["trainer.n_gpus_per_node=4", "trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=2"]
    assert load_config(DEMO, pool + ["trainer.off_policy_steps=4"]).trainer.off_policy_steps == 4
    with pytest.raises(ConfigError, match=r"trainer.off_policy_steps.*-1.*use k >= 0"):
        load_config(DEMO, pool + ["trainer.off_policy_steps=-1"])
    with pytest.raises(ConfigError, match="set trainer.rollout_pool=separate"):
        load_config(DEMO, ["trainer.off_policy_steps=2"])


def test_partial_rollout_is_refused_where_no_weights_arrive_mid_generation():
    pool = ["trainer.n_gpus_per_node=4", "trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=2"]
    on = ["trainer.off_policy_steps=2", "trainer.partial_rollout=true"]
    assert load_config(DEMO, pool + on).trainer.partial_rollout
    with pytest.raises(ConfigError, match=r"trainer.partial_rollout.*off_policy_steps >= 1"):
        load_config(DEMO, pool + ["trainer.partial_rollout=true"])
    with pytest.raises(ConfigError, match=r"trainer.partial_rollout.*tensor_model_parallel_size=2"):
        load_config(DEMO, pool + on + ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"trainer.partial_rollout.*router_replay=false"):
        load_config(DEMO, pool + on + ["actor_rollout_ref.actor.router_replay=true"])


def test_partial_rollout_takes_sglang():
    """SGLang pauses and continues (engine/rollout/sglang_partial.py), vLLM not yet; the doubles
    stand in for the GPU (and leave sys.modules after: a later test asking whether vLLM is
    installed must not find the double)."""
    from tests.doubles import double_on_path
    pool = ["trainer.n_gpus_per_node=4", "trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=2",
            "trainer.off_policy_steps=1", "trainer.partial_rollout=true", "actor_rollout_ref.rollout.name=sglang"]
    with double_on_path("sglang"), double_on_path("vllm"):
        assert load_config(DEMO, pool).trainer.partial_rollout
        tp2 = load_config(DEMO, pool + ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
        assert tp2.trainer.partial_rollout  # the engine's leader alone drives it
        with pytest.raises(ConfigError, match=r"trainer.partial_rollout.*rollout.name='vllm'"):
            load_config(DEMO, pool + ["actor_rollout_ref.rollout.name=vllm"])

