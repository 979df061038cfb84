"""The offline trainers end to end: `torchrun -m engine.train` on the tiny recipes (2 CPU ranks).

The reward model trained on arith pairs reaches >= 90% held-out pairwise accuracy; its HF export
loads into the PPO path (`reward_model.enable=true`, `reward_model.model.path`), where
RewardModelWorker scores the held-out pairs to the same accuracy (and transformers' own
LlamaForSequenceClassification to the same scores); the convert tool exports its Megatron
checkpoint to the same HF model. DPO on the same pairs raises held-out preference accuracy.
In process: DPO from precomputed reference columns updates exactly as with the reference
model, and a resumed reward-model run ends where an uninterrupted one does.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(tmp, recipe, *extra, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "engine.train", os.path.join(ROOT, "recipes", recipe),
           f"trainer.default_local_dir={tmp}/ckpt", f"trainer.log_dir={tmp}/logs",
           "trainer.logger=[console,jsonl]", *extra]
    out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    lines = (tmp / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm")
    records = _torchrun(tmp, "tiny_rm_arith.yaml")  # 128 steps, checkpoints at 64 and 128
    return tmp, records


def test_reward_model_reaches_90_percent_held_out(rm_run):
    _, records = rm_run
    val = {r["step"]: r["val/accuracy"] for r in records if "val/accuracy" in r}
    print(f"RM held-out pairwise accuracy by step: {val}")
    assert val[0] < 0.7 and val[128] >= 0.9
    last = records[-1]
    assert last["step"] == 128 and last["data/dropped_overlong"] == 0
    for key in ("loss", "accuracy", "margin", "grad_norm", "val/loss", "val/margin"):
        assert key in last, key


def _val_batch():
    from engine.offline.build import BUILTIN_VAL_PAIRS
    from engine.data.preference import PreferenceDataset, arith_pairs, pair_batch
    from engine.tasks import build_tokenizer
    tok = build_tokenizer()  # the recipe's data: builtin arith, seed 1, difficulty 0
    data = PreferenceDataset(arith_pairs(BUILTIN_VAL_PAIRS, 1, 0, "test"), tok, 16, 4)
    return pair_batch(data.examples, tok.pad_token_id)


def _ppo_reward_model_scores(hf_dir, batch):
    """The PPO recipe's own build with the trained RM enabled; its RewardModelWorker scores."""
    from engine.config import load_config
    from engine.train import build
    cfg = load_config(os.path.join(ROOT, "recipes/tiny_cpu_demo.yaml"), [
        "reward_model.enable=true", f"reward_model.model.path={hf_dir}",
        "reward_model.micro_batch_size_per_gpu=32", "trainer.save_freq=-1",
        "trainer.resume_mode=disable"])
    _, components = build(cfg, 2)
    try:
        return components.reward_model.compute_scores(batch)
    finally:
        components.rollout.shutdown()


def test_trained_reward_model_scores_the_same_in_the_ppo_path(rm_run):
    import transformers
    tmp, records = rm_run
    hf_dir = str(tmp / "ckpt" / "hf" / "step_128")
    batch = _val_batch()
    scores = run_on_ranks(_ppo_reward_model_scores, 2, hf_dir, batch)[0]
    accuracy = float((scores[0::2] > scores[1::2]).float().mean())
    print(f"PPO-path RewardModelWorker held-out accuracy: {accuracy:.4f}")
    assert accuracy == pytest.approx(records[-1]["val/accuracy"], abs=1e-9)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    with torch.no_grad():  # one sequence at a time: no padding to locate
        hf = torch.stack([model(input_ids=ids[m.bool()][None]).logits[0, 0] for ids, m in
                          zip(batch["input_ids"], batch["attention_mask"])])
    torch.testing.assert_close(scores, hf, atol=1e-4, rtol=1e-4)


def test_convert_tool_exports_the_reward_model_checkpoint(rm_run):
    from safetensors.torch import load_file
    tmp, _ = rm_run
    ckpt = tmp / "ckpt"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools/convert_checkpoint.py"),
                          "mcore-to-hf", "--ckpt", str(ckpt / "global_step_128" / "reward_model"),
                          "--hf-config", str(ckpt / "hf_config"), "--out", str(tmp / "converted")],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]

    def tensors(d):
        t = {}
        for f in sorted(d.glob("*.safetensors")):
            t.update(load_file(str(f)))
        return t
    a, b = tensors(tmp / "converted"), tensors(ckpt / "hf" / "step_128")
    assert "score.weight" in a and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.loads((tmp / "converted" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]


def test_dpo_raises_held_out_preference_accuracy(tmp_path):
    records = _torchrun(tmp_path, "tiny_dpo_arith.yaml", "trainer.save_freq=-1")
    val = {r["step"]: (r["val/rewards/accuracies"], r["val/logps/accuracies"])
           for r in records if "val/rewards/accuracies" in r}
    print(f"DPO held-out (log-ratio accuracy, policy preference accuracy) by step: {val}")
    (ratio0, pref0), (ratio1, pref1) = val[0], val[max(val)]
    assert ratio0 == 0.0  # policy == reference: every log-ratio ties
    assert ratio1 >= 0.8 and pref1 >= pref0 + 0.2
    last = records[-1]
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                "rewards/margins", "timing_s/ref", "val/loss"):
        assert key in last, key
    assert (tmp_path / "ckpt" / "hf" / f"step_{last['step']}" / "config.json").exists()


