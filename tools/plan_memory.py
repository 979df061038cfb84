"""Per-rank memory of one Megatron model (tools/plan.py adds the phases, the rollout engine
and the search).

What one rank holds (bytes; P = this rank's parameters of the fullest pipeline stage, split into
dense P_d and expert P_e; DP / EDP = data / expert-data parallel size):

  cuda (bf16 params, fp32 grad buffer as engine/workers/base.py sets grad_reduce_in_fp32, Adam
        with fp32 master + 2 moments in Megatron's DistributedOptimizer, sharded over DP):
        weights 2P, grads 4P, optimizer 12 P_d/DP + 12 P_e/EDP
  cpu   (fp32 params are their own master copy, torch Adam's 2 moments):
        weights 4P, grads 4P, optimizer 8 P_d/DP + 8 P_e/EDP
  (without the distributed optimizer the optimizer term is not divided.)

Activations, per token of a micro-batch, per transformer layer, after Korthikanti et al.
("Reducing Activation Recomputation in Large Transformer Models"), without dropout, for GQA
(a query heads, g key/value groups, head dims k_qk / k_v), SwiGLU (ffn f), TP t, sequence
parallel (sp = t with SP, else 1), context parallel dividing the tokens:
  cuda, TransformerEngine layers, bf16 (2 bytes/element):
        2 [ 4h/sp + ((a + g) k_qk + g k_v   (the fused QKV output, kept by V)
                     + a k_qk + g k_qk      (Q, K after RoPE)
                     + a k_v                (attention output = projection input)
                     + 3f) / t ]            (fc1 output 2f, SwiGLU output f)
  cpu,  Megatron's local layers + Trident's torch norm / SDPA attention, fp32 (4 bytes),
        counted by autograd's saved tensors (see tests/test_plan.py):
        4 [ 6h/sp + (4 a k + a + 5f) / t ]  (+ (a + 2g) k + (a + g)(k + 1) with QK-norm)
  MoE layers replace the MLP terms by top-k routed copies: topk (h + 3 f_e)/etp + E (router)
  + the shared expert's 3 f_s / t (cuda; cpu uses 5 f_e).
With full recompute (uniform, n layers per unit) a layer keeps only its unit's input h/sp and
one unit is re-materialised during backward; selective recompute drops only the s^2 attention
scores, which flash / SDPA attention never stores, so it is counted as no recompute. The first
pipeline stage holds min(PP, micro-batches) micro-batches in flight under 1F1B (x (1 + (PP-1) /
(PP x VPP)) when interleaved). Backward adds one layer's activations as gradient workspace and
the largest parameter's gradient (autograd makes it before Megatron's hook accumulates it).
Logits are never materialised (kernels/logprob.py): the last stage holds the final hidden
states, its fp32 gradient, the output-weight gradient and the kernel's chunk buffers.
The exact KL (kl_loss_type / kl_penalty full, full+) keeps the reference's hidden states at
every response token of the rank's batch in host memory (`host`) and adds to the pass that
computes it the reference's weight shard, a micro-batch of those states and a chunk of both
models' logits (`full_kl_bytes`).

Tests: tests/test_plan.py, tests/test_recipes.py, tests/test_device_memory.py
"""
import math
from dataclasses import dataclass


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Shape:
    """What the memory model needs of one architecture, in Megatron's terms."""
    layers: int
    h: int
    a: int
    g: int
    k_qk: int
    k_v: int
    f: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    moe_pattern: list  # 1 = MoE layer
    experts: int = 0
    topk: int = 0
    f_expert: int = 0
    f_shared: int = 0
    shared_gate: bool = False
    q_lora: int = 0  # MLA (DeepSeek-V3); 0 = standard attention
    kv_lora: int = 0
    k_rope: int = 0


