"""Hybrid engine: training layout -> full tensors (parallel/reshard.py) -> rollout engine
(engine/rollout/colocated.py).

Weights are generated from their global names (test_layouts' generator), so the full tensors a
layout reshards to can be checked bit-exactly against the generator, and the rollout's logits
against the training model's own forward.
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.multirank import run_on_ranks
from tests.test_layouts import weight_for
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
    load_global(chunks, lambda name: weight_for(name, shapes[name]))
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
            if not torch.equal(tensor, weight_for(name, tensor.shape)):
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


# ------------------------------------------------------------------ sync into the CPU rollout

PROMPTS = [[5, 17, 42, 8, 61, 3], [90, 2, 33, 71, 12, 44]]
NEW_TOKENS = 4


def _megatron_logits(chunks, tokens):
    """Full-vocabulary logits [b, s, V] of a model without pipeline stages (TP-gathered)."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        local = chunks[0](tokens, pos, None)
    tp = ps.get_tensor_model_parallel_world_size()
    pieces = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(pieces, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=-1).float()


def _megatron_greedy(chunks, prompts, steps):
    tokens = torch.tensor(prompts)
    for _ in range(steps):
        nxt = _megatron_logits(chunks, tokens)[:, -1].argmax(-1)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    return tokens[:, len(prompts[0]):].tolist()


def _compare(chunks, rollout):
    """max |rollout logits - training logits| on the prompts, and both greedy continuations."""
    from engine.rollout.base import SamplingParams

    tokens = torch.tensor(PROMPTS)
    with torch.no_grad():
        hf_logits = rollout.model(input_ids=tokens).logits.float()
    mg_logits = _megatron_logits(chunks, tokens)
    out = rollout.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=NEW_TOKENS))
    return dict(diff=float((hf_logits - mg_logits).abs().max()), logits=mg_logits,
                rollout_tokens=out.responses, training_tokens=_megatron_greedy(chunks, PROMPTS, NEW_TOKENS))


def _updated_weight(name, shape):
    """An optimizer-like step away from the generator's weights, the same on every rank."""
    return weight_for(name, shape) - 0.05 * weight_for(name + "/update", shape)


def _sync_run(family, layout_kwargs, bucket_megabytes):
    from engine.rollout.colocated import sync_weights
    from engine.models.weights import global_shapes
    from engine.rollout.cpu import CPURollout
    from parallel.shards import load_global, local_shards

    hf, chunks = _build(family, layout_kwargs)
    rollout = CPURollout(hf, eos_token_ids=())
    stats = sync_weights(chunks, rollout, hf, bucket_megabytes)
    before = _compare(chunks, rollout)

    shapes = {s.global_name: s.global_shape for _, s in local_shards(chunks)}
    load_global(chunks, lambda name: _updated_weight(name, shapes[name]))
    sync_weights(chunks, rollout, hf, bucket_megabytes)
    after = _compare(chunks, rollout)
    changed = float((after["logits"] - before["logits"]).abs().max())
    for res in (before, after):
        del res["logits"]
    return dict(before=before, after=after, changed=changed, stats=stats,
                model_bytes=sum(4 * torch.Size(s).numel() for s in global_shapes(hf).values()))


@pytest.mark.parametrize("family,layout", [("llama", dict(tp=2)), ("qwen2_moe", dict(ep=2))],
                         ids=["llama-tp2", "qwen2_moe-ep2"])
def test_sync_weights_rollout_matches_training(family, layout):
    bucket_megabytes = 0.025  # 25.6 KiB: the largest tiny tensor (16 KiB) and its staging fit
    for res in run_on_ranks(_sync_run, 2, family, layout, bucket_megabytes):
        for phase in ("before", "after"):  # (b) first sync; (c) after a weight update
            r = res[phase]
            assert r["diff"] <= ATOL, (phase, r["diff"])
            assert r["rollout_tokens"] == r["training_tokens"], phase
        assert res["changed"] > 1e-2  # the update did change the model, and the rollout followed
        stats = res["stats"]
        assert stats.buckets > 3 and 0 < stats.peak_bytes <= bucket_megabytes * (1 << 20)
        assert stats.bytes == res["model_bytes"]  # every weight, once


