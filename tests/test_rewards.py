"""Rule rewards against hand-made cases; manager placement; Ray pool == in-process."""
import pytest
import torch

from engine import tasks
from engine.rewards import RewardManager, default_compute_score, known_data_sources, register_reward
from engine.rewards import arith, gsm8k, math_verify, registry
from engine.rewards.manager import last_token_index
from engine.rewards.preference import (RewardModelScorer, implicit_token_rewards, margin_token_rewards,
                                       pair_preference_probability)


# ---- gsm8k -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,strict,flexible", [
    ("3 + 4 = 7 so #### 7", "7", "7"),
    ("first #### 3 then corrected #### 1,234", "1234", "1234"),
    ("#### $18", "18", "18"),
    ("she pays $42.", None, "42"),
    ("#### -7", "-7", "-7"),
    ("no digits here", None, None),
    ("#### 12 apples and 3 pears", "12", "3"),
])
def test_gsm8k_extraction(text, strict, flexible):
    assert gsm8k.extract_solution(text, "strict") == strict
    assert gsm8k.extract_solution(text, "flexible") == flexible


def test_gsm8k_scores():
    assert gsm8k.compute_score("so #### 1,000", "1000") == 1.0
    assert gsm8k.compute_score("so #### 72.0", "72") == 1.0  # compared as numbers
    assert gsm8k.compute_score("so #### 71", "72", format_score=0.1) == 0.1  # well formed, wrong
    assert gsm8k.compute_score("the answer is 72", "72", format_score=0.1) == 0.0  # malformed in strict
    assert gsm8k.compute_score("the answer is 72", "72", method="flexible") == 1.0
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        gsm8k.extract_solution("#### 1", "loose")


# ---- math --------------------------------------------------------------------------------------

def test_last_boxed():
    assert math_verify.last_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == r"\frac{1}{2}"
    assert math_verify.last_boxed(r"nested \boxed{x^{2}+\sqrt{y}}") == r"x^{2}+\sqrt{y}"
    assert math_verify.last_boxed(r"$\boxed 5$") == "5"
    assert math_verify.last_boxed(r"\fbox{3}") == "3"
    assert math_verify.last_boxed(r"cut off \boxed{3") is None
    assert math_verify.last_boxed("nothing") is None


@pytest.mark.parametrize("answer,truth", [
    (r"\dfrac{1}{2}", "0.5"),
    (r"\frac12", r"\frac{1}{2}"),
    ("1/2", r"\tfrac{1}{2}"),
    ("-3/6", r"-\frac{1}{2}"),
    (r"5\text{ cm}", "5"),
    (r"90^\circ", "90"),
    (r"90^{\circ}", "90"),
    (r"50\%", "50"),
    ("x = 3", "3"),
    ("5.00", "5"),
    (".5", "0.5"),
    ("1,000", "1000"),
    (r"\left( 3, 4 \right)", "(3,4)"),
    (r"\text{(B)}", "(B)"),
    (r"\sqrt2/2", r"\frac{\sqrt{2}}{2}"),
    (r"2\pi", r"\pi \cdot 2"),
    (r"\!10", "10"),
])
def test_math_equivalent(answer, truth):
    assert math_verify.is_equiv(answer, truth)


@pytest.mark.parametrize("answer,truth", [
    ("0.333", r"\frac{1}{3}"),
    ("(1,2)", "(2,1)"),
    ("12", "1,2"),
    (r"\sqrt{3}", r"\sqrt{2}"),
    ("2^{1000}", "2^{1001}"),  # refused by the size guard, not computed
])
def test_math_not_equivalent(answer, truth):
    assert not math_verify.is_equiv(answer, truth)


def test_math_compute_score():
    assert math_verify.compute_score(r"so \boxed{\dfrac{3}{4}}.", "0.75") == 1.0
    assert math_verify.compute_score(r"so \boxed{3/4}", r"The answer is $\boxed{\frac34}$") == 1.0
    assert math_verify.compute_score(r"so \boxed{1}", "2") == 0.0
    assert math_verify.compute_score("so 0.75", "0.75") == 0.0  # no boxed answer


