"""Fused (hidden @ W_vocab) -> per-token log-prob and entropy, without the [tokens, vocab] logits.

The largest activation in PPO is the logits tensor: 4096 tokens x 151936 vocab in fp32 is 2.5 GB,
and log_softmax / softmax / entropy / their gradients make several more of it. Here the logits
are computed a chunk of tokens at a time; each chunk is reduced at once to three numbers per
token (running max, sum of exp, sum of exp * logit) plus the label's logit, and is then thrown
away. The backward recomputes each chunk's logits (one extra matmul) instead of storing them.
At most `chunk_tokens x V_local` logits exist at any moment.

Vocab parallelism (Megatron's vocab-parallel output layer): `weight` is this rank's shard of
the output embedding, rows [r * V_local, (r + 1) * V_local) of the global vocab for rank r of
`tp_group`. Each rank computes its shard's statistics for ALL tokens, then two all-reduces over
`tp_group` (MAX of the per-token max, SUM of the rescaled sums and of the label logit, which
only the owning rank contributes) give exact global log-probs and entropies on every rank.

Gradients under TP:
  * d weight: every rank's shard gets its own, complete gradient (no communication).
  * d hidden: every rank's vocab shard contributes a partial sum, so this function ALL-REDUCES
    (SUM) the hidden gradient over `tp_group` before returning it; the gradient it returns is
    the full one, identical on every rank. Callers must therefore not reduce it again: pass
    the hidden states in directly (not through Megatron's copy_to_tensor_model_parallel_region,
    whose backward would all-reduce a second time).
  * Sequence parallelism: `hidden` must be the FULL sequence on every TP rank. The caller
    gathers it before the call and, since the returned gradient is already complete, splits it
    back without reducing, e.g. Megatron's
    `gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False)`.

Backends: "torch" (chunked plain torch ops; CPU and any device) and "triton" (the same chunking,
matmuls by the vendor BLAS, the per-chunk softmax statistics and logit gradients as one Triton
kernel each, see kernels/triton/logprob.py). "auto" picks Triton for CUDA tensors when it is
importable. TransformerEngine and apex are never required; `optional_libraries()` only reports
whether they are installed.

`naive_logprob_entropy` is the plain full-logits reference used by tests and the benchmark.

Tests: tests/test_kernels_logprob.py, tests/test_benchmark_json.py
"""
import importlib.util
import os

import torch
import torch.distributed as dist

__all__ = ["linear_logprob_entropy", "linear_token_loss", "naive_logprob_entropy",
           "default_chunk_tokens", "resolve_backend", "optional_libraries", "BACKENDS"]

BACKENDS = ("auto", "torch", "triton")

# Bytes of one chunk of fp32 logits. CPU: the fused path does 4 GEMMs to the naive path's 3
# (the backward recomputes the logits), so each must run near peak: measured on a 2-core
# AVX-512 CPU against a 152k vocab, GEMMs with ~200 token rows are ~1.5x faster than with ~50;
# 128 MiB (~220 tokens there) keeps the two chunk buffers a few percent of the naive path's
# memory. CUDA: bigger chunks mean fewer, fuller GEMMs and fewer roundings of the
# accumulated weight gradient.
CPU_CHUNK_BYTES = 128 << 20
CUDA_CHUNK_BYTES = 1 << 30


def optional_libraries():
    """Which optional accelerator libraries are installed (found, not imported)."""
    return {name: importlib.util.find_spec(name) is not None
            for name in ("triton", "transformer_engine", "apex")}


