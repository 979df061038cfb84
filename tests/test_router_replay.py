"""MoE routing replay (actor.router_replay): the training forward routes every token the rollout
ran to the experts the rollout chose, even when the training router would pick others."""
import torch

from tests.multirank import run_on_ranks
from tests.test_layouts import _weight_for
from tests.tiny_models import tiny_config


def _routes(replay):
    from engine.batch import Batch
    from engine.config import ActorConfig, MegatronConfig, ModelConfig
    from engine.hybrid import sync_weights
    from engine.rollout.base import SamplingParams
    from engine.rollout.cpu import CPURollout
    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import load_global, local_shards

    init_mesh(Layout(), seed=1)
    hf = tiny_config("qwen2_moe")
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=2, router_replay=replay,
                      megatron=MegatronConfig(params_dtype="float32"))
    actor = ActorWorker(hf, cfg, ModelConfig(use_remove_padding=True), response_length=4)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(actor.chunks)}
    load_global(actor.chunks, lambda n: _weight_for(n, shapes[n]))
    rollout = CPURollout(hf, eos_token_ids=[], pad_token_id=0, record_routing=True)
    sync_weights(actor.chunks, rollout, hf, bucket_megabytes=1)
    prompts = [[5, 6, 7], [9, 10]]
    out = rollout.generate(prompts, SamplingParams(n=1, do_sample=False, max_new_tokens=4))
    rows = len(prompts)
    ids = torch.zeros(rows, 3 + 4, dtype=torch.long)
    mask = torch.zeros_like(ids)
    resp = torch.tensor(out.responses)
    for r, p in enumerate(prompts):
        ids[r, 3 - len(p):3], mask[r, 3 - len(p):] = torch.tensor(p), 1
        ids[r, 3:] = resp[r]
    batch = Batch(dict(input_ids=ids, attention_mask=mask, responses=resp,
                       response_mask=torch.ones_like(resp)),
                  non_tensors=dict(routed_experts=out.routed_experts))

    # the training router now disagrees with the rollout's (as after a policy update)
    chosen = {}
    for layer in actor.models[0].decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        with torch.no_grad():
            router.weight.copy_(-router.weight)
        router.register_forward_hook(
            lambda mod, inp, outp, L=layer.layer_number - 1: chosen.__setitem__(
                L, outp[1].nonzero()[:, 1].view(-1, hf.num_experts_per_tok)))
    actor.compute_log_prob(batch, micro_batch_size=2)
    # tokens of the packed micro-batch: row 0 (3 + 4) then row 1 (2 + 4); the rollout ran all
    # but each row's last token
    moe_layers = sorted(chosen)
    agree, total = 0, 0
    for ordinal, layer in enumerate(moe_layers):
        starts = [0, 7]
        for r, start in enumerate(starts):
            rec = out.routed_experts[r][:, ordinal].long().sort(-1).values
            got = chosen[layer][start:start + rec.shape[0]].sort(-1).values
            agree += int((rec == got).all(-1).sum())
            total += rec.shape[0]
    return agree, total


def test_replay_routes_tokens_to_the_rollouts_experts():
    agree, total = run_on_ranks(_routes, 1, True)[0]
    assert total > 0 and agree == total
    agree_off, total_off = run_on_ranks(_routes, 1, False)[0]
    assert agree_off < total_off  # without replay the perturbed router picks other experts
