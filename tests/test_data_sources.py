"""Data from a HF `datasets` directory (save_to_disk, one split or several), a dataset's data files
with split names, JSON lines, and a user's dataset class (data.custom_cls), against the same
rows read from parquet: the same examples, the same row policy and error lines; the real
`datasets` package writes every source here. Then 2 training steps of the tiny demo from a HF
directory and from a custom class."""
import json
import os
import sys

import datasets  # the hf extra, in dev: missing fails, never skips
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.config import ConfigError, load_config
from engine.data import PromptDataset
from engine.data.preference import PreferenceDataset
from engine.data.sources import Rows, rows_or_files
from engine.errors import DataError
from engine.tasks import build_tokenizer, make_builtin_task


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
LONG = "1+1+1+1+1+1+1+1+1="  # 19 tokens with bos
BAD = [{"prompt": "1+2=", "reward_model": {"ground_truth": "3"}, "data_source": "arith"},
       {"prompt": "  ", "reward_model": {"ground_truth": "1"}, "data_source": "arith"},
       {"prompt": "2+2=", "reward_model": {"ground_truth": ""}, "data_source": "arith"},
       {"prompt": LONG, "reward_model": {"ground_truth": "9"}, "data_source": "arith"}]

CUSTOM = '''
import json
class ArithRows:
    """A user's dataset: JSON-lines files of {"q", "a"} -> rows in the data schema."""
    def __init__(self, data_files, tokenizer, config):
        self.rows = []
        for path in data_files:
            for line in open(path):
                r = json.loads(line)
                self.rows.append({"prompt": r["q"], "reward_model": {"ground_truth": r["a"]},
                                  "data_source": "arith", "extra_info": {"from": config["prompt_key"]}})
    def __len__(self):
        return len(self.rows)
    def __getitem__(self, i):
        return self.rows[i]

class VerlStyle:  # verl's RLHFDataset items: tokenized tensors
    def __init__(self, data_files, tokenizer, config, processor=None):
        self.n = 2
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return {"input_ids": [1, 2], "attention_mask": [1, 1]}

class NoConfig:
    def __init__(self, data_files):
        pass
'''


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _examples(ds):
    return [(e["input_ids"], e["ground_truth"], e["data_source"]) for e in ds.examples]


def _error(make):
    with pytest.raises(DataError) as e:
        make()
    return str(e.value)


def test_hf_directory_and_files_give_the_parquet_rows(tok, tmp_path):
    train, val, _ = make_builtin_task("arith", seed=3, n_train=12, n_val=5)
    pq.write_table(pa.Table.from_pylist(train), tmp_path / "train.parquet")
    datasets.Dataset.from_list(train).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(val)}).save_to_disk(str(tmp_path / "dict"))
    hub = tmp_path / "hub" / "data"  # a hub dataset's layout: split names in the file names
    hub.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(train), hub / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(val), hub / "test-00000-of-00001.parquet")
    datasets.Dataset.from_list(train).to_json(str(tmp_path / "train.jsonl"))
    reference = _examples(PromptDataset([str(tmp_path / "train.parquet")], tok, max_prompt_length=32))
    for source, split in (("saved", "train"), ("dict", "train"), ("hub", "train"), ("train.jsonl", "train")):
        data = rows_or_files([str(tmp_path / source)], split)
        assert isinstance(data, Rows)
        assert _examples(PromptDataset(data, tok, max_prompt_length=32)) == reference, source
    val_ref = _examples(PromptDataset(val, tok, max_prompt_length=32))
    for source in ("dict", "hub"):  # val_split null: 'validation', else 'test'
        got = _examples(PromptDataset(rows_or_files([str(tmp_path / source)], None, "data.val_files"), tok,
                                      max_prompt_length=32))
        assert got == val_ref, source
    assert rows_or_files([str(tmp_path / "train.parquet")]) == [str(tmp_path / "train.parquet")]  # as before
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=",\nnot json\n')
    assert _error(lambda: rows_or_files([str(tmp_path / "bad.jsonl")])) == (
        f"data.train_files {str(tmp_path / 'bad.jsonl')!r} could not be read as a HF dataset (JSON parse error: "
        "Missing a name for object member. in row 0); check the files or convert them to parquet")
    msg = _error(lambda: rows_or_files([str(tmp_path / "dict")], "validation", "data.val_files"))
    assert msg == (f"data.val_files {str(tmp_path / 'dict')!r} has no split 'validation' (its splits: "
                   "['train', 'test']); set data.val_split to one of them")


