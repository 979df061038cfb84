"""The plain logic of the experience sources, each against a reference written out here: truncated
IS weights, PF-PPO selection and weights, DAPO's group filter and DP re-sharding plan, token-level
model rewards (engine/rewards/preference.py's formulas), logged-response data, the replay
buffer's checkpointable state, and the config keys' refusals."""
import itertools
import math
import random

import pytest
import torch

from engine.algorithms.correction import CorrectionPlan, rollout_correction, score_weights
from engine.config import ConfigError, load_config
from engine.experience.dynamic_sampling import informative_groups, reshard_plan
from engine.experience.replay import ReplayBuffer, pf_select
from tests.test_config_keys import DEMO


def test_truncated_is_weights_follow_the_formula():
    g = torch.Generator().manual_seed(0)
    old, mu = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    w, keep, m = rollout_correction(old, mu, mask, CorrectionPlan(is_level="token", is_upper=1.5))
    for i, j in itertools.product(range(3), range(5)):
        want = min(math.exp(old[i, j] - mu[i, j]), 1.5) if mask[i, j] else 0.0
        assert float(w[i, j]) == pytest.approx(want, rel=1e-6)
    assert torch.equal(keep, mask.bool())  # no rejection configured: every token trains
    ratios = [math.exp(old[i, j] - mu[i, j]) for i, j in itertools.product(range(3), range(5)) if mask[i, j]]
    assert m["rollout_corr/ratio_mean"] == pytest.approx(sum(ratios) / len(ratios))
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(sum(r > 1.5 for r in ratios) / 8)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    w, _, m = rollout_correction(old, mu, mask, CorrectionPlan(is_level="sequence", is_upper=1.5))
    for i in range(2):  # the empty row counts for nothing
        seq = math.exp(sum(float(old[i, j] - mu[i, j]) for j in range(5) if mask[i, j]))
        assert w[i][mask[i].bool()].tolist() == pytest.approx([min(seq, 1.5)] * int(mask[i].sum()), rel=1e-6)
    assert float(w[2].abs().sum()) == 0.0
    seqs = [math.exp(sum(float(old[i, j] - mu[i, j]) for j in range(5) if mask[i, j])) for i in range(2)]
    assert m["rollout_corr/ratio_mean"] == pytest.approx(sum(seqs) / 2, rel=1e-6)


def test_pf_ppo_weights_have_mean_one():
    s = torch.tensor([1.0, -2.0, 0.0, 3.0])
    w = score_weights(s, 2.0)
    assert w.tolist() == pytest.approx([4 * 1 / 14, 4 * 4 / 14, 0.0, 4 * 9 / 14])
    assert score_weights(torch.zeros(3), 2.0).tolist() == [1.0, 1.0, 1.0]


def test_pf_ppo_selection_keeps_the_best_and_worst_of_each_group():
    rng = random.Random(0)
    for _ in range(50):
        n, keep = rng.choice([(4, 0.5), (8, 0.5), (8, 0.25), (6, 1.0), (5, 0.6)])
        scores = [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(3 * n)]
        k = round(keep * n)
        for mode in ("best", "best_worst"):
            if mode == "best_worst" and k < 2:
                continue
            got = pf_select(torch.tensor(scores), n, keep, mode)
            want = []
            for gi in range(3):  # reference: rank the group, take the ends
                idx = list(range(gi * n, (gi + 1) * n))
                by = sorted(idx, key=lambda i: (-scores[i], i))
                top = k if mode == "best" else (k + 1) // 2
                low = [i for i in sorted(idx, key=lambda i: (scores[i], i)) if i not in by[:top]][:k - top]
                want += sorted(by[:top] + low)
            assert got == want
            assert len(got) == 3 * k


def test_dapo_filter_and_the_reshard_plan():
    assert informative_groups([1, 1, 0, 1, 2, 2, 0.5, 0.5], 2) == [1]
    rng = random.Random(1)
    for _ in range(200):
        dp, q = rng.randint(1, 5), rng.randint(1, 6)
        counts = [rng.randint(0, 2 * q) for _ in range(dp)]
        if sum(counts) < dp * q:
            continue
        moves = reshard_plan(counts, q)
        end = [min(k, q) for k in counts]
        for src, dst, g in moves:
            assert g >= q and counts[src] > q and counts[dst] < q  # only surplus, only to short ranks
            end[dst] += 1
        assert end == [q] * dp
        assert len(moves) == sum(max(0, q - k) for k in counts)  # the least that must move
        assert len(set((s, g) for s, _, g in moves)) == len(moves)  # no group twice


