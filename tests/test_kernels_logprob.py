"""kernels.logprob: the chunked, vocab-parallel log-prob + entropy against the naive full-logits
reference (values and gradients wrt hidden and weight), torch and Triton backends."""
import pytest
import torch

from kernels.logprob import linear_logprob_entropy, linear_token_loss, naive_logprob_entropy
from tests.multirank import run_on_ranks

# Tolerances. fp32: both paths compute the same logits; they differ only in summation order
# (chunking, online softmax), ~1e-6 relative. bf16: both round the logits to bf16 identically,
# so values still agree to fp32 precision, but gradients are rounded to bf16 before the
# matmuls (and the weight gradient once per chunk) in a different order than autograd's:
# compare gradients to 2% of their largest entry (bf16 has 8 bits of mantissa).
FP32_TOL = dict(rtol=1e-4, atol=1e-5)
FP32_GRAD_TOL = dict(rtol=1e-4, atol=1e-4)
BF16_VALUE_TOL = dict(rtol=1e-4, atol=1e-4)
BF16_GRAD_REL = 2e-2


def _inputs(tokens, hidden, vocab, dtype, seed=0, lead=None):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5 * 3  # peaked distributions
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    coef_lp = torch.randn(tokens, generator=gen)  # loss = sum(coef_lp * lp + coef_ent * ent)
    coef_ent = torch.randn(tokens, generator=gen)
    if lead is not None:
        h, labels = h.view(*lead, hidden), labels.view(lead)
        coef_lp, coef_ent = coef_lp.view(lead), coef_ent.view(lead)
    return h.to(dtype), w.to(dtype), labels, coef_lp, coef_ent