def default_chunk_tokens(vocab_local, device):
    """Tokens per chunk so that one chunk of fp32 logits stays within the device's byte budget."""
    budget = CUDA_CHUNK_BYTES if torch.device(device).type == "cuda" else CPU_CHUNK_BYTES
    return max(1, budget // (4 * vocab_local))


def naive_logprob_entropy(hidden, weight, labels, temperature=1.0):
    """Reference: full logits, log_softmax in fp32, entropy from the probabilities.

    Single process, full (unsharded) `weight` [V, H]. Returns fp32 (logprob, entropy) shaped
    like `labels`.
    """
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    logprob = logp.gather(-1, labels.reshape(-1, 1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logprob.view(labels.shape), entropy.view(labels.shape)


def linear_logprob_entropy(hidden, weight, labels, temperature=1.0, tp_group=None,
                           chunk_tokens=None, compute_entropy=True, entropy_grad=True,
                           backend="auto"):
    """Per-token log p(label) and entropy of softmax(hidden @ weight.T / temperature).

    hidden [..., H] (full sequence on every TP rank), weight [V_local, H] (this rank's vocab
    shard), labels [...] GLOBAL vocab ids. tp_group: the vocab-parallel group, None for no TP.
    chunk_tokens: tokens per chunk (None: `default_chunk_tokens`). compute_entropy=False skips
    the entropy (returned as None); entropy_grad=False returns it detached. backend: one of
    BACKENDS. Returns fp32 (logprob, entropy) shaped like `labels`. See the module docstring
    for how gradients are reduced under TP.
    """
    backend, vocab_local = _check_inputs(hidden, weight, labels, temperature, tp_group,
                                         chunk_tokens, backend)
    chunk = chunk_tokens or default_chunk_tokens(vocab_local, hidden.device)
    logprob, entropy = _LinearLogprobEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), float(temperature),
        tp_group, int(chunk), bool(compute_entropy), bool(entropy_grad), backend)
    entropy = entropy.view(labels.shape) if compute_entropy else None
    return logprob.view(labels.shape), entropy


def linear_token_loss(hidden, weight, labels, token_loss, temperature=1.0, tp_group=None,
                      chunk_tokens=None, backend="auto"):
    """Single-pass fused loss for objectives that are sums of per-token terms.

        loss = sum over chunks of token_loss(start, end, logprob[start:end], entropy[start:end])

    `token_loss(start, end, logprob, entropy)` returns a 0-dim tensor: the summed loss of tokens
    [start, end) of the flattened `labels`, differentiable in their fp32 log-probs and entropies
    and depending on no other token's (PPO's clipped surrogate, the entropy bonus and the k1-k3
    KL losses with token- or sequence-mean weights all qualify; GSPO's sequence ratio does not).

    Because the loss gradient of a token is known as soon as its chunk's statistics are, each
    chunk's logits are used once for the statistics and at once for the gradients: three GEMMs
    per chunk, as many as the naive full-logits path, where `linear_logprob_entropy` needs four
    (its backward must recompute the logits). The gradients wrt hidden and weight are made in
    the forward and held (the size of the inputs) until backward scales them by the upstream
    gradient. Returns (loss 0-dim fp32, logprob, entropy): logprob and entropy are detached fp32
    shaped like `labels`. TP reduction as in `linear_logprob_entropy` (the statistics of each
    chunk are all-reduced over `tp_group`, so every rank runs the same chunks).
    """
    backend, vocab_local = _check_inputs(hidden, weight, labels, temperature, tp_group,
                                         chunk_tokens, backend)
    chunk = chunk_tokens or default_chunk_tokens(vocab_local, hidden.device)
    loss, logprob, entropy = _LinearTokenLoss.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), token_loss,
        1.0 / float(temperature), tp_group, int(chunk), backend)
    return loss, logprob.view(labels.shape), entropy.view(labels.shape)


def _check_inputs(hidden, weight, labels, temperature, tp_group, chunk_tokens, backend):
    """One clear error per bad argument; returns (resolved backend, local vocab size)."""
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be "
                         f"[..., H] and [V_local, H] with the same H")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1 (or None for the default)")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} != weight dtype {weight.dtype}; "
                         f"cast one of them")
    backend = resolve_backend(backend, hidden)
    vocab_local = weight.shape[0]
    vocab = vocab_local * _group_size(tp_group)
    low, high = torch.stack(torch.aminmax(labels)).tolist() if labels.numel() else (0, 0)  # one host read
    if low < 0 or high >= vocab:
        raise ValueError(f"labels must be global vocab ids in [0, {vocab}); got values in "
                         f"[{low}, {high}] (mask padding after the "
                         f"call instead of using ignore ids)")
    return backend, vocab_local


