"""tools/plan.py's vLLM memory model (tools/plan_rollout.py) against its written formula, and the
way it differs from SGLang's on the same gpu_memory_utilization: vLLM's share is u x the whole
device and holds weights + activation peak + KV cache; SGLang's is u x the memory free when the
engine starts and holds weights + KV pool."""
import math
import os

import pytest

from engine.config import load_config
from tools.plan import GIB, RESERVE_GIB, estimate, report_text
from tools.plan_memory import Shape
from tools.plan_rollout import KEY, engine_memory, kv_bytes_per_token, vllm_activation_peak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
QWEN = os.path.join(ROOT, "recipes", "qwen2_5_7b_gsm8k_ppo.yaml")
R = "actor_rollout_ref.rollout"
ON_DEVICE = ["actor_rollout_ref.actor.megatron.param_offload=false",
             "actor_rollout_ref.actor.megatron.grad_offload=false",
             "actor_rollout_ref.actor.megatron.optimizer_offload=false"]


def _shape(**kw):
    base = dict(layers=3, h=96, a=6, g=2, k_qk=16, k_v=16, f=200, vocab=50, tied=False, qkv_bias=False,
                qk_norm=False, moe_pattern=[0, 0, 0])
    return Shape(**{**base, **kw})


def test_vllm_figures_follow_the_formula():
    s = _shape()
    total, free, weights = 10_000_000, 9_000_000, 1_234_567
    mem = engine_memory("vllm", s, utilization=0.7, total=total, start_free=free, weights=weights, tp=2,
                        dtype_bytes=2, max_num_batched_tokens=300, max_num_seqs=7, max_model_len=40)
    # tokens x B x [2h + ((a + 2g) k_qk + a k_v + 3 f) / t] + rows x V x (B + 8)
    activations = 300 * 2 * (2 * 96 + ((6 + 4) * 16 + 6 * 16 + 3 * 200) / 2) + 7 * 50 * (2 + 8)
    assert mem["activation_peak_per_gpu"] == activations == 375_500
    assert mem["share_per_gpu"] == 7_000_000 and mem["share_of"] == "total"
    assert mem["kv_cache_per_gpu"] == 7_000_000 - weights - activations
    per_token = 3 * 1 * (16 + 16) * 2  # layers x KV heads per GPU (2 / TP 2) x (k + v) x B
    assert mem["kv_bytes_per_token"] == per_token == 192
    assert mem["kv_tokens"] == (7_000_000 - weights - activations) // per_token
    assert mem["min_kv_tokens"] == 40


def test_kv_heads_replicate_past_tp_and_mla_keeps_its_latent():
    s = _shape()
    assert kv_bytes_per_token(s, tp=4, dtype_bytes=2) == 3 * 1 * 32 * 2  # g=2 < t=4: one head per GPU
    assert kv_bytes_per_token(s, tp=1, dtype_bytes=4) == 3 * 2 * 32 * 4
    assert kv_bytes_per_token(_shape(kv_lora=64, k_rope=8), tp=8, dtype_bytes=2) == 3 * (64 + 8) * 2
    moe = _shape(experts=8, topk=2, f_expert=40, f_shared=24, moe_pattern=[1, 1, 1])
    assert vllm_activation_peak(moe, 1, 2, 10, 100) == \
        10 * 2 * (2 * 96 + (10 * 16 + 6 * 16 + 3 * (2 * 40 + 24))) + 10 * 50 * 10


def test_vllm_and_sglang_read_the_same_fraction_differently():
    s = _shape()
    total, free, weights, u = 10_000_000, 9_000_000, 1_234_567, 0.7
    kw = dict(utilization=u, total=total, start_free=free, weights=weights, tp=2, dtype_bytes=2,
              max_num_batched_tokens=300, max_num_seqs=7, max_model_len=40)
    v, g = engine_memory("vllm", s, **kw), engine_memory("sglang", s, **kw)
    assert g["share_per_gpu"] == pytest.approx(u * free) and g["share_of"] == "free"
    assert g["activation_peak_per_gpu"] == 0 and g["kv_cache_per_gpu"] == pytest.approx(u * free - weights)
    # vLLM takes u of the memory SGLang never sees (total - free), and keeps its activations inside
    assert v["share_per_gpu"] - g["share_per_gpu"] == pytest.approx(u * (total - free))
    assert v["kv_cache_per_gpu"] - g["kv_cache_per_gpu"] == pytest.approx(
        u * (total - free) - v["activation_peak_per_gpu"])


def _tiny(name, u, gpu_mem=16, extra=()):
    over = [f"{R}.name={name}", "trainer.device=cuda", f"{R}.gpu_memory_utilization={u}",
            f"{R}.max_num_batched_tokens=300", f"{R}.max_num_seqs=7", *extra]
    return estimate(load_config(DEMO, over), 2, gpu_mem_gib=gpu_mem, device="cuda")


