"""LoRA end to end: a 2-step trainer run under torchrun (2 ranks, TP 2) with lora_rank > 0, its
adapter-only checkpoint and merged save_hf; tools/convert_checkpoint.py lora-to-hf writes merged
HF weights (transformers gives the LoRA actor's log-probs) and a PEFT adapter (PEFT's names;
base + (alpha / r) B A per module equals the merged export; PEFT itself agrees when installed)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from tests.test_e2e import run_demo
from tests.test_hf_parity import read_all, save_random_model
from tests.test_layouts import weight_for
from tests.test_lora import ALPHA, RANK, SOME, hf_log_probs
from tests.test_ppo_update import R, make_batch, make_configs
from tests.tiny_models import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]


def _tool(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env,
                          timeout=600)
    return done.returncode, done.stdout + done.stderr


# ~26 s; make test keeps test_merged_export_is_the_lora_actor, test_peft_loads_the_adapter, tests/test_lora.py
@pytest.mark.slow
def test_two_step_lora_run_under_torchrun(tmp_path):
    from megatron.core import dist_checkpointing

    # param_offload: the reference phase (the actor with adapters off) brings the actor's
    # parameters back although the schedule offloads them there
    extra = [*LORA, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
             "actor_rollout_ref.actor.megatron.param_offload=true",
             "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.save_hf=true"]
    _, records = run_demo(tmp_path, "lora", extra, steps=2)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 and "actor/kl_loss" in r for r in records)
    step = tmp_path / "ckpt" / "lora" / "global_step_2"
    keys = sorted(dist_checkpointing.load_tensors_metadata(str(step / "actor")))
    assert keys and all(".lora_" in k or k.startswith("optimizer.") for k in keys), keys
    meta = json.loads((step / "meta.json").read_text())
    assert meta["workers"]["actor"]["lora"] == {"rank": 4, "alpha": 8.0, "targets": [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]}
    merged = tmp_path / "ckpt" / "lora" / "hf" / "step_2"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(merged))  # a plain HF model
    assert not any("lora" in n for n in model.state_dict())
    code, out = _tool("lora-to-hf", "--ckpt", str(step), "--format", "peft", "--hf-config",
                      str(merged), "--out", str(tmp_path / "peft"))
    assert code == 0, out[-3000:]
    assert len(_peft_tensors(tmp_path / "peft")) == 2 * 7 * 2  # A and B of 7 modules, 2 layers


def _peft_tensors(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(str(path), "adapter_model.safetensors"))


def _lora_checkpoint(base_dir, root):
    """A LoRA actor on the HF base, with non-zero adapters, saved as a trainer checkpoint."""
    from engine.checkpoint import CheckpointManager
    from engine.config import ModelConfig
    from engine.models import hf_io
    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import load_global, local_shards

    init_mesh(Layout(), seed=1)
    hf = hf_io.load_config(base_dir)
    actor_cfg, _, _ = make_configs()
    model = ModelConfig(path=base_dir, lora_rank=RANK, lora_alpha=ALPHA, target_modules=SOME)
    worker = ActorWorker(hf, actor_cfg, model, response_length=R)
    hf_io.load_hf_weights(worker.chunks, base_dir)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n, shapes[n]) * 0.05 if ".lora_B." in n else None)
    path = CheckpointManager(root).save(1, {"actor": worker}, {"step": 1})
    return path, worker.compute_log_prob(make_batch(hf.vocab_size), micro_batch_size=4)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tests.multirank import run_on_ranks
    tmp = tmp_path_factory.mktemp("lora_export")
    base = str(tmp / "base")
    save_random_model(tiny_config("llama"), base)
    step, log_prob = run_on_ranks(_lora_checkpoint, 1, base, str(tmp / "ckpt"))[0]
    out = dict(base=base, step=step, log_prob=log_prob, merged=str(tmp / "merged"),
               peft=str(tmp / "peft"))
    for fmt, extra in (("merged", ["--base", base]), ("peft", ["--hf-config", base])):
        code, text = _tool("lora-to-hf", "--ckpt", step, "--format", fmt, *extra, "--out", out[fmt])
        assert code == 0, text[-3000:]
    return out


def test_merged_export_is_the_lora_actor(exported):
    model = transformers.AutoModelForCausalLM.from_pretrained(exported["merged"], dtype=torch.float32)
    lp = hf_log_probs(model.eval(), make_batch(model.config.vocab_size))
    torch.testing.assert_close(lp, exported["log_prob"], atol=1e-5, rtol=0)


def test_peft_adapter_names_and_deltas(exported):
    peft_dir = exported["peft"]
    config = json.load(open(os.path.join(peft_dir, "adapter_config.json")))
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, ALPHA)
    assert config["target_modules"] == sorted(SOME)
    tensors = _peft_tensors(peft_dir)
    modules = {k[: -len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")}
    assert modules == {f"base_model.model.model.layers.{i}.{m}" for i in range(4) for m in (
        "self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.down_proj")}
    base, merged = read_all(exported["base"]), read_all(exported["merged"])
    expected = dict(base)
    for m in modules:  # PEFT's delta, computed here from the adapter files alone
        name = m[len("base_model.model."):] + ".weight"
        a, b = tensors[m + ".lora_A.weight"], tensors[m + ".lora_B.weight"]
        assert a.shape[0] == b.shape[1] == RANK
        expected[name] = base[name] + (ALPHA / RANK) * b @ a
    assert set(merged) == set(base)
    for name, t in merged.items():
        torch.testing.assert_close(t, expected[name], atol=1e-6, rtol=0, msg=name)


def test_peft_loads_the_adapter(exported):
    import peft  # the dev extra installs it: missing fails, never skips
    base = transformers.AutoModelForCausalLM.from_pretrained(exported["base"], dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, exported["peft"]).eval()
    lp = hf_log_probs(model, make_batch(base.config.vocab_size))
    torch.testing.assert_close(lp, exported["log_prob"], atol=1e-5, rtol=0)


def test_lora_export_refuses_what_it_cannot_do(exported, tmp_path):
    code, out = _tool("lora-to-hf", "--ckpt", exported["step"], "--out", str(tmp_path / "x"))
    assert code == 2 and "--format merged needs --base" in out
    code, out = _tool("lora-to-hf", "--ckpt", str(tmp_path), "--base", exported["base"],
                      "--out", str(tmp_path / "y"))
    assert code == 2 and "not a trainer checkpoint" in out
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
