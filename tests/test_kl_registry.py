"""Whether a KL kind is exact is the registry's metadata (kernels.kl.KL_KINDS[kind].exact), and
it is true of the kernel: an exact kind's value is the KL summed over the whole vocabulary and
cannot be had from sampled log-probs; every other kind's is a function of the sampled
log-ratio. Callers (the step flags, the actor) ask the registry, so changing it moves them."""
from types import SimpleNamespace

import pytest
import torch

from engine.algorithms.kl import KL_KINDS, KLKind
from kernels.kl import kl_penalty, linear_full_kl


def _distributions(tokens=6, hidden=5, vocab=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(tokens, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    rh, rw = torch.randn(tokens, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    logp, logq = torch.log_softmax(h @ w.T, -1), torch.log_softmax(rh @ rw.T, -1)
    sampled = torch.randint(vocab, (tokens,), generator=g)
    lp, ref = logp.gather(1, sampled[:, None])[:, 0], logq.gather(1, sampled[:, None])[:, 0]
    true_kl = (logp.exp() * (logp - logq)).sum(-1)  # the whole vocabulary, written out
    return lp, ref, true_kl, (h, w, rh, rw)


@pytest.mark.parametrize("kind", list(KL_KINDS))
def test_the_exact_metadata_is_what_the_kernel_computes(kind):
    lp, ref, true_kl, (h, w, rh, rw) = _distributions()
    if KL_KINDS[kind].exact:
        with pytest.raises(ValueError, match="full_kl"):
            kl_penalty(lp, ref, kind)
        value = kl_penalty(lp, ref, kind, full_kl=linear_full_kl(h, w, rh, rw))
        torch.testing.assert_close(value, true_kl, rtol=1e-5, atol=1e-6)
    else:
        value = kl_penalty(lp, ref, kind)
        torch.testing.assert_close(kl_penalty(lp, ref, kind, full_kl=torch.full_like(lp, 1e3)), value)
        torch.testing.assert_close(kl_penalty(lp + 0.5, ref + 0.5, kind), value)  # the log-ratio only
        assert not torch.allclose(value, true_kl, atol=1e-3)


@pytest.mark.parametrize("kind", [k for k, m in KL_KINDS.items() if m.straight_through])
def test_straight_through_kinds_have_the_k2_gradient(kind):
    lp, ref, _, (h, w, rh, rw) = _distributions(seed=1)
    lp = lp.clone().requires_grad_(True)
    full = linear_full_kl(h, w, rh, rw).detach() if KL_KINDS[kind].exact else None
    kl_penalty(lp, ref, kind, full_kl=full).sum().backward()
    torch.testing.assert_close(lp.grad, (lp - ref).detach())


def test_the_exact_kinds_are_full_and_full_plus():
    assert tuple(k for k, m in KL_KINDS.items() if m.exact) == ("full", "full+")


def test_the_step_flags_and_the_actor_ask_the_registry(monkeypatch):
    from engine.config import derive, load_config
    from engine.workers.actor import ActorWorker
    from tests.test_derive_parts import DEMO
    cfg = load_config(DEMO, ["actor_rollout_ref.actor.kl_loss_type=k3", "algorithm.use_kl_in_reward=true",
                             "algorithm.kl_penalty=k2"])
    actor_cfg = SimpleNamespace(cfg=SimpleNamespace(use_kl_loss=True, kl_loss_type="k3"))
    before = derive(cfg).step
    assert not (before.full_kl_in_loss or before.full_kl_in_reward or before.keep_ref_hidden)
    assert not ActorWorker._uses_full_kl.fget(actor_cfg)
    monkeypatch.setitem(KL_KINDS, "k3", KLKind("full"))  # pretend k3 and k2 were exact
    monkeypatch.setitem(KL_KINDS, "k2", KLKind("full"))
    after = derive(cfg).step
    assert after.full_kl_in_loss and after.full_kl_in_reward and after.keep_ref_hidden
    assert ActorWorker._uses_full_kl.fget(actor_cfg)