def test_estimate_states_vllms_budget_of_the_whole_device():
    e = _tiny("vllm", 0.55)
    r = e["rollout"]
    total = 16 * GIB
    assert r["share_per_gpu"] == e["rollout_share"] == math.ceil(0.55 * total)
    # the demo's model: 2 layers, h 64, 4 heads of 16, 2 KV groups, f 128, vocab 20, float32
    assert r["weights_per_gpu"] == 4 * (2 * (2 * 64 + 64 * (4 + 2 + 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128)
                                        + 64 + 2 * 20 * 64)
    activations = 300 * 4 * (2 * 64 + ((4 + 4) * 16 + 4 * 16 + 3 * 128)) + 7 * 20 * (4 + 8)
    assert r["activation_peak_per_gpu"] == activations
    kv = math.ceil(0.55 * total) - r["weights_per_gpu"] - activations
    assert r["kv_cache_per_gpu"] == kv
    assert r["kv_bytes_per_token"] == 2 * 2 * 32 * 4 and r["kv_tokens"] == int(kv // 512)
    assert e["phases"]["gen"] >= r["share_per_gpu"] and e["fits"]
    text = report_text(e)
    assert "vLLM budget gpu_memory_utilization 0.55 x 16.00 GiB device memory" in text
    # SGLang on the same recipe and value: u x (16 - RESERVE_GIB) GiB, the weights, the rest a pool
    g = _tiny("sglang", 0.55)["rollout"]
    assert g["share_per_gpu"] == pytest.approx(0.55 * (16 - RESERVE_GIB) * GIB)
    assert r["share_per_gpu"] - g["share_per_gpu"] == pytest.approx(0.55 * RESERVE_GIB * GIB, abs=1)
    assert g["kv_cache_per_gpu"] == pytest.approx(g["share_per_gpu"] - g["weights_per_gpu"])


def test_a_vllm_share_larger_than_the_free_device_is_refused_where_sglang_fits():
    g = _tiny("sglang", 0.95)
    assert g["fits"] and not g["rollout"]["problems"]
    v = _tiny("vllm", 0.95)
    assert not v["fits"]
    share, awake = math.ceil(0.95 * 16 * GIB), v["rollout"]["training_awake"]
    assert v["free"] == pytest.approx((16 - RESERVE_GIB) * GIB - share - awake) and 0 < awake < share / 1000
    fit = v["rollout"]["utilization_fit"]
    assert fit == math.floor((16 - RESERVE_GIB) / 16 * 100) / 100 == 0.87
    assert any(f"{KEY}=0.95" in p and "vLLM refuses to start" in p and f"use {KEY}=0.87" in p
               for p in v["rollout"]["problems"])
    assert _tiny("vllm", fit)["fits"]


def test_vllm_fit_beside_resident_training_names_the_value_that_fits():
    def plan(name, u):
        cfg = load_config(QWEN, [f"{R}.name={name}", f"{R}.gpu_memory_utilization={u}", *ON_DEVICE])
        return estimate(cfg, 8, gpu_mem_gib=80, device="cuda")

    e = plan("vllm", 0.6)
    r = e["rollout"]
    awake = r["training_awake"]
    assert awake == pytest.approx(e["reserved"]["gen"] - r["share_per_gpu"]) and awake > 10 * GIB
    assert not e["fits"] and e["free"] == pytest.approx((80 - RESERVE_GIB) * GIB - awake - math.ceil(0.6 * 80 * GIB))
    fit = r["utilization_fit"]
    assert fit == math.floor(((80 - RESERVE_GIB) * GIB - awake) / (80 * GIB) * 100) / 100
    assert r["problems"] and all(p.startswith(f"{KEY}=0.6:") and p.endswith(f"use {KEY}={fit:g}")
                                 for p in r["problems"])
    assert "NOT FITTING" in report_text(e)
    assert plan("vllm", fit)["fits"] and not plan("vllm", round(fit + 0.01, 2))["fits"]
    # SGLang's fraction is of the free device: the same training leaves it a larger value
    assert plan("sglang", 0.6)["rollout"]["utilization_fit"] > fit


def test_vllm_without_room_for_one_sequence_is_refused():
    cfg = load_config(QWEN, [f"{R}.name=vllm", f"{R}.gpu_memory_utilization=0.1"])
    e = estimate(cfg, 8, gpu_mem_gib=80, device="cuda")
    r = e["rollout"]
    assert r["kv_cache_per_gpu"] < 0 and r["kv_tokens"] == 0 and r["min_kv_tokens"] == 512 + 1024
    assert not e["fits"]
    need = r["weights_per_gpu"] + r["activation_peak_per_gpu"] + 1536 * r["kv_bytes_per_token"]
    assert r["utilization_fit"] >= need / (80 * GIB)
    assert any("less than one sequence of 1536" in p for p in r["problems"])