# ------------------------------------------------------------------ memory

# a model of 44 MiB (fp32) against 6 MiB buckets: keeping the whole model would be 7 buckets;
# large enough that RSS noise (~1 MiB) is small against what is measured
MEMORY_MODEL = dict(hidden_size=512, intermediate_size=1024, vocab_size=2048, num_attention_heads=8,
                    num_key_value_heads=4)


def test_reshard_peak_rss_is_one_bucket(tmp_path):
    """Resident-set high-water mark of a full reshard over the resident set at its start, in
    fresh processes (tools/bench_reshard.py): the pool's workers keep freed heap pages from
    earlier tests that would be reused, and stay resident, outside the process's live bytes."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "reshard.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "tools", "bench_reshard.py"),
                           "--size-mb", "44", "--bucket-mb", "8", "--hidden", "512", "--vocab",
                           "2048", "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    report = json.loads(out.read_text())
    assert report["model_mb"] >= 6 * report["bucket_mb"]
    for layout in ("tp=2", "pp=2"):
        r = report["layouts"][layout]
        assert r["buckets"] >= 6
        assert 0.5 * report["bucket_mb"] < r["counted_peak_mb"] <= report["bucket_mb"]
        # RSS also counts gloo's and the allocator's small blocks (measured: 0-3 MiB); holding
        # the whole model would be 7 buckets
        assert r["rss_peak_mb"] <= 1.5 * report["bucket_mb"], (layout, r)


def _cycles_run(cycles, bucket_megabytes):
    """update -> sync -> generate -> release, `cycles` times; RSS after each phase."""
    import ctypes

    from engine.rollout.colocated import HybridEngine
    from engine.perf import proc_status_bytes
    from engine.rollout.base import SamplingParams
    from engine.rollout.cpu import CPURollout
    from parallel.shards import local_shards

    hf, chunks = _build("llama", dict(tp=2), **MEMORY_MODEL)
    rollout = CPURollout(hf, eos_token_ids=())
    engine = HybridEngine(chunks, rollout, hf, bucket_megabytes=bucket_megabytes)
    params = [p for p, _ in local_shards(chunks)]
    synced, released, outputs = [], [], []
    for cycle in range(cycles):
        with torch.no_grad():  # an optimizer-like step, identical on TP replicas
            for p in params:
                p.mul_(0.98)
        engine.to_rollout()
        # RSS of what is held: a CPU trainer's allocator keeps freed pages for reuse (parallel/cpu.py)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        synced.append(proc_status_bytes("VmRSS"))
        out = rollout.generate(PROMPTS, SamplingParams(do_sample=False, max_new_tokens=2))
        outputs.append(out.responses)
        engine.to_training()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        released.append(proc_status_bytes("VmRSS"))
    return dict(synced=synced, released=released, outputs=outputs,
                model_bytes=sum(4 * p.numel() for p in params) * 2)  # TP=2: the model, roughly


def test_release_resume_cycles_do_not_grow_memory():
    mib = 1 << 20
    for rank, res in enumerate(run_on_ranks(_cycles_run, 2, 10, 6)):
        synced, released = res["synced"], res["released"]
        print(f"rank {rank}: RSS after sync {[round(x / mib, 1) for x in synced]} MiB, "
              f"after release {[round(x / mib, 1) for x in released]} MiB")
        # the rollout holds one copy of the weights while synced and gives it back on release
        # (the first sync may reuse heap pages freed by model building, so it is left out)
        assert min(s - r for s, r in zip(synced[1:], released[1:])) >= 0.8 * res["model_bytes"]
        # no growth: later cycles sit where the second one did (a leak of one weight copy
        # per cycle would add 44 MiB each time)
        assert max(synced[2:]) - synced[1] <= 0.1 * res["model_bytes"]
        assert max(released[2:]) - released[1] <= 0.1 * res["model_bytes"]
        assert all(len(o) == len(PROMPTS) and len(o[0]) == 2 for o in res["outputs"])