def test_token_level_model_rewards_follow_the_preference_formulas():
    from engine.rewards.manager import RewardManager
    from engine.rewards.preference import implicit_token_rewards, margin_token_rewards
    from engine.tasks import build_tokenizer
    tok = build_tokenizer()
    responses = torch.tensor([tok.encode("7", add_special_tokens=False) + [tok.eos_token_id, 0],
                              tok.encode("12", add_special_tokens=False) + [tok.eos_token_id]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    model = torch.tensor([0.9, -0.3])
    args = dict(ground_truths=["7", "3"], data_sources=["arith", "arith"])
    rule, _ = RewardManager(tok)(responses, mask, **args)
    margin, extra = RewardManager(tok, token_level="margin")(responses, mask, model_scores=model, **args)
    want = margin_token_rewards(mask, mask, margin=model[:, None])[0] + rule
    torch.testing.assert_close(margin, want.float())
    assert margin.sum(-1).tolist() == pytest.approx((model + rule.sum(-1)).tolist())
    assert extra["model_score"] == pytest.approx(model.tolist())
    lp, ref = torch.randn(2, 3), torch.randn(2, 3)
    token = implicit_token_rewards(lp, ref, mask, beta=0.1)
    only, extra = RewardManager(tok, token_level="implicit")(responses, mask, model_scores=token)
    torch.testing.assert_close(only, token * mask)
    assert extra["model_score"] == pytest.approx((token * mask).sum(-1).tolist())
    last, _ = RewardManager(tok)(responses, mask, model_scores=model)  # null: on the last token
    assert last[0].tolist() == pytest.approx([0.0, 0.9, 0.0]) and last[1].tolist() == pytest.approx([0, 0, -0.3])


def _logged_rows():
    rows = []
    for p, answers in (("1+1=", ["2", "3"]), ("2+2=", ["4", "5"])):
        for a in answers:
            rows.append({"prompt": [{"role": "user", "content": p}], "response": a,
                         "reward": float(a in ("2", "4"))})
    return rows


def test_logged_dataset_groups_responses_by_prompt(tmp_path):
    from engine.data import write_prompt_parquet
    from engine.data.logged import LoggedDataset
    from engine.tasks import build_tokenizer
    tok = build_tokenizer()
    path = str(tmp_path / "log.parquet")
    write_prompt_parquet(_logged_rows(), path)
    data = LoggedDataset(path, tok, 16, n=2, response_length=4)
    assert len(data) == 2 and data[0]["input_ids"] == [tok.bos_token_id] + tok.encode("1+1=", add_special_tokens=False)
    log = data.logged(data[1]["index"])
    eos = tok.eos_token_id
    assert log["responses"] == [tok.encode("4", add_special_tokens=False) + [eos],
                                tok.encode("5", add_special_tokens=False) + [eos]]
    assert log["scores"] == [1.0, 0.0] and log["log_probs"] is None
    with pytest.raises(ValueError, match="rollout.n=3"):
        LoggedDataset(path, tok, 16, n=3, response_length=4)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        LoggedDataset(path, tok, 16, n=2, response_length=4, need_log_probs=True)
    bad = _logged_rows()
    bad[0]["rollout_log_probs"] = [-0.1]  # "2" + eos: two tokens
    for r in bad[1:]:
        r["rollout_log_probs"] = [-0.1, -0.2]
    write_prompt_parquet(bad, path)
    with pytest.raises(ValueError, match="row 0: rollout_log_probs has 1 values for 2"):
        LoggedDataset(path, tok, 16, n=2, response_length=4)
    long = _logged_rows()
    long[3]["response"] = "55555"
    write_prompt_parquet(long, path)
    with pytest.raises(ValueError, match="row 3: the response has 6 tokens"):
        LoggedDataset(path, tok, 16, n=2, response_length=4)
    kept = LoggedDataset(path, tok, 16, n=2, response_length=4, truncation="filter")
    assert len(kept) == 1 and kept.filter_counts["data/filtered_overlong_response"] == 1


def test_replay_buffer_state_survives_a_weights_only_checkpoint(tmp_path):
    from engine.batch import Batch
    from engine.checkpoint.files import load_safe, save_safe
    buf = ReplayBuffer(capacity=2, group_size=2)
    for step in range(3):
        buf.add(step, Batch({"x": torch.arange(4) + 10 * step},
                            {"uid": [step * 2, step * 2, step * 2 + 1, step * 2 + 1],
                             "extra_info": [{"i": step}] * 4}))
    assert len(buf) == 4 and [s for s, _ in buf.entries] == [1, 2]  # the oldest step left
    save_safe(buf.state_dict(), str(tmp_path / "s.pt"), "replay")
    back = ReplayBuffer(capacity=2, group_size=2)
    back.load_state_dict(load_safe(str(tmp_path / "s.pt")))
    a = buf.draw(3, torch.Generator().manual_seed(5))
    b = back.draw(3, torch.Generator().manual_seed(5))
    assert [p["x"].tolist() for p in a] == [p["x"].tolist() for p in b] and len(a) == 3
    assert all(p["uid"][0] == p["uid"][1] and p["uid"][0][0] == "replay" for p in a)
    drawn = sorted(p["x"].tolist()[0] for p in a)  # whole groups, three different ones
    assert len(set(drawn)) == 3 and all(x in (10, 12, 20, 22) for x in drawn)


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.replay.enable=true"], "algorithm.replay.enable=True: with algorithm.replay.ratio=0"),
    (["algorithm.replay.enable=true", "algorithm.replay.filter=best_worst", "algorithm.replay.keep=0.125"],
     "algorithm.replay.keep=0.125: keeps round"),
    (["algorithm.replay.enable=true", "algorithm.replay.ratio=1", "algorithm.replay.weight_pow=1"],
     "algorithm.replay.weight_pow=1.0: read by filter 'reweight' only"),
    (["algorithm.filter_groups.metric=acc"], "algorithm.filter_groups.metric='acc': read only with"),
    (["algorithm.filter_groups.enable=true", "algorithm.use_kl_in_reward=true",
      "algorithm.filter_groups.metric=seq_final_reward"], "seq_final_reward'"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=-1"],
     "max_num_gen_batches=-1"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0.5"],
     "rollout_is_threshold=0.5"),
    (["reward_model.token_level=implicit"], "reward_model.token_level='implicit': spreads"),
    (["data.offline_path=/x.parquet", "data.builtin_task=null", "algorithm.adv_estimator=remax",
      "actor_rollout_ref.model.tokenizer_path=/t"], "algorithm.adv_estimator='remax'"),
    (["data.offline_path=/x.parquet", "data.builtin_task=null", "actor_rollout_ref.model.tokenizer_path=/t",
      "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=1"],
     "reward_model.overlong_buffer.enable=True"),
    (["trainer.task=dpo", "algorithm.replay.enable=true", "algorithm.replay.ratio=1",
      "actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=false"],
     "algorithm.replay.enable=True: a PPO key"),
])
def test_experience_keys_are_refused_where_they_cannot_act(overrides, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace("[", r"\[")):
        load_config(DEMO, overrides)


