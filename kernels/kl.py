"""KL estimators between the policy and the reference, the one place their formulas live.

Per-token estimators from sampled log-probs, r = logprob - ref_logprob:

    kl  | k1          r
    abs               |r|
    mse | k2          0.5 r^2
    low_var_kl | k3   exp(-r) - 1 + r     (ratio = exp(ref - logp): ratio - log ratio - 1),
                      r clamped to [-20, 20] first and the result to [-10, 10]

A trailing "+" (e.g. "k3+", "low_var_kl+") is the straight-through variant: the forward value
of the named estimator with the gradient of k2 (d/d logprob = r, unclamped), which is unbiased
for the gradient of KL(pi || ref) whatever the value estimator.

`kl_penalty` is one fused op: a custom autograd Function computes the value and keeps only the
derivative it will need, instead of a graph of elementwise ops.

"full" is the exact KL(pi || ref) = sum_v p_v log(p_v / q_v) over the whole vocabulary. It
needs both distributions, not two sampled log-probs, so it is `linear_full_kl`, computed from
the actor's and the reference's hidden states and output weights, chunked over tokens and
vocab-parallel exactly like kernels/logprob.py (never a [tokens, vocab] tensor). `kl_penalty`
takes that per-token KL as `full_kl`:

    full  | the exact KL, value and gradient (d/d logits = p (log p - log q - KL), every
            vocabulary entry: linear_full_kl's own backward)
    full+ | straight-through like the other "+" kinds: the value of the exact KL, the gradient
            of k2 on the sampled token (d/d logprob = r = logprob - ref_logprob), so
            E_{y ~ pi}[r grad log pi(y)] = grad KL(pi || ref), as for k1+..k3+. It needs no
            backward through the vocabulary: a forward-only linear_full_kl and the sampled
            log-prob's gradient, which the fused loss kernel makes anyway.

Tests: tests/test_kernels_kl.py, tests/test_kl_controllers.py, tests/test_full_kl_actor.py
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.logprob import ChunkBuffers, reduce_in_group, vocab_global_max, default_chunk_tokens

__all__ = ["kl_penalty", "linear_full_kl", "KL_KINDS", "KLKind"]


@dataclass(frozen=True)
class KLKind:
    """What a KL kind is, the one answer every caller reads (`KL_KINDS[kind]`).

    base: the value's estimator, k1 / abs / k2 / k3, or 'full' (the exact KL);
    straight_through: the "+" kinds, whose gradient is k2's on the sampled token;
    exact: it needs both full distributions, not two sampled log-probs (`linear_full_kl`'s
    per-token KL as `full_kl`): the reference pass keeps its hidden states for it."""
    base: str
    straight_through: bool = False

    @property
    def exact(self) -> bool:
        return self.base == "full"


_SAMPLED = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
# the registry: kind name (actor.kl_loss_type, algorithm.kl_penalty) -> KLKind
KL_KINDS: dict = {**{name: KLKind(base) for name, base in _SAMPLED.items()},
                  **{name + "+": KLKind(base, straight_through=True) for name, base in _SAMPLED.items()},
                  "full": KLKind("full"), "full+": KLKind("full", straight_through=True)}

LOG_RATIO_CLAMP = 20.0  # k3: exp(+-20) is finite in fp32
K3_VALUE_CLAMP = 10.0


def _kind(kind) -> KLKind:
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind {kind!r} is not one of {tuple(KL_KINDS)}")
    return KL_KINDS[kind]


def _value_and_slope(r, base):
    """Estimator value and its derivative d value / d r (zero where a clamp is active)."""
    if base == "k1":
        return r.clone(), torch.ones_like(r)
    if base == "abs":
        return r.abs(), torch.sign(r)
    if base == "k2":
        return 0.5 * r * r, r
    rc = r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    inv_ratio = torch.exp(-rc)
    value = inv_ratio - 1 + rc
    inside = (r.abs() <= LOG_RATIO_CLAMP) & (value.abs() <= K3_VALUE_CLAMP)
    slope = torch.where(inside, 1 - inv_ratio, torch.zeros_like(r))
    return value.clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP), slope


class _KLPenalty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logprob, ref_logprob, base, straight_through):
        out_dtype = torch.promote_types(logprob.dtype, ref_logprob.dtype)
        r = logprob.float() - ref_logprob.float()  # exp of low-precision log-ratios is too coarse
        value, slope = _value_and_slope(r, base)
        ctx.save_for_backward(r if straight_through else slope)
        ctx.dtypes = (logprob.dtype, ref_logprob.dtype)
        return value.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        (slope,) = ctx.saved_tensors  # for "+" variants this is r, the slope of k2
        d_r = grad.float() * slope
        d_logprob = d_r.to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        d_ref = (-d_r).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return d_logprob, d_ref, None, None


class _ValueWithK2Grad(torch.autograd.Function):
    """`value` forward; backward as k2 of (logprob - ref_logprob), like the "+" kinds."""

    @staticmethod
    def forward(ctx, value, logprob, ref_logprob):
        ctx.save_for_backward(logprob.float() - ref_logprob.float())
        ctx.dtypes = (logprob.dtype, ref_logprob.dtype)
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        (r,) = ctx.saved_tensors
        d_r = grad.float() * r
        d_logprob = d_r.to(ctx.dtypes[0]) if ctx.needs_input_grad[1] else None
        d_ref = (-d_r).to(ctx.dtypes[1]) if ctx.needs_input_grad[2] else None
        return None, d_logprob, d_ref


def kl_penalty(logprob, ref_logprob, kind, full_kl=None):
    """Per-token KL estimate of `kind` (see module docstring), same shape as the inputs.

    The "full" kinds take the exact per-token KL as `full_kl` (from `linear_full_kl`, same
    shape): "full" returns it as it is (its gradient is its own), "full+" returns its value with
    the gradient of k2 on (logprob, ref_logprob)."""
    if logprob.shape != ref_logprob.shape:
        raise ValueError(f"logprob shape {tuple(logprob.shape)} != ref_logprob shape "
                         f"{tuple(ref_logprob.shape)}; pass per-token log-probs of the same tokens")
    meta = _kind(kind)
    if meta.exact:
        if full_kl is None:
            raise ValueError(f"kl kind {kind!r} needs both full distributions, not sampled "
                             f"log-probs: pass full_kl=kernels.kl.linear_full_kl(hidden, weight, "
                             f"ref_hidden, ref_weight)")
        if full_kl.shape != logprob.shape:
            raise ValueError(f"full_kl shape {tuple(full_kl.shape)} != logprob shape "
                             f"{tuple(logprob.shape)}")
        return _ValueWithK2Grad.apply(full_kl, logprob, ref_logprob) if meta.straight_through else full_kl
    return _KLPenalty.apply(logprob, ref_logprob, meta.base, meta.straight_through)


# ---------------------------------------------------------------------------------------------
# Exact KL over the vocabulary

def linear_full_kl(hidden, weight, ref_hidden, ref_weight, temperature=1.0, tp_group=None,
                   chunk_tokens=None):
    """Per-token KL(pi || ref) = sum_v p_v (log p_v - log q_v), with
    p = softmax(hidden @ weight.T / t) and q = softmax(ref_hidden @ ref_weight.T / t).

    hidden [..., H], weight [V_local, H]; ref_hidden [..., H_ref], ref_weight [V_local, H_ref]
    (same tokens, same vocab sharding over `tp_group`; hidden is the full sequence on every TP
    rank). Returns fp32 [...]. Gradients flow to hidden and weight only (the reference is a
    constant); the hidden gradient is all-reduced over tp_group, as in linear_logprob_entropy.
    Torch ops only (any device).
    """
    if weight.shape[0] != ref_weight.shape[0] or hidden.shape[:-1] != ref_hidden.shape[:-1]:
        raise ValueError(f"actor (hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}) and "
                         f"reference (hidden {tuple(ref_hidden.shape)}, weight "
                         f"{tuple(ref_weight.shape)}) must cover the same tokens and vocab shard")
    if hidden.shape[-1] != weight.shape[1] or ref_hidden.shape[-1] != ref_weight.shape[1]:
        raise ValueError("hidden's last dim must equal weight's (and ref_hidden's ref_weight's)")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if hidden.dtype != weight.dtype or ref_hidden.dtype != ref_weight.dtype:
        raise ValueError("hidden and weight (and ref_hidden and ref_weight) must share a dtype")
    # actor and reference logits chunks live at once: half the default tokens each
    chunk = chunk_tokens or max(1, default_chunk_tokens(weight.shape[0], hidden.device) // 2)
    lead = hidden.shape[:-1]
    kl = _LinearFullKL.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                             ref_hidden.reshape(-1, ref_hidden.shape[-1]).detach(),
                             ref_weight.detach(), 1.0 / temperature, tp_group, int(chunk))
    return kl.view(lead)


class _LinearFullKL(torch.autograd.Function):
    """Forward, per rank and chunk: za, zr = scaled logits; ma, mr = their maxes;
    sa = sum exp(za - ma), sr = sum exp(zr - mr), b = sum exp(za - ma) (za - zr). Across ranks
    (M = global max, S = rescaled sums): KL = B / Sa - logZa + logZr, logZ = M + log S.
    Backward: d KL / d za = p (log p - log q - KL)."""

    @staticmethod
    def forward(ctx, hidden, weight, ref_hidden, ref_weight, inv_t, tp_group, chunk):
        n_tokens, vocab_local = hidden.shape[0], weight.shape[0]
        stats = torch.zeros(5, n_tokens, dtype=torch.float32, device=hidden.device)
        if n_tokens:
            actor = ChunkBuffers(min(chunk, n_tokens), vocab_local, weight, "torch")
            ref = ChunkBuffers(min(chunk, n_tokens), vocab_local, ref_weight, "torch")
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            za = actor.logits(hidden[start:end], weight).mul_(inv_t)
            zr = ref.logits(ref_hidden[start:end], ref_weight).mul_(inv_t)
            ma, mr = za.amax(1), zr.amax(1)
            ea = torch.exp(za.sub_(ma.unsqueeze(1)), out=actor.aux[:end - start])
            sa = ea.sum(1)
            # za - zr = (za - ma) - (zr - mr) + (ma - mr)
            diff = za.sub_(zr.sub_(mr.unsqueeze(1)))
            b = torch.bmm(ea.unsqueeze(1), diff.unsqueeze(2)).view(-1) + (ma - mr) * sa
            sr = zr.exp_().sum(1)
            stats[:, start:end] = torch.stack([ma, mr, sa, sr, b])
        kl, log_za, log_zr = _combine_kl(stats, tp_group)
        ctx.save_for_backward(hidden, weight, ref_hidden, ref_weight, kl, log_za, log_zr)
        ctx.params = (inv_t, tp_group, chunk)
        return kl

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, ref_hidden, ref_weight, kl, log_za, log_zr = ctx.saved_tensors
        inv_t, tp_group, chunk = ctx.params
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_tokens, vocab_local = hidden.shape[0], weight.shape[0]
        d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) \
            if need_hidden else None
        d_weight = torch.zeros_like(weight) if need_weight else None
        g = grad.float() * inv_t
        if n_tokens:
            actor = ChunkBuffers(min(chunk, n_tokens), vocab_local, weight, "torch")
            ref = ChunkBuffers(min(chunk, n_tokens), vocab_local, ref_weight, "torch")
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            rows = slice(start, end)
            za = actor.logits(hidden[rows], weight)
            logp = torch.add(log_za[rows].neg().unsqueeze(1), za, alpha=inv_t, out=za)
            p = torch.exp(logp, out=actor.aux[:end - start])
            zr = ref.logits(ref_hidden[rows], ref_weight)
            logq = torch.add(log_zr[rows].neg().unsqueeze(1), zr, alpha=inv_t, out=zr)
            # g (log p - log q - KL) in two passes
            coef = torch.addcmul((-g[rows] * kl[rows]).unsqueeze(1), logp.sub_(logq),
                                 g[rows].unsqueeze(1), out=logp)
            dz = p.mul_(coef)
            if dz.dtype != weight.dtype:
                dz = actor.mm[:end - start].copy_(dz)
            if need_hidden:
                d_hidden[rows] = torch.mm(dz, weight)
            if need_weight:
                d_weight.addmm_(dz.t(), hidden[rows])
        if d_hidden is not None:
            d_hidden = reduce_in_group(d_hidden, dist.ReduceOp.SUM, tp_group).to(hidden.dtype)
        return d_hidden, d_weight, None, None, None, None, None


def _combine_kl(stats, group):
    ma, mr, sa, sr, b = stats
    big_ma, scale_a = vocab_global_max(ma, group)
    big_mr, scale_r = vocab_global_max(mr, group)
    sums = reduce_in_group(torch.stack([sa * scale_a, sr * scale_r, b * scale_a]),
                       dist.ReduceOp.SUM, group)
    log_za = big_ma + torch.log(sums[0])
    log_zr = big_mr + torch.log(sums[1])
    return sums[2] / sums[0] - log_za + log_zr, log_za, log_zr
