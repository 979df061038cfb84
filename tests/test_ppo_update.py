"""Headline test of the PPO core: one full `update_policy` / `update_critic` on the same data
gives the same updated weights, loss and grad-norm under every layout and micro-batching.

fp32 throughout; Adam's first step moves every weight by ~lr regardless of the gradient's size,
so weight differences stay at fp32 rounding of the update (atol 1e-5 with lr 1e-3). Losses
and grad norms are sums in different orders: rtol 1e-5.
"""
import dataclasses

import pytest
import torch

from tests.multirank import run_on_ranks
from tests.test_layouts import weight_for
from tests.tiny_models import tiny_config

B, P, R = 8, 5, 6


def make_batch(vocab, seed=3):
    from engine.batch import Batch
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, P + 1, (B,), generator=g)
    rlen = torch.randint(1, R + 1, (B,), generator=g)
    rlen[3] = R  # at least one full-length response
    input_ids = torch.zeros(B, P + R, dtype=torch.long)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    rmask = torch.zeros(B, R, dtype=torch.long)
    for i in range(B):
        prompt = torch.randint(1, vocab, (int(plen[i]),), generator=g)
        resp = torch.randint(1, vocab, (int(rlen[i]),), generator=g)
        input_ids[i, P - plen[i]:P] = prompt
        attn[i, P - plen[i]:P] = 1
        input_ids[i, P:P + rlen[i]] = resp
        attn[i, P:P + rlen[i]] = 1
        responses[i, :rlen[i]] = resp
        rmask[i, :rlen[i]] = 1
    return Batch(dict(input_ids=input_ids, attention_mask=attn, responses=responses,
                      response_mask=rmask,
                      advantages=torch.randn(B, R, generator=g) * rmask,
                      returns=torch.randn(B, R, generator=g) * rmask,
                      noise=torch.randn(B, R, generator=g) * 0.3))


def make_configs(**actor_kw):
    from engine.config import ActorConfig, CriticConfig, MegatronConfig, ModelConfig, OptimConfig
    meg = MegatronConfig(params_dtype="float32", use_distributed_optimizer=True)
    optim = OptimConfig(lr=1e-3, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=0)
    actor = ActorConfig(ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=2, megatron=meg,
                        optim=optim, use_kl_loss=True, kl_loss_type="low_var_kl",
                        kl_loss_coef=0.1, entropy_coeff=0.01, clip_ratio=0.2)
    actor = dataclasses.replace(actor, **actor_kw)
    critic = CriticConfig(ppo_micro_batch_size_per_gpu=2, ppo_epochs=1, cliprange_value=0.2,
                          megatron=meg, optim=optim)
    return actor, critic, ModelConfig()


