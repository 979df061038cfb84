"""LoRA on the Megatron actor: the adapted model starts as the base, the reference is the base,
only adapters train (and Adam's state shrinks to theirs), TP 2 (with and without sequence
parallelism) equals TP 1, the rollout receives W + (alpha / r) B A under HF names (checked
against transformers' own forward and against the formula), checkpoints hold adapters only.

Weights come from their global names (`weight_for`), so every layout holds the same model;
B starts from its global name too (scaled), so the adapters are not trivially zero.
"""
import dataclasses
import os

import pytest
import torch

from tests.multirank import run_on_ranks
from tests.test_layouts import weight_for
from tests.test_ppo_update import B, P, R, make_batch, make_configs
from tests.tiny_models import tiny_config

RANK, ALPHA = 4, 8.0
SOME = ["q_proj", "v_proj", "gate_proj", "down_proj"]  # masks in qkv and the gated fc1, a row layer


def _actor(layout_kwargs, targets, b_scale=0.05, lora_rank=RANK, base_only=False):
    """A LoRA actor (or, base_only, the plain actor) holding the named-weight model."""
    from engine.config import ModelConfig
    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import load_global, local_shards

    init_mesh(Layout(**layout_kwargs), seed=1)
    hf = tiny_config("llama")
    actor_cfg, _, _ = make_configs()
    model_cfg = ModelConfig(lora_rank=0 if base_only else lora_rank, lora_alpha=ALPHA,
                            target_modules=list(targets))
    worker = ActorWorker(hf, actor_cfg, model_cfg, response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}

    def get(name):
        if ".lora_A." in name or (".lora_B." in name and not b_scale):
            return None  # the seeded initialisation (B = 0)
        return weight_for(name, shapes[name]) * (b_scale if ".lora_B." in name else 1.0)
    load_global(worker.chunks, get)
    return hf, worker