def test_implicit_reward_reads_the_dpo_beta():
    cfg = load_config(DEMO, ["reward_model.enable=true", "reward_model.model.path=/m",
                             "reward_model.micro_batch_size_per_gpu=4", "reward_model.token_level=implicit",
                             "algorithm.dpo.beta=0.05"])
    assert cfg.algorithm.dpo.beta == 0.05
    with pytest.raises(ConfigError, match="only .trainer.task='ppo'. or reward_model.token_level=implicit"):
        load_config(DEMO, ["algorithm.dpo.beta=0.05"])


def test_graded_arith_pairs_rank_the_answer_first():
    from engine.data.preference import ANSWER_RANGE, PreferenceDataset, arith_pairs
    from engine.tasks import build_tokenizer, make_rows
    truth = [r["reward_model"]["ground_truth"] for r in make_rows("arith", 2000, 1, 0, split="train")]
    pairs = arith_pairs(2000, 1, 0, "train", graded=True)
    blank = 0
    for p, answer in zip(pairs, truth):
        assert p["chosen"].startswith(answer) and p["rejected"] != p["chosen"]
        if p["chosen"] != answer:  # the right answer first beats a wrong one first
            assert not p["rejected"].startswith(answer)
        blank += p["rejected"] == ""
    assert 0.07 < blank / len(pairs) < 0.13
    wrong = [p["rejected"] for p, a in zip(pairs, truth) if p["chosen"] == a and len(p["rejected"]) == 1
             and p["rejected"].isdigit()]
    four = sum(w == "4" for w in wrong) / len(wrong)  # drawn like the answers: 4 is the likeliest sum
    assert four > 1.4 / 8  # (uniform over the 8 wrong values: 1 / 8)
    # the plain pairs are what they were: a wrong number drawn uniformly from the level's range
    import random
    rng = random.Random("arith-pairs-0-train-1")
    old = [str(rng.choice([v for v in ANSWER_RANGE[0] if str(v) != a])) for a in truth[:50]]
    assert [p["rejected"] for p in arith_pairs(50, 1, 0, "train")] == old
    tok = build_tokenizer()
    data = PreferenceDataset([dict(prompt="1+1=", chosen="2", rejected="")], tok, 16, 4)
    assert data[0]["rejected_ids"] == [tok.eos_token_id]  # no answer at all: kept as a loser
