"""The actor's config -> loss path anchored to the written PPO objective (issue 26, class 1).

Every other actor test compares two paths through the same adapter (config -> policy loss
registry -> single-pass kernel); here one `update_policy` of the real ActorWorker is checked
against the objective written out below, evaluated on transformers' logits of the same weights,
with a distinct, asymmetric value for every knob (clip low != high, dual clip, entropy bonus,
KL kind and coefficient, aggregation mode).

The gradient is read through Adam's first step: with bias correction m_hat = g and
v_hat = g^2, so the step is -lr * g / (|g| + eps); a large eps makes it -lr * g / eps to first
order, i.e. the step is the gradient itself (weight decay 0, no clipping).
"""
import dataclasses
import os

import pytest
import torch

from tests.multirank import run_on_ranks
from tests.test_hf_parity import save_random_model
from tests.test_ppo_update import make_batch
from tests.tiny_models import tiny_config

KNOBS = dict(clip_ratio=0.2, clip_ratio_low=0.12, clip_ratio_high=0.31, clip_ratio_c=2.5,
             entropy_coeff=0.013, use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.07)
LR, EPS = 1.0, 1e3


def _update(model_dir, loss_agg_mode):
    from engine.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    from engine.models.hf_io import load_hf_weights
    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global

    import transformers
    init_mesh(Layout(), seed=1)
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    meg = MegatronConfig(params_dtype="float32", use_distributed_optimizer=True)
    optim = OptimConfig(lr=LR, eps=EPS, weight_decay=0.0, clip_grad=1e9, lr_warmup_steps=0)
    actor_cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=3, megatron=meg,
                            optim=optim, loss_agg_mode=loss_agg_mode, **KNOBS)
    worker = ActorWorker(hf, actor_cfg, dataclasses.replace(ModelConfig(), use_fused_kernels=True),
                         response_length=6)
    load_hf_weights(worker.chunks, model_dir)
    worker.optimizer.reload_model_params()
    batch = make_batch(hf.vocab_size)
    current = worker.compute_log_prob(batch, micro_batch_size=4)
    # old log-probs off by up to ~+-1 (ratios inside and outside both clip bounds and the dual
    # clip); the reference 0.5 * noise away
    batch["old_log_probs"] = current + batch["noise"] * 3.0 * batch["response_mask"]
    batch["ref_log_prob"] = current - 0.5 * batch["noise"] * batch["response_mask"]
    before = {k: v.clone() for k, v in iter_global(worker.chunks, "param")}
    metrics = worker.update_policy(batch)
    after = dict(iter_global(worker.chunks, "param"))
    return dict(batch={k: batch[k] for k in batch.keys()}, metrics=metrics,
                lm_head_step=after["output_layer.weight"] - before["output_layer.weight"])


def _written_objective(model, batch, loss_agg_mode):
    """The PPO objective as written (verl's actor loss), from transformers' logits, row by row
    on the unpadded tokens; returns (loss, metrics)."""
    low, high, c = KNOBS["clip_ratio_low"], KNOBS["clip_ratio_high"], KNOBS["clip_ratio_c"]
    P = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    per_row = []
    counts = dict(tokens=0, clip=0, lower=0)
    for i in range(batch["input_ids"].shape[0]):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep]
        n = int(batch["response_mask"][i].sum())
        prompt_len = len(ids) - n
        logits = model(ids[None]).logits[0].float()
        logp_all = torch.log_softmax(logits[prompt_len - 1:prompt_len - 1 + n], dim=-1)
        lp = logp_all.gather(-1, ids[prompt_len:, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        old = batch["old_log_probs"][i, :n]
        ref = batch["ref_log_prob"][i, :n]
        adv = batch["advantages"][i, :n]
        ratio = torch.exp(lp - old)
        surrogate = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
        dual = torch.where(adv < 0, torch.minimum(surrogate, -adv * c), surrogate)
        kl = ref - lp
        low_var_kl = torch.clamp(torch.exp(kl) - kl - 1, -10, 10)
        per_row.append((dual, entropy, low_var_kl))
        counts["tokens"] += n
        counts["clip"] += int(((-adv * torch.clamp(ratio, 1 - low, 1 + high)) > -adv * ratio).sum())
        counts["lower"] += int(((adv < 0) & (surrogate > -adv * c)).sum())
        assert P >= prompt_len
    if loss_agg_mode == "token-mean":
        agg = lambda k: sum(r[k].sum() for r in per_row) / counts["tokens"]  # noqa: E731
    else:  # seq-mean-token-mean
        agg = lambda k: sum(r[k].mean() for r in per_row) / len(per_row)  # noqa: E731
    pg, ent, kl = agg(0), agg(1), agg(2)
    loss = pg - KNOBS["entropy_coeff"] * ent + KNOBS["kl_loss_coef"] * kl
    metrics = {"actor/pg_loss": pg, "actor/entropy": ent, "actor/kl_loss": kl,
               "actor/pg_clipfrac": counts["clip"] / counts["tokens"],
               "actor/pg_clipfrac_lower": counts["lower"] / counts["tokens"]}
    return loss, metrics


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_actor_update_is_the_written_ppo_objective(tmp_path, loss_agg_mode):
    import transformers
    model_dir = os.path.join(tmp_path, "model")
    save_random_model(tiny_config("llama"), model_dir, seed=5)
    got = run_on_ranks(_update, 1, model_dir, loss_agg_mode)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    loss, want = _written_objective(model, got["batch"], loss_agg_mode)
    # the knobs must matter here: ratios beyond both clip bounds and the dual clip
    assert 0 < want["actor/pg_clipfrac"] < 1 and want["actor/pg_clipfrac_lower"] > 0
    for name, value in want.items():
        value = float(value.detach()) if torch.is_tensor(value) else value
        assert got["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    loss.backward()
    grad = model.lm_head.weight.grad
    want_step = -LR * grad / (grad.abs() + EPS)
    step = got["lm_head_step"]
    scale = want_step.abs().max()
    assert scale > 1e-6
    assert torch.allclose(step, want_step, atol=1e-3 * float(scale), rtol=0), \
        f"lm_head step differs from the written objective's by {(step - want_step).abs().max():.3g} " \
        f"(largest step {float(scale):.3g})"
