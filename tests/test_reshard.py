"""Hybrid engine: training layout -> full tensors (parallel/reshard.py) -> rollout engine
(engine/hybrid.py).

Weights are generated from their global names (test_layouts' generator), so the full tensors a
layout reshards to can be checked bit-exactly against the generator, and the rollout's logits
against the training model's own forward.
"""
import os

import pytest
import torch
import torch.distributed as dist

from tests.multirank import run_on_ranks
from tests.test_layouts import _weight_for
from tests.tiny_models import tiny_config

ATOL = 1e-5  # fp32 logits, TP-split reductions vs HF's unsplit ones


def _build(family, layout_kwargs, **config_overrides):
    from engine.models.builder import build_model
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import load_global, local_shards

    init_mesh(Layout(**layout_kwargs), seed=1)
    hf = tiny_config(family, **config_overrides)
    chunks = build_model(hf)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(chunks)}
    load_global(chunks, lambda name: _weight_for(name, shapes[name]))
    return hf, chunks


def _global_names(family, config_overrides):
    """Parameter names of the single-process model: the names resharding must produce."""
    from engine.models.builder import build_model
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    chunks = build_model(tiny_config(family, **config_overrides))
    return {name: tuple(p.shape) for name, p in chunks[0].named_parameters()}


def _reshard_run(family, layout_kwargs, bucket_bytes, config_overrides):
    from parallel.reshard import MemoryCounter, iter_buckets, plan_buckets

    _, chunks = _build(family, layout_kwargs, **config_overrides)
    planned = plan_buckets(chunks, bucket_bytes)
    counter = MemoryCounter()
    seen, mismatched, bucket_bytes_seen = [], [], []
    for bucket in iter_buckets(chunks, bucket_bytes, counter=counter):
        bucket_bytes_seen.append(sum(t.numel() * t.element_size() for _, t in bucket))
        for name, tensor in bucket:
            seen.append((name, tuple(tensor.shape)))
            if not torch.equal(tensor, _weight_for(name, tensor.shape)):
                mismatched.append(name)
    return dict(seen=seen, mismatched=mismatched, peak=counter.peak, alive=counter.alive,
                planned=[b.nbytes for b in planned], yielded=bucket_bytes_seen,
                planned_peak=max(b.peak_bytes for b in planned))


LAYOUTS = [
    ("llama", 2, dict(tp=2), {}),
    ("llama", 2, dict(pp=2), dict(tie_word_embeddings=True)),  # last stage holds a tied copy
    ("llama", 2, dict(pp=2, vpp=2), {}),
    ("qwen2", 2, dict(), {}),                                   # DP=2: everything replicated
    ("qwen2_moe", 2, dict(ep=2), {}),
    ("mixtral", 2, dict(tp=2), {}),                             # expert-TP=2, gated expert fc1
    ("qwen3_moe", 2, dict(tp=2, ep=2, etp=1), {}),
    ("llama", 4, dict(tp=2, pp=2), {}),
]


@pytest.mark.parametrize("family,world,layout,overrides", LAYOUTS,
                         ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in l.items()) or 'dp'}"
                              for f, _, l, _ in LAYOUTS])
def test_reshard_yields_every_global_tensor_once(family, world, layout, overrides):
    expected = run_on_ranks(_global_names, 1, family, overrides)[0]
    largest = max(4 * torch.Size(shape).numel() for shape in expected.values())
    bucket_bytes = 24 << 10  # a few tensors per bucket: exercises bucket boundaries
    assert bucket_bytes >= 1.5 * largest  # so even a row-parallel tensor + its staging piece fits
    for rank, res in enumerate(run_on_ranks(_reshard_run, world, family, layout, bucket_bytes, overrides)):
        names = [n for n, _ in res["seen"]]
        assert len(names) == len(set(names)), f"rank {rank}: a tensor was yielded twice"
        assert dict(res["seen"]) == expected, f"rank {rank}: {set(names) ^ set(expected)}"
        assert res["mismatched"] == [], f"rank {rank}: tensors differ from the generator"
        assert res["yielded"] == res["planned"]
        assert len(res["planned"]) > 3
        # memory: what reshard allocated never exceeded the plan nor the bucket size
        assert res["alive"] == 0
        assert res["peak"] <= res["planned_peak"] <= bucket_bytes
        assert max(res["yielded"]) <= bucket_bytes
        if layout:  # a pure DP layout holds everything already and allocates nothing
            assert res["peak"] > 0
