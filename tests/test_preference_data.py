"""Preference pairs: every supported row format tokenizes to the same pair, bad rows follow
data.truncation with counts, pairs stay whole in micro-batches, and prepare_data writes them."""
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch

from engine.data.preference import (PreferenceDataset, arith_pairs, pair_batch,
                                 write_preference_parquet)
from engine.tasks import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _ids(tok, text):  # characters -> ids straight from the vocabulary
    return tok.convert_tokens_to_ids(list(text))


def _dataset(rows, tok, **kw):
    kw = dict(dict(max_prompt_length=8, max_response_length=3), **kw)
    return PreferenceDataset(rows, tok, **kw)


def test_every_format_gives_the_same_pair(tok):
    user = [{"role": "user", "content": "3+4="}]
    rows = [
        {"prompt": "3+4=", "chosen": "7", "rejected": "5"},                          # text
        {"prompt": user, "chosen": "7", "rejected": "5"},                            # chat prompt
        {"prompt": "unused", "chosen": user + [{"role": "assistant", "content": "7"}],  # UltraFeedback
         "rejected": user + [{"role": "assistant", "content": "5"}]},
        {"chosen": user + [{"role": "assistant", "content": "7"}],                   # HH: no prompt
         "rejected": user + [{"role": "assistant", "content": "5"}]},
    ]
    data = _dataset(rows, tok)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    for ex in data.examples:
        assert ex["prompt_ids"] == [bos] + _ids(tok, "3+4=")
        assert ex["chosen_ids"] == _ids(tok, "7") + [eos]
        assert ex["rejected_ids"] == _ids(tok, "5") + [eos]
    assert len(data) == 4


def test_bad_rows_follow_the_truncation_policy(tok):
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},        # good
        {"prompt": " ", "chosen": "2", "rejected": "3"},           # empty prompt
        {"prompt": "1+1=", "chosen": "", "rejected": "3"},         # empty response
        {"prompt": "1+1=", "chosen": "2", "rejected": "2"},        # identical
        {"prompt": "1+1+1+1+1=", "chosen": "5", "rejected": "4"},  # prompt of 11 tokens > 8
        {"prompt": "1+1=", "chosen": "2222", "rejected": "3"},     # response 5 tokens > 3
    ]
    data = _dataset(rows, tok, truncation="filter")
    assert [e["index"] for e in data.examples] == [0]
    assert data.metrics == {"data/dropped_empty": 2, "data/dropped_identical": 1,
                            "data/dropped_overlong": 2, "data/truncated_pairs": 0}
    for i, needle in ((1, "empty"), (3, "same response"), (4, "max_prompt_length=8")):
        with pytest.raises(ValueError, match=rf"row 1: .*{needle}.*truncation"):
            _dataset([rows[0], rows[i]], tok, truncation="error")
    left = _dataset([rows[4], rows[5]], tok, truncation="left")
    assert left.examples[0]["prompt_ids"] == _ids(tok, "1+1+1+1+1=")[-8:]
    assert left.examples[1]["chosen_ids"] == _ids(tok, "222")  # cut at the end (eos too)
    right = _dataset([rows[4]], tok, truncation="right")
    assert right.examples[0]["prompt_ids"] == [tok.bos_token_id] + _ids(tok, "1+1+1+1")
    assert left.metrics["data/truncated_pairs"] == 2
    with pytest.raises(ValueError, match="row 1: .*empty"):  # cutting does not fix other rows
        _dataset([rows[0], rows[1]], tok, truncation="left")
    # responses equal within the limit: nothing to prefer once cut
    with pytest.raises(ValueError, match="identical within data.max_response_length"):
        _dataset([{"prompt": "1=", "chosen": "1234", "rejected": "1235"}], tok, truncation="left")


def test_malformed_rows_raise_naming_the_fix(tok):
    user = [{"role": "user", "content": "1+1="}]
    with pytest.raises(ValueError, match="last message has role 'user'"):
        _dataset([{"chosen": user, "rejected": user}], tok)
    other = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    with pytest.raises(ValueError, match="differ before their last assistant turn"):
        _dataset([{"chosen": user + [{"role": "assistant", "content": "2"}], "rejected": other}],
                 tok)
    with pytest.raises(ValueError, match="no column 'better'.*data.chosen_key"):
        _dataset([{"prompt": "1=", "chosen": "1", "rejected": "2"}], tok, chosen_key="better")
    with pytest.raises(ValueError, match="'margin' is None.*data.margin_key=null"):
        _dataset([{"prompt": "1=", "chosen": "1", "rejected": "2"}], tok, margin_key="margin")
    with pytest.raises(ValueError, match="ref_rejected_logps.*precomputed_ref_log_probs=false"):
        _dataset([{"prompt": "1=", "chosen": "1", "rejected": "2", "ref_chosen_logps": -1.0,
                   "ref_rejected_logps": float("nan")}], tok, ref_columns=True)


