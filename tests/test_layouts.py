"""Layout equivalence: the same weights and data give the same logits and gradients under every
parallel layout as in one process (fp32).

Weights are generated from their *global* names (so every layout and the single-process
reference hold identical values); the fixed loss is sum(logits * R) for a fixed random R.
"""
import hashlib

import pytest
import torch
import torch.distributed as dist

from tests.multirank import run_on_ranks
from tests.tiny_models import tiny_config

BATCH, SEQ = 4, 8
# fp32 sums over a few hundred products in different orders (TP splits the reductions):
# differences are a few ulp of the values; 1e-5 absolute is the bound for values O(1).
# The tied embedding's gradient sums over every token and reaches ~6.5, where 10 ulp is 5e-6
# and another CPU's SIMD width adds a few more, so the bound scales with the largest value.
ATOL = 1e-5


def _assert_close(got, want, msg=None):
    atol = ATOL * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, atol=atol, rtol=0,
                               msg=lambda detail: f"{msg or 'logits'}: {detail}")


def weight_for(name, shape):
    seed = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.2
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        w = 1.0 + 0.1 * w
    return w


def _data(vocab):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    r = torch.randn(BATCH, SEQ, vocab, generator=g) / (BATCH * SEQ)  # a token mean: O(1) grads
    return tokens, r


def _layout_run(family, layout_kwargs, n_micro):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from engine.models.builder import build_model
    from parallel.mesh import Layout, init_mesh
    from parallel.schedule import forward_backward
    from parallel.shards import iter_global, load_global, local_shards

    layout = Layout(**layout_kwargs)
    init_mesh(layout, seed=1)
    hf = tiny_config(family)
    chunks = build_model(hf, sequence_parallel=layout.sequence_parallel)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(chunks)}
    load_global(chunks, lambda name: weight_for(name, shapes[name]))
    ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
    chunks = [DistributedDataParallel(c.config, ddp_cfg, c) for c in chunks]

    tokens, r = _data(hf.vocab_size)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    per_rank = BATCH // dp
    mine = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
    vshard = hf.vocab_size // tp
    mbs = per_rank // n_micro
    micro = [dict(ids=mine[i * mbs:(i + 1) * mbs]) for i in range(n_micro)]

    def step(model, mb):
        ids = tokens[mb["ids"]]
        pos = torch.arange(SEQ).expand_as(ids)
        out = model(ids, pos, None)

        def loss_fn(logits):
            rr = r[mb["ids"]][..., tp_rank * vshard:(tp_rank + 1) * vshard]
            loss = (logits.float() * rr).sum()
            return loss, torch.tensor(1), dict(ids=mb["ids"], logits=logits.detach())
        return out, loss_fn

    infos = forward_backward(chunks, micro, step, forward_only=False, seq_length=SEQ,
                             micro_batch_size=mbs)
    logits = {}
    for info in infos:
        full = [torch.empty_like(info["logits"]) for _ in range(tp)]
        dist.all_gather(full, info["logits"].contiguous(), group=ps.get_tensor_model_parallel_group())
        for row, sample in enumerate(info["ids"]):
            logits[sample] = torch.cat(full, dim=-1)[row]
    grads = dict(iter_global(chunks, "grad"))
    return dict(logits=logits, grads=grads)


def _merge(results):
    logits, grads = {}, {}
    for res in results:
        logits.update(res["logits"])
        for name, g in res["grads"].items():
            if name in grads:  # replicas (DP, TP-replicated, tied copies) must agree
                _assert_close(g, grads[name], msg=name)
            grads[name] = g
    return logits, grads


_REFERENCE = {}


def _reference(family):
    if family not in _REFERENCE:
        _REFERENCE[family] = _merge(run_on_ranks(_layout_run, 1, family, {}, 1))
    return _REFERENCE[family]


def _check(family, world, layout_kwargs, n_micro=1):
    ref_logits, ref_grads = _reference(family)
    logits, grads = _merge(run_on_ranks(_layout_run, world, family, layout_kwargs, n_micro))
    assert sorted(logits) == list(range(BATCH))
    for i in range(BATCH):
        _assert_close(logits[i], ref_logits[i])
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name in ref_grads:
        assert ref_grads[name].abs().sum() > 0, f"{name}: reference gradient is all zero"
        _assert_close(grads[name], ref_grads[name], msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp2(family):
    _check(family, 2, dict(tp=2))


def test_tp2_sequence_parallel():
    _check("qwen2", 2, dict(tp=2, sequence_parallel=True))


def test_pp2_1f1b():
    _check("llama", 2, dict(pp=2), n_micro=4)


def test_pp2_virtual_pipeline():
    _check("llama", 2, dict(pp=2, vpp=2), n_micro=4)


def test_dp2():
    _check("qwen2", 2, dict(), n_micro=2)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_ep2_moe(family):
    _check(family, 2, dict(ep=2))


def test_tp2_ep2_moe_sequence_parallel():
    _check("qwen3_moe", 2, dict(tp=2, ep=2, etp=1, sequence_parallel=True))


def test_tp2_pp2_four_ranks():
    _check("llama", 4, dict(tp=2, pp=2), n_micro=2)


def test_pp2_ep2_moe_four_ranks():
    _check("qwen2_moe", 4, dict(pp=2, ep=2), n_micro=2)


def _build_with_cp2():
    from engine.models.builder import build_model
    from parallel.mesh import Layout, init_mesh
    init_mesh(Layout(cp=2))
    try:
        build_model(tiny_config("llama"))
    except ValueError as e:
        return str(e)
    return None


def test_context_parallel_is_validated_and_needs_te_on_cpu():
    # Megatron's context parallelism runs on TE attention: its equivalence test is
    # tests/gpu/test_context_parallel.py; here the layout validates and the build says why not.
    for message in run_on_ranks(_build_with_cp2, 2):
        assert message and "context_parallel_size=2" in message and "TransformerEngine" in message
