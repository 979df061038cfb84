"""Multi-turn through the real trainer (2 CPU ranks, the CPU backend, the agent tokenizer's
template, the calculator): the ids trained on are the ids generated, the response mask is the
trajectories' model tokens, and the trainer's log-probs of model tokens equal the rollout's
(fp32 rounding) in a batch of several-turn trajectories with tool calls."""
import os

import pytest

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
MT = "actor_rollout_ref.rollout.multi_turn"


def save_tool_happy_model(directory):
    """tests/test_multi_turn.py's tool-happy Llama, with the agent tokenizer, as a HF directory."""
    from engine.tasks import build_agent_tokenizer
    from tests.test_multi_turn import tool_happy_model
    tok = build_agent_tokenizer()
    model, _ = tool_happy_model(tok, max_positions=512)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)

def _step(tmp, model_dir, extra=()):
    import sys

    import torch.distributed as dist
    if "actor_rollout_ref.rollout.name=sglang" in extra:  # the SGLang double (tests/fakes) as sglang
        sys.path.insert(0, os.path.join(ROOT, "tests", "fakes"))

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed

    class Recording(Trainer):
        def compute_advantages(self, batch):
            batch = super().compute_advantages(batch)
            self.seen = {k: batch[k].clone() for k in ("responses", "response_mask", "attention_mask",
                                                          "old_log_probs", "rollout_log_probs")}
            self.seen["stats"] = list(batch.non_tensors["multi_turn"])
            return batch

    cfg = load_config(DEMO, [
        "trainer.logger=[]", "trainer.resume_mode=disable", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.default_local_dir={tmp}/ckpt",
        f"trainer.log_dir={tmp}/logs/{dist.get_rank()}", "data.builtin_task=multiply",
        "data.max_prompt_length=32", "data.max_response_length=160", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # 2 updates: old pass
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.model.config=null", f"actor_rollout_ref.model.path={model_dir}",
        f"{MT}.enable=true", f"{MT}.max_assistant_turns=4", f"{MT}.max_tool_response_length=24",
        f"{MT}.tools_in_prompt=false", *extra])
    set_seed(cfg.trainer.seed)
    t = Recording(*build(cfg, 2))
    generated = []
    inner = t.ctx.run_engine

    def recording(engine, prompt_ids, sampling, keys):
        out = inner(engine, prompt_ids, sampling, keys)
        generated.extend((list(p), r, m) for p, r, m in zip(
            [prompt_ids[i] for i in out.prompt_index], out.responses, out.loss_masks))
        return out
    t.ctx.run_engine = recording
    metrics = t.train_step(t.loader.next_batch())
    t.colocated.to_training()
    t.rollout.shutdown()
    records = sys.modules["sglang"].RECORDS if "sglang" in sys.modules else []
    return dict(seen=t.seen, generated=generated, metrics=metrics,
                async_requests=sum(r["kind"] == "async_generate" for r in records))


@pytest.mark.parametrize("backend", [
    "cpu",
    # ~20 s: the colocated SGLang double, each trajectory's turns through Engine.async_generate (the
    # adapter's async path itself: tests/test_sglang_double.py, fast)
    pytest.param("sglang", marks=pytest.mark.slow)])
def test_the_trainer_trains_on_the_generated_trajectories(tmp_path, backend):
    save_tool_happy_model(tmp_path / "model")
    extra = (f"actor_rollout_ref.rollout.name={backend}",) + (
        ("actor_rollout_ref.rollout.deterministic=true",) if backend == "sglang" else ())
    ranks = run_on_ranks(_step, 2, str(tmp_path), str(tmp_path / "model"), extra)
    generated = {tuple(r): (tuple(p), m) for rank in ranks for p, r, m in rank["generated"]}
    assert len(generated) == 8  # 4 prompts x 2 trajectories, made by the group leaders
    several = 0
    for rank in ranks:
        seen = rank["seen"]
        valid = seen["attention_mask"][:, -seen["responses"].shape[1]:].bool()
        for row in range(len(seen["responses"])):
            ids = tuple(seen["responses"][row][valid[row]].tolist())
            assert ids in generated  # the ids trained on are a generated trajectory's, whole
            assert seen["response_mask"][row][valid[row]].tolist() == generated[ids][1]
        model = seen["response_mask"].bool()
        diff = (seen["old_log_probs"] - seen["rollout_log_probs"]).abs()[model]
        assert float(diff.max()) < 1e-4
        several += sum(s["turns"] >= 3 for s in seen["stats"])
        assert (seen["response_mask"].bool() & ~valid).sum() == 0
        assert rank["metrics"]["num_turns/max"] >= 3
    assert several >= 1
    if backend == "sglang":  # every turn was a request of its own on the engine's loop
        turns = sum(s["turns"] for rank in ranks for s in rank["seen"]["stats"])
        assert sum(rank["async_requests"] for rank in ranks) == turns > 0


@pytest.mark.slow  # ~45 s; the fast sibling above runs rollout TP 1 (2 groups)
def test_the_trajectories_do_not_depend_on_the_rollout_layout(tmp_path):
    """Rollout TP 2 (one engine for both ranks) and TP 1 (one per rank) sample the same
    trajectories: each turn draws from its (prompt, sample, turn) stream."""
    save_tool_happy_model(tmp_path / "model")
    runs = {}
    for tp in (1, 2):
        ranks = run_on_ranks(_step, 2, str(tmp_path / f"tp{tp}"), str(tmp_path / "model"),
                             [f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"])
        runs[tp] = sorted((tuple(p), tuple(r)) for rank in ranks for p, r, _ in rank["generated"])
    assert len(runs[1]) == 8 and runs[1] == runs[2]


def _launch(tmp_path, name, nproc, model_dir, extra):
    import json
    import subprocess
    import sys
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "engine.train", DEMO, "trainer.logger=[jsonl]", "trainer.total_training_steps=2",
           "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false",
           f"trainer.n_gpus_per_node={nproc}", f"trainer.default_local_dir={tmp_path}/ckpt/{name}",
           f"trainer.log_dir={tmp_path}/logs/{name}", "data.builtin_task=multiply", "data.max_prompt_length=32",
           "data.max_response_length=160", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
           "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.model.config=null",
           f"actor_rollout_ref.model.path={model_dir}", f"{MT}.enable=true", f"{MT}.max_assistant_turns=4",
           f"{MT}.max_tool_response_length=24", f"{MT}.tools_in_prompt=false", *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (tmp_path / "logs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.slow  # two torchrun runs, ~70 s
def test_a_separate_rollout_pool_runs_the_same_trajectories(tmp_path):
    """2 training ranks colocated vs 2 training + 1 rollout rank: the pool's engine drives the
    turns and its tools; the steps train on the same trajectories (keyed sampling)."""
    save_tool_happy_model(tmp_path / "model")
    colocated = _launch(tmp_path, "colocated", 2, tmp_path / "model", [])
    pool = _launch(tmp_path, "pool", 3, tmp_path / "model",
                   ["trainer.rollout_pool=separate", "trainer.rollout_pool_ranks=1"])
    for a, b in zip(colocated, pool):
        for key in ("num_turns/mean", "num_turns/max", "multi_turn/tool_calls/mean",
                    "multi_turn/observation_tokens/mean", "actor/pg_loss", "critic/score/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
    assert [r["step"] for r in pool] == [1, 2] and max(r["num_turns/max"] for r in pool) >= 3