def shape_of(hf) -> Shape:
    """The model's shape from its HF config (public key names, so the planner also covers
    architectures the builder is still gaining; the tests check it against meta builds)."""
    g = lambda *names, default=None: next(  # noqa: E731
        (getattr(hf, n) for n in names if getattr(hf, n, None) is not None), default)
    kind = g("model_type", default="")
    layers, h, a = hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads
    experts = g("num_experts", "num_local_experts", "n_routed_experts", default=0) or 0
    if kind == "deepseek_v3":
        dense_first = g("first_k_dense_replace", default=0)
        freq = g("moe_layer_freq", default=1)
        pattern = [int(i >= dense_first and i % freq == 0) for i in range(layers)]
    elif experts:
        skip, step = set(g("mlp_only_layers", default=[]) or []), g("decoder_sparse_step", default=1)
        pattern = [int(i not in skip and (i + 1) % step == 0) for i in range(layers)]
    else:
        pattern = [0] * layers
    mla = kind == "deepseek_v3"
    k = g("head_dim", default=h // a)
    f_shared = (g("shared_expert_intermediate_size", default=0)
                or g("n_shared_experts", default=0) * g("moe_intermediate_size", default=0))
    return Shape(
        layers=layers, h=h, a=a, g=a if mla else g("num_key_value_heads", default=a),
        k_qk=hf.qk_nope_head_dim + hf.qk_rope_head_dim if mla else k,
        k_v=hf.v_head_dim if mla else k, f=hf.intermediate_size, vocab=hf.vocab_size,
        tied=bool(g("tie_word_embeddings", default=False)),
        qkv_bias=kind in ("qwen2", "qwen2_moe") or bool(g("attention_bias", default=False)) and not mla,
        qk_norm=kind in ("qwen3", "qwen3_moe"), moe_pattern=pattern, experts=experts,
        topk=g("num_experts_per_tok", default=0) if experts else 0,
        f_expert=(hf.intermediate_size if kind == "mixtral" else g("moe_intermediate_size", default=0))
        if experts else 0,
        f_shared=f_shared if experts else 0, shared_gate=kind == "qwen2_moe",
        q_lora=g("q_lora_rank", default=0) if mla else 0,
        kv_lora=g("kv_lora_rank", default=0) if mla else 0,
        k_rope=g("qk_rope_head_dim", default=0) if mla else 0)


def stage_params(s: Shape, tp: int, pp: int, ep: int, etp: int, stage: int, head: str = "lm",
                 te: bool = True):
    """(dense, expert) parameter counts of one rank of pipeline stage `stage` (analytic; the
    tests check it against meta builds). `te`: TransformerEngine's layer spec, whose MLA
    down-projections are replicated over TP; Megatron's local spec splits them (column
    parallel), so a CPU build counts them divided by TP."""
    h, a, g = s.h, s.a, s.g
    if s.q_lora or s.kv_lora:  # MLA: up-projections split over TP
        down = 1 if te else tp
        q = (h * s.q_lora // down + s.q_lora + s.q_lora * a * s.k_qk // tp) if s.q_lora \
            else h * a * s.k_qk // tp
        attn = (q + h * (s.kv_lora + s.k_rope) // down + s.kv_lora
                + s.kv_lora * a * (s.k_qk - s.k_rope + s.k_v) // tp + a * s.k_v * h // tp)
    else:
        qkv = (a + g) * s.k_qk + g * s.k_v
        attn = h * qkv // tp + (qkv // tp if s.qkv_bias else 0) + a * s.k_v * h // tp
        attn += 2 * s.k_qk if s.qk_norm else 0
    per = s.layers // pp
    dense = expert = 0
    for layer in range(stage * per, (stage + 1) * per):
        dense += 2 * h + attn
        if s.moe_pattern[layer]:
            dense += s.experts * h  # router, replicated
            expert += (s.experts // ep) * 3 * h * s.f_expert // etp
            if s.f_shared:
                dense += 3 * h * s.f_shared // tp + (h if s.shared_gate else 0)
        else:
            dense += 3 * h * s.f // tp
    if stage == 0:
        dense += s.vocab * h // tp
    if stage == pp - 1:
        dense += h  # final norm
        if head == "value":
            dense += h
        elif not (s.tied and pp == 1):
            dense += s.vocab * h // tp
    return dense, expert


def largest_param(s: Shape, tp: int, etp: int) -> int:
    return max(s.vocab * s.h // tp, 2 * s.h * max(s.f, 1) // tp, 2 * s.h * s.f_expert // etp)


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------

def layer_activation_bytes(s: Shape, moe: bool, tp: int, sp: bool, etp: int, device: str) -> float:
    """Bytes per token of one layer's saved activations (formula in the module docstring)."""
    h, a, g, kq, kv = s.h, s.a, s.g, s.k_qk, s.k_v
    spd = tp if sp else 1
    if device == "cuda":
        mlp = (s.topk * (h + 3 * s.f_expert / etp) + s.experts + 3 * s.f_shared / tp) if moe else 3 * s.f / tp
        attn = ((a + g) * kq + g * kv + a * kq + g * kq + a * kv) / tp
        latent = 2 * (s.q_lora + s.kv_lora + s.k_rope)
        return 2 * (4 * h / spd + attn + latent + mlp)
    mlp = (s.topk * (h + 5 * s.f_expert / etp) + s.experts + 5 * s.f_shared / tp) if moe else 5 * s.f / tp
    attn = (4 * a * kq + a) / tp
    if s.qk_norm:
        attn += ((a + 2 * g) * kq + (a + g) * (kq + 1)) / tp
    return 4 * (6 * h / spd + attn + mlp)


def head_bytes(s: Shape, tokens: int, tp: int, device: str, param_bytes: int, head: str) -> float:
    """Last stage: the final hidden states (+ SP gather), their fp32 gradient, and the fused
    log-prob kernel's output-weight gradient and chunk buffers (kernels/logprob.py)."""
    if head == "value":
        return tokens * s.h * (param_bytes + 4)
    from kernels.logprob import default_chunk_tokens

    v_local = s.vocab // tp
    chunk = min(tokens, default_chunk_tokens(v_local, device))
    buffers = chunk * v_local * (2 if device == "cuda" else 8)  # bf16 matmul out | fp32 + aux
    return tokens * s.h * (param_bytes + 4) + v_local * s.h * param_bytes + buffers


def full_kl_bytes(s: Shape, c, lay, tokens: int, device: str, pbytes: int):
    """(host, device) bytes of the exact KL on a last-stage rank: the reference's final hidden
    states at every response token of the rank's batch (whole on every TP and CP rank) and a
    copy of its output-weight shard, held from the reference pass to the actor update; on the
    device while the KL runs, that shard, a micro-batch of the states and one chunk of both
    models' logits (kernels/kl.py: half the log-prob chunk each, matmul dtype + fp32 + aux)."""
    from kernels.logprob import default_chunk_tokens

    v_local = s.vocab // lay.tp
    weight = v_local * s.h * pbytes
    seqs = c.data.train_batch_size * c.actor_rollout_ref.rollout.n // lay.dp
    host = seqs * c.data.max_response_length * s.h * pbytes + weight
    chunk = min(tokens, max(1, default_chunk_tokens(v_local, device) // 2))
    buffers = 2 * chunk * v_local * (pbytes + (4 if pbytes != 4 else 0) + 4)
    return host, weight + tokens * s.h * pbytes + buffers


def model_memory(s: Shape, m, lay, *, head: str, tokens: int, n_micro: int, train: bool,
                 device: str, strategy: str = "megatron") -> dict:
    """Bytes per rank of one model (worst pipeline stage) for a Megatron section `m`.

    strategy fsdp / fsdp2 (parallel/fsdp.py, PP = 1): parameters, gradients and optimizer state
    divided over DP x CP, plus one unit gathered whole while it computes (the largest of a
    layer and the vocabulary projection; two layers with forward_prefetch) and its unsharded
    gradient before the reduce-scatter."""
    tp, pp, ep, etp, cp = lay.tp, lay.pp, lay.ep, lay.etp, lay.cp
    sp = bool(m.sequence_parallel)
    pbytes = DTYPE_BYTES[m.params_dtype] if device == "cuda" else 4
    master = 4 if (device == "cuda" and pbytes != 4) else 0
    opt_bytes = master + 8
    vpp = lay.vpp or 1
    tokens = math.ceil(tokens / cp)
    in_flight = min(pp, n_micro) * (1 + (pp - 1) / (pp * vpp)) if pp > 1 and vpp > 1 else min(pp, n_micro)
    recompute = m.recompute_granularity == "full"
    unit = m.recompute_num_layers or 1
    best = None
    for stage in range(pp):
        dense, expert = stage_params(s, tp, pp, ep, etp, stage, head)
        p = dense + expert
        out = dict(params=p, dense_params=dense, expert_params=expert,
                   weights=p * pbytes, grads=0, optimizer=0, activations=0, forward_activations=0)
        shard, unit = 1, 0
        if strategy != "megatron":
            shard = lay.dp * cp
            vocab = s.vocab * s.h // tp
            layer = (p - vocab * (2 if head == "lm" else 1)) / max(s.layers, 1)
            unit = max(layer * (2 if m.forward_prefetch else 1), vocab)
            out["weights"] = p * pbytes / shard + unit * pbytes
        per = s.layers // pp
        per_layer = [layer_activation_bytes(s, bool(s.moe_pattern[i]), tp, sp, etp, device)
                     for i in range(stage * per, (stage + 1) * per)]
        # a forward-only pass keeps no activations: one layer's at a time, and the head
        out["forward_activations"] = max(per_layer) * tokens + (
            head_bytes(s, tokens, tp, device, pbytes, head) if stage == pp - 1 else 0)
        if train:
            dp_shard = lay.dp if m.use_distributed_optimizer else 1
            edp_shard = lay.expert_dp if m.use_distributed_optimizer else 1
            if shard > 1:  # fully sharded: everything over DP x CP
                dp_shard = edp_shard = shard
            out["grads"] = p * 4 / shard + unit * pbytes
            out["optimizer"] = opt_bytes * (dense / dp_shard + expert / edp_shard)
            if recompute:
                kept = per * s.h / (tp if sp else 1) * pbytes
                work = max(per_layer) * min(unit, per)
                stored = kept
            else:
                stored, work = sum(per_layer), 0.0
            act = stored * tokens * in_flight + (work + max(per_layer)) * tokens
            act += largest_param(s, tp, etp) * pbytes
            if stage == pp - 1:
                act += head_bytes(s, tokens, tp, device, pbytes, head)
            out["activations"] = act
        out["total"] = out["weights"] + out["grads"] + out["optimizer"] + out["activations"]
        out["strategy"] = strategy
        if best is None or out["total"] > best["total"]:
            best = dict(out, stage=stage)
    return best


def total_params(s: Shape) -> int:
    """Every parameter of the model (one rank of a 1-GPU layout)."""
    dense, expert = stage_params(s, 1, 1, 1, 1, 0)
    return dense + expert
