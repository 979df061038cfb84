"""verl's reward managers as Trident runs them (engine/rewards/manager.py): `dapo` is the
per-sample manager plus the overlong penalty (reward_model.overlong_buffer, verl's formula written
out here), `prime` the per-sample manager over the num_workers process pool (refused without one);
verl's overlong_buffer.log is accepted (the penalty is always logged)."""
import os

import pytest
import torch

from engine import tasks
from engine.config import ConfigError, load_config
from engine.config.schema import OverlongBufferConfig
from engine.rewards import RewardManager

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny_cpu_demo.yaml")


def _responses(tok, texts, length):
    ids = torch.full((len(texts), length), tok.pad_token_id)
    mask = torch.zeros(len(texts), length, dtype=torch.long)
    for i, text in enumerate(texts):
        seq = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids[i, :len(seq)], mask[i, :len(seq)] = torch.tensor(seq), 1
    return ids, mask


def test_dapo_is_the_per_sample_manager_with_the_overlong_penalty():
    tok = tasks.build_tokenizer()
    texts, truths = ["7", "7777", "12345678", "3"], ["7", "7", "7", "9"]
    ids, mask = _responses(tok, texts, 10)
    buffer = OverlongBufferConfig(enable=True, len=4, penalty_factor=0.5)
    dapo = RewardManager(tok, reward_manager="dapo", overlong=buffer, max_response_length=10)
    scores, extra = dapo(ids, mask, truths, ["arith"] * 4)
    naive = RewardManager(tok, reward_manager="naive")(ids, mask, truths, ["arith"] * 4)[0]
    lengths = mask.sum(-1).tolist()  # 2, 5, 9, 2 tokens with eos
    # verl's DAPO: exceed = length - (max_response_length - len); penalty min(-exceed / len * factor, 0)
    penalty = [min(-(n - (10 - 4)) / 4 * 0.5, 0.0) for n in lengths]
    assert penalty == [0.0, 0.0, -0.375, 0.0]
    assert scores.sum(-1).tolist() == pytest.approx([a + p for a, p in zip(naive.sum(-1).tolist(), penalty)])
    assert extra["overlong_reward"] == pytest.approx(penalty) and extra["overlong"] == [False, False, True, False]
    assert load_config(DEMO, ["reward_model.reward_manager=dapo"]).reward_model.reward_manager == "dapo"
    notes = []
    load_config(DEMO, ["reward_model.overlong_buffer.log=true"], notes=notes)
    assert any("overlong_buffer.log" in n and "always logged" in n for n in notes)


def test_prime_needs_the_process_pool():
    tok = tasks.build_tokenizer()
    line = ("reward_model.reward_manager='prime' scores in parallel processes: set reward_model.num_workers=N "
            "(a pool of N scoring processes, e.g. 8), or use reward_manager=naive")
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["reward_model.reward_manager=prime"])
    assert str(e.value) == line
    with pytest.raises(ValueError, match="num_workers=N"):
        RewardManager(tok, reward_manager="prime")
    cfg = load_config(DEMO, ["reward_model.reward_manager=prime", "reward_model.num_workers=2"])
    manager = RewardManager(tok, reward_manager=cfg.reward_model.reward_manager,
                            num_workers=cfg.reward_model.num_workers)
    # per sample over the pool: the pool's scores equal in-process ones (tests/test_rewards.py
    # test_ray_pool_matches_in_process)
    assert manager.num_workers == 2 and not manager.batched
    with pytest.raises(ConfigError, match="reward_manager='ppo' is not allowed"):
        load_config(DEMO, ["reward_model.reward_manager=ppo"])