def resolve_backend(backend, tensor):
    """'auto' -> 'triton' for CUDA tensors when Triton is installed, else 'torch'."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "triton" if tensor.is_cuda and optional_libraries()["triton"] else "torch"
    if backend == "triton":
        if not optional_libraries()["triton"]:
            raise ValueError("backend='triton' but triton is not installed; use backend='torch'")
        if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set "
                             "before triton is imported; use backend='torch' on CPU")
    return backend


# ---------------------------------------------------------------------------------------------
# Tensor-parallel helpers (shared with kernels/kl.py)

def _group_size(group):
    return 1 if group is None else dist.get_world_size(group)


def _vocab_offset(group, vocab_local):
    return 0 if group is None else dist.get_rank(group) * vocab_local


def _local_labels(labels, offset, vocab_local):
    """Labels as indices into this rank's shard; -1 where another rank owns the label."""
    local = labels - offset
    return torch.where((local >= 0) & (local < vocab_local), local, torch.full_like(local, -1))


def reduce_in_group(tensor, op, group):
    if _group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def vocab_global_max(local_max, group):
    """Per-token max over the vocab shards, and the factor exp(local - global) that rescales a
    sum of exp(z - local_max) to one of exp(z - global_max)."""
    global_max = reduce_in_group(local_max.clone(), dist.ReduceOp.MAX, group)
    return global_max, torch.exp(local_max - global_max)


def _combine_stats(m, s, a, zlab, group):
    """Per-rank shard statistics -> global (logprob, entropy, logZ).

    m: max logit of the shard; s = sum exp(z - m); a = sum exp(z - m) * (z - m) (None without
    entropy); zlab: the label logit on the owning rank, 0 elsewhere. With M the global max and
    S = sum over ranks of s * exp(m - M):  logZ = M + log S;  logprob = z_label - logZ;
    entropy = logZ - E_p[z] = log S - A / S, A = sum over ranks of exp(m - M) (a + (m - M) s).
    """
    big_m, scale = vocab_global_max(m, group)
    parts = [s * scale, zlab]
    if a is not None:
        parts.append((a + (m - big_m) * s) * scale)
    sums = reduce_in_group(torch.stack(parts), dist.ReduceOp.SUM, group)
    log_s = torch.log(sums[0])
    log_z = big_m + log_s
    entropy = log_s - sums[2] / sums[0] if a is not None else None
    return sums[1] - log_z, entropy, log_z


# ---------------------------------------------------------------------------------------------
# Per-chunk work, torch backend. `z` is a chunk of raw logits (before temperature), fp32,
# used as scratch; `buf` is another fp32 buffer of the same shape.

def _torch_chunk_stats(z, inv_t, local_labels, need_entropy, buf):
    m = z.amax(dim=1).mul_(inv_t)  # temperature > 0, so scaling commutes with max
    owned = local_labels >= 0
    zlab = z.gather(1, local_labels.clamp(min=0).unsqueeze(1)).squeeze(1).mul_(inv_t)
    zlab = torch.where(owned, zlab, torch.zeros_like(zlab))
    shifted = torch.add(m.neg().unsqueeze(1), z, alpha=inv_t, out=z)  # z / t - m, one pass
    e = torch.exp(shifted, out=buf)
    s = e.sum(dim=1)
    a = torch.bmm(e.unsqueeze(1), shifted.unsqueeze(2)).view(-1) if need_entropy else None
    return m, s, a, zlab