def _run(fn, h, w, labels, coef_lp, coef_ent, **kw):
    """Values and gradients of loss = sum(coef_lp * logprob + coef_ent * entropy)."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    logprob, entropy = fn(h, w, labels, **kw)
    loss = (coef_lp * logprob).sum()
    if coef_ent is not None:
        loss = loss + (coef_ent * entropy).sum()
    loss.backward()
    return logprob.detach(), entropy.detach(), h.grad, w.grad


def _assert_match(got, ref, dtype):
    names = ("logprob", "entropy", "grad hidden", "grad weight")
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(g, r, **(FP32_TOL if "grad" not in name else FP32_GRAD_TOL),
                                       msg=name)
        elif "grad" not in name:
            torch.testing.assert_close(g, r, **BF16_VALUE_TOL, msg=name)
        else:
            scale = r.float().abs().max().item()
            err = (g.float() - r.float()).abs().max().item()
            assert err <= BF16_GRAD_REL * scale, f"{name}: max err {err} vs scale {scale}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [7, None])  # several uneven chunks; one default chunk
def test_torch_backend_matches_naive(dtype, chunk_tokens):
    h, w, labels, c_lp, c_ent = _inputs(30, 24, 97, dtype, lead=(5, 6))
    got = _run(linear_logprob_entropy, h, w, labels, c_lp, c_ent, temperature=0.7,
               chunk_tokens=chunk_tokens, backend="torch")
    ref = _run(naive_logprob_entropy, h, w, labels, c_lp, c_ent, temperature=0.7)
    assert got[0].shape == labels.shape and got[0].dtype == torch.float32
    _assert_match(got, ref, dtype)


def test_entropy_options():
    h, w, labels, c_lp, _ = _inputs(20, 16, 50, torch.float32)
    ref = _run(naive_logprob_entropy, h, w, labels, c_lp, None, temperature=1.3)
    # entropy detached: gradients are those of the log-prob term alone
    got = _run(linear_logprob_entropy, h, w, labels, c_lp, None, temperature=1.3, chunk_tokens=6,
               entropy_grad=False)
    _assert_match(got, ref, torch.float32)
    hh = h.clone().requires_grad_()
    logprob, entropy = linear_logprob_entropy(hh, w, labels, 1.3, entropy_grad=False)
    assert logprob.requires_grad and not entropy.requires_grad
    # no entropy at all
    logprob2, none = linear_logprob_entropy(h, w, labels, 1.3, compute_entropy=False)
    assert none is None
    torch.testing.assert_close(logprob2, ref[0], **FP32_TOL)


def test_logits_are_not_saved_for_backward():
    """Autograd keeps only inputs and per-token statistics, never a [tokens, vocab] tensor."""
    h, w, labels, _, _ = _inputs(64, 8, 200, torch.float32)
    h.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        linear_logprob_entropy(h, w, labels, chunk_tokens=16)
    assert saved and max(saved) <= max(h.numel(), w.numel()) < 64 * 200


def test_bad_inputs():
    h, w, labels, _, _ = _inputs(4, 8, 10, torch.float32)
    with pytest.raises(ValueError, match="labels"):
        linear_logprob_entropy(h, w, labels + 10)
    low = labels.clone()
    low[1] = -3  # one bad id of either sign is named with the range it makes (one host read)
    with pytest.raises(ValueError, match=rf"got values in \[-3, {int(low.max())}\]"):
        linear_logprob_entropy(h, w, low)
    high = labels.clone()
    high[0] = 10
    with pytest.raises(ValueError, match=rf"got values in \[{int(high.min())}, 10\]"):
        linear_logprob_entropy(h, w, high)
    with pytest.raises(ValueError, match="same H"):
        linear_logprob_entropy(h, w[:, :4], labels)
    with pytest.raises(ValueError, match="backend"):
        linear_logprob_entropy(h, w, labels, backend="cuda")
    with pytest.raises(ValueError, match="temperature"):
        linear_logprob_entropy(h, w, labels, temperature=0)


# --------------------------------------------------------------------------------------------
# Single pass (linear_token_loss): a non-linear per-token loss, gradients made in the forward

def _ppo_like(lp, ent, old, adv, w):
    """A clipped-ratio surrogate with an entropy term and a k3 KL: non-linear in lp and ent."""
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    kl = torch.exp(old - lp) - (old - lp) - 1
    return (w * (pg - 0.01 * ent + 0.1 * kl + 0.5 * ent ** 2)).sum()


def _loss_data(h, w, labels, temperature, seed=1):
    """(old log-probs near the current ones, so ratios straddle the clip range; advantages;
    per-token weights like a token-mean's)."""
    gen = torch.Generator().manual_seed(seed)
    n = labels.numel()
    lp = naive_logprob_entropy(h.float(), w.float(), labels, temperature)[0].reshape(-1)
    noise, adv, wt = (torch.randn(n, generator=gen), torch.randn(n, generator=gen),
                      torch.rand(n, generator=gen) / n)  # drawn on the CPU: the same on every device
    return lp + 0.3 * noise.to(lp.device), adv.to(lp.device), wt.to(lp.device)


def _single_pass(h, w, labels, data, **kw):
    old, adv, wt = data
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss, lp, ent = linear_token_loss(
        h, w, labels, lambda a, b, lp, ent: _ppo_like(lp, ent, old[a:b], adv[a:b], wt[a:b]), **kw)
    (3.0 * loss).backward()  # the upstream gradient scales the held gradients
    return loss.detach(), lp, ent, h.grad, w.grad


def _single_pass_reference(h, w, labels, data, temperature):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    lp, ent = naive_logprob_entropy(h, w, labels, temperature)
    loss = _ppo_like(lp.reshape(-1), ent.reshape(-1), *data)
    (3.0 * loss).backward()
    return loss.detach(), lp.detach(), ent.detach(), h.grad, w.grad


def _assert_single_pass(got, ref, dtype):
    torch.testing.assert_close(got[0], ref[0], **(FP32_TOL if dtype == torch.float32
                                                  else BF16_VALUE_TOL))
    _assert_match(got[1:], ref[1:], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_single_pass_loss_matches_naive(dtype, backend):
    h, w, labels, _, _ = _inputs(30, 24, 97, dtype, lead=(5, 6), seed=4)
    data = _loss_data(h, w, labels, 0.7)
    got = _single_pass(h, w, labels, data, temperature=0.7, chunk_tokens=7, backend=backend)
    ref = _single_pass_reference(h, w, labels, data, 0.7)
    assert not got[1].requires_grad and got[1].shape == labels.shape
    _assert_single_pass(got, ref, dtype)


def test_single_pass_options():
    h, w, labels, _, _ = _inputs(20, 16, 50, torch.float32, seed=5)
    # a loss of the log-prob alone (no entropy gradient), under no_grad for weight
    coef = torch.randn(20)
    hh = h.clone().requires_grad_()
    loss, lp, _ = linear_token_loss(hh, w, labels, lambda a, b, lp, ent: (coef[a:b] * lp).sum(),
                                    chunk_tokens=6)
    loss.backward()
    ref = _run(naive_logprob_entropy, h, w, labels, coef, None)
    torch.testing.assert_close(hh.grad, ref[2], **FP32_GRAD_TOL)
    torch.testing.assert_close(loss, (coef * ref[0]).sum(), **FP32_TOL)
    # nothing requires grad: values only
    with torch.no_grad():
        loss2, lp2, _ = linear_token_loss(h, w, labels, lambda a, b, lp, ent: lp.sum())
    torch.testing.assert_close(lp2, ref[0], **FP32_TOL)
    with pytest.raises(ValueError, match="0-dim"):
        linear_token_loss(h, w, labels, lambda a, b, lp, ent: lp)
    with pytest.raises(ValueError, match="temperature"):
        linear_token_loss(h, w, labels, lambda a, b, lp, ent: lp.sum(), temperature=-1)


def _single_pass_tp_worker(dtype_name):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    h, w, labels, _, _ = _inputs(18, 16, 64, getattr(torch, dtype_name), seed=6)
    shard = w.shape[0] // world
    return _single_pass(h, w[rank * shard:(rank + 1) * shard], labels, _loss_data(h, w, labels, 0.8),
                        temperature=0.8, tp_group=dist.group.WORLD, chunk_tokens=5,
                        backend="torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_pass_tensor_parallel(dtype):
    results = run_on_ranks(_single_pass_tp_worker, 2, str(dtype).split(".")[1])
    h, w, labels, _, _ = _inputs(18, 16, 64, dtype, seed=6)
    ref = _single_pass_reference(h, w, labels, _loss_data(h, w, labels, 0.8), 0.8)
    for r in results:
        _assert_single_pass(r[:4] + (ref[4],), ref, dtype)
    _assert_single_pass(ref[:4] + (torch.cat([r[4] for r in results]),), ref, dtype)


# --------------------------------------------------------------------------------------------
# Tensor parallel: the vocab split between ranks, compared with one process on the full weight

def _tp_worker(dtype_name, temperature, backend):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    h, w, labels, c_lp, c_ent = _inputs(18, 16, 64, getattr(torch, dtype_name), seed=3)
    shard = w.shape[0] // world
    w_local = w[rank * shard:(rank + 1) * shard]
    return _run(linear_logprob_entropy, h, w_local, labels, c_lp, c_ent, temperature=temperature,
                tp_group=dist.group.WORLD, chunk_tokens=5, backend=backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_parallel_matches_single_process(dtype):
    name = str(dtype).split(".")[1]
    results = run_on_ranks(_tp_worker, 2, name, 0.8, "torch")
    h, w, labels, c_lp, c_ent = _inputs(18, 16, 64, dtype, seed=3)
    ref = _run(naive_logprob_entropy, h, w, labels, c_lp, c_ent, temperature=0.8)
    for r in results:  # every rank holds the full log-probs, entropies and hidden gradient
        _assert_match(r[:3] + (ref[3],), ref, dtype)
    grad_weight = torch.cat([r[3] for r in results])  # each rank: its own shard's gradient
    _assert_match(ref[:3] + (grad_weight,), ref, dtype)


# --------------------------------------------------------------------------------------------
# Triton (CPU: TRITON_INTERPRET=1, set by conftest; small shapes, the interpreter is slow)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [64, 100])  # 100: partial vocab tiles exercise the masks
def test_triton_matches_naive(dtype, vocab):
    h, w, labels, c_lp, c_ent = _inputs(16, 32, vocab, dtype, seed=vocab)
    got = _run(linear_logprob_entropy, h, w, labels, c_lp, c_ent, temperature=0.9,
               chunk_tokens=11, backend="triton")
    ref = _run(naive_logprob_entropy, h, w, labels, c_lp, c_ent, temperature=0.9)
    _assert_match(got, ref, dtype)


def test_triton_without_entropy_gradient():
    h, w, labels, c_lp, _ = _inputs(16, 32, 64, torch.float32, seed=1)
    got = _run(linear_logprob_entropy, h, w, labels, c_lp, None, chunk_tokens=16,
               backend="triton", entropy_grad=False)
    ref = _run(naive_logprob_entropy, h, w, labels, c_lp, None)
    _assert_match(got, ref, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_matches_naive(dtype, backend):
    h, w, labels, c_lp, c_ent = _inputs(1000, 256, 5000, dtype, seed=7)
    h, w, labels, c_lp, c_ent = (t.cuda() for t in (h, w, labels, c_lp, c_ent))
    got = _run(linear_logprob_entropy, h, w, labels, c_lp, c_ent, temperature=0.7,
               chunk_tokens=300, backend=backend)
    ref = _run(naive_logprob_entropy, h, w, labels, c_lp, c_ent, temperature=0.7)
    _assert_match(got, ref, dtype)


def test_single_pass_data_is_made_on_its_inputs_device():
    """The GPU test's data beside CUDA inputs ("meta" stands in here): drawing the noise on the
    CPU and adding it to CUDA log-probs failed the first GPU run's single-pass tests."""
    h, w, labels, _, _ = _inputs(10, 16, 50, torch.float32, seed=8)
    on_cpu = _loss_data(h, w, labels, 0.7)
    on_meta = _loss_data(h.to("meta"), w.to("meta"), labels.to("meta"), 0.7)
    assert [t.device.type for t in on_meta] == ["meta"] * 3
    assert [t.shape for t in on_meta] == [t.shape for t in on_cpu]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_single_pass_matches_naive(dtype, backend):
    h, w, labels, _, _ = _inputs(1000, 256, 5000, dtype, seed=8)
    h, w, labels = h.cuda(), w.cuda(), labels.cuda()
    data = tuple(t.cuda() for t in _loss_data(h, w, labels, 0.7))
    got = _single_pass(h, w, labels, data, temperature=0.7, chunk_tokens=300, backend=backend)
    ref = _single_pass_reference(h, w, labels, data, 0.7)
    _assert_single_pass(got, ref, dtype)