def test_bad_rows_give_the_parquet_error_lines(tok, tmp_path):
    pq.write_table(pa.Table.from_pylist(BAD), tmp_path / "bad.parquet")
    datasets.Dataset.from_list(BAD).save_to_disk(str(tmp_path / "bad"))
    pairs = [{"prompt": "1+1=", "chosen": "2", "rejected": "2"}]
    pq.write_table(pa.Table.from_pylist(pairs), tmp_path / "pairs.parquet")
    datasets.Dataset.from_list(pairs).save_to_disk(str(tmp_path / "pairs"))
    for policy in ("error", "filter", "left"):
        drop = BAD[:1] + BAD[2:] if policy == "left" else BAD[:3]  # left: the empty row stops it first
        for rows in ([BAD[1]], [BAD[2]], [BAD[3]], drop):
            pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
            datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "d"))
            outs = []
            for source in ("p.parquet", "d"):
                path = str(tmp_path / source)

                def make():
                    return PromptDataset(rows_or_files([path]), tok, max_prompt_length=8, truncation=policy)
                try:
                    ds = make()
                    outs.append(("ok", _examples(ds), ds.filter_counts, ds.num_truncated))
                except DataError as e:
                    outs.append(("error", str(e).replace(path, "SOURCE")))
            assert outs[0] == outs[1], (policy, rows, outs)
    line = _error(lambda: PromptDataset(rows_or_files([str(tmp_path / "bad")]), tok, max_prompt_length=8))
    assert line == (f"prompt data row 1 of {str(tmp_path / 'bad')!r}: field 'prompt' is empty; fix the data "
                    "or set data.truncation='filter' to drop such rows")
    for policy in ("error", "filter"):  # pairs read the same from a HF directory (one reader)
        outs = []
        for source in ("pairs.parquet", "pairs"):
            try:
                ds = PreferenceDataset([str(tmp_path / source)], tok, max_prompt_length=8, max_response_length=4,
                                       truncation=policy)
                outs.append(("ok", len(ds), ds.filter_counts))
            except DataError as e:
                outs.append(("error", str(e)))
        assert outs[0] == outs[1] and outs[0][0] == ("error" if policy == "error" else "ok")


def test_sft_conversations_from_a_hf_directory(tmp_path):
    from engine.data.sft import SFTDataset, tool_conversations
    from engine.tasks import build_agent_tokenizer
    agent = build_agent_tokenizer()
    rows = tool_conversations(6, 0, 0, "train")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sft.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "sft"))
    got = [SFTDataset(rows_or_files([str(tmp_path / source)]), agent, 600).examples
           for source in ("sft.parquet", "sft")]
    assert len(got[0]) == 6 and got[0] == got[1]