def _torch_chunk_grad(z, inv_t, log_z, entropy, g_lp, g_ent, local_labels, buf):
    """d loss / d raw logits (temperature's 1/t folded into g_lp, g_ent by the caller):
        dz = g_lp * (onehot - p) + g_ent * dH/dz,   dH/dz = -p (log p + H).
    """
    logp = torch.add(log_z.neg().unsqueeze(1), z, alpha=inv_t, out=z)
    p = torch.exp(logp, out=buf)
    return _torch_grad_from(logp, p, entropy, g_lp, g_ent, local_labels)


def _torch_grad_from_stats(shifted, e, m, log_z, entropy, g_lp, g_ent, local_labels):
    """Like `_torch_chunk_grad`, from what `_torch_chunk_stats` left in the buffers
    (shifted = z / t - m, e = exp(shifted)): log p = shifted + (m - logZ), p = e exp(m - logZ),
    so the single-pass loss needs no second exp over the chunk."""
    c = (m - log_z).unsqueeze(1)
    p = e.mul_(torch.exp(c))
    logp = shifted.add_(c)
    return _torch_grad_from(logp, p, entropy, g_lp, g_ent, local_labels)


def _torch_grad_from(logp, p, entropy, g_lp, g_ent, local_labels):
    """dz from a chunk's log p and p (both buffers are overwritten; dz lives in p's)."""
    if g_ent is None:
        dz = p.mul_(g_lp.neg().unsqueeze(1))
    else:  # -(g_lp + g_ent (log p + H)) as one pass over the chunk
        coef = torch.addcmul((-(g_lp + g_ent * entropy)).unsqueeze(1), logp,
                             g_ent.neg().unsqueeze(1), out=logp)
        dz = p.mul_(coef)
    rows = (local_labels >= 0).nonzero().squeeze(1)
    dz[rows, local_labels[rows]] += g_lp[rows]
    return dz


# ---------------------------------------------------------------------------------------------
# Chunk driver, shared by both backends

class ChunkBuffers:
    """Chunk-sized work buffers allocated once per call: repeated allocation of buffers this
    size goes through mmap and pays page faults on every chunk."""

    def __init__(self, chunk, vocab_local, weight, backend):
        shape = (chunk, vocab_local)
        self.mm = torch.empty(shape, dtype=weight.dtype, device=weight.device)
        self.backend = backend
        if backend == "torch":
            self.f32 = self.mm if weight.dtype == torch.float32 else torch.empty(
                shape, dtype=torch.float32, device=weight.device)
            self.aux = torch.empty(shape, dtype=torch.float32, device=weight.device)

    def logits(self, h_chunk, weight):
        """Raw logits of a chunk: matmul in the input dtype; fp32 copy for the torch backend."""
        n = h_chunk.shape[0]
        z = torch.mm(h_chunk, weight.t(), out=self.mm[:n])
        if self.backend == "torch" and z.dtype != torch.float32:
            z = self.f32[:n].copy_(z)
        return z


def _forward(hidden, weight, local_labels, inv_t, chunk, need_entropy, backend):
    """Per-rank shard statistics (m, s, a, zlab) for every token, a chunk at a time."""
    n_tokens, vocab_local = hidden.shape[0], weight.shape[0]
    stats = torch.empty(4, n_tokens, dtype=torch.float32, device=hidden.device)
    if n_tokens == 0:
        return stats[0], stats[1], (stats[2] if need_entropy else None), stats[3]
    bufs = ChunkBuffers(min(chunk, n_tokens), vocab_local, weight, backend)
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        z = bufs.logits(hidden[start:end], weight)
        if backend == "triton":
            from kernels.triton.logprob import chunk_stats
            m, s, a, zlab = chunk_stats(z, inv_t, local_labels[start:end], need_entropy)
        else:
            m, s, a, zlab = _torch_chunk_stats(z, inv_t, local_labels[start:end], need_entropy,
                                               bufs.aux[:end - start])
        stats[0, start:end], stats[1, start:end], stats[3, start:end] = m, s, zlab
        if need_entropy:
            stats[2, start:end] = a
    return stats[0], stats[1], (stats[2] if need_entropy else None), stats[3]


