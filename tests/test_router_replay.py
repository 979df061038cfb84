"""MoE routing replay (actor.router_replay): the training forward routes every token the rollout
ran to the experts the rollout chose, even when the training router would pick others.

The reference is the rollout's own record, in SGLang's layout ([positions, num_hidden_layers,
top_k], a row for every hidden layer; tests/fakes/sglang mirrors sglang/srt/state_capturer/):
the tiny Qwen2-MoE has a dense first layer (mlp_only_layers=[0]), so MoE layer L must replay
row L, not its MoE ordinal. Checked at TP 1 and at TP 2 + sequence parallelism (each TP rank's
routers see their slice of the sequence), packed (THD) and unpacked."""
import hashlib

import pytest
import torch

from tests.multirank import run_on_ranks
from tests.tiny_models import tiny_config

PROMPTS = [[5, 6, 7], [9, 10]]
R = 4


def weight_for(name, shape):
    """Deterministic random weights by name (norms near 1)."""
    g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    w = torch.randn(shape, generator=g) * 0.2
    return 1.0 + 0.1 * w if name.endswith("norm.weight") else w


def rollout_batch(rollout, prompts, response_length):
    """Greedy responses of `prompts` as a verl-layout Batch carrying the rollout's routing."""
    from engine.batch import Batch
    from engine.rollout.base import SamplingParams

    out = rollout.generate(prompts, SamplingParams(n=1, do_sample=False, max_new_tokens=response_length))
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width + response_length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    resp = torch.tensor(out.responses)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):width], mask[r, width - len(p):] = torch.tensor(p), 1
        ids[r, width:] = resp[r]
    batch = Batch(dict(input_ids=ids, attention_mask=mask, responses=resp,
                       response_mask=torch.ones_like(resp)),
                  non_tensors=dict(routed_experts=out.routed_experts))
    return batch, out


def record_routers(models):
    """Hook every router: {global layer index: [routing map of each call]} ([tokens, experts],
    True where a token goes) and the model inputs of each forward [(tokens, cu_seqlens or None)]."""
    chosen, inputs = {}, []
    for model in models:
        model.register_forward_pre_hook(lambda mod, args, kwargs: inputs.append(
            (args[0].clone(), getattr(kwargs.get("packed_seq_params"), "cu_seqlens_q", None))),
            with_kwargs=True)
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.register_forward_hook(
                    lambda mod, inp, outp, L=layer.layer_number - 1: chosen.setdefault(L, []).append(
                        outp[1].bool().clone()))
    return chosen, inputs


def _model(family):
    """The tiny Qwen2-MoE (layer 0 dense), or a DeepSeek-V3 with first_k_dense_replace=2 (MLA,
    sigmoid group-limited routing, 8 experts, top-4; MoE layers 2 and 3)."""
    if family == "deepseek_v3":
        from tests.test_hf_parity import deepseek_v3_config
        return deepseek_v3_config(num_hidden_layers=4, first_k_dense_replace=2)
    return tiny_config(family)


def _replaying_actor(hf, replay, packed, sequence_parallel=False):
    """An actor with the test's weights, a CPU rollout synced from it and a rollout batch of
    PROMPTS recorded there; then the actor's routers are flipped, so its own routing disagrees
    with the record (as after a policy update). Returns (actor, batch, rollout output)."""
    from engine.config import ActorConfig, MegatronConfig, ModelConfig
    from engine.rollout.colocated import sync_weights
    from engine.rollout.cpu import CPURollout
    from engine.workers.actor import ActorWorker
    from parallel.shards import load_global, local_shards

    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=2, router_replay=replay,
                      megatron=MegatronConfig(params_dtype="float32", sequence_parallel=sequence_parallel))
    actor = ActorWorker(hf, cfg, ModelConfig(use_remove_padding=packed), response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(actor.chunks)}
    load_global(actor.chunks, lambda n: weight_for(n, shapes[n]))
    rollout = CPURollout(hf, eos_token_ids=[], pad_token_id=0, record_routing=True)
    sync_weights(actor.chunks, rollout, hf, bucket_megabytes=1)
    batch, out = rollout_batch(rollout, PROMPTS, R)
    for layer in actor.models[0].decoder.layers:
        if getattr(layer.mlp, "router", None) is not None:
            with torch.no_grad():
                layer.mlp.router.weight.neg_()
    return actor, batch, out


