"""kl_loss_type full / full+ in the actor: one `update_policy` on a tiny model, with the reference's
hidden states and output weight from its own pass (`forward_outputs(with_hidden=True)`, another
micro-batch split), against an independent autograd computation of the same loss from the full
[tokens, vocab] logits of both models, one sequence at a time; and the same update at TP 2.

full+ is the exact KL's value with the gradient of k2 = 0.5 (logp(y) - ref_logp(y))^2 on the
sampled token y (kernels/kl.py)."""
import dataclasses

import pytest
import torch

from tests.multirank import run_on_ranks
from tests.test_layouts import weight_for
from tests.test_ppo_update import R, make_batch, make_configs
from tests.tiny_models import tiny_config

TEMPERATURE = 0.9
KL_COEF = 0.5  # large enough that the KL term's gradient is a clear share of the whole


def _ref_weight_for(name, shape):
    """The reference: near the actor's weights, not equal to them."""
    return weight_for(name, shape) + 0.1 * weight_for(name + "/ref", shape)


def _cfgs(kind, fused, agg):
    actor_cfg, _, model_cfg = make_configs(kl_loss_type=kind, kl_loss_coef=KL_COEF, loss_agg_mode=agg)
    # no clipping: the gradients left in the buffers are the loss's own
    actor_cfg = dataclasses.replace(actor_cfg, optim=dataclasses.replace(actor_cfg.optim, clip_grad=1e6))
    return actor_cfg, dataclasses.replace(model_cfg, use_fused_kernels=fused)


def _load(worker, weight_for):
    from parallel.shards import load_global, local_shards
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n, shapes[n]))


def _actor_update(layout_kwargs, kind, fused, agg):
    from engine.workers.actor import ActorWorker, ReferenceWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global

    init_mesh(Layout(**layout_kwargs), seed=1)
    hf = tiny_config("llama")
    actor_cfg, model_cfg = _cfgs(kind, fused, agg)
    actor = ActorWorker(hf, actor_cfg, model_cfg, response_length=R)
    ref = ReferenceWorker(hf, actor_cfg.megatron, model_cfg)
    _load(actor, weight_for)
    _load(ref, _ref_weight_for)
    batch = make_batch(hf.vocab_size)
    mask = batch["response_mask"]
    old = actor.compute_log_prob(batch, temperature=TEMPERATURE, micro_batch_size=4)
    batch["old_log_probs"] = old + batch["noise"] * mask
    out = ref.forward_outputs(batch, temperature=TEMPERATURE, micro_batch_size=3, with_hidden=True)
    batch["ref_log_prob"] = out["log_prob"]
    if actor.is_last_stage:  # where the loss runs; earlier pipeline stages get no hidden states
        batch["ref_hidden"] = out["hidden"]
        batch.meta["ref_output_weight"] = out["output_weight"]
        assert [h.shape for h in out["hidden"]] == [(int(n), hf.hidden_size) for n in mask.sum(-1)]
    else:
        assert "hidden" not in out
    # the in-reward KL's pass (algorithm.kl_penalty=full): the exact KL before the update
    full_kl = actor.forward_outputs(batch, temperature=TEMPERATURE, micro_batch_size=5,
                                    with_full_kl=True)["full_kl"]
    metrics = actor.update_policy(batch, temperature=TEMPERATURE)
    return dict(metrics=metrics, grads=dict(iter_global(actor.chunks, "grad")),
                full_kl=full_kl, ref_log_prob=out["log_prob"])


def _full_logit_loss(kind, agg, with_kl=True):
    """The loss from full logits, plain autograd (no fused kernel, no micro-batches, no
    Megatron schedule): returns (gradients by global name, metrics)."""
    from engine.algorithms.losses import agg_loss, policy_loss
    from engine.workers.actor import LogProbModel
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import local_shards

    init_mesh(Layout(), seed=1)
    hf = tiny_config("llama")
    actor_cfg, model_cfg = _cfgs(kind, True, agg)
    policy = LogProbModel(hf, megatron_cfg=actor_cfg.megatron, model_cfg=model_cfg)
    ref = LogProbModel(hf, megatron_cfg=actor_cfg.megatron, model_cfg=model_cfg)
    _load(policy, weight_for)
    _load(ref, _ref_weight_for)
    for worker in (policy, ref):
        worker.models[0].return_hidden = False  # full-vocabulary logits
    batch = make_batch(hf.vocab_size)
    mask = batch["response_mask"].float()

    def log_softmax_of(model, i):
        width = batch["responses"].shape[1]
        keep = batch["attention_mask"][i].bool()
        seq = batch["input_ids"][i][keep]
        plen, rlen = int(keep[:-width].sum()), int(mask[i].sum())
        logits = model(seq[None], torch.arange(seq.numel())[None], None)[0]
        logits = logits[plen - 1: plen - 1 + rlen].float() / TEMPERATURE
        return torch.log_softmax(logits, -1), seq[plen: plen + rlen]

    pad = lambda t: torch.nn.functional.pad(t, (0, R - t.shape[0]))  # noqa: E731
    rows = {k: [] for k in ("logp", "entropy", "exact", "r")}
    for i in range(len(batch)):
        logp, labels = log_softmax_of(policy.models[0], i)
        with torch.no_grad():
            logq, _ = log_softmax_of(ref.models[0], i)
        token = logp.gather(1, labels[:, None]).squeeze(1)
        rows["logp"].append(pad(token))
        rows["entropy"].append(pad(-(logp.exp() * logp).sum(-1)))
        rows["exact"].append(pad((logp.exp() * (logp - logq)).sum(-1)))
        rows["r"].append(pad(token - logq.gather(1, labels[:, None]).squeeze(1)))
    logp, entropy, exact, r = (torch.stack(rows[k]) for k in ("logp", "entropy", "exact", "r"))
    cfg = actor_cfg
    old = logp.detach() + batch["noise"] * mask
    pg, _ = policy_loss(logp, old, batch["advantages"], mask, clip_ratio=cfg.clip_ratio,
                        clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=agg)
    ent = agg_loss(entropy, mask, agg)
    k2 = 0.5 * r * r
    kl_tokens = exact if kind == "full" else exact.detach() + k2 - k2.detach()
    kl = agg_loss(kl_tokens, mask, agg)
    loss = pg - cfg.entropy_coeff * ent + (KL_COEF * kl if with_kl else 0.0)
    params = [(p, s.global_name) for p, s in local_shards(policy.chunks)]
    grads = torch.autograd.grad(loss, [p for p, _ in params])
    metrics = {"actor/pg_loss": float(pg), "actor/entropy": float(ent), "actor/kl_loss": float(kl),
               "actor/grad_norm": float(torch.sqrt(sum((g * g).sum() for g in grads))),
               "full_kl": exact.detach()}
    return {n: g for (_, n), g in zip(params, grads)}, metrics