def _backward(hidden, weight, local_labels, inv_t, chunk, log_z, entropy, g_lp, g_ent,
              need_hidden, need_weight, backend):
    """(d hidden fp32 partial over this shard, d weight) by recomputing each chunk's logits."""
    n_tokens, vocab_local = hidden.shape[0], weight.shape[0]
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) \
        if need_hidden else None
    # The weight gradient is accumulated with addmm in the weight's dtype: the GEMM accumulates
    # in fp32 within a chunk, so low precision rounds once per chunk, not once per token.
    d_weight = torch.zeros_like(weight) if need_weight else None
    if n_tokens == 0:
        return d_hidden, d_weight
    bufs = ChunkBuffers(min(chunk, n_tokens), vocab_local, weight, backend)
    g_lp = g_lp * inv_t  # d logits / d raw logits = 1 / t
    g_ent = g_ent * inv_t if g_ent is not None else None
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        h = hidden[start:end]
        z = bufs.logits(h, weight)
        args = (inv_t, log_z[start:end], entropy[start:end] if g_ent is not None else None,
                g_lp[start:end], g_ent[start:end] if g_ent is not None else None,
                local_labels[start:end])
        if backend == "triton":
            from kernels.triton.logprob import chunk_grad
            dz = chunk_grad(z, *args)  # written over z, in the matmul dtype
        else:
            dz = _torch_chunk_grad(z, *args, bufs.aux[:end - start])
        _chunk_input_grads(dz, h, weight, bufs, d_hidden, d_weight, start, end)
    return d_hidden, d_weight


def _chunk_input_grads(dz, h, weight, bufs, d_hidden, d_weight, start, end):
    """Add one chunk's share to d hidden and d weight (None: not wanted), from its logit
    gradient dz (fp32 scratch or the matmul dtype)."""
    if dz.dtype != weight.dtype:
        dz = bufs.mm[:end - start].copy_(dz)
    if d_hidden is not None:
        d_hidden[start:end] = torch.mm(dz, weight)
    if d_weight is not None:
        d_weight.addmm_(dz.t(), h)


class _LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, tp_group, chunk, compute_entropy,
                entropy_grad, backend):
        vocab_local = weight.shape[0]
        local_labels = _local_labels(labels, _vocab_offset(tp_group, vocab_local), vocab_local)
        inv_t = 1.0 / temperature
        m, s, a, zlab = _forward(hidden, weight, local_labels, inv_t, chunk, compute_entropy,
                                 backend)
        logprob, entropy, log_z = _combine_stats(m, s, a, zlab, tp_group)
        if entropy is None:
            entropy = logprob.new_empty(0)
        if not (compute_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, local_labels, log_z, entropy)
        ctx.params = (inv_t, tp_group, chunk, compute_entropy and entropy_grad, backend)
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, local_labels, log_z, entropy = ctx.saved_tensors
        inv_t, tp_group, chunk, entropy_differentiable, backend = ctx.params
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not entropy_differentiable:
            grad_entropy = None
        if grad_logprob is None and grad_entropy is None:
            return (None,) * 9
        if grad_logprob is None:
            grad_logprob = torch.zeros_like(log_z)
        d_hidden, d_weight = _backward(
            hidden, weight, local_labels, inv_t, chunk, log_z, entropy,
            grad_logprob.float(), grad_entropy.float() if grad_entropy is not None else None,
            need_hidden, need_weight, backend)
        if d_hidden is not None:
            # every vocab shard contributes to every token's hidden gradient
            d_hidden = reduce_in_group(d_hidden, dist.ReduceOp.SUM, tp_group).to(hidden.dtype)
        return d_hidden, d_weight, None, None, None, None, None, None, None


