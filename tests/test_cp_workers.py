"""Context parallelism in the workers, on the CPU with simulated CP ranks.

Megatron's local attention cannot run CP, so each CP rank's model output is taken from the
forward of the padded, unsplit row at the rank's token positions -- what TE's CP attention
computes exactly (tests/gpu/test_context_parallel.py checks that part on GPUs). Everything the
workers do around the model runs for real: the CP micro-batch (`make_micro_batch`), the heads
(log-probs, the single-pass and autograd policy losses, values) and `gather_cp` with the
all-gather's semantics (a rank's own values differentiable, the others' as received).

Checked against the unsplit computation: log-probs and values equal, each rank's loss and
the sum of every rank's gradient equal the unsplit loss and gradient (what Megatron's
gradient all-reduce over DP x CP adds up), metrics equal.
"""
import dataclasses

import pytest
import torch

from tests.multirank import run_on_ranks
from tests.test_layouts import weight_for
from tests.test_ppo_update import B, R, make_batch, make_configs
from tests.tiny_models import tiny_config

CPS = (2, 4)


def _hidden(model, mb):
    ids = mb.tokens
    pos = None if mb.packed_params is not None else torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, None, packed_seq_params=mb.packed_params)


class _SimulatedGather:
    """`gather_cp` of rank `rank` over ranks run one after the other. Pass 1 (`payloads` None)
    records what the rank sends, call by call; pass 2 serves the other ranks' records."""

    def __init__(self, rank, payloads=None):
        self.rank, self.payloads, self.sent, self.calls = rank, payloads, [], 0

    def __call__(self, values, mb, takes=None):
        takes = mb.cp_takes if takes is None else takes
        self.sent.append(values.detach())
        parts = [values if q == self.rank else
                 (self.payloads[q][self.calls] if self.payloads else
                  values.new_zeros(takes[q].numel()))
                 for q in range(len(takes))]
        self.calls += 1
        return torch.cat(parts)[torch.argsort(torch.cat(takes))]


def _run_ranks(worker, fn, micro, hiddens):
    """fn(h_r, mb_r) on every simulated rank, twice (record, then exchange)."""
    gathers = [_SimulatedGather(r) for r in range(len(micro))]
    for r, (mb, h) in enumerate(zip(micro, hiddens)):
        worker.gather_cp = gathers[r]
        fn(h, mb)
    sent = [g.sent for g in gathers]
    outs = []
    for r, (mb, h) in enumerate(zip(micro, hiddens)):
        worker.gather_cp = _SimulatedGather(r, sent)
        outs.append(fn(h, mb))
    del worker.gather_cp  # back to the real method
    return outs


def _shares(whole_output, micro):
    """Each CP rank's model output: the unsplit forward at the rank's token positions."""
    h = whole_output
    flat = h.reshape(h.shape[0] * h.shape[1], *h.shape[2:])
    return [flat[mb.cp_index].view(mb.tokens.shape[0], -1, *h.shape[2:]) for mb in micro]


def _grad_check(losses, want, h):
    """(largest error of the ranks' summed gradient w.r.t. the model output, largest entry of
    the unsplit gradient)."""
    [expected] = torch.autograd.grad(want, h)
    got = sum(torch.autograd.grad(loss, h)[0] for loss in losses)
    return dict(grad_err=float((got - expected).abs().max()),
                grad_scale=float(expected.abs().max()))