def _run_update(layout_kwargs, micro, dynamic, packed, role, mini_batches=1, overlap=False,
                actor_kw=None, fused=True, old_noise=1.0):
    from megatron.core import parallel_state as ps

    from engine.workers.actor import ActorWorker
    from engine.workers.critic import CriticWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global, load_global, local_shards

    layout = Layout(**layout_kwargs)
    init_mesh(layout, seed=1)
    hf = tiny_config("llama")
    actor_cfg, critic_cfg, model_cfg = make_configs(use_dynamic_bsz=dynamic,
                                                    ppo_max_token_len_per_gpu=24,
                                                    ppo_micro_batch_size_per_gpu=micro,
                                                    **(actor_kw or {}))
    model_cfg = dataclasses.replace(model_cfg, use_remove_padding=packed, use_fused_kernels=fused)
    if overlap:  # Megatron's overlapped gradient reduce / parameter gather
        meg = dataclasses.replace(actor_cfg.megatron, overlap_grad_reduce=True,
                                  overlap_param_gather=True)
        actor_cfg = dataclasses.replace(actor_cfg, megatron=meg)
    critic_cfg = dataclasses.replace(critic_cfg, use_dynamic_bsz=dynamic,
                                     ppo_max_token_len_per_gpu=24,
                                     ppo_micro_batch_size_per_gpu=micro)
    if role == "actor":
        worker = ActorWorker(hf, actor_cfg, model_cfg, response_length=R)
    else:
        worker = CriticWorker(hf, critic_cfg, model_cfg, response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n, shapes[n]))
    if role == "critic":
        for m in worker.models:
            if m.post_process:
                m.value_head.weight.data.copy_(weight_for("value_head", m.value_head.weight.shape))

    batch = make_batch(hf.vocab_size)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = batch.index_select(list(range(rank * B // dp, (rank + 1) * B // dp)))
    worker.mini_batch_size_per_rank = len(mine) // mini_batches
    if role == "actor":
        old = worker.compute_log_prob(mine, micro_batch_size=3)
        if old_noise is not None:  # None: on-policy, update_policy takes its own (detached)
            mine["old_log_probs"] = old + old_noise * mine["noise"] * mine["response_mask"]
        mine["ref_log_prob"] = old - 0.5 * mine["noise"] * mine["response_mask"]
        metrics = worker.update_policy(mine)
        out = dict(old_log_probs=(rank, old))
    else:
        values = worker.compute_values(mine, micro_batch_size=3)
        mine["values"] = values + mine["noise"] * mine["response_mask"]
        metrics = worker.update_critic(mine)
        out = dict(values=(rank, values))
    out["metrics"] = metrics
    out["weights"] = dict(iter_global(worker.chunks, "param"))
    return out


def _collect(results):
    weights, forward = {}, {}
    for res in results:
        weights.update(res["weights"])
        key = "old_log_probs" if "old_log_probs" in res else "values"
        rank, t = res[key]
        forward[rank] = t
    b = torch.cat([forward[r] for r in sorted(forward)])
    return results[0]["metrics"], weights, b


_REF = {}


def _reference(role):
    if role not in _REF:
        _REF[role] = _collect(run_on_ranks(_run_update, 1, {}, 2, False, True, role))
    return _REF[role]


CASES = [
    ("single_micro1", 1, {}, 1, False, True),
    ("single_micro4_padded", 1, {}, 4, False, False),
    ("single_dynamic", 1, {}, None, True, True),
    ("dp2", 2, {}, 2, False, True),
    ("tp2", 2, dict(tp=2), 2, False, True),
    ("tp2_sp", 2, dict(tp=2, sequence_parallel=True), 1, False, True),
    ("pp2", 2, dict(pp=2), 2, False, True),
    ("pp2_dynamic", 2, dict(pp=2), None, True, True),
]


def test_overlapped_communication_gives_the_same_update():
    ref_metrics, ref_weights, _ = _reference("actor")
    metrics, weights, _ = _collect(run_on_ranks(_run_update, 2, {}, 1, False, True, "actor",
                                                overlap=True))
    for k in ref_metrics:
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-6), k
    for n in ref_weights:
        torch.testing.assert_close(weights[n], ref_weights[n], atol=1e-5, rtol=0, msg=n)


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("name,world,layout,micro,dynamic,packed", CASES, ids=[c[0] for c in CASES])
def test_update_is_layout_and_split_invariant(role, name, world, layout, micro, dynamic, packed):
    if role == "critic" and name not in ("single_micro4_padded", "dp2", "tp2", "pp2_dynamic"):
        pytest.skip("critic: a representative subset of layouts")
    ref_metrics, ref_weights, ref_fwd = _reference(role)
    metrics, weights, fwd = _collect(run_on_ranks(_run_update, world, layout, micro, dynamic,
                                                  packed, role))
    torch.testing.assert_close(fwd, ref_fwd, atol=1e-5, rtol=0)
    assert set(metrics) == set(ref_metrics)
    for k in ref_metrics:
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-6), k
    assert set(weights) == set(ref_weights)
    moved = 0
    for n in ref_weights:
        torch.testing.assert_close(weights[n], ref_weights[n], atol=1e-5, rtol=0, msg=n)
        moved += int(not torch.equal(weights[n], weight_for(n, weights[n].shape)))
    assert moved > len(ref_weights) // 2, "the update should change most weights"


@pytest.mark.parametrize("actor_kw", [
    {},
    dict(loss_agg_mode="seq-mean-token-mean", kl_loss_type="k2+", clip_ratio_high=0.28,
         entropy_coeff=0.0),
], ids=["token-mean-k3", "seq-mean-k2st-cliphigher"])
def test_single_pass_loss_gives_the_same_update_as_autograd(actor_kw):
    """The actor's single-pass fused loss (gradients made in the kernel's forward) against the
    log-probs differentiated by autograd through the loss functions (use_fused_kernels=False:
    one chunk, the plain path whose losses test_losses checks against the written formulas)."""
    fused = _collect(run_on_ranks(_run_update, 1, {}, 2, False, True, "actor", actor_kw=actor_kw))
    plain = _collect(run_on_ranks(_run_update, 1, {}, 2, False, True, "actor", actor_kw=actor_kw,
                                  fused=False))
    for k in plain[0]:
        assert fused[0][k] == pytest.approx(plain[0][k], rel=1e-5, abs=1e-6), k
    for n in plain[1]:
        torch.testing.assert_close(fused[1][n], plain[1][n], atol=1e-5, rtol=0, msg=n)


@pytest.mark.parametrize("fused", [True, False], ids=["single-pass", "autograd"])
def test_on_policy_update_without_old_log_probs_equals_one_with_them(fused):
    """One epoch of one mini-batch: the update's own log-probs, detached, are the old ones (the
    trainer then skips the separate forward): same weights, grad-norm and metrics as feeding
    compute_log_prob's values in."""
    kw = dict(actor_kw=dict(clip_ratio_high=0.28), fused=fused)
    given = _collect(run_on_ranks(_run_update, 1, {}, 2, False, True, "actor", old_noise=0.0, **kw))
    reused = _collect(run_on_ranks(_run_update, 1, {}, 2, False, True, "actor", old_noise=None,
                                   **kw))
    for k in given[0]:
        assert reused[0][k] == pytest.approx(given[0][k], rel=1e-5, abs=1e-6), k
    assert reused[0]["actor/ppo_kl"] == 0 and reused[0]["actor/pg_clipfrac"] == 0
    for n in given[1]:
        torch.testing.assert_close(reused[1][n], given[1][n], atol=1e-5, rtol=0, msg=n)


def _update_without_old_log_probs_over_two_mini_batches():
    from parallel.mesh import Layout, init_mesh
    from engine.workers.actor import ActorWorker

    init_mesh(Layout(), seed=1)
    hf = tiny_config("llama")
    actor_cfg, _, model_cfg = make_configs()
    worker = ActorWorker(hf, actor_cfg, model_cfg, response_length=R)
    worker.mini_batch_size_per_rank = B // 2
    batch = make_batch(hf.vocab_size)
    batch["ref_log_prob"] = torch.zeros(B, R)
    with pytest.raises(ValueError, match="old_log_probs are needed"):
        worker.update_policy(batch)
    return True


def test_off_policy_update_requires_old_log_probs():
    assert run_on_ranks(_update_without_old_log_probs_over_two_mini_batches, 1) == [True]


def test_gspo_takes_the_two_pass_kernel_and_matches_autograd():
    kw = dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4,
              clip_ratio_high=4e-4)
    fused = _collect(run_on_ranks(_run_update, 1, {}, 2, False, True, "actor", actor_kw=kw))
    plain = _collect(run_on_ranks(_run_update, 1, {}, 2, False, True, "actor", actor_kw=kw,
                                  fused=False))
    for n in plain[1]:
        torch.testing.assert_close(fused[1][n], plain[1][n], atol=1e-5, rtol=0, msg=n)