_WANT = {}


def _want(kind, agg, with_kl=True):
    key = (kind, agg, with_kl)
    if key not in _WANT:
        _WANT[key] = run_on_ranks(_full_logit_loss, 1, kind, agg, with_kl)[0]
    return _WANT[key]


def _check(results, want_grads, want_metrics):
    """Every rank's metrics and exact KLs; the ranks' gradients together (pipeline stages)."""
    grads = {}
    for got in results:
        torch.testing.assert_close(got["full_kl"], want_metrics["full_kl"], rtol=1e-4, atol=1e-6)
        for k, v in want_metrics.items():
            if k != "full_kl":
                assert got["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
        assert got["metrics"]["actor/kl_loss"] > 0
        grads.update(got["grads"])
    assert set(grads) == set(want_grads)
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=2e-6, msg=n)


@pytest.mark.parametrize("kind,fused,agg", [
    ("full", True, "token-mean"),
    ("full", False, "token-mean"),
    ("full+", True, "seq-mean-token-mean"),
    ("full+", False, "token-mean"),
], ids=["full-single-pass", "full-autograd", "full+-single-pass-seqmean", "full+-autograd"])
def test_update_equals_full_logit_autograd(kind, fused, agg):
    want_grads, want_metrics = _want(kind, agg)
    results = run_on_ranks(_actor_update, 1, {}, kind, fused, agg)
    _check(results, want_grads, want_metrics)
    # the KL term moves the gradient far beyond the tolerance (the test sees it)
    no_kl, _ = _want(kind, agg, with_kl=False)
    assert max(float((no_kl[n] - g).abs().max()) for n, g in want_grads.items()) > 1e-3


@pytest.mark.parametrize("layout,kind", [(dict(tp=2), "full"), (dict(tp=2), "full+"),
                                         (dict(tp=2, sequence_parallel=True), "full"),
                                         (dict(pp=2), "full")],
                         ids=["tp2-full", "tp2-full+", "tp2-sp-full", "pp2-full"])
def test_model_parallel_update_equals_full_logit_autograd(layout, kind):
    """Vocab-parallel at TP 2 (each rank: its shard of both output weights, the whole hidden
    states, gathered under sequence parallelism), and PP 2 (the reference's hidden states on
    the last stage only): the gathered gradients equal the single-process full-logit ones."""
    want_grads, want_metrics = _want(kind, "token-mean")
    results = run_on_ranks(_actor_update, 2, layout, kind, True, "token-mean")
    torch.testing.assert_close(results[0]["ref_log_prob"], results[1]["ref_log_prob"])
    _check(results, want_grads, want_metrics)


def _kept_bytes():
    """Host bytes the reference pass keeps for the exact KL, every response at full length."""
    from engine.batch import Batch
    from engine.workers.actor import ReferenceWorker
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    hf = tiny_config("llama")
    actor_cfg, model_cfg = _cfgs("full", True, "token-mean")
    ref = ReferenceWorker(hf, actor_cfg.megatron, model_cfg)
    b, p = 6, 3
    ids = torch.randint(1, hf.vocab_size, (b, p + R), generator=torch.Generator().manual_seed(0))
    batch = Batch(dict(input_ids=ids, attention_mask=torch.ones_like(ids), responses=ids[:, p:],
                       response_mask=torch.ones(b, R, dtype=torch.long)))
    out = ref.forward_outputs(batch, micro_batch_size=4, with_hidden=True)
    return sum(h.numel() * h.element_size() for h in out["hidden"]) + \
        out["output_weight"].numel() * out["output_weight"].element_size()


def test_planner_counts_the_kept_hidden_states():
    from engine.config import from_dict
    from tools.plan import estimate

    model = dict(tiny_config("llama").to_dict(), model_type="llama")
    cfg = from_dict({
        "data": {"builtin_task": "arith", "max_prompt_length": 3, "max_response_length": R,
                 "train_batch_size": 3},
        "actor_rollout_ref": {
            "model": {"config": model},
            "actor": {"ppo_mini_batch_size": 3, "ppo_micro_batch_size_per_gpu": 2,
                      "use_kl_loss": True, "kl_loss_type": "full",
                      "megatron": {"params_dtype": "float32"}},
            "rollout": {"name": "cpu", "n": 2}},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 1, "device": "cpu"}})
    plan = estimate(cfg, 1, gpu_mem_gib=64, device="cpu")
    assert plan["host"]["ref_hidden"] == run_on_ranks(_kept_bytes, 1)[0]  # 3 prompts x 2 = 6 rows