def test_parquet_round_trip_with_margin_and_ref_columns(tmp_path, tok):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "chosen": str(i + 1),
             "rejected": str(i + 2), "margin": 0.5 * i, "ref_chosen_logps": -1.0 - i,
             "ref_rejected_logps": -2.0 - i} for i in range(4)]
    path = str(tmp_path / "pairs.parquet")
    write_preference_parquet(rows, path)
    data = _dataset([path], tok, margin_key="margin", ref_columns=True)
    batch = pair_batch(data.examples, tok.pad_token_id)
    assert batch["pair_margin"].tolist() == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.5, 1.5]
    assert batch["ref_logps"].tolist() == [-1.0, -2.0, -2.0, -3.0, -3.0, -4.0, -4.0, -5.0]
    # a directory of parquet files is one table, as for prompts (HF sources: tests/test_data_sources.py)
    assert len(_dataset([str(tmp_path)], tok)) == 4
    with pytest.raises(ValueError, match="column 'chosen' holds text .* and messages"):
        write_preference_parquet([rows[0], dict(rows[1], chosen=rows[1]["prompt"])],
                                 str(tmp_path / "mixed.parquet"))


def test_pair_batch_layout_and_whole_pairs_in_micro_batches(tok):
    from engine.workers.pairs import pair_groups
    from engine.workers.base import sample_sequences
    examples = [dict(index=i, prompt_ids=list(range(4, 5 + i)), chosen_ids=[7] * (1 + i % 3),
                     rejected_ids=[9] * (3 - i % 3)) for i in range(5)]
    batch = pair_batch(examples, pad_token_id=0)
    seqs = sample_sequences(batch)  # what the workers feed the model
    for i, ex in enumerate(examples):
        for k, key in ((0, "chosen_ids"), (1, "rejected_ids")):
            seq, plen, rlen = seqs[2 * i + k]
            assert seq.tolist() == ex["prompt_ids"] + ex[key]
            assert (plen, rlen) == (len(ex["prompt_ids"]), len(ex[key]))
    assert pair_groups(batch, micro_pairs=2) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    lengths = batch["attention_mask"].sum(-1).view(5, 2).sum(-1).tolist()  # 6 .. 14 tokens
    groups = pair_groups(batch, max_tokens=16)
    assert sorted(r for g in groups for r in g) == list(range(10))
    for g in groups:
        assert all(g[j + 1] == g[j] + 1 and g[j] % 2 == 0 for j in range(0, len(g), 2))
        assert sum(lengths[r // 2] for r in g[0::2]) <= 16
    with pytest.raises(ValueError, match="pair of 14 tokens.*ppo_max_token_len_per_gpu"):
        pair_groups(batch, max_tokens=13)


def test_arith_pairs_prefer_the_correct_answer():
    import re
    for level in (0, 1, 2):
        pairs = arith_pairs(200, seed=0, difficulty=level)
        for p in pairs:
            a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", p["prompt"][0]["content"]).groups()
            answer = int(a) + int(b) if op == "+" else int(a) - int(b)
            assert p["chosen"] == str(answer) and p["rejected"] != p["chosen"]
            int(p["rejected"])
    # the wrong answers span the correct answers' range: the answer alone gives nothing away
    assert {p["rejected"] for p in arith_pairs(200, 0)} == {str(v) for v in range(9)}
    assert arith_pairs(8, 0) == arith_pairs(8, 0) != arith_pairs(8, 0, split="test")


def _prepare(*args, cwd):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools/prepare_data.py"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_prepare_data_writes_pairs(tmp_path, tok):
    lines = [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 1.0},
             {"prompt": "1+1=", "chosen": "2", "rejected": "2", "margin": 0.0},
             {"prompt": "", "chosen": "2", "rejected": "3", "margin": 0.0},
             {"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": 0.5}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = _prepare("--pairs", "--input", "p.jsonl", "--output", "d/p.parquet", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert '"data/dropped_empty": 1, "data/dropped_identical": 1' in out.stdout
    rows = pq.read_table(tmp_path / "d/p.parquet").to_pylist()
    assert [r["chosen"] for r in rows] == ["2", "4"] and rows[1]["margin"] == 0.5
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1=", "chosen": "1"}\n')
    out = _prepare("--pairs", "--input", "bad.jsonl", "--output", "b.parquet", cwd=tmp_path)
    assert out.returncode == 2 and "bad.jsonl:1" in out.stderr and "rejected" in out.stderr
    out = _prepare("--pairs", "--builtin", "arith", "--out-dir", "arith", "--n-train", "16",
                   "--n-val", "4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    data = _dataset([str(tmp_path / "arith/train.parquet")], tok)
    assert len(data) == 16 and os.path.isdir(tmp_path / "arith/tokenizer")
    assert len(pq.read_table(tmp_path / "arith/val.parquet")) == 4
    assert torch.equal(torch.tensor(data[0]["prompt_ids"][:1]), torch.tensor([tok.bos_token_id]))