def _case(packed, fused, gspo, kl=None):
    from engine.algorithms.losses import LossNormaliser, value_loss
    from engine.workers.actor import ActorWorker
    from engine.workers.base import make_micro_batch
    from engine.workers.critic import CriticWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import load_global, local_shards

    init_mesh(Layout(), seed=1)
    hf = tiny_config("llama")
    gspo_kw = dict(policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4, use_kl_loss=False)
    kl_kw = dict(kl_loss_type=kl, kl_loss_coef=0.5) if kl else {}
    actor_cfg, critic_cfg, model_cfg = make_configs(**(gspo_kw if gspo else kl_kw))
    model_cfg = dataclasses.replace(model_cfg, use_remove_padding=packed, use_fused_kernels=fused)
    actor = ActorWorker(hf, actor_cfg, model_cfg, response_length=R)
    critic = CriticWorker(hf, critic_cfg, model_cfg, response_length=R)
    for w in (actor, critic):
        shapes = {s.global_name: s.global_shape for _, s in local_shards(w.chunks)}
        load_global(w.chunks, lambda n: weight_for(n, shapes[n]))
        w.chunks[0].eval()
    head = critic.models[0].value_head.weight
    head.data.copy_(weight_for("value_head", head.shape))

    batch = make_batch(hf.vocab_size)
    mask = batch["response_mask"].float()
    reference = actor.compute_log_prob(batch, micro_batch_size=B)  # no CP, no CP padding
    batch["old_log_probs"] = reference + 0.3 * batch["noise"] * mask
    batch["ref_log_prob"] = reference - 0.5 * batch["noise"] * mask
    batch["values"] = batch["noise"] * mask
    if kl:  # exact KL: a reference of other weights, its hidden states from its own pass
        from engine.workers.actor import ReferenceWorker
        ref = ReferenceWorker(hf, actor_cfg.megatron, model_cfg)
        shapes = {s.global_name: s.global_shape for _, s in local_shards(ref.chunks)}
        load_global(ref.chunks, lambda n: 1.1 * weight_for(n, shapes[n]))
        got = ref.forward_outputs(batch, micro_batch_size=3, with_hidden=True)
        batch["ref_log_prob"], batch["ref_hidden"] = got["log_prob"], got["hidden"]
        actor._ref_weight = got["output_weight"]
    norm = LossNormaliser.from_mask(batch["response_mask"], R)
    rows = list(range(B))

    def policy(h, mb):
        loss, metrics = actor._policy_loss(h, mb, batch, norm, 1.0)
        return loss, {k: float(v) for k, v in metrics.items()}

    def values(out, mb):
        v = critic._values(out, mb)
        return v, value_loss(v, batch["values"], batch["returns"], mask, 0.2, "token-mean",
                             norm)[0]

    def log_prob(h, mb):
        return actor.gather_cp(actor._logprob_entropy(h, mb, 1.0, False)[0], mb)

    out = dict(reference=reference)
    for cp in CPS:
        kw = dict(packed=packed, multiple_of=1, cp_size=cp)
        whole = make_micro_batch(batch, rows, cp_rank=None, **kw)
        micro = [make_micro_batch(batch, rows, cp_rank=r, **kw) for r in range(cp)]
        res = out[cp] = dict(local_tokens=all(torch.equal(
            mb.tokens.view(-1), whole.tokens.view(-1)[mb.cp_index]) for mb in micro))

        h = _hidden(actor.models[0], whole).requires_grad_()
        shares = _shares(h, micro)
        res["log_prob"] = [whole.to_padded(v.detach())
                           for v in _run_ranks(actor, log_prob, micro, shares)]
        want, want_metrics = policy(h, whole)
        got = _run_ranks(actor, policy, micro, shares)
        res["actor"] = dict(
            want=float(want), want_metrics=want_metrics,
            losses=[float(loss) for loss, _ in got], metrics=[m for _, m in got],
            **_grad_check([loss for loss, _ in got], want, h))

        v = _hidden(critic.models[0], whole).requires_grad_()
        want_values, want = values(v, whole)
        got = _run_ranks(critic, values, micro, _shares(v, micro))
        # a reward model's score: the value at each row's last token
        res["last"] = [x.detach() for x in _run_ranks(critic, critic.last_token_values, micro,
                                                      _shares(v, micro))]
        res["want_last"] = v.detach().reshape(-1)[whole.last_tokens]
        res["critic"] = dict(
            want=float(want), want_values=want_values.detach(),
            values=[x.detach() for x, _ in got], losses=[float(loss) for _, loss in got],
            **_grad_check([loss for _, loss in got], want, v))
    return out


@pytest.mark.parametrize("packed,fused,gspo,kl", [
    (True, True, False, None), (True, False, False, None), (False, True, False, None),
    (True, False, True, None), (True, True, False, "full"), (False, False, False, "full+")],
    ids=["packed-single-pass", "packed-autograd", "rows-single-pass", "packed-gspo",
         "packed-single-pass-full-kl", "rows-autograd-full+-kl"])