def _routes(replay, layout_kwargs, packed, family="qwen2_moe"):
    from megatron.core import parallel_state as ps

    from parallel.mesh import Layout, init_mesh

    layout = Layout(**layout_kwargs)
    init_mesh(layout, seed=1)
    hf = _model(family)
    actor, batch, out = _replaying_actor(hf, replay, packed, layout.sequence_parallel)
    chosen, inputs = record_routers(actor.models)
    actor.compute_log_prob(batch, micro_batch_size=2)
    tokens, cu = inputs[0]
    return dict(tp_rank=ps.get_tensor_model_parallel_rank(), routed=out.routed_experts,
                shape=(hf.num_hidden_layers, hf.num_experts_per_tok),
                chosen={L: c[0] for L, c in chosen.items()}, tokens=tokens, cu=cu)


def _agreement(results):
    """(tokens whose replayed experts equal the rollout's, tokens compared), over MoE layers."""
    ranks = sorted(results, key=lambda r: r["tp_rank"])
    first = ranks[0]
    tokens, cu, routed = first["tokens"], first["cu"], first["routed"]
    b, s = tokens.shape
    # packed: each sample starts at its cu_seqlens entry (a padding segment may follow them)
    starts = (cu[:-1].tolist() if cu is not None else [r * s for r in range(b)])[:len(routed)]
    moe = sorted(first["chosen"])
    dense = [L for L in range(first["shape"][0]) if L not in moe]
    assert dense and moe
    for rec in routed:  # SGLang's layout: a row per hidden layer, the dense ones empty (0)
        assert rec.shape[1:] == first["shape"] and rec.dtype == torch.int32 and not rec[:, dense].any()
    agree = total = 0
    for layer in moe:
        # under SP each TP rank routed its slice of the s-major [s, b] tokens: put them together
        smajor = torch.cat([r["chosen"][layer] for r in ranks])
        row_major = smajor.view(s, b, -1).transpose(0, 1).reshape(b * s, -1)
        for r, start in enumerate(starts):
            n = routed[r].shape[0]
            assert tokens.reshape(-1)[start:start + len(PROMPTS[r])].tolist() == PROMPTS[r]  # sample r
            want = torch.zeros(n, row_major.shape[1], dtype=torch.bool).scatter_(
                1, routed[r][:, layer].long(), True)
            agree += int((row_major[start:start + n] == want).all(-1).sum())
            total += n
    return agree, total, len(moe)


LAYOUTS = [("tp1_packed", 1, {}, True), ("tp1_unpacked", 1, {}, False),
           ("tp2_sp_packed", 2, dict(tp=2, sequence_parallel=True), True),
           ("tp2_sp_unpacked", 2, dict(tp=2, sequence_parallel=True), False)]


@pytest.mark.parametrize("name,world,layout,packed", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_replay_routes_tokens_to_the_rollouts_experts(name, world, layout, packed):
    agree, total, moe = _agreement(run_on_ranks(_routes, world, True, layout, packed))
    assert moe == 3 and total == moe * sum(len(p) + R - 1 for p in PROMPTS) and agree == total


def test_deepseek_v3_with_dense_layers_replays_each_moe_layers_own_row():
    """The issue's case: first_k_dense_replace (2 here), MoE layer k would replay layer k - 2."""
    agree, total, moe = _agreement(run_on_ranks(_routes, 1, True, {}, True, "deepseek_v3"))
    assert moe == 2 and total == moe * sum(len(p) + R - 1 for p in PROMPTS) and agree == total


def test_without_replay_the_perturbed_router_picks_other_experts():
    agree, total, _ = _agreement(run_on_ranks(_routes, 1, False, {}, True))
    assert agree < total


def _without_record_after_one_with():
    from engine.batch import Batch
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    hf = tiny_config("qwen2_moe")
    out = {}
    for replay in (True, False):
        actor, batch, _ = _replaying_actor(hf, replay, packed=True)
        replayed = actor.compute_log_prob(batch, micro_batch_size=2)
        bare = Batch({k: batch[k] for k in ("input_ids", "attention_mask", "responses", "response_mask")})
        out[replay] = (replayed, actor.compute_log_prob(bare, micro_batch_size=2))
    return out


def test_a_batch_without_a_record_routes_by_itself():
    """After a replayed batch, one without routed_experts (no record) must not replay the last
    micro-batch's routing: it gives the log-probs of an actor without replay."""
    out = run_on_ranks(_without_record_after_one_with, 1)[0]
    (replayed, bare), (_, own) = out[True], out[False]
    assert float((replayed - own).abs().max()) > 1e-3  # the record is not the router's own choice
    torch.testing.assert_close(bare, own, atol=1e-6, rtol=0)
