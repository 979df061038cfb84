"""Prompt data: parquet round trip via tools/prepare_data.py, chat templates, bad-row policies,
seeded shuffling and exact mid-epoch resume."""
import json
import subprocess
import sys

import pytest
import torch

from engine import tasks
from engine.data import PromptDataset, PromptLoader, left_pad, read_prompt_rows, write_prompt_parquet
from tools import prepare_data

ROOT = prepare_data.__file__.rsplit("/tools/", 1)[0]


def _row(prompt, truth="1", source="arith", **extra):
    return {"data_source": source, "prompt": prompt, "reward_model": {"style": "rule", "ground_truth": truth},
            **extra}


@pytest.fixture(scope="module")
def tokenizer():
    return tasks.build_tokenizer()


def test_builtin_tokenizer_round_trip(tmp_path, tokenizer):
    from transformers import AutoTokenizer
    tasks.save_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = loaded("12+7=")["input_ids"]
    assert ids[0] == loaded.bos_token_id and len(ids) == 1 + len("12+7=")  # one token per character
    assert loaded.decode(ids, skip_special_tokens=True) == "12+7="
    assert loaded.chat_template == tokenizer.chat_template


def test_builtin_task_rows_are_reproducible_and_correct():
    train, val, _ = tasks.make_builtin_task("arith", seed=3, n_train=50, n_val=10, difficulty=2)
    again, _, _ = tasks.make_builtin_task("arith", seed=3, n_train=50, n_val=10, difficulty=2)
    assert train == again and train != tasks.make_builtin_task("arith", seed=4, n_train=50, n_val=10,
                                                               difficulty=2)[0]
    for row in train + val:
        expression = row["prompt"][0]["content"].rstrip("=")
        assert str(eval(expression)) == row["reward_model"]["ground_truth"]  # the written arithmetic
    copy, _, _ = tasks.make_builtin_task("copy", seed=0, n_train=5, n_val=1, difficulty=1)
    assert all(r["prompt"][0]["content"] == r["reward_model"]["ground_truth"] + "=" for r in copy)
    with pytest.raises(ValueError, match="unknown built-in task 'sort'"):
        tasks.make_builtin_task("sort")


def test_gsm8k_jsonl_to_parquet_cli(tmp_path, tokenizer):
    records = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
               {"question": "A car costs $1,200 and a bike $300. Total?", "answer": "1200+300\n#### 1,500"}]
    src = tmp_path / "gsm8k.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "data" / "train.parquet"
    subprocess.run([sys.executable, "tools/prepare_data.py", "--input", str(src), "--output", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    rows = read_prompt_rows(str(out))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1500"]
    assert {r["data_source"] for r in rows} == {"openai/gsm8k"}
    content = rows[1]["prompt"][0]["content"]
    assert content.startswith(records[1]["question"]) and content.endswith(prepare_data.GSM8K_INSTRUCTION)
    assert rows[1]["prompt"][0]["role"] == "user" and rows[1]["extra_info"]["answer"] == records[1]["answer"]


def test_gsm8k_bad_record_names_the_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "a #### 1"}) + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        prepare_data.gsm8k_rows(str(src))


def test_builtin_cli_writes_train_val_and_tokenizer(tmp_path):
    prepare_data.main(["--builtin", "arith", "--out-dir", str(tmp_path), "--n-train", "20", "--n-val", "4"])
    train, val = read_prompt_rows(str(tmp_path / "train.parquet")), read_prompt_rows(str(tmp_path / "val.parquet"))
    expected_train, expected_val, _ = tasks.make_builtin_task("arith", seed=0, n_train=20, n_val=4)
    assert train == expected_train and val == expected_val
    assert (tmp_path / "tokenizer" / "tokenizer.json").exists()


