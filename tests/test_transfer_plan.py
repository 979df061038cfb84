"""The weight-sync transfer plan (engine/rollout/transfer.py, issue 22 item 1).

(a) Small layouts against ground truth: every HF tensor of a tiny model filled with values unique
across the model; each rollout GPU's planned slices must give exactly the values of its shard
cut by an independently written SGLang rule (no value missing, none twice, nothing else), and
every planned sender must hold the values it sends under parallel/shards.py's rule on a real
meta build of every rank (one helper process builds all ranks over torch's fake process group).
(b) The recipes' layouts for DeepSeek-V3 and Qwen3-30B-A3B at 8 to 1024 ranks, no processes:
bytes each GPU loads <= 1.1 x model / rollout TP + replicated, every engine loads the model
exactly once, an expert goes only to the GPUs that load it, from the EP rank that owns it.
"""
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import transformers

from engine.models.weights import expected_hf_tensors, global_shapes, megatron_from_hf
from engine.rollout.topology import rollout_topology
from engine.rollout.transfer import transfer_plan
from parallel.mesh import Layout
from parallel.shards import Shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = os.path.join(ROOT, "recipes", "hf_configs")

TINY = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_hidden_layers=4, num_experts=4,
                      num_experts_per_tok=2, vocab_size=128, tie_word_embeddings=False),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                        num_key_value_heads=4, num_hidden_layers=3, n_routed_experts=4, num_experts_per_tok=2,
                        vocab_size=128, tie_word_embeddings=False, q_lora_rank=24, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1,
                        n_shared_experts=1, n_group=2, topk_group=1),
    "qwen2": dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=128, tie_word_embeddings=True),
}
# (model, training layout at 8 ranks, rollout TP, attention DP, rollout EP, separate pool of P ranks)
CASES = [
    ("qwen3_moe", dict(tp=2, pp=2, ep=2, etp=1, sequence_parallel=True), 4, 1, 1, 0),
    ("qwen3_moe", dict(tp=2, pp=2, ep=2, etp=1, sequence_parallel=True), 2, 1, 2, 0),
    ("qwen3_moe", dict(tp=1, pp=2, vpp=2, ep=4, etp=1), 8, 2, 4, 0),
    ("qwen3_moe", dict(tp=2, pp=2, ep=2, etp=1, sequence_parallel=True), 2, 1, 1, 4),
    ("deepseek_v3", dict(tp=2, pp=1, ep=2, etp=2, sequence_parallel=True), 4, 1, 1, 0),
    ("deepseek_v3", dict(tp=4, pp=1, ep=4, etp=1, sequence_parallel=True), 2, 1, 2, 0),
    ("qwen2", dict(tp=4, pp=2), 8, 1, 1, 0),
]
WORLD, NODE = 8, 4

_BUILD = r"""
import json, sys, torch, torch.distributed as dist, transformers
from parallel.mesh import Layout, destroy_mesh
from parallel.meta import init_fake_mesh, META_CONFIG_OVERRIDES
from parallel.shards import local_shards
from engine.models.builder import build_model
out = []
for model, hf_kwargs, layout, world in json.loads(sys.argv[1]):
    hf = transformers.AutoConfig.for_model(model, **hf_kwargs)
    ranks = []
    for rank in range(world):
        if dist.is_initialized():
            destroy_mesh(); dist.destroy_process_group()
        lay = Layout(world_size=world, **layout)
        init_fake_mesh(lay, world, rank)
        with torch.device("meta"):
            chunks = build_model(hf, head="lm", params_dtype=torch.float32, sequence_parallel=lay.sequence_parallel,
                                 config_overrides=dict(META_CONFIG_OVERRIDES))
        held = [[s.global_name, list(s.global_shape), s.dim, s.index, s.count, s.gated]
                for _, s in local_shards(chunks)]
        for chunk in chunks:  # the router's expert bias is a buffer: every rank of the stage has it
            for i, layer in enumerate(getattr(chunk, "decoder", chunk).layers):
                bias = getattr(getattr(layer.mlp, "router", None), "expert_bias", None)
                if bias is not None:
                    held.append([f"decoder.layers.{layer.layer_number - 1}.mlp.router.expert_bias",
                                 list(bias.shape), None, 0, 1, False])
        ranks.append(held)
    out.append(ranks)
print(json.dumps(out))
"""