def _update_twice(offload):
    import dataclasses as dc

    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global, load_global, local_shards

    init_mesh(Layout(), seed=1)
    hf = tiny_config("llama")
    actor_cfg, _, model_cfg = make_configs()
    actor_cfg = dc.replace(actor_cfg, megatron=dc.replace(
        actor_cfg.megatron, param_offload=True, grad_offload=True, optimizer_offload=True))
    worker = ActorWorker(hf, actor_cfg, model_cfg, response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n, shapes[n]))
    batch = make_batch(hf.vocab_size)
    freed = []
    for _ in range(2):
        old = worker.compute_log_prob(batch, micro_batch_size=4)
        batch["old_log_probs"], batch["ref_log_prob"] = old + batch["noise"] * batch["response_mask"], old
        worker.update_policy(batch)
        if offload:
            before = worker.resident_bytes()
            worker.set_resident(())
            assert all(p.untyped_storage().nbytes() == 0 for c in worker.chunks for p in c.parameters())
            assert worker.resident_bytes() == {"params": 0, "grads": 0, "optimizer": 0}
            freed.append(sum(before.values()))
            worker.set_resident(("params", "grads", "optimizer"))
            assert worker.resident_bytes() == before
    return freed, dict(iter_global(worker.chunks, "param"))


def test_offloaded_state_comes_back_exactly():
    """Parameters, gradients and optimizer state freed between updates and restored: training
    continues bit-exactly as if nothing had moved."""
    (freed, offloaded), (_, kept) = run_on_ranks(_update_twice, 1, True)[0], run_on_ranks(_update_twice, 1, False)[0]
    n_params = sum(t.numel() for t in kept.values())
    assert all(f >= 4 * n_params * 3 for f in freed)  # fp32 params + main grads + 2 Adam moments
    assert all(torch.equal(offloaded[k], kept[k]) for k in kept)