def test_chat_template_and_plain_text(tmp_path, tokenizer):
    rows = [_row([{"role": "user", "content": "3+4="}], "7"), _row("3+4=", "7")]
    path = str(tmp_path / "p.parquet")
    write_prompt_parquet(rows[:1], path)
    with_template = PromptDataset(path, tokenizer, max_prompt_length=16)
    rendered = tokenizer.apply_chat_template(rows[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert with_template[0]["input_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert with_template[0]["input_ids"] == [tokenizer.bos_token_id] + tokenizer.convert_tokens_to_ids(list("3+4="))
    plain = PromptDataset(rows[1:], tokenizer, max_prompt_length=16)
    assert plain[0]["input_ids"] == with_template[0]["input_ids"]  # post-processor adds bos
    no_template = PromptDataset(rows[:1], tokenizer, max_prompt_length=16, apply_chat_template=False)
    assert no_template[0]["input_ids"] == tokenizer("3+4=")["input_ids"]


def test_chat_template_of_a_real_chat_tokenizer(tokenizer):
    # a template with role markers: the rendered text, not the raw content, must be tokenized
    tokenizer = tasks.build_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}#{% endfor %}"
                               "{% if add_generation_prompt %}= {% endif %}")
    ds = PromptDataset([_row([{"role": "system", "content": "1"}, {"role": "user", "content": "2+2"}])],
                       tokenizer, max_prompt_length=16)
    assert tokenizer.decode(ds[0]["input_ids"]) == "1#2+2#= "


def _bad_rows():
    return [
        _row([{"role": "user", "content": "1+1="}], "2"),
        _row([{"role": "user", "content": "  "}], "2"),          # empty prompt
        _row("", "2"),                                          # empty prompt
        _row([{"role": "user", "content": "2+2="}], None),       # missing ground truth
        {"data_source": "arith", "prompt": "2+3="},              # missing reward_model
        _row("11111111+22222222=", "33333333"),                 # over-long (19 tokens > 8)
        _row("3+3=", "6"),
    ]


def test_filter_policy_counts_each_reason(tokenizer):
    ds = PromptDataset(_bad_rows(), tokenizer, max_prompt_length=8, truncation="filter")
    assert [ex["index"] for ex in ds] == [0, 6]
    assert ds.filter_counts == {"data/filtered_empty_prompt": 2, "data/filtered_missing_ground_truth": 2,
                                "data/filtered_overlong": 1}


@pytest.mark.parametrize("rows,message", [
    ([_row("1=", "1"), _row("", "2")], r"row 1: field 'prompt' is empty"),
    ([_row("1=", None)], r"row 0: field 'reward_model.ground_truth' is missing"),
    ([_row("1=", "1"), _row("123456789=", "1")], r"row 1: field 'prompt' has 11 tokens > data.max_prompt_length=8"),
])
def test_error_policy_names_row_and_field(tokenizer, rows, message):
    with pytest.raises(ValueError, match=message):
        PromptDataset(rows, tokenizer, max_prompt_length=8, truncation="error")


def test_left_and_right_truncation(tokenizer):
    rows = [_row("123456789=", "1"), _row("1=", "1")]
    full = tokenizer("123456789=")["input_ids"]
    left = PromptDataset(rows, tokenizer, max_prompt_length=4, truncation="left")
    right = PromptDataset(rows, tokenizer, max_prompt_length=4, truncation="right")
    assert left[0]["input_ids"] == full[-4:] and right[0]["input_ids"] == full[:4]
    assert left[1]["input_ids"] == right[1]["input_ids"] == tokenizer("1=")["input_ids"]
    assert left.num_truncated == right.num_truncated == 1
    with pytest.raises(ValueError, match="empty"):  # truncation cannot fix an empty prompt
        PromptDataset([_row("", "1")], tokenizer, max_prompt_length=4, truncation="left")


def test_model_style_rows_need_no_ground_truth(tokenizer):
    row = {"data_source": "hh", "prompt": "1=", "reward_model": {"style": "model", "ground_truth": None}}
    assert len(PromptDataset([row], tokenizer, max_prompt_length=8)) == 1


def test_bad_settings(tokenizer):
    with pytest.raises(ValueError, match="data.truncation='middle'"):
        PromptDataset([_row("1=")], tokenizer, max_prompt_length=8, truncation="middle")
    with pytest.raises(ValueError, match="data.prompt_key"):
        PromptDataset([_row("1=")], tokenizer, max_prompt_length=8, prompt_key="question")
    ds = PromptDataset([_row("1=")] * 3, tokenizer, max_prompt_length=8)
    with pytest.raises(ValueError, match="train_batch_size=4"):
        PromptLoader(ds, batch_size=4)


def _dataset(tokenizer, n=23):
    rows, _, _ = tasks.make_builtin_task("arith", seed=1, n_train=n, n_val=1, difficulty=2)
    return PromptDataset(rows, tokenizer, max_prompt_length=16)


def _indices(loader, n_batches):
    return [loader.next_batch().indices for _ in range(n_batches)]


def test_shuffle_is_a_seeded_permutation_per_epoch(tokenizer):
    ds = _dataset(tokenizer)
    loader = PromptLoader(ds, batch_size=5, seed=7)  # 4 batches/epoch, 3 rows dropped
    epoch0, epoch1 = _indices(loader, 4), _indices(loader, 4)
    expected0 = torch.randperm(23, generator=torch.Generator().manual_seed(7)).tolist()[:20]
    assert sum(epoch0, []) == expected0
    assert sum(epoch1, []) == torch.randperm(23, generator=torch.Generator().manual_seed(8)).tolist()[:20]
    assert _indices(PromptLoader(ds, batch_size=5, seed=7), 8) == epoch0 + epoch1
    assert _indices(PromptLoader(ds, batch_size=5, seed=9), 4) != epoch0
    in_order = PromptLoader(ds, batch_size=5, shuffle=False, drop_last=False)
    assert len(in_order) == 5 and sum((b.indices for b in in_order), []) == list(range(23))


@pytest.mark.parametrize("stop_after", [2, 4, 6])  # mid-epoch, exactly at an epoch end, next epoch
def test_exact_resume(tokenizer, stop_after):
    ds = _dataset(tokenizer)
    uninterrupted = _indices(PromptLoader(ds, batch_size=5, seed=3), 10)
    first = PromptLoader(ds, batch_size=5, seed=3)
    head = _indices(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = PromptLoader(ds, batch_size=5, seed=3)
    resumed.load_state_dict(state)
    assert head + _indices(resumed, 10 - stop_after) == uninterrupted


def test_resume_through_epoch_iterators(tokenizer):
    ds = _dataset(tokenizer)
    reference = PromptLoader(ds, batch_size=5, seed=0)
    uninterrupted = [b.indices for _ in range(2) for b in reference]
    first = PromptLoader(ds, batch_size=5, seed=0)
    head = []
    for batch in first:
        head.append(batch.indices)
        if len(head) == 3:
            break
    resumed = PromptLoader(ds, batch_size=5, seed=0)
    resumed.load_state_dict(first.state_dict())
    tail = [b.indices for b in resumed] + [b.indices for b in resumed]
    assert head + tail == uninterrupted
    assert resumed.epoch == 1
    with pytest.raises(ValueError, match="seed=0 but this run has 1"):
        PromptLoader(ds, batch_size=5, seed=1).load_state_dict(first.state_dict())


def test_batch_fields_and_left_pad_collate(tokenizer):
    ds = _dataset(tokenizer)
    batch = PromptLoader(ds, batch_size=4, seed=0).next_batch()
    assert [ds.examples[i]["ground_truth"] for i in batch.indices] == batch.ground_truths  # indices == positions
    assert batch.data_sources == ["arith"] * 4 and len(batch.raw_prompts) == 4
    ids, mask = batch.collate(tokenizer.pad_token_id)
    for row, seq in enumerate(batch.input_ids):
        n = len(seq)
        assert ids[row, ids.shape[1] - n:].tolist() == seq and mask[row].tolist() == [0] * (ids.shape[1] - n) + [1] * n
        assert (ids[row, :ids.shape[1] - n] == tokenizer.pad_token_id).all()
    padded, _ = left_pad([[5]], pad_token_id=0, length=3)
    assert padded.tolist() == [[0, 0, 5]]
    with pytest.raises(ValueError, match="sequence 0 has 4 tokens > pad length 3"):
        left_pad([[1, 2, 3, 4]], 0, length=3)


def test_prefetch_builds_the_next_batch_in_the_background_and_resumes_exactly(tokenizer):
    """data.dataloader_num_workers: the same batches and positions as without it, while every
    batch after the first was built by the prefetch thread."""
    import threading

    ds = _dataset(tokenizer)

    class Recording:
        def __init__(self):
            self.threads = []

        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            self.threads.append(threading.current_thread().name)
            return ds[i]

    plain = PromptLoader(ds, batch_size=5, seed=3)
    rec = Recording()
    ahead = PromptLoader(rec, batch_size=5, seed=3, prefetch=1)
    for step in range(9):  # crosses an epoch boundary (4 batches per epoch)
        assert ahead.next_batch().indices == plain.next_batch().indices
        assert ahead.state_dict() == plain.state_dict()
    assert rec.threads[:5] == ["MainThread"] * 5  # only the first batch on the caller's thread
    assert set(rec.threads[5:]) and all(t.startswith("prefetch") for t in rec.threads[5:])
    resumed = PromptLoader(ds, batch_size=5, seed=3, prefetch=1)
    resumed.load_state_dict(ahead.state_dict())
    assert resumed.next_batch().indices == plain.next_batch().indices