def _token_loss_grads(token_loss, start, end, lp, ent, need_grad):
    """(loss value, d loss / d logprob, d loss / d entropy) of one chunk; None for an unused input."""
    with torch.enable_grad():
        lp_leaf = lp.detach().requires_grad_(need_grad)
        ent_leaf = ent.detach().requires_grad_(need_grad)
        loss = token_loss(start, end, lp_leaf, ent_leaf)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise ValueError(f"token_loss must return a 0-dim tensor (the chunk's summed loss); "
                             f"got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
        if not (need_grad and loss.requires_grad):
            return loss.detach(), None, None
        g_lp, g_ent = torch.autograd.grad(loss, [lp_leaf, ent_leaf], allow_unused=True)
    return loss.detach(), g_lp, g_ent


def _single_pass(hidden, weight, local_labels, inv_t, chunk, tp_group, token_loss,
                 need_hidden, need_weight, backend):
    """(loss, logprob, entropy, d hidden fp32 partial over this shard, d weight), one pass."""
    n_tokens, vocab_local = hidden.shape[0], weight.shape[0]
    device = hidden.device
    logprob = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    entropy = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=device) if need_hidden else None
    d_weight = torch.zeros_like(weight) if need_weight else None
    if n_tokens == 0:
        return total.float(), logprob, entropy, d_hidden, d_weight
    need_grad = need_hidden or need_weight
    bufs = ChunkBuffers(min(chunk, n_tokens), vocab_local, weight, backend)
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        h, labels = hidden[start:end], local_labels[start:end]
        z = bufs.logits(h, weight)
        if backend == "triton":
            from kernels.triton.logprob import chunk_grad, chunk_stats
            m, s, a, zlab = chunk_stats(z, inv_t, labels, True)
        else:
            e = bufs.aux[:end - start]
            m, s, a, zlab = _torch_chunk_stats(z, inv_t, labels, True, e)
        lp, ent, log_z = _combine_stats(m, s, a, zlab, tp_group)
        logprob[start:end], entropy[start:end] = lp, ent
        loss, g_lp, g_ent = _token_loss_grads(token_loss, start, end, lp, ent, need_grad)
        total += loss.double()
        if g_lp is None and g_ent is None:
            continue
        g_lp = (torch.zeros_like(lp) if g_lp is None else g_lp.float()) * inv_t
        g_ent = g_ent.float() * inv_t if g_ent is not None else None
        ent_arg = ent if g_ent is not None else None
        if backend == "triton":
            dz = chunk_grad(z, inv_t, log_z, ent_arg, g_lp, g_ent, labels)
        else:
            dz = _torch_grad_from_stats(z, e, m, log_z, ent_arg, g_lp, g_ent, labels)
        _chunk_input_grads(dz, h, weight, bufs, d_hidden, d_weight, start, end)
    return total.float(), logprob, entropy, d_hidden, d_weight


class _LinearTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, token_loss, inv_t, tp_group, chunk, backend):
        vocab_local = weight.shape[0]
        local_labels = _local_labels(labels, _vocab_offset(tp_group, vocab_local), vocab_local)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, logprob, entropy, d_hidden, d_weight = _single_pass(
            hidden, weight, local_labels, inv_t, chunk, tp_group, token_loss, need_hidden,
            need_weight, backend)
        if d_hidden is not None:
            # every vocab shard contributes to every token's hidden gradient
            d_hidden = reduce_in_group(d_hidden, dist.ReduceOp.SUM, tp_group).to(hidden.dtype)
        # kept as attributes, not saved tensors: backward scales them in place and hands them
        # over, so no second weight-sized gradient is ever allocated
        ctx.grads = [d_hidden, d_weight]
        ctx.mark_non_differentiable(logprob, entropy)
        ctx.set_materialize_grads(False)
        return loss, logprob, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logprob, _grad_entropy):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("linear_token_loss: backward ran twice; its gradients were made "
                               "once, in the forward (call the kernel again instead of "
                               "retain_graph=True)")
        if grad_loss is None:
            return (None,) * 8
        if not bool(grad_loss == 1):
            grads = [g.mul_(grad_loss.to(g.dtype)) if g is not None else None for g in grads]
        return grads[0], grads[1], None, None, None, None, None, None
