"""PPO updates of a MoE model (tiny Qwen2-MoE: a dense first layer, then 3 MoE layers of 4
experts, top-2) under the layouts and memory options users run it with, each against one
process with the same weights and data: EP 2 with and without router replay, and activation
recompute (full and selective) at PP 2, where 1F1B runs several micro-batches' forwards before
the first backward, so a recomputed forward must replay its own micro-batch's routing
(engine/workers/routing.py), not the latest one's.

The replayed routing is random (not what the training router would choose), so a layer that
replays the wrong rows, or a recomputation that routes differently from its forward, moves the
update far beyond fp32 rounding. fp32; Adam's first step: weights agree to 1e-5.
"""
import os

import pytest
import torch

from tests.multirank import run_on_ranks
from tests.test_router_replay import weight_for
from tests.tiny_models import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")

B, P, R = 8, 5, 6
TOP_K, EXPERTS = 2, 4


def moe_batch(vocab, layers, seed=3):
    """B samples in verl's layout with a recorded routing per sample in SGLang's layout
    ([positions, num_hidden_layers, top_k], random distinct experts; row 0 dense: 0)."""
    from engine.batch import Batch
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, P + 1, (B,), generator=g)
    rlen = torch.randint(2, R + 1, (B,), generator=g)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros(B, R, dtype=torch.long)
    rmask = torch.zeros(B, R, dtype=torch.long)
    routed = []
    for i in range(B):
        p, r = int(plen[i]), int(rlen[i])
        ids[i, P - p:P] = torch.randint(1, vocab, (p,), generator=g)
        resp[i, :r] = torch.randint(1, vocab, (r,), generator=g)
        ids[i, P:P + r], attn[i, P - p:P + r], rmask[i, :r] = resp[i, :r], 1, 1
        rec = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K]
                           for _ in range((p + r - 1) * layers)]).view(p + r - 1, layers, TOP_K)
        rec[:, 0] = 0  # the dense layer's row, as SGLang leaves it
        routed.append(rec.to(torch.int32))
    return Batch(dict(input_ids=ids, attention_mask=attn, responses=resp, response_mask=rmask,
                      advantages=torch.randn(B, R, generator=g) * rmask,
                      noise=torch.randn(B, R, generator=g) * 0.3),
                 non_tensors=dict(routed_experts=routed))