def test_cp_ranks_reproduce_the_unsplit_update(packed, fused, gspo, kl):
    [out] = run_on_ranks(_case, 1, packed, fused, gspo, kl)
    for cp in CPS:
        res = out[cp]
        assert res["local_tokens"]
        for lp in res["log_prob"]:  # every rank ends up with every log-prob, in order
            torch.testing.assert_close(lp, out["reference"], atol=1e-5, rtol=0)
        actor, critic = res["actor"], res["critic"]
        for v in critic["values"]:
            torch.testing.assert_close(v, critic["want_values"], atol=1e-5, rtol=0)
        for last in res["last"]:
            torch.testing.assert_close(last, res["want_last"], atol=0, rtol=0)
        for part in (actor, critic):
            assert part["grad_scale"] > 0 and part["grad_err"] <= 1e-5 * part["grad_scale"]
        # the gathered paths compute the whole loss on every rank; the single-pass kernel sums
        # the rank's own tokens, and the ranks' losses add up to the whole loss
        single_pass = fused and not gspo
        for loss in ([sum(actor["losses"])] if single_pass else actor["losses"]):
            assert loss == pytest.approx(actor["want"], rel=1e-5, abs=1e-6)
        for loss in critic["losses"]:
            assert loss == pytest.approx(critic["want"], rel=1e-5, abs=1e-6)
        for metrics in actor["metrics"]:
            assert metrics.keys() == actor["want_metrics"].keys()
            for k, v in actor["want_metrics"].items():
                assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def _gather_over_a_real_cp_group(takes):
    from megatron.core import parallel_state as ps

    from parallel.mesh import Layout, init_mesh
    from parallel.packing import cp_all_gather, cp_gather

    init_mesh(Layout(cp=2), seed=1)
    rank = ps.get_context_parallel_rank()
    x = (torch.arange(len(takes[rank]), dtype=torch.float) + 10 * rank).requires_grad_()
    y = cp_gather(cp_all_gather(x, [len(t) for t in takes], ps.get_context_parallel_group()),
                  takes)
    (y * (torch.arange(y.numel()) + 1.0)).sum().backward()  # the same loss on both ranks
    return y.detach(), x.grad


@pytest.mark.parametrize("takes", [([0, 3, 4], [1, 2]), ([0, 1, 2], [])], ids=["uneven", "empty"])
def test_cp_all_gather_returns_each_rank_its_own_gradient(takes):
    """Both CP ranks compute the same loss on the gathered values: each must get the gradient
    of its own values once (not summed over the ranks), so DP x CP's all-reduce counts it once."""
    takes = [torch.tensor(t, dtype=torch.long) for t in takes]
    results = run_on_ranks(_gather_over_a_real_cp_group, 2, takes)
    expected = torch.zeros(sum(len(t) for t in takes))
    for r, t in enumerate(takes):
        expected[t] = torch.arange(len(t), dtype=torch.float) + 10 * r
    for r, (y, grad) in enumerate(results):
        torch.testing.assert_close(y, expected)
        torch.testing.assert_close(grad, takes[r].float() + 1.0)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "rows"])
def test_cp_micro_batch_carries_the_ranks_positions_and_replayed_routing(packed):
    from engine.batch import Batch
    from engine.workers.base import make_micro_batch

    batch = make_batch(96)
    g = torch.Generator().manual_seed(5)
    lengths = batch["attention_mask"].sum(-1).tolist()
    routing = [torch.randint(0, 8, (n - 1, 3, 2), generator=g) for n in lengths]  # 3 MoE layers
    batch = Batch({k: batch[k] for k in ("input_ids", "attention_mask", "responses",
                                         "response_mask")},
                  non_tensors=dict(routed_experts=routing))
    kw = dict(packed=packed, multiple_of=2, cp_size=2)  # sequence parallelism over TP 2
    whole = make_micro_batch(batch, list(range(B)), cp_rank=None, **kw)

    def per_token(mb):  # Megatron's s-major routing -> [b * s, layers, topk] row-major
        b = mb.tokens.shape[0]
        return torch.stack([r.view(-1, b, 2).transpose(0, 1).reshape(-1, 2)
                            for r in mb.routing], 1)

    for r in range(2):
        mb = make_micro_batch(batch, list(range(B)), cp_rank=r, **kw)
        assert mb.tokens.numel() * 2 == whole.tokens.numel() and mb.tokens.shape[1] % 2 == 0
        assert torch.equal(per_token(mb), per_token(whole)[mb.cp_index])
        if packed:
            assert mb.position_ids is None  # THD RoPE positions come from the padded cu_seqlens
            assert whole.packed_params.cu_seqlens_q_padded is not None
        else:
            width = whole.tokens.shape[1]
            assert width % 8 == 0  # 2 x CP x TP
            assert torch.equal(mb.position_ids.reshape(-1), mb.cp_index % width)
