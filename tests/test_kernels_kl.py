"""kernels.kl: every estimator (and its straight-through "+" variant) against its written
formula, values and gradients, clamps included; the exact vocabulary KL against an explicit
sum over the vocabulary, single process and vocab-parallel."""
import pytest
import torch

from kernels.kl import kl_penalty, linear_full_kl
from tests.multirank import run_on_ranks


def _formula(kind, logprob, ref_logprob):
    """The estimators as written in the docs, in plain autograd-able torch ops."""
    r = logprob - ref_logprob
    if kind in ("kl", "k1"):
        return r
    if kind == "abs":
        return r.abs()
    if kind in ("mse", "k2"):
        return 0.5 * r.square()
    if kind in ("low_var_kl", "k3"):
        r = torch.clamp(r, -20, 20)
        ratio = torch.exp(-r)  # = exp(ref - logp)
        return torch.clamp(ratio - torch.log(ratio) - 1, -10, 10)
    raise AssertionError(kind)


def _log_probs():
    gen = torch.Generator().manual_seed(0)
    logprob = -torch.rand(4, 50, generator=gen) * 5
    ref = -torch.rand(4, 50, generator=gen) * 5
    # k3 clamps: |r| > 20 (input clamp), r = -5 (value 142 -> output clamp), r = 0, inf padding
    logprob[0, :4] = torch.tensor([-30.0, -1.0, -2.0, -3.0])
    ref[0, :4] = torch.tensor([-1.0, -30.0, 3.0, -3.0])
    return logprob, ref


def _value_and_grads(fn, kind, logprob, ref, weight):
    lp = logprob.clone().requires_grad_()
    rf = ref.clone().requires_grad_()
    value = fn(kind, lp, rf) if fn is _formula else fn(lp, rf, kind)
    (value * weight).sum().backward()
    return value.detach(), lp.grad, rf.grad


BASE_KINDS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


@pytest.mark.parametrize("kind", BASE_KINDS)
def test_estimators_match_formula(kind):
    logprob, ref = _log_probs()
    weight = torch.randn(logprob.shape)
    got = _value_and_grads(kl_penalty, kind, logprob, ref, weight)
    want = _value_and_grads(_formula, kind, logprob, ref, weight)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", [k + "+" for k in BASE_KINDS])
def test_straight_through_variants(kind):
    """Value of the named estimator, gradient of k2 = 0.5 r^2 (unclamped)."""
    logprob, ref = _log_probs()
    weight = torch.randn(logprob.shape)
    value, d_lp, d_ref = _value_and_grads(kl_penalty, kind, logprob, ref, weight)
    want_value = _formula(kind[:-1], logprob, ref)
    _, want_d_lp, want_d_ref = _value_and_grads(_formula, "k2", logprob, ref, weight)
    torch.testing.assert_close(value, want_value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_lp, want_d_lp)
    torch.testing.assert_close(d_ref, want_d_ref)


def test_clamps_are_active():
    # r = -inf (padding), -29 (input clamp), 29 (value 19 -> output clamp), -5 (value 142), 0
    logprob = torch.tensor([-float("inf"), -30.0, -1.0, -2.0, -3.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0, -30.0, 3.0, -3.0])
    k3 = kl_penalty(logprob, ref, "k3")
    assert k3.tolist() == [10.0, 10.0, 10.0, 10.0, 0.0]  # unclamped: NaN, inf, 28, 142, 0
    k3.sum().backward()
    assert logprob.grad.tolist() == [0.0] * 5  # clamped points have zero slope, and r = 0 too


def test_dtype_and_bad_kinds():
    logprob, ref = _log_probs()
    out = kl_penalty(logprob.bfloat16(), ref.bfloat16(), "k3")
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="linear_full_kl"):
        kl_penalty(logprob, ref, "full")
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logprob, ref, "k4")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(logprob, ref[:2], "k1")


# --------------------------------------------------------------------------------------------
# full: exact KL over the vocabulary

def _full_inputs(seed=0, tokens=21, hidden=12, ref_hidden=10, vocab=40):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=gen),
            torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5 * 2,
            torch.randn(tokens, ref_hidden, generator=gen),
            torch.randn(vocab, ref_hidden, generator=gen) / ref_hidden ** 0.5 * 2,
            torch.randn(tokens, generator=gen))


def _explicit_full_kl(h, w, rh, rw, temperature):
    logp = torch.log_softmax(h @ w.t() / temperature, -1)
    logq = torch.log_softmax(rh @ rw.t() / temperature, -1)
    return sum(logp[:, v].exp() * (logp[:, v] - logq[:, v]) for v in range(w.shape[0]))