# ---- built-in task reward + registry ---------------------------------------------------------

def test_arith_grades():
    assert arith.compute_score("7", "7") == {"score": 1.0, "acc": 1.0}
    assert arith.compute_score("7+3=", "7")["score"] == pytest.approx(0.5 - 3 * 0.1)
    assert arith.compute_score("12", "7") == {"score": 0.0, "acc": 0.0}
    assert arith.compute_score("7 ", "7")["score"] == pytest.approx(0.4)  # a space is an extra token
    assert arith.compute_score("7<pad>", "7")["score"] == pytest.approx(0.1)  # hidden junk is not clean
    assert arith.compute_score("+=", "7")["score"] == 0.0


def test_registry_dispatch_and_unknown_source(monkeypatch):
    assert default_compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    assert default_compute_score("HuggingFaceH4/MATH-500", r"\boxed{5}", "5") == 1.0
    assert default_compute_score("arith", "5", "5")["score"] == 1.0
    with pytest.raises(ValueError, match="no rule reward for data_source='mystery'.*openai/gsm8k"):
        default_compute_score("mystery", "5", "5")
    monkeypatch.setattr(registry, "REWARDS", dict(registry.REWARDS))  # keep the global table clean
    register_reward("test/always_half", lambda s, gt, extra=None: 0.5)
    assert "test/always_half" in known_data_sources()
    assert default_compute_score("test/always_half", "x", "y") == 0.5


# ---- manager -----------------------------------------------------------------------------------

def _responses(tokenizer, texts, length):
    """Right-padded [B, length] response ids (text + eos) and masks."""
    ids = torch.full((len(texts), length), tokenizer.pad_token_id)
    mask = torch.zeros(len(texts), length, dtype=torch.long)
    for i, text in enumerate(texts):
        seq = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
    return ids, mask


def test_last_token_index_non_contiguous_and_empty():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    assert last_token_index(mask).tolist() == [1, 3, 0, 2]


