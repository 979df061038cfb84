"""Triton kernels for one chunk of logits of kernels/logprob.py.

The chunk's logits come from the vendor GEMM (torch.mm, cuBLAS on GPU); these kernels replace
the chain of elementwise torch ops that follow it, each reading the chunk once:

  chunk_stats: per token, online over vocab tiles, the shard statistics
               m = max z, s = sum exp(z - m), a = sum exp(z - m) (z - m), and the label logit.
  chunk_grad:  per (token tile, vocab tile), d loss / d raw logits, written over the logits.

z holds raw logits (before temperature) in the matmul dtype; all arithmetic is fp32. The
formulas are those of `_combine_stats` / `_torch_chunk_grad` in kernels/logprob.py. On CPU the
kernels run under TRITON_INTERPRET=1 (tests only: the interpreter is slow).

Tests: tests/test_kernels_logprob.py
"""
import torch
import triton
import triton.language as tl

# -3e38 rather than -inf as the empty running max: (m_old - m_new) * s_old stays 0, not NaN.
_NEG_BIG = tl.constexpr(-3.0e38)


@triton.jit
def _stats_kernel(z_ptr, stride_z, labels_ptr, out_ptr, n_rows, n_cols, inv_t,
                  NEED_ENTROPY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_rows
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    m = tl.full([BLOCK_T], _NEG_BIG, tl.float32)
    s = tl.zeros([BLOCK_T], tl.float32)
    a = tl.zeros([BLOCK_T], tl.float32)
    zlab = tl.zeros([BLOCK_T], tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        z = tl.load(z_ptr + rows[:, None].to(tl.int64) * stride_z + cols[None, :],
                    mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=1))
        scale = tl.exp(m - m_new)
        shifted = tl.where(ok, z - m_new[:, None], 0.0)
        e = tl.where(ok, tl.exp(shifted), 0.0)
        if NEED_ENTROPY:
            a = scale * (a + (m - m_new) * s) + tl.sum(e * shifted, axis=1)
        s = scale * s + tl.sum(e, axis=1)
        m = m_new
        zlab += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
    tl.store(out_ptr + rows, m, mask=row_ok)
    tl.store(out_ptr + n_rows + rows, s, mask=row_ok)
    tl.store(out_ptr + 2 * n_rows + rows, a, mask=row_ok)
    tl.store(out_ptr + 3 * n_rows + rows, zlab, mask=row_ok)


@triton.jit
def _grad_kernel(z_ptr, stride_z, labels_ptr, log_z_ptr, entropy_ptr, g_lp_ptr, g_ent_ptr,
                 n_rows, n_cols, inv_t,
                 HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & (cols < n_cols)[None, :]
    ptrs = z_ptr + rows[:, None].to(tl.int64) * stride_z + cols[None, :]
    z = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    log_z = tl.load(log_z_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(g_lp_ptr + rows, mask=row_ok, other=0.0)
    logp = z * inv_t - log_z[:, None]
    p = tl.exp(logp)
    dz = tl.where(cols[None, :] == labels[:, None], g_lp[:, None], 0.0) - p * g_lp[:, None]
    if HAS_ENTROPY_GRAD:
        entropy = tl.load(entropy_ptr + rows, mask=row_ok, other=0.0)
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
        dz -= p * g_ent[:, None] * (logp + entropy[:, None])
    tl.store(ptrs, dz.to(z_ptr.dtype.element_ty), mask=ok)


def _blocks(n_cols):
    """(tokens, vocab entries) per tile: 4096 fp32 values, 32 per thread at 4 warps."""
    return 8, min(512, triton.next_power_of_2(n_cols))


def chunk_stats(z, inv_t, local_labels, need_entropy):
    """(m, s, a or None, zlab) fp32 [rows] for a chunk z [rows, V_local]; see module doc."""
    n_rows, n_cols = z.shape
    out = torch.empty(4, n_rows, dtype=torch.float32, device=z.device)
    block_t, block_v = _blocks(n_cols)
    _stats_kernel[(triton.cdiv(n_rows, block_t),)](
        z, z.stride(0), local_labels.contiguous(), out, n_rows, n_cols, inv_t,
        NEED_ENTROPY=need_entropy, BLOCK_T=block_t, BLOCK_V=block_v)
    return out[0], out[1], (out[2] if need_entropy else None), out[3]


def chunk_grad(z, inv_t, log_z, entropy, g_lp, g_ent, local_labels):
    """Overwrite z [rows, V_local] with d loss / d raw logits (1/t already in g_lp, g_ent):
    dz = g_lp * onehot - p * (g_lp + g_ent * (log p + H)). Returns z."""
    n_rows, n_cols = z.shape
    block_t, block_v = _blocks(n_cols)
    has_ent = g_ent is not None
    _grad_kernel[(triton.cdiv(n_rows, block_t), triton.cdiv(n_cols, block_v))](
        z, z.stride(0), local_labels.contiguous(), log_z.contiguous(),
        entropy.contiguous() if has_ent else log_z, g_lp.contiguous(),
        g_ent.contiguous() if has_ent else g_lp, n_rows, n_cols, inv_t,
        HAS_ENTROPY_GRAD=has_ent, BLOCK_T=block_t, BLOCK_V=block_v)
    return z