def _hf(model):
    return transformers.AutoConfig.for_model(model, **TINY[model])


@pytest.fixture(scope="module")
def shards():
    """Every rank's parallel.shards of every case's layout, from real meta builds."""
    todo = sorted({(m, json.dumps(lay, sort_keys=True)) for m, lay, *_ in CASES})
    arg = json.dumps([[m, TINY[m], json.loads(lay), WORLD] for m, lay in todo])
    proc = subprocess.run([sys.executable, "-c", _BUILD, arg], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    return {key: [[Shard("", n, tuple(shape), d, i, c, False, g) for n, shape, d, i, c, g in rank]
                  for rank in ranks] for key, ranks in zip(todo, built)}


def _values(hf):
    """Every HF tensor, filled with values unique across the model."""
    out, start = {}, 0
    for name, shape in expected_hf_tensors(hf).items():
        n = math.prod(shape)
        out[name] = np.arange(start, start + n, dtype=np.float64).reshape(shape)
        start += n
    return out


def _expected(name, arr, j, R, attn_dp, rollout_ep, head_dim, experts):
    """What SGLang's TP rank j loads of `name` (written apart from the plan's rule)."""
    attn, moe_tp = R // attn_dp, R // rollout_ep
    leaf = name.split(".")[-2]
    if leaf in ("embed_tokens", "lm_head"):
        padded = -(-arr.shape[0] // 64) * 64
        if padded % R:
            padded = -(-arr.shape[0] // (64 * R)) * 64 * R
        return arr[j * padded // R:(j + 1) * padded // R]
    if leaf in ("q_proj", "q_b_proj", "kv_b_proj"):
        return np.split(arr, attn, axis=0)[j % attn]
    if leaf == "o_proj":
        return np.split(arr, attn, axis=1)[j % attn]
    if leaf in ("k_proj", "v_proj"):
        heads = arr.shape[0] // head_dim
        if heads >= attn:
            return np.split(arr, attn, axis=0)[j % attn]
        return arr.reshape((heads, head_dim) + arr.shape[1:])[(j % attn) * heads // attn]
    if ".experts." in name:
        e = int(re.search(r"\.experts\.(\d+)\.", name).group(1))
        if e // (experts // rollout_ep) != j // moe_tp:
            return None
        return np.split(arr, moe_tp, axis=1 if leaf in ("down_proj", "w2") else 0)[j % moe_tp]
    if leaf in ("gate_proj", "up_proj"):
        return np.split(arr, R, axis=0)[j]
    if leaf == "down_proj":
        return np.split(arr, R, axis=1)[j]
    return arr


def _cut(arr, box):
    return arr[tuple(slice(lo, hi) for lo, hi in box)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-R{c[2]}-adp{c[3]}-rep{c[4]}-pool{c[5]}")
def test_plan_matches_ground_truth(case, shards):
    model, lay, R, attn_dp, rollout_ep, pool = case
    hf = _hf(model)
    layout = Layout(world_size=WORLD, **lay)
    topo = rollout_topology(pool or WORLD, NODE, R)
    plan = transfer_plan(hf, layout, topo, bytes_per_element=8, bucket_megabytes=0.001,
                         attention_dp=attn_dp, rollout_ep=rollout_ep, separate_pool=bool(pool))
    values = _values(hf)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    experts = getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None) or 0
    got = {}
    for t in plan.transfers():
        got.setdefault((t.receiver, t.hf_name), []).append(_cut(values[t.hf_name], t.box).ravel())
        assert t.nbytes == _cut(values[t.hf_name], t.box).size * 8
    offset = WORLD if pool else 0
    for name, arr in values.items():
        for gpu in range(offset, offset + topo.world_size):
            want = _expected(name, arr, (gpu - offset) % R, R, attn_dp, rollout_ep, head_dim, experts)
            have = got.pop((gpu, name), None)
            if want is None:
                assert have is None, f"GPU {gpu} gets {name} but does not load it"
                continue
            assert have is not None, f"GPU {gpu} gets nothing of {name}"
            assert np.array_equal(np.sort(np.concatenate(have)), np.sort(want.ravel())), (gpu, name)
    assert not got, f"slices sent to GPUs that do not load them: {sorted(got)[:3]}"
    # every sender holds what it sends, by parallel.shards' rule on the real build
    ranks = shards[(model, json.dumps(lay, sort_keys=True))]
    def read(n):
        return torch.from_numpy(values[n])
    globals_ = {n: megatron_from_hf(hf, n, read)[...] for n in global_shapes(hf)}
    held = [set(np.concatenate([s.take(globals_[s.global_name]).numpy().ravel() for s in rank]).tolist())
            for rank in ranks]
    for t in plan.transfers():
        assert 0 <= t.sender < WORLD
        missing = set(_cut(values[t.hf_name], t.box).ravel().tolist()) - held[t.sender]
        assert not missing, f"rank {t.sender} sends {t.hf_name}{t.box} but does not hold it"
    if not pool:
        _check_slices(plan, ranks, globals_, values, got_from=plan.transfers())
    # the buckets of a pair carry its slices, flattened, a bucket at most bucket bytes
    t = plan.transfers()[0]
    buckets = plan.buckets(t.sender, t.receiver)
    assert all(sum(n for _, _, n in b) <= plan.bucket for b in buckets)
    assert sum(n for b in buckets for _, _, n in b) == plan.pair_bytes()[t.sender, t.receiver]


def _check_slices(plan, ranks, globals_, values, got_from):
    """What engine/rollout/delivery.py sends (TransferPlan.slices_of): each sender's local index of
    a slice holds exactly the HF values of its box (the real layout's pieces); both ends of a pair
    list the same slices in the same order each round; a GPU receives at most a bucket a round;
    over the rounds each GPU gets what the plan's transfers give it."""
    per = [plan.slices_of(r) for r in range(WORLD)]
    rounds = len(plan.rounds())
    assert rounds > 1  # the tiny bucket cuts the model into many rounds (rows of big tensors too)
    for rank, (sends, recvs) in enumerate(per):
        local = {s.global_name: s.take(globals_[s.global_name]).numpy() for s in ranks[rank]}
        assert len(sends) == len(recvs) == rounds
        for k in range(rounds):
            for other, piece in sends[k]:
                assert np.array_equal(local[piece.source][piece.local()], _cut(values[piece.hf_name], piece.box)), \
                    (rank, piece)
                assert [p for o, p in per[other][1][k] if o == rank] == [p for o, p in sends[k] if o == other]
            assert sum(math.prod(p.shape) for _, p in recvs[k]) * plan.elt <= plan.bucket
    # a backend loading whole HF tensors (SGLang) gets each tensor in one round, whatever its size
    whole = plan.round_tensors(whole_tensors=True)
    names = [n for r in whole for n, _, _ in r]
    assert len(names) == len(set(names)) == len({t.hf_name for t in got_from})
    split = [n for r in plan.round_tensors() for n, _, _ in r]
    assert len(split) > len(set(split))  # without it, the tiny bucket cuts tensors by rows
    for rank in (0, WORLD - 1):
        sends, recvs = plan.slices_of(rank, whole_tensors=True)
        for k, r in enumerate(recvs):
            assert {p.hf_name for _, p in r} <= {n for n, _, _ in whole[k]}
    for rank, (_, recvs) in enumerate(per):
        have = sorted((p.hf_name, v) for r in recvs for _, p in r for v in _cut(values[p.hf_name], p.box).ravel())
        want = sorted((t.hf_name, v) for t in got_from if t.receiver == rank
                      for v in _cut(values[t.hf_name], t.box).ravel())
        assert have == want, rank


def _recipe_case(name, world):
    """The shipped recipe's layouts, scaled down where a size exceeds the world."""
    if name == "DeepSeek-V3":   # recipes/deepseek_v3_671b_grpo.yaml
        return Layout(tp=min(8, world), pp=1, ep=min(256, world), etp=1, sequence_parallel=True,
                      world_size=world), min(16, world)
    pp = 2                      # recipes/qwen3_30b_a3b_grpo.yaml
    return Layout(tp=1, pp=pp, ep=min(8, world // pp), etp=1, world_size=world), 4


@pytest.mark.parametrize("world", [8, 64, 256, 1024])
@pytest.mark.parametrize("name", ["DeepSeek-V3", "Qwen3-30B-A3B"])
def test_recipes_at_scale(name, world):
    hf = transformers.AutoConfig.from_pretrained(os.path.join(HF, name))
    layout, R = _recipe_case(name, world)
    start = time.perf_counter()
    plan = transfer_plan(hf, layout, rollout_topology(world, 8, R), bucket_megabytes=512)
    pairs = plan.pair_bytes()
    s = plan.summary(400, 50)
    print(f"{name} at {world}: plan + summary {time.perf_counter() - start:.2f} s; {s['planned']}")
    loaded = pairs.sum(0)
    bound = 1.1 * plan.model_bytes / R + plan.replicated_bytes
    assert loaded.max() <= bound, (loaded.max(), bound)
    # every engine loads the model exactly once: the model split over its R GPUs, replicated ones R times
    assert pairs.sum() == pytest.approx(plan.engines * (plan.model_bytes + (R - 1) * plan.replicated_bytes))
    assert s["planned"]["recv_gb_max"] < s["today"]["recv_gb_max"] / 2
    # experts: each GPU that loads one gets exactly its slice, once, from the EP rank that owns it
    experts = hf.num_experts if name.startswith("Qwen") else hf.n_routed_experts
    layer = hf.num_hidden_layers - 1
    names = [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"
             for e in (0, experts // 2 + 1, experts - 1) for p in ("gate", "down")]
    S, ep = world // layout.pp, layout.ep
    every = plan.transfers(names)
    for n in names:
        ts = [t for t in every if t.hf_name == n]
        e = int(re.search(r"experts\.(\d+)\.", n).group(1))
        assert len({t.receiver for t in ts}) == len(ts) == world, n
        shape = expected_hf_tensors(hf)[n]
        assert all(t.nbytes == math.prod(shape) * 2 // R for t in ts)
        assert {(t.sender % S) // layout.expert_tp % ep for t in ts} == {e // (experts // ep)}


def test_planner_reports_the_weight_sync_of_the_recipes():
    """tools/plan.py's `weight_sync` (its --json section and report line) for the shipped MoE
    recipes: today vs planned, seconds scaling with the stated link bandwidths."""
    from engine.config import load_config
    from tools.plan import estimate, weight_sync

    for recipe, world in (("deepseek_v3_671b_grpo", 256), ("qwen3_30b_a3b_grpo", 16)):
        cfg = load_config(os.path.join(ROOT, "recipes", f"{recipe}.yaml"), [])
        e = estimate(cfg, world, 141, "cuda")
        w = weight_sync(cfg, e, 400, 50)
        slow = weight_sync(cfg, e, 200, 25)
        for side in ("today", "planned"):
            assert {"recv_gb_max", "recv_gb_mean", "sent_gb_max", "sent_gb_mean", "messages",
                    "seconds"} <= set(w[side])
            assert slow[side]["seconds"] == pytest.approx(2 * w[side]["seconds"], rel=1e-3)
        assert w["planned"]["recv_gb_max"] <= 1.1 * w["model_gb"] / w["rollout_tp"] + w["replicated_gb"]
        assert w["planned"]["seconds"] < w["today"]["seconds"] / 5