def _my_rows(batch):
    from megatron.core import parallel_state as ps
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return batch.index_select(list(range(rank * B // dp, (rank + 1) * B // dp)))


# ------------------------------------------------------------------------------ config keys
def test_target_modules_map_to_megatron_linears_and_bad_values_are_refused():
    from engine.config import ConfigError, load_config
    from engine.models.lora import resolve_targets

    assert resolve_targets("all-linear") == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                             "up_proj", "down_proj"}
    assert resolve_targets(["linear_qkv", "down_proj"]) == {"q_proj", "k_proj", "v_proj", "down_proj"}
    recipe = "recipes/tiny_cpu_demo.yaml"
    bad = [("actor_rollout_ref.model.target_modules=[q_proj,lm_head]", "'lm_head'"),
           ("actor_rollout_ref.model.target_modules=[all-linear,q_proj]", "alone"),
           ("actor_rollout_ref.model.lora_rank=-1", "lora_rank=-1"),
           ("critic.model.lora_rank=8", "critic.model.lora_rank=8")]
    for override, words in bad:
        with pytest.raises(ConfigError, match=words):
            load_config(recipe, [override])
    with pytest.raises(ConfigError, match="lora_alpha=0.0"):
        load_config(recipe, ["actor_rollout_ref.model.lora_rank=4",
                             "actor_rollout_ref.model.lora_alpha=0"])
    with pytest.raises(ConfigError, match="ref.megatron.param_offload=True"):
        load_config(recipe, ["actor_rollout_ref.model.lora_rank=4",
                             "actor_rollout_ref.ref.megatron.param_offload=true"])
    cfg = load_config(recipe, ["actor_rollout_ref.model.lora_rank=8",
                               "actor_rollout_ref.model.target_modules=q_proj"])
    assert cfg.actor_rollout_ref.model.target_modules == ["q_proj"]


# -------------------------------------------------------- start, reference, what trains
def _start_and_reference():
    from engine.config import MegatronConfig, ModelConfig
    from engine.workers.actor import ReferenceWorker
    from parallel.shards import iter_global, load_global, local_shards

    batch = make_batch(96)
    hf, fresh = _actor({}, ["all-linear"], b_scale=0.0)
    out = {"fresh": fresh.compute_log_prob(batch, micro_batch_size=4)}
    _, trained = _actor({}, ["all-linear"])
    out["adapted"] = trained.compute_log_prob(batch, micro_batch_size=4)
    out["adapters_off"] = trained.base_reference().compute_log_prob(batch, micro_batch_size=4)
    # the independent reference: a plain Megatron model, no LoRA code, same base weights
    ref = ReferenceWorker(hf, MegatronConfig(params_dtype="float32"), ModelConfig())
    shapes = {s.global_name: s.global_shape for _, s in local_shards(ref.chunks)}
    load_global(ref.chunks, lambda n: weight_for(n, shapes[n]))
    out["base"] = ref.compute_log_prob(batch, micro_batch_size=4)
    out["A"] = {n: t.clone() for n, t in iter_global(fresh.chunks) if ".lora_A." in n}
    return out


def test_adapters_start_at_the_base_and_the_reference_is_the_base_model():
    out = run_on_ranks(_start_and_reference, 1)[0]
    assert torch.equal(out["fresh"], out["base"])  # B = 0: the first step's policy is the base
    assert torch.equal(out["adapters_off"], out["base"])
    assert (out["adapted"] - out["base"]).abs().max() > 1e-3
    # A: PEFT's kaiming-uniform(a=sqrt(5)), U(-1/sqrt(in), 1/sqrt(in)), a different draw per layer
    fan_in = {"linear_qkv": 32, "linear_proj": 32, "linear_fc1": 32, "linear_fc2": 64}
    for name, a in out["A"].items():
        bound = fan_in[name.split(".")[-3]] ** -0.5
        assert a.shape[0] == RANK and a.abs().max() <= bound
        assert abs(a.std().item() - bound / 3 ** 0.5) < 0.25 * bound, name
    assert len({round(a.sum().item(), 6) for a in out["A"].values()}) == len(out["A"])


def _train_once(adapters: bool):
    """One update of the recipe's tiny model; what moved, what the optimizer holds."""
    import transformers

    from engine.checkpoint.state import torch_optimizers
    from engine.config import load_config
    from engine.models.lora import is_adapter_name
    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global

    init_mesh(Layout(), seed=1)
    model = load_config("recipes/tiny_cpu_demo.yaml").actor_rollout_ref.model
    inline = dict(model.config)
    hf = transformers.AutoConfig.for_model(inline.pop("model_type"), **inline)
    model = dataclasses.replace(model, lora_rank=RANK if adapters else 0, lora_alpha=ALPHA,
                                target_modules=["all-linear"])
    actor_cfg, _, _ = make_configs()
    worker = ActorWorker(hf, actor_cfg, model, response_length=R)
    batch = make_batch(hf.vocab_size)
    before = {n: t.clone() for n, t in iter_global(worker.chunks)}
    old = worker.compute_log_prob(batch, micro_batch_size=4)
    batch["old_log_probs"] = old + 0.3 * batch["noise"] * batch["response_mask"]
    batch["ref_log_prob"] = old
    worker.mini_batch_size_per_rank = B
    worker.update_policy(batch)  # B = 0 gives A no gradient on the first step: two steps
    worker.update_policy(batch)
    after = dict(iter_global(worker.chunks))
    opts = torch_optimizers(worker)
    return dict(
        moved={n for n in before if not torch.equal(before[n], after[n])},
        names=set(before), adapters={n for n in before if is_adapter_name(n)},
        optimized=sum(p.numel() for o in opts for g in o.param_groups for p in g["params"]),
        grad_buffer=sum(b.grad_data.numel() for c in worker.chunks for b in c.buffers),
        adam_bytes=sum(v.numel() * v.element_size() for o in opts for s in o.state.values()
                       for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
        numel={n: t.numel() for n, t in after.items()},
        shape=dict(h=hf.hidden_size, i=hf.intermediate_size, heads=hf.num_attention_heads,
                   kv=hf.num_key_value_heads, layers=hf.num_hidden_layers))


def test_only_adapters_train_and_adam_state_shrinks_to_theirs():
    full, lora = run_on_ranks(_train_once, 1, False)[0], run_on_ranks(_train_once, 1, True)[0]
    assert lora["moved"] == lora["adapters"] and lora["adapters"]  # the base stays bit-identical
    # the adapter count from the config alone: r x (in + out) for qkv, proj, fc1, fc2
    s = full["shape"]
    d = s["h"] // s["heads"]
    per_layer = RANK * ((s["h"] + (s["heads"] + 2 * s["kv"]) * d) + (s["heads"] * d + s["h"])
                        + (s["h"] + 2 * s["i"]) + (s["i"] + s["h"]))
    adapter_numel = per_layer * s["layers"]
    assert sum(lora["numel"][n] for n in lora["adapters"]) == adapter_numel
    assert lora["grad_buffer"] == adapter_numel  # DDP holds gradients for the adapters only
    assert lora["optimized"] == adapter_numel  # ... and the optimizer their parameters only
    total = sum(full["numel"].values())
    assert full["adam_bytes"] == 8 * total and lora["adam_bytes"] == 8 * adapter_numel  # fp32 m, v
    print(f"\nAdam state, recipes/tiny_cpu_demo.yaml model ({total} parameters): full "
          f"{full['adam_bytes']} bytes, LoRA r={RANK} all-linear {lora['adam_bytes']} bytes "
          f"({lora['adam_bytes'] / full['adam_bytes']:.1%})")


# ------------------------------------------------- layouts, and what the rollout receives
def hf_log_probs(model, batch):
    """Response log-probs from a transformers model, left-padded prompts as the trainer's."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    lp = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, batch["responses"][..., None])[..., 0]
    return lp * batch["response_mask"]


def _lora_step(layout_kwargs, targets):
    from engine.rollout.colocated import sync_weights
    from engine.rollout.cpu import CPURollout
    from parallel.shards import iter_global

    hf, worker = _actor(layout_kwargs, targets)
    batch = make_batch(hf.vocab_size)
    mine = _my_rows(batch)
    out = {"log_prob": worker.compute_log_prob(mine, micro_batch_size=2),
           "ref": worker.base_reference().compute_log_prob(mine, micro_batch_size=2)}
    mine["old_log_probs"] = out["log_prob"] + 0.3 * mine["noise"] * mine["response_mask"]
    mine["ref_log_prob"] = out["ref"]
    worker.mini_batch_size_per_rank = len(mine)
    out["metrics"] = worker.update_policy(mine)
    out["weights"] = dict(iter_global(worker.chunks))
    rollout = CPURollout(hf)
    sync_weights(worker.chunks, rollout, hf, bucket_megabytes=0.01)  # several buckets
    out["merged"] = {n: t.clone() for n, t in rollout.model.state_dict().items()}
    out["rollout_log_prob"] = hf_log_probs(rollout.model, batch)
    out["after"] = worker.compute_log_prob(batch, micro_batch_size=4)
    return out


_REF = {}


def _reference():
    if "tp1" not in _REF:
        _REF["tp1"] = run_on_ranks(_lora_step, 1, {}, SOME)[0]
    return _REF["tp1"]


def test_rollout_receives_the_merged_weights():
    from engine.models.weights import megatron_to_hf

    out, s = _reference(), ALPHA / RANK
    w = out["weights"]
    # transformers' forward on the merged weights = the Megatron actor with its adapters on
    torch.testing.assert_close(out["rollout_log_prob"], out["after"], atol=1e-5, rtol=0)
    for layer in range(4):
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        a, b = w[m + "mlp.linear_fc2.lora_A.weight"], w[m + "mlp.linear_fc2.lora_B.weight"]
        expected = w[m + "mlp.linear_fc2.weight"] + s * b @ a  # the formula, by hand
        torch.testing.assert_close(out["merged"][h + "mlp.down_proj.weight"], expected,
                                   atol=1e-6, rtol=0)
        base = dict(megatron_to_hf(tiny_config("llama"), m + "self_attention.linear_qkv.weight",
                                   w[m + "self_attention.linear_qkv.weight"]))
        q_rows = 32  # 4 heads x 8: the q rows of B follow [q; k; v] per query group (2 groups)
        bq = torch.cat([w[m + "self_attention.linear_qkv.lora_B.weight"][g * 32:g * 32 + 16]
                        for g in range(2)])
        assert bq.shape[0] == q_rows
        torch.testing.assert_close(out["merged"][h + "self_attn.q_proj.weight"],
                                   base[h + "self_attn.q_proj.weight"]
                                   + s * bq @ w[m + "self_attention.linear_qkv.lora_A.weight"],
                                   atol=1e-6, rtol=0)
        # k_proj, up_proj and o_proj are not targeted: the base, exactly
        assert torch.equal(out["merged"][h + "self_attn.k_proj.weight"], base[h + "self_attn.k_proj.weight"])
        up = w[m + "mlp.linear_fc1.weight"][64:]
        assert torch.equal(out["merged"][h + "mlp.up_proj.weight"], up)
        assert torch.equal(out["merged"][h + "self_attn.o_proj.weight"],
                           w[m + "self_attention.linear_proj.weight"])


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, sequence_parallel=True), dict(pp=2)],
                         ids=["tp2", "tp2_sp", "pp2"])
def test_parallel_lora_equals_one_process(layout):
    ref = _reference()
    got = run_on_ranks(_lora_step, 2, layout, SOME)
    held = {}
    for r in got:  # TP / PP ranks hold the whole batch: same values on both
        torch.testing.assert_close(r["log_prob"], ref["log_prob"], atol=1e-5, rtol=0)
        torch.testing.assert_close(r["ref"], ref["ref"], atol=1e-5, rtol=0)
        for k, v in ref["metrics"].items():
            assert r["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
        held.update(r["weights"])  # a pipeline stage holds its own layers
        for n, t in ref["merged"].items():  # every rank receives the whole merged model
            torch.testing.assert_close(r["merged"][n], t, atol=1e-5, rtol=0, msg=n)
    assert set(held) == set(ref["weights"])
    for n, t in ref["weights"].items():  # the update: adapters moved alike, base untouched
        torch.testing.assert_close(held[n], t, atol=1e-5, rtol=0, msg=n)


# ------------------------------------------------------------------------------ checkpoints
def _save_resume(root):
    from megatron.core import dist_checkpointing

    from engine.checkpoint import CheckpointManager
    from parallel.shards import iter_global

    def update(worker, seed):
        batch = make_batch(96, seed=seed)
        mine = _my_rows(batch)
        old = worker.compute_log_prob(mine, micro_batch_size=2)
        mine["old_log_probs"] = old + 0.3 * mine["noise"] * mine["response_mask"]
        mine["ref_log_prob"] = old
        worker.mini_batch_size_per_rank = len(mine)
        return worker.update_policy(mine)

    layout = dict(tp=2)
    _, worker = _actor(layout, SOME)
    update(worker, 3)
    manager = CheckpointManager(root)
    path = manager.save(1, {"actor": worker}, {"step": 1})
    saved = {n: t.clone() for n, t in iter_global(worker.chunks) if ".lora_" in n}
    straight = update(worker, 4), dict(iter_global(worker.chunks))
    _, fresh = _actor(layout, SOME, b_scale=0.0)  # base from its source, adapters restored
    manager.load(path, {"actor": fresh})
    resumed = update(fresh, 4), dict(iter_global(fresh.chunks))
    keys = sorted(dist_checkpointing.load_tensors_metadata(f"{path}/actor"))
    return straight, resumed, keys, path, saved


def _load_at_tp1(path):
    from engine.checkpoint import CheckpointManager
    from parallel.shards import iter_global
    _, fresh = _actor({}, SOME, b_scale=0.0)
    CheckpointManager(os.path.dirname(path)).load(path, {"actor": fresh}, load_optimizer=False)
    return {n: t.clone() for n, t in iter_global(fresh.chunks) if ".lora_" in n}


def test_checkpoint_holds_adapters_and_optimizer_and_resumes_exactly(tmp_path):
    (m1, w1), (m2, w2), keys, path, saved = run_on_ranks(_save_resume, 2, str(tmp_path))[0]
    # the adapters' TP sharding (B split by rows, the gated fc1's per half, A by columns) is
    # described globally: a TP 1 model reads the TP 2 checkpoint's adapters whole
    at_tp1 = run_on_ranks(_load_at_tp1, 1, path)[0]
    assert set(at_tp1) == set(saved)
    for n in saved:
        assert torch.equal(at_tp1[n], saved[n]), n
    assert keys and all(".lora_" in k or k.startswith("optimizer.") for k in keys), keys
    assert any(".lora_B." in k for k in keys) and not any(k.endswith("linear_qkv.weight") for k in keys)
    for k in m1:
        assert m2[k] == pytest.approx(m1[k], rel=1e-6, abs=1e-9), k
    for n in w1:
        assert torch.equal(w1[n], w2[n]), n