def test_without_the_datasets_package_one_line(tok, tmp_path, monkeypatch):
    datasets.Dataset.from_list(BAD[:1]).save_to_disk(str(tmp_path / "saved"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    line = _error(lambda: rows_or_files([str(tmp_path / "saved")], "train"))
    assert line == (f"data.train_files {str(tmp_path / 'saved')!r} is a HF dataset (directory or JSON); reading "
                    "it needs the `datasets` package: pip install trident-rl[hf] (or convert it to parquet)")
    setup = open(os.path.join(ROOT, "setup.py")).read()  # the extra the line names exists, and dev has it
    pin = f'"datasets=={datasets.__version__}"'
    assert f'"hf": [{pin}]' in setup and setup.count(pin) == 2


def test_custom_dataset_class(tok, tmp_path):
    (tmp_path / "mine.py").write_text(CUSTOM)
    (tmp_path / "a.jsonl").write_text('{"q": "1+2=", "a": "3"}\n{"q": "  ", "a": "1"}\n')
    mine = str(tmp_path / "mine.py")

    def build(name, policy="error"):
        rows = rows_or_files([str(tmp_path / "a.jsonl")], custom=(mine, name), tokenizer=tok,
                             config={"prompt_key": "prompt"})
        return PromptDataset(rows, tok, max_prompt_length=8, truncation=policy)
    ds = build("ArithRows", "filter")
    assert [e["ground_truth"] for e in ds.examples] == ["3"] and ds.filter_counts["data/filtered_empty_prompt"] == 1
    assert ds.examples[0]["extra_info"] == {"from": "prompt"}
    assert _error(lambda: build("ArithRows")) == (
        f"prompt data row 1 of ArithRows({str(tmp_path / 'a.jsonl')!r}): field 'prompt' is empty; fix the data or "
        "set data.truncation='filter' to drop such rows")
    assert "item 0 is ['attention_mask', 'input_ids'], tokenized or not a dict; Trident's dataset class returns " \
           "rows in the data schema" in _error(lambda: build("VerlStyle"))
    assert _error(lambda: build("NoConfig")).startswith(
        "data.custom_cls.name='NoConfig': NoConfig(data_files=..., tokenizer=..., config=...) failed")
    assert _error(lambda: build("Nope")) == (f"data.custom_cls.name='Nope': {mine!r} defines no class of that "
                                             "name; set it to the dataset class")
    with pytest.raises(ConfigError, match=r"data.custom_cls.name=None: name the dataset class"):
        load_config(DEMO, [f"data.custom_cls.path={mine}"])
    with pytest.raises(ConfigError, match=r"data.custom_cls.path='.*mine.py': data.builtin_task is set too"):
        load_config(DEMO, [f"data.custom_cls.path={mine}", "data.custom_cls.name=ArithRows"])


# ---- 2 training steps of the tiny demo from each source ---------------------------------------

def _two_steps(tmp, overrides):
    import torch.distributed as dist

    from engine.train import build
    from engine.trainer import Trainer, set_seed
    cfg = load_config(DEMO, [
        "trainer.n_gpus_per_node=1", "trainer.logger=[]", "trainer.resume_mode=disable", "trainer.save_freq=-1",
        "trainer.test_freq=-1", f"trainer.default_local_dir={tmp}/ckpt", f"trainer.log_dir={tmp}/logs",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "data.builtin_task=null",
        f"actor_rollout_ref.model.tokenizer_path={tmp}/tok", *overrides])
    set_seed(cfg.trainer.seed + dist.get_rank())
    t = Trainer(*build(cfg, 1))
    scores = []
    for _ in range(2):
        scores.append(t.train_step(t.loader.next_batch())["critic/score/mean"])
        t.step_count += 1
    t.colocated.to_training()
    t.rollout.shutdown()
    return dict(rows=len(t.loader.dataset), scores=scores, steps=t.step_count)


def test_two_steps_from_a_hf_directory_and_a_custom_class(tmp_path):
    from engine.tasks import save_tokenizer
    from tests.multirank import run_on_ranks
    train, _, _ = make_builtin_task("arith", seed=1, n_train=16, n_val=4)
    save_tokenizer(str(tmp_path / "tok"))
    datasets.Dataset.from_list(train).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "mine.py").write_text(CUSTOM)
    with open(tmp_path / "q.jsonl", "w") as f:
        for row in train:
            f.write(json.dumps({"q": row["prompt"], "a": row["reward_model"]["ground_truth"]}) + "\n")
    hf = run_on_ranks(_two_steps, 1, str(tmp_path), [f"data.train_files={tmp_path}/saved"])[0]
    custom = run_on_ranks(_two_steps, 1, str(tmp_path), [
        f"data.train_files={tmp_path}/q.jsonl", f"data.custom_cls.path={tmp_path}/mine.py",
        "data.custom_cls.name=ArithRows"])[0]
    for run in (hf, custom):
        assert run["rows"] == 16 and run["steps"] == 2 and len(run["scores"]) == 2