def _full_kl_and_grads(fn, h, w, rh, rw, coef, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    kl = fn(h, w, rh, rw, **kw)
    (kl * coef).sum().backward()
    return kl.detach(), h.grad, w.grad


def test_full_kl_matches_explicit_sum():
    h, w, rh, rw, coef = _full_inputs()
    got = _full_kl_and_grads(linear_full_kl, h, w, rh, rw, coef, temperature=0.8, chunk_tokens=4)
    want = _full_kl_and_grads(_explicit_full_kl, h, w, rh, rw, coef, temperature=0.8)
    assert (got[0] > 0).all()
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_full_kl_of_identical_policies_is_zero():
    h, w, _, _, _ = _full_inputs()
    kl = linear_full_kl(h.view(3, 7, -1), w, h.view(3, 7, -1), w, chunk_tokens=5)
    assert kl.shape == (3, 7) and (kl == 0).all()


def _full_kl_tp_worker():
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    h, w, rh, rw, coef = _full_inputs(seed=5)
    rows = slice(rank * w.shape[0] // world, (rank + 1) * w.shape[0] // world)
    return _full_kl_and_grads(linear_full_kl, h, w[rows], rh, rw[rows], coef, temperature=1.2,
                              tp_group=dist.group.WORLD, chunk_tokens=8)


def test_full_kl_tensor_parallel():
    results = run_on_ranks(_full_kl_tp_worker, 2)
    h, w, rh, rw, coef = _full_inputs(seed=5)
    want = _full_kl_and_grads(_explicit_full_kl, h, w, rh, rw, coef, temperature=1.2)
    for kl, d_h, _ in results:
        torch.testing.assert_close(kl, want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(d_h, want[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([r[2] for r in results]), want[2], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# full / full+ through kl_penalty, as the actor uses them: the kernels against full-logit
# autograd (full+: the exact KL's value, the gradient of k2 on the sampled token)

def _kind_inputs(seed):
    h, w, rh, rw, coef = _full_inputs(seed=seed)
    labels = torch.randint(0, w.shape[0], (h.shape[0],), generator=torch.Generator().manual_seed(seed))
    return h, w, rh, rw, coef, labels


def _explicit_kind(kind, h, w, rh, rw, coef, labels, temperature):
    """Value and (d hidden, d weight) from full logits; the reference is a constant."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp = torch.log_softmax(h @ w.t() / temperature, -1)
    logq = torch.log_softmax(rh @ rw.t() / temperature, -1)
    exact = (logp.exp() * (logp - logq)).sum(-1)
    r = (logp - logq).gather(1, labels[:, None]).squeeze(1)
    objective = exact if kind == "full" else 0.5 * r * r
    (objective * coef).sum().backward()
    return exact.detach(), h.grad, w.grad


def _kernel_kind(kind, h, w, rh, rw, coef, labels, temperature, tp_group=None):
    """The actor's path: sampled log-probs from the fused kernel, the exact KL from
    linear_full_kl (forward only for full+), combined by kl_penalty."""
    from kernels.logprob import linear_logprob_entropy
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    rh, rw = rh.clone().requires_grad_(), rw.clone().requires_grad_()  # must get no gradient
    lp, _ = linear_logprob_entropy(h, w, labels, temperature, tp_group, chunk_tokens=5,
                                   compute_entropy=False)
    with torch.no_grad():
        ref_lp, _ = linear_logprob_entropy(rh, rw, labels, temperature, tp_group,
                                           compute_entropy=False)
    with torch.set_grad_enabled(kind == "full"):
        exact = linear_full_kl(h, w, rh, rw, temperature, tp_group, chunk_tokens=6)
    kl = kl_penalty(lp, ref_lp, kind, full_kl=exact)
    (kl * coef).sum().backward()
    assert rh.grad is None and rw.grad is None
    return kl.detach(), h.grad, w.grad


@pytest.mark.parametrize("kind", ["full", "full+"])
def test_full_kinds_match_full_logit_autograd(kind):
    h, w, rh, rw, coef, labels = _kind_inputs(seed=2)
    got = _kernel_kind(kind, h, w, rh, rw, coef, labels, 0.9)
    want = _explicit_kind(kind, h, w, rh, rw, coef, labels, 0.9)
    assert (got[0] > 0).all()
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def _full_kinds_tp_worker(kind):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    h, w, rh, rw, coef, labels = _kind_inputs(seed=7)
    rows = slice(rank * w.shape[0] // world, (rank + 1) * w.shape[0] // world)
    return _kernel_kind(kind, h, w[rows], rh, rw[rows], coef, labels, 1.1, dist.group.WORLD)


@pytest.mark.parametrize("kind", ["full", "full+"])
def test_full_kinds_tensor_parallel(kind):
    results = run_on_ranks(_full_kinds_tp_worker, 2, kind)
    h, w, rh, rw, coef, labels = _kind_inputs(seed=7)
    want = _explicit_kind(kind, h, w, rh, rw, coef, labels, 1.1)
    for kl, d_h, _ in results:
        torch.testing.assert_close(kl, want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(d_h, want[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([r[2] for r in results]), want[2], rtol=1e-4, atol=1e-5)


def test_full_kinds_need_the_exact_kl():
    logprob, ref = _log_probs()
    for kind in ("full", "full+"):
        with pytest.raises(ValueError, match="linear_full_kl"):
            kl_penalty(logprob, ref, kind)
        with pytest.raises(ValueError, match="full_kl shape"):
            kl_penalty(logprob, ref, kind, full_kl=torch.zeros(3))