# -- in process ------------------------------------------------------------------------------
def _offline_cfg(recipe, tmp, *extra):
    from engine.config import load_config
    return load_config(os.path.join(ROOT, "recipes", recipe), [
        "trainer.total_training_steps=4", "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.save_hf=false",
        "trainer.logger=[jsonl]", f"trainer.log_dir={tmp}/logs", f"trainer.default_local_dir={tmp}/ck",
        *extra])


def _train(recipe, tmp, *extra, ref_logps_of=None):
    """Build and fit on these ranks; (final weights, metrics records, ref log-probs of the
    `ref_logps_of` examples under the initial reference)."""
    from engine.offline.build import build_offline
    from engine.data.preference import pair_batch
    from engine.workers.pairs import sequence_log_probs
    from parallel.shards import iter_global
    import torch.distributed as dist

    from engine.trainer import set_seed
    cfg = _offline_cfg(recipe, tmp, *extra)
    set_seed(cfg.trainer.seed + dist.get_rank())  # as engine.train.main: the CPU init draws on it
    trainer = build_offline(cfg, 2)
    ref = None
    if ref_logps_of is not None:
        ref = sequence_log_probs(trainer.ref, pair_batch(ref_logps_of, trainer.pad_id),
                                 micro_batch_size=16)
    built_ref = getattr(trainer, "ref", None) is not None
    trainer.fit()
    weights = dict(iter_global(trainer.model.chunks, "param"))
    records = [json.loads(x) for x in open(f"{tmp}/logs/metrics.jsonl")] if trainer.rank == 0 \
        else None
    return weights, records, ref, built_ref


def test_dpo_from_precomputed_reference_columns_matches_the_reference_model(tmp_path):
    from engine.data.preference import PreferenceDataset, arith_pairs, write_preference_parquet
    from engine.tasks import build_tokenizer, save_tokenizer
    tok = build_tokenizer()
    save_tokenizer(str(tmp_path / "tok"))
    rows = {"train": arith_pairs(32, 5), "val": arith_pairs(8, 5, split="test")}
    for split, r in rows.items():
        write_preference_parquet(r, str(tmp_path / f"{split}.parquet"))
    files = ["data.builtin_task=null", f"actor_rollout_ref.model.tokenizer_path={tmp_path}/tok",
             "trainer.test_freq=2", "trainer.save_freq=-1", "trainer.resume_mode=disable"]
    examples = {s: PreferenceDataset(r, tok, 16, 4).examples for s, r in rows.items()}
    a = run_on_ranks(_train, 2, "tiny_dpo_arith.yaml", str(tmp_path / "a"), *files,
                     f"data.train_files=[{tmp_path}/train.parquet]",
                     f"data.val_files=[{tmp_path}/val.parquet]",
                     ref_logps_of=examples["train"] + examples["val"])
    ref = a[0][2].tolist()
    for split, r in rows.items():  # the reference's log-probs as the data's columns
        k = 0 if split == "train" else 2 * len(examples["train"])
        for i, row in enumerate(r):
            row["ref_chosen_logps"], row["ref_rejected_logps"] = ref[k + 2 * i], ref[k + 2 * i + 1]
        write_preference_parquet(r, str(tmp_path / f"{split}_ref.parquet"))
    b = run_on_ranks(_train, 2, "tiny_dpo_arith.yaml", str(tmp_path / "b"), *files,
                     f"data.train_files=[{tmp_path}/train_ref.parquet]",
                     f"data.val_files=[{tmp_path}/val_ref.parquet]",
                     "algorithm.dpo.precomputed_ref_log_probs=true")
    assert a[0][3] and not b[0][3]  # the reference model is built only without the columns
    for k, w in a[0][0].items():
        torch.testing.assert_close(b[0][0][k], w, atol=1e-5, rtol=0)
    for ra, rb in zip(a[0][1], b[0][1]):
        for key in ("loss", "rewards/margins", "val/loss", "val/rewards/accuracies"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)


# without 'extra' (~9 s more) in make test-all: the data position from the step alone
@pytest.mark.parametrize("contents", ["[model,optimizer,extra]",
                                      pytest.param("[model,optimizer]", marks=pytest.mark.slow)])
def test_resumed_reward_model_run_matches_an_uninterrupted_one(tmp_path, contents):
    """Without 'extra' (no trainer state saved) the data position follows from the step."""
    common = ["trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
              "data.dataloader_num_workers=1",  # batches prepared ahead: resume stays exact
              f"actor_rollout_ref.actor.checkpoint.save_contents={contents}"]
    straight = run_on_ranks(_train, 2, "tiny_rm_arith.yaml", str(tmp_path / "s"), *common)[0]
    run_on_ranks(_train, 2, "tiny_rm_arith.yaml", str(tmp_path / "r"), *common,
                 "trainer.total_training_steps=2")
    resumed = run_on_ranks(_train, 2, "tiny_rm_arith.yaml", str(tmp_path / "r"), *common,
                           "trainer.resume_mode=auto")[0]
    assert [r["step"] for r in resumed[1]] == [1, 2, 3, 4]
    for a, b in zip(straight[1][2:], resumed[1][2:]):
        for key in ("loss", "accuracy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (a["step"], key)
    for k, w in straight[0].items():
        assert torch.equal(resumed[0][k], w), k
