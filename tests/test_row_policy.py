"""One row policy (engine/data/rows.py) for prompt rows and preference pairs: the same error
type and messages, the same rules; the datasets and loaders ask it, so changing it changes both;
data.filter_overlong_prompts reads as truncation='filter' for every loader (PPO's prompts too)."""
import os

import pytest

from engine.data import PromptDataset, RowPolicy, truncation_of
from engine.data.preference import PreferenceDataset
from engine.errors import DataError
from engine.tasks import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
LONG = "1+1+1+1+1+1+1+1+1="  # 19 tokens with bos
DROP = "fix the data or set data.truncation='filter' to drop such rows"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _prompts(tok, rows, truncation):
    return PromptDataset([{"prompt": p, "reward_model": {"ground_truth": "1"}} for p in rows], tok,
                         max_prompt_length=8, truncation=truncation)


def _pairs(tok, rows, truncation):
    return PreferenceDataset([{"prompt": p, "chosen": "2", "rejected": "3"} for p in rows], tok,
                             max_prompt_length=8, max_response_length=3, truncation=truncation)


def test_the_policy_by_itself():
    for truncation, kept in (("left", [3, 4]), ("right", [1, 2])):
        p = RowPolicy(truncation, "row", ("c",))
        assert p.too_long("c", 0, "long") and p.truncated == 1 and p.cut([1, 2, 3, 4], 2) == kept
        with pytest.raises(DataError, match=f"row 7: empty; {DROP}"):
            p.bad("c", 7, "empty")
    f = RowPolicy("filter", "row", ("c",))
    assert f.bad("c", 0, "empty") is None and not f.too_long("c", 1, "long") and f.counts == {"c": 2}
    with pytest.raises(DataError, match="row 3 of 'x': long; shorten it"):
        RowPolicy("error", "row", where=" of 'x'").too_long("c", 3, "long", "shorten it")


@pytest.mark.parametrize("make", [_prompts, _pairs])
def test_both_datasets_follow_the_one_policy(tok, make):
    with pytest.raises(DataError, match=r"row 1: .*8.*; raise"):
        make(tok, ["1=", LONG], "error")
    with pytest.raises(DataError, match=rf"row 0: .*empty; {DROP}"):
        make(tok, [" "], "left")  # cutting fixes over-long rows only
    kept = make(tok, ["1=", LONG, " "], "filter")
    assert len(kept) == 1 and sum(kept.filter_counts.values()) == 2 and kept.num_truncated == 0
    cut = make(tok, ["1=", LONG], "left")
    assert len(cut) == 2 and cut.num_truncated == 1 and sum(cut.filter_counts.values()) == 0
    with pytest.raises(ValueError, match=r"data.truncation='middle'; choose one of \['error', 'filter'"):
        make(tok, ["1="], "middle")


@pytest.mark.parametrize("make", [_prompts, _pairs])
def test_a_rule_planted_in_the_policy_reaches_both_datasets(tok, make, monkeypatch):
    """Over-long rows cut even under 'error': only a dataset that asks the policy does so."""
    monkeypatch.setattr(RowPolicy, "too_long", lambda self, *a, **k: True)
    data = make(tok, [LONG], "error")
    assert len(data) == 1


def test_filter_overlong_prompts_is_filter_for_every_loader(tok):
    from engine.config import derive, load_config
    from engine.loading import load_datasets
    from engine.offline.build import load_pair_datasets
    short = ["data.max_prompt_length=6", "data.builtin_task_difficulty=2"]  # most prompts have 7 tokens
    cfg = load_config(DEMO, short + ["data.filter_overlong_prompts=true"])
    assert truncation_of(cfg.data) == "filter" == derive(cfg).config.data.truncation
    train, val = load_datasets(cfg, tok)
    assert train.filter_counts["data/filtered_overlong"] > 0 and len(train) > 0
    with pytest.raises(DataError, match="max_prompt_length=6"):
        load_datasets(load_config(DEMO, short), tok)
    pairs = load_config(os.path.join(ROOT, "recipes", "tiny_dpo_arith.yaml"),
                        short + ["data.filter_overlong_prompts=true"])
    train, _ = load_pair_datasets(pairs, tok)
    assert train.filter_counts["data/dropped_overlong"] > 0 and len(train) > 0
