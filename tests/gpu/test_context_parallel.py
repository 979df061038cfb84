"""Context parallelism on 2 GPUs with TransformerEngine: CP=2 against CP=1 (two DP replicas).

TE's CP attention runs only in FlashAttention / cuDNN kernels, i.e. in bf16 / fp16, so these
compare bf16 runs and tolerances are bf16's.

- the model alone: CP rank r's logits (chunks r and 3-r of each row, Megatron's batch split)
  equal the same positions of the unsplit forward;
- the worker path: `ActorWorker.compute_log_prob` and one `update_policy` step, packed (THD with
  per-sequence padding) and unpacked: log-probs, metrics and the updated weights match CP=1's.
"""
import dataclasses

import pytest
import torch

from tests.gpu.spawn import run_spawned

pytestmark = pytest.mark.gpu

SEQ, BATCH = 64, 2
LR = 1e-3


def _needs():
    if torch.cuda.device_count() < 2:
        pytest.skip("context parallelism needs 2 GPUs")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        pytest.skip("context parallelism needs TransformerEngine (pip install -e .[gpu])")


def _logits_rank(rank):
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from engine.models.builder import build_model
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import load_global, local_shards
    from tests.test_layouts import weight_for
    from tests.tiny_models import tiny_config

    hf = tiny_config("llama", max_position_embeddings=SEQ)
    tokens = torch.randint(0, hf.vocab_size, (BATCH, SEQ),
                           generator=torch.Generator().manual_seed(0)).cuda()
    logits = {}
    for cp in (1, 2):
        init_mesh(Layout(cp=cp), seed=1)
        [model] = build_model(hf, params_dtype=torch.bfloat16)
        model.eval()
        shapes = {s.global_name: s.global_shape for _, s in local_shards([model])}
        load_global([model], lambda n: weight_for(n, shapes[n]).cuda())
        pos = torch.arange(SEQ, device="cuda").expand(BATCH, SEQ)
        batch = get_batch_on_this_cp_rank({"tokens": tokens, "position_ids": pos})
        with torch.no_grad():
            logits[cp] = (model(batch["tokens"], batch["position_ids"], None).float().cpu(),
                          batch["position_ids"][0].cpu())
        ps.destroy_model_parallel()
    full, _ = logits[1]
    part, positions = logits[2]
    return float((part - full[:, positions]).abs().max()), float(full.abs().max())


def test_cp2_logits_equal_single_rank():
    _needs()
    for err, scale in run_spawned(_logits_rank, 2):
        assert err <= 2e-2 * scale, (err, scale)


def _update_rank(rank, packed):
    from megatron.core import parallel_state as ps

    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global, load_global, local_shards
    from tests.test_layouts import weight_for
    from tests.test_ppo_update import B, R, make_batch, make_configs
    from tests.tiny_models import tiny_config

    hf = tiny_config("llama")
    out = {}
    for cp in (1, 2):
        init_mesh(Layout(cp=cp), seed=1)
        actor_cfg, _, model_cfg = make_configs()
        meg = dataclasses.replace(actor_cfg.megatron, params_dtype="bfloat16")
        actor_cfg = dataclasses.replace(actor_cfg, megatron=meg,
                                        optim=dataclasses.replace(actor_cfg.optim, lr=LR))
        model_cfg = dataclasses.replace(model_cfg, use_remove_padding=packed)
        actor = ActorWorker(hf, actor_cfg, model_cfg, response_length=R)
        shapes = {s.global_name: s.global_shape for _, s in local_shards(actor.chunks)}
        load_global(actor.chunks, lambda n: weight_for(n, shapes[n]))
        initial = {n: t.float().cpu() for n, t in iter_global(actor.chunks, "param")}
        # CP=1 on 2 GPUs is 2 DP replicas with half the batch each; CP=2 is one with all of it
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mine = make_batch(hf.vocab_size).index_select(
            list(range(dp_rank * B // dp, (dp_rank + 1) * B // dp)))
        actor.mini_batch_size_per_rank = len(mine)
        old = actor.compute_log_prob(mine, micro_batch_size=3)
        mine["old_log_probs"] = old + 0.3 * mine["noise"] * mine["response_mask"]
        mine["ref_log_prob"] = old - 0.5 * mine["noise"] * mine["response_mask"]
        metrics = actor.update_policy(mine)
        out[cp] = dict(log_prob=(dp_rank, old.float().cpu()), metrics=metrics, initial=initial,
                       weights={n: t.float().cpu() for n, t in iter_global(actor.chunks, "param")})
        ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "rows"])
def test_cp2_actor_update_equals_cp1(packed):
    _needs()
    results = run_spawned(_update_rank, 2, packed)
    by_cp = {}
    for cp in (1, 2):
        parts = dict(res[cp]["log_prob"] for res in results)
        by_cp[cp] = torch.cat([parts[r] for r in sorted(parts)])
    torch.testing.assert_close(by_cp[2], by_cp[1], atol=5e-2, rtol=0)

    one, two = results[0][1], results[0][2]
    for k, v in one["metrics"].items():
        assert two["metrics"][k] == pytest.approx(v, rel=5e-2, abs=5e-3), k
    # Adam's first step moves each weight by ~lr x sign(grad): the steps must agree except
    # where a gradient is near zero and bf16 noise flips its sign
    step1 = torch.cat([(one["weights"][n] - one["initial"][n]).flatten() for n in one["weights"]])
    step2 = torch.cat([(two["weights"][n] - two["initial"][n]).flatten() for n in one["weights"]])
    assert step1.abs().max() > 0.5 * LR
    assert torch.nn.functional.cosine_similarity(step1, step2, dim=0) > 0.99
    # at most a sign flip (2 lr) plus a bf16 rounding step of the weight on each side
    w = torch.cat([one["initial"][n].flatten() for n in one["weights"]]).abs().clamp_min(1e-30)
    ulp = torch.exp2(torch.floor(torch.log2(w)) - 7)
    assert bool(((step1 - step2).abs() <= 2 * LR + 2 * ulp).all())
    assert float(((step1 - step2).abs() > 0.5 * LR).float().mean()) < 0.05