def _update(layout_kwargs, replay, recompute=None, micro=1, max_tokens=None):
    from megatron.core import parallel_state as ps

    from engine.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global, load_global, local_shards

    init_mesh(Layout(**layout_kwargs), seed=1)
    hf = tiny_config("qwen2_moe")
    how = dict(full=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
               selective=dict(recompute_granularity="selective")).get(recompute, {})
    meg = MegatronConfig(params_dtype="float32", use_distributed_optimizer=True, **how)
    dynamic = dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=max_tokens) if max_tokens else {}
    cfg = ActorConfig(ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=micro, megatron=meg, **dynamic,
                      optim=OptimConfig(lr=1e-3, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=0),
                      router_replay=replay, use_kl_loss=False, entropy_coeff=0.0, clip_ratio=0.2)
    actor = ActorWorker(hf, cfg, ModelConfig(use_remove_padding=True), response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(actor.chunks)}
    load_global(actor.chunks, lambda n: weight_for(n, shapes[n]))
    batch = moe_batch(hf.vocab_size, hf.num_hidden_layers)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = batch.index_select(list(range(rank * B // dp, (rank + 1) * B // dp)))
    actor.mini_batch_size_per_rank = len(mine)
    old = actor.compute_log_prob(mine, micro_batch_size=None if max_tokens else 2, max_tokens=max_tokens)
    mine["old_log_probs"] = old + mine["noise"] * mine["response_mask"]
    metrics = actor.update_policy(mine)
    return dict(metrics=metrics, weights=dict(iter_global(actor.chunks, "param")), rank=rank, old=old)


def _merged(results):
    weights = {}
    for res in results:
        weights.update(res["weights"])
    old = torch.cat([r["old"] for r in sorted(results, key=lambda r: r["rank"])
                     if r["old"] is not None][:len({r["rank"] for r in results})])
    return results[0]["metrics"], weights, old


_REF = {}


def _reference(replay):
    if replay not in _REF:
        _REF[replay] = _merged(run_on_ranks(_update, 1, {}, replay))
    return _REF[replay]


def _assert_same_update(got, want):
    metrics, weights, old = got
    ref_metrics, ref_weights, ref_old = want
    torch.testing.assert_close(old, ref_old, atol=1e-5, rtol=0)
    assert set(weights) == set(ref_weights)
    for n in ref_weights:
        torch.testing.assert_close(weights[n], ref_weights[n], atol=1e-5, rtol=0, msg=n)
    for k in ("actor/pg_loss", "actor/grad_norm"):
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-6), k


CASES = [  # name, world, layout, router replay, recompute
    pytest.param(2, dict(ep=2), True, None, id="ep2_replay"),
    pytest.param(2, dict(ep=2), False, None, id="ep2"),
    pytest.param(2, dict(pp=2), True, "full", id="pp2_full_recompute_replay"),
    pytest.param(2, dict(pp=2), True, "selective", id="pp2_selective_recompute_replay"),
    pytest.param(2, dict(pp=2), False, "full", id="pp2_full_recompute"),
]


@pytest.mark.parametrize("world,layout,replay,recompute", CASES)
def test_moe_update_equals_one_process(world, layout, replay, recompute):
    got = _merged(run_on_ranks(_update, world, layout, replay, recompute))
    _assert_same_update(got, _reference(replay))


def test_ep2_dynamic_batching_runs_as_many_micro_batches_on_every_ep_rank():
    """Token-budget micro-batches: with 14 tokens the DP ranks' shares need 4 and 2 micro-batches
    (tests: lengths 7 8 9 8 | 4 8 5 9); every MoE layer's dispatch is a collective over the EP
    peers, so they must run as many (the smaller count splits further). Same update."""
    got = _merged(run_on_ranks(_update, 2, dict(ep=2), True, None, max_tokens=14))
    _assert_same_update(got, _reference(True))


def test_replay_changes_the_update():
    """The replayed routing is not the router's own: were it ignored, the cases above could not
    tell replay from no replay."""
    _, with_replay, _ = _reference(True)
    _, without, _ = _reference(False)
    assert max(float((with_replay[n] - without[n]).abs().max()) for n in without) > 1e-4


# -- through the real trainer ------------------------------------------------------------------
MOE_MODEL = ["actor_rollout_ref.model.config.model_type=qwen2_moe",
             "actor_rollout_ref.model.config.num_hidden_layers=3",
             "actor_rollout_ref.model.config.num_experts=4",
             "actor_rollout_ref.model.config.num_experts_per_tok=2",
             "actor_rollout_ref.model.config.moe_intermediate_size=32",
             "actor_rollout_ref.model.config.shared_expert_intermediate_size=64",
             "actor_rollout_ref.model.config.norm_topk_prob=false",
             "actor_rollout_ref.model.config.mlp_only_layers=[0]",
             "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
             "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]


def _trainer_step(replay, tmp, rollout="cpu"):
    from tests.doubles import double_on_path
    # the double (tests/fakes): routed experts as SGLang's meta_info sends them
    with double_on_path("sglang", rollout == "sglang"):
        return _trainer_step_with(replay, tmp, rollout)


def _trainer_step_with(replay, tmp, rollout):
    """One PPO step of the tiny MoE (3 layers, the first dense) through engine.trainer at EP 2.
    Each router call of the actor's first forward (old log-probs, with the weights the rollout
    also holds) is compared with the router's own top-k, over the tokens the rollout ran: with
    replay it routes as the rollout did, which with equal weights is the router's own choice.
    Replaying another layer's record (the MoE ordinal) agrees on ~5-40% of tokens."""
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed
    from parallel.shards import iter_global

    cfg = load_config(DEMO, ["trainer.n_gpus_per_node=2", "trainer.logger=[]", "trainer.test_freq=-1",
                             "trainer.resume_mode=disable", "trainer.save_freq=-1",
                             "trainer.val_before_train=false",
                             f"trainer.default_local_dir={tmp}/ckpt", f"trainer.log_dir={tmp}/logs/{dist.get_rank()}",
                             "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                             f"actor_rollout_ref.actor.router_replay={str(replay).lower()}",
                             f"actor_rollout_ref.rollout.name={rollout}", *MOE_MODEL])
    set_seed(cfg.trainer.seed)
    derived, components = build(cfg, 2)
    t = Trainer(derived, components)
    before = {n: w.clone() for n, w in iter_global(t.actor.chunks)}
    calls, inputs = {}, []
    pad = t.actor.pad_token_id

    def fed(tokens, cu):
        """Tokens the rollout ran: each sequence but its last token; no padding segment."""
        keep = torch.zeros(tokens.numel(), dtype=torch.bool)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if not bool((tokens.reshape(-1)[a:b] == pad).all()):
                keep[a:b - 1] = True
        return keep

    def compare(mod, inp, outp, L):
        logits = torch.nn.functional.linear(inp[0].reshape(-1, mod.weight.shape[1]), mod.weight)
        own = torch.zeros_like(outp[1], dtype=torch.bool).scatter_(1, logits.topk(2, -1).indices, True)
        keep = fed(*inputs[-1])
        action = getattr(mod.router_replay, "router_replay_action", None)  # the record reached it
        calls.setdefault(L, []).append((float((own == outp[1].bool()).all(-1)[keep].float().mean()),
                                        getattr(action, "value", None)))

    model = t.actor.models[0]
    model.register_forward_pre_hook(lambda m, args, kwargs: inputs.append(
        (args[0], kwargs["packed_seq_params"].cu_seqlens_q)), with_kwargs=True)
    for layer in model.decoder.layers:
        if getattr(layer.mlp, "router", None) is not None:
            layer.mlp.router.register_forward_hook(lambda m, i, o, L=layer.layer_number - 1: compare(m, i, o, L))
    metrics = t.train_step(t.loader.next_batch())
    t.colocated.to_training()
    t.rollout.shutdown()
    moved = max(float((w - before[n]).abs().max()) for n, w in iter_global(t.actor.chunks))
    return dict(first={L: c[0][0] for L, c in calls.items()}, actions={c[0][1] for c in calls.values()},
                moved=moved,
                grad_norm=metrics["actor/grad_norm"])


@pytest.mark.parametrize("replay,rollout", [(True, "cpu"), (True, "sglang"), (False, "cpu")],
                         ids=["replay", "replay_sglang_double", "no_replay"])
def test_ep2_moe_ppo_step_through_the_trainer(replay, rollout, tmp_path):
    for res in run_on_ranks(_trainer_step, 2, replay, str(tmp_path), rollout):
        assert sorted(res["first"]) == [1, 2]  # layer 0 dense
        # the actor's first forward routes every token the rollout ran as the rollout did, at
        # every MoE layer (with the rollout's weights: the router's own choice, bar float ties)
        assert min(res["first"].values()) > 0.97, res["first"]
        assert res["actions"] == ({"replay_forward"} if replay else {None})
        assert res["moved"] > 0 and res["grad_norm"] > 0