def test_manager_places_score_on_last_valid_token():
    tok = tasks.build_tokenizer()
    texts = ["7", "75", "3", "+*", "12"]
    truths = ["7", "7", "7", "7", "12"]
    ids, mask = _responses(tok, texts, length=6)
    manager = RewardManager(tok)
    token_rewards, extra = manager(ids, mask, truths, ["arith"] * 5)
    expected = [arith.compute_score(t, g)["score"] for t, g in zip(texts, truths)]
    assert token_rewards.shape == ids.shape and token_rewards.dtype == torch.float32
    for i, seq_len in enumerate(mask.sum(-1).tolist()):
        assert token_rewards[i, seq_len - 1].item() == pytest.approx(expected[i])
        assert token_rewards[i].abs().sum().item() == pytest.approx(abs(expected[i]))  # nowhere else
    assert extra["score"] == pytest.approx(expected)
    assert extra["acc"] == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_manager_does_not_hide_special_tokens_in_the_answer():
    tok = tasks.build_tokenizer()
    seven, eos, pad = tok.convert_tokens_to_ids("7"), tok.eos_token_id, tok.pad_token_id
    ids = torch.tensor([[pad, seven, eos, pad], [seven, pad, pad, pad], [seven, eos, pad, pad]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    manager = RewardManager(tok)
    assert manager.decode(ids, mask) == ["<pad>7", "7<pad><pad><pad>", "7"]
    rewards, _ = manager(ids, mask, ["7"] * 3, ["arith"] * 3)
    assert rewards.sum(-1).tolist() == pytest.approx([0.0, 0.1, 1.0])
    assert RewardManager(tok, skip_special_tokens=True).decode(ids, mask) == ["7", "7", "7"]


def test_manager_adds_reward_model_scores():
    tok = tasks.build_tokenizer()
    ids, mask = _responses(tok, ["7", "3"], length=4)
    model_scores = torch.tensor([0.25, -1.0])
    rewards, extra = RewardManager(tok)(ids, mask, ["7", "7"], ["arith", "arith"], model_scores=model_scores)
    assert rewards.sum(-1).tolist() == pytest.approx([1.0 + 0.25, 0.0 - 1.0])
    assert extra["model_score"] == pytest.approx([0.25, -1.0])
    only_model, _ = RewardManager(tok)(ids, mask, model_scores=model_scores)
    assert only_model[:, 1].tolist() == pytest.approx([0.25, -1.0])
    with pytest.raises(ValueError, match="ground_truths .* or model_scores"):
        RewardManager(tok)(ids, mask)


def test_ray_pool_matches_in_process():
    import ray  # noqa: F401  (in the dev extra: missing fails, never skips)
    tok = tasks.build_tokenizer()
    texts = ["7", "75", "3", "+*", "12", "8", "9"]
    truths = ["7", "7", "7", "7", "12", "8", "1"]
    ids, mask = _responses(tok, texts, length=6)
    local, local_extra = RewardManager(tok)(ids, mask, truths, ["arith"] * 7)
    pooled_manager = RewardManager(tok, num_workers=2)
    try:
        pooled, pooled_extra = pooled_manager(ids, mask, truths, ["arith"] * 7)
    finally:
        pooled_manager.close()
    assert torch.equal(local, pooled)
    assert local_extra == pooled_extra


# ---- preference pairs --------------------------------------------------------------------------

def test_margin_token_rewards_sum_to_margin():
    chosen = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    rejected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    r_chosen, r_rejected = margin_token_rewards(chosen, rejected, margin=0.6)
    assert r_chosen.sum(-1).tolist() == pytest.approx([0.6, 0.6])
    assert r_rejected.sum(-1).tolist() == pytest.approx([-0.6, -0.6])
    assert r_chosen[0].tolist() == pytest.approx([0.2, 0.2, 0.2, 0.0])
    assert (r_rejected[chosen.new_tensor([[0, 0, 1, 1], [0, 0, 0, 0]]).bool()] == 0).all()


def test_implicit_rewards_and_bradley_terry_probability():
    torch.manual_seed(0)
    policy, ref = torch.randn(2, 2, 5), torch.randn(2, 2, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    beta = 0.3
    chosen = implicit_token_rewards(policy[0], ref[0], mask, beta)
    rejected = implicit_token_rewards(policy[1], ref[1], mask, beta)
    for b in range(2):
        n = int(mask[b].sum())
        want = beta * (policy[0, b, :n] - ref[0, b, :n])
        assert torch.allclose(chosen[b, :n], want) and (chosen[b, n:] == 0).all()
    margin = chosen.sum(-1) - rejected.sum(-1)
    assert torch.allclose(pair_preference_probability(chosen, rejected), 1 / (1 + torch.exp(-margin)))
    with pytest.raises(ValueError, match="response_mask"):
        implicit_token_rewards(policy[0], ref[0], mask[:, :3], beta)


def test_reward_model_scorer_protocol():
    class ConstantScorer:
        def score(self, batch):
            return torch.zeros(len(batch))

    assert isinstance(ConstantScorer(), RewardModelScorer)
    assert not isinstance(object(), RewardModelScorer)


def test_reasoning_gym_rows_are_scored_by_the_tasks_own_verifier():
    from engine.rewards.reasoning_gym import extract_answer, make_rows
    from engine.rewards.registry import default_compute_score
    rows = make_rows("basic_arithmetic", 4, seed=3, split="val", min_terms=2, max_terms=2,
                     min_digits=1, max_digits=1)
    for row in rows:
        gt, src, extra = row["reward_model"]["ground_truth"], row["data_source"], row["extra_info"]
        assert src == "reasoning_gym/basic_arithmetic"
        assert default_compute_score(src, f"thinking...\nAnswer: {gt}", gt, extra)["score"] == 1.0
        wrong = str(int(gt) + 7)
        assert default_compute_score(src, f"Answer: {wrong}", gt, extra)["score"] < 1.0
        assert default_compute_score(src, f"{row['extra_info']['question']} = {gt}", gt, extra)["acc"] == 1.0
    assert extract_answer("5 - 3 = 2") == "2"
    assert extract_answer("Answer: -4.\nextra 7") == "-4"
    assert extract_answer("no digits here") == "no digits here"
