"""Step-overhead removals keep their results (issue 28): the non-finite-gradient check against
torch.isfinite element by element, packed (THD) attention, whose packing is worked out once
per micro-batch, against causal softmax attention written out per sequence, and gradient
clipping on foreach kernels against the written norm and clip formulas, and the gradient norm as
the optimizer step's finite check."""
import dataclasses
import math

import pytest
import torch

from engine.workers.finite import all_finite


@pytest.mark.parametrize("values, dtype", [
    ([1.0, -2.0, 3.0], torch.float32),
    ([1.0, float("nan"), 3.0], torch.float32),
    ([1.0, float("inf"), 3.0], torch.float32),
    ([float("-inf"), float("inf")], torch.float32),  # a NaN sum
    ([3e38, 3e38, -1.0], torch.float32),  # finite values whose sum overflows: still finite
    ([60000.0, 60000.0], torch.bfloat16),
    ([1.0, float("nan")], torch.bfloat16),
])
def test_all_finite_is_isfinite_everywhere(values, dtype):
    grads = [torch.randn(50).to(dtype), torch.tensor(values, dtype=dtype)]
    want = all(bool(torch.isfinite(g).all()) for g in grads)
    assert all_finite(grads) is want
    assert all_finite(grads[::-1]) is want
    assert all_finite([]) is True


def per_sequence_attention(q, k, v, lengths, scale):
    """Causal softmax attention of each sequence alone; q, k, v [t, heads, d] packed."""
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))  # [heads, n, d]
        if ks.shape[0] != qs.shape[0]:  # grouped-query: each kv head serves a group of q heads
            ks, vs = (x.repeat_interleave(qs.shape[0] // x.shape[0], 0) for x in (ks, vs))
        scores = qs @ ks.transpose(1, 2) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=qs.device).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out).reshape(start, -1)


def test_packed_attention_reads_the_packing_once_per_micro_batch():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from engine.models.local_modules import CoreAttention

    config = type("Config", (), dict(kv_channels=8, attention_dropout=0.0))
    attention = CoreAttention(config, 1, AttnMaskType.causal).eval()

    def packed(lengths):
        cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))

    gen = torch.Generator().manual_seed(0)
    lengths = [5, 3, 5, 1, 3]  # equal lengths are batched together
    q = torch.randn(sum(lengths), 4, 8, generator=gen)
    k, v = torch.randn(2, sum(lengths), 2, 8, generator=gen)
    params = packed(lengths)
    want = per_sequence_attention(q, k, v, lengths, 1 / math.sqrt(8))
    torch.testing.assert_close(attention(q, k, v, packed_seq_params=params), want)
    # the next layer of the same micro-batch: the packing is not read again
    params.cu_seqlens_q = params.cu_seqlens_kv = torch.tensor([0, sum(lengths)], dtype=torch.int32)
    torch.testing.assert_close(attention(q, k, v, packed_seq_params=params), want)
    # another micro-batch (MicroBatch.to makes new params every step): its own packing
    other = [4, 4, 9]
    fresh = dataclasses.replace(packed(other))
    torch.testing.assert_close(attention(q, k, v, packed_seq_params=fresh),
                               per_sequence_attention(q, k, v, other, 1 / math.sqrt(8)))


@pytest.mark.parametrize("lengths, runs", [
    ([4, 4, 4], [True]),                   # one length: the whole packed tensor, no copy
    ([5, 5, 3, 1], [True, True, True]),    # back-to-back runs of equal lengths
    ([2, 6, 2], [False, True]),            # the 2s are apart: gathered
])
def test_packed_attention_reads_runs_of_equal_lengths_as_views(lengths, runs):
    """q, k, v as Megatron hands them (views of one fused QKV tensor): values and gradients
    equal causal attention written out per sequence, whether a length's sequences lie back to
    back (a view) or apart (a gathered copy)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from engine.models import local_modules
    from engine.models.local_modules import CoreAttention

    config = type("Config", (), dict(kv_channels=8, attention_dropout=0.0))
    attention = CoreAttention(config, 1, AttnMaskType.causal).eval()
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    t = sum(lengths)
    mixed = torch.randn(t, (4 + 2 + 2) * 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad_out = torch.randn(t, 4 * 8, generator=torch.Generator().manual_seed(2))
    results = []
    for run in (lambda q, k, v: attention(q, k, v, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
            max_seqlen_kv=max(lengths))),
            lambda q, k, v: per_sequence_attention(q, k, v, lengths, 1 / math.sqrt(8)).reshape(t, -1)):
        mixed.grad = None
        q, k, v = mixed[:, :32].view(t, 4, 8), mixed[:, 32:48].view(t, 2, 8), mixed[:, 48:].view(t, 2, 8)
        out = run(q, k, v)
        out.backward(grad_out)
        results.append((out.detach(), mixed.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    groups = local_modules.length_groups(params, torch.device("cpu"))
    assert [isinstance(where, slice) for _, _, where in groups] == runs


def _inner_adam_groups(distributed):
    """The fused / foreach flags of the torch optimizer(s) inside a real ActorWorker's Megatron
    optimizer (one rank), plain or distributed."""
    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh
    from tests.test_ppo_update import make_configs
    from tests.tiny_models import tiny_config

    init_mesh(Layout(), seed=1)
    actor_cfg, _, model_cfg = make_configs()
    actor_cfg = dataclasses.replace(actor_cfg, megatron=dataclasses.replace(
        actor_cfg.megatron, use_distributed_optimizer=distributed))
    worker = ActorWorker(tiny_config("llama"), actor_cfg, model_cfg, total_steps=2)
    opt = worker.optimizer
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    groups = [(type(o).__name__, g["fused"], g["foreach"]) for o in inner for g in o.param_groups]
    # the moments exist before the first step (init_adam_state), as torch would make them
    state = [(o.state[p]["step"].dtype, o.state[p]["step"].device, o.state[p]["exp_avg"].shape == p.shape,
              float(o.state[p]["exp_avg_sq"].abs().sum()))
             for o in inner for g in o.param_groups for p in g["params"]]
    return groups, state


@pytest.mark.parametrize("distributed", [False, True])
def test_megatrons_torch_adam_runs_the_fused_kernel(distributed):
    from tests.multirank import run_on_ranks
    ((groups, state),) = run_on_ranks(_inner_adam_groups, 1, distributed)
    assert groups and all(g[1:] == (True, False) for g in groups), groups
    assert state and set(state) == {(torch.float32, torch.device("cpu"), True, 0.0)}, state


def test_adam_state_made_up_front_is_the_state_torch_makes():
    """init_adam_state gives every parameter the state the fused AdamW's first step would make:
    three steps from it end bit for bit where three steps from lazily made state end (parameters
    and every state tensor, dtype and device included); state that exists is kept."""
    from engine.workers.fused_adam import init_adam_state, use_fused_adam

    class Wrapper:  # what both read of a Megatron optimizer: its torch `optimizer`
        def __init__(self, inner):
            self.optimizer = inner

    torch.manual_seed(0)
    shapes = [(16, 8), (8,)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    runs = []
    for up_front in (False, True):
        for amsgrad in (False, True):
            params = [torch.nn.Parameter(t.clone()) for t in start]
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
            use_fused_adam(Wrapper(opt))
            if up_front:
                assert init_adam_state(Wrapper(opt)) == len(params)
                assert all(len(opt.state[p]) == 3 + amsgrad for p in params)
            for step in grads:
                for p, g in zip(params, step):
                    p.grad = g.clone()
                opt.step()
            runs.append((params, opt))
    for (lazy, lazy_opt), (eager, eager_opt) in zip(runs[:2], runs[2:]):
        for a, b in zip(lazy, eager):
            assert torch.equal(a, b)
            assert lazy_opt.state[a].keys() == eager_opt.state[b].keys()
            for k, v in lazy_opt.state[a].items():
                w = eager_opt.state[b][k]
                assert (v.dtype, v.device, v.shape) == (w.dtype, w.device, w.shape) and torch.equal(v, w), k
    assert init_adam_state(Wrapper(runs[2][1])) == 0  # state that exists is kept


def test_the_fused_adamw_step_is_the_per_parameter_loops():
    """use_fused_adam changes the kernel, not the update: three AdamW steps (weight decay,
    bias correction) match torch's per-parameter loop to float rounding."""
    from engine.workers.fused_adam import use_fused_adam

    class Wrapper:  # what use_fused_adam reads of a Megatron optimizer: its torch `optimizer`
        def __init__(self, inner):
            self.optimizer = inner

    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (7, 5)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    runs = []
    for fuse in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
        if fuse:
            assert use_fused_adam(Wrapper(opt)) == 1
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        runs.append(params)
    assert all(g["fused"] for g in opt.param_groups)
    for a, b in zip(*runs):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()
    moved = max(float((a.detach() - s).abs().max()) for a, s in zip(runs[1], start))
    assert moved > 1e-2  # the steps did move the parameters
    # an optimizer that already holds state keeps its kernel (its step counters are on the host)
    assert use_fused_adam(Wrapper(opt)) == 0


def _clip_with_megatron(shapes, max_norm, seed):
    """Megatron's own clipping (get_grad_norm_fp32, clip_grad_by_total_norm_fp32) on one rank
    after use_foreach_multi_tensor: (what was swapped, norm, clipped grads, the grads before)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    from engine.workers.fused_adam import use_foreach_multi_tensor
    from parallel.mesh import Layout, init_mesh
    init_mesh(Layout(), seed=1)
    # what Megatron imports without TE or Apex (this worker may have swapped them already)
    clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = optimizer.multi_tensor_scale_impl = utils.local_multi_tensor_scale
    swapped = use_foreach_multi_tensor()
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    before = [p.grad.clone() for p in params]
    norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, norm)
    return swapped, norm, [p.grad for p in params], before


def test_gradient_clipping_runs_on_foreach_kernels():
    """Without TE or Apex, Megatron clips with megatron/core/utils.py's per-tensor loops (a host
    copy per gradient on a GPU); use_foreach_multi_tensor swaps in torch's foreach kernels. The
    norm is the per-tensor norms' norm, bit for bit as the loop computes it, and the clipped
    gradients are the written formula g * max_norm / (norm + 1e-6)."""
    from engine.workers.fused_adam import foreach_l2_norm, foreach_scale
    from tests.multirank import run_on_ranks

    shapes = [(64, 32), (32,), (7, 5), (300,)]
    swapped, norm, clipped, before = run_on_ranks(_clip_with_megatron, 1, shapes, 1.0, 0)[0]
    assert ("megatron.core.optimizer.clip_grads", "l2_norm_impl") in swapped
    assert ("megatron.core.optimizer.clip_grads", "multi_tensor_scale_impl") in swapped
    assert ("megatron.core.optimizer.optimizer", "multi_tensor_scale_impl") in swapped
    exact = math.sqrt(sum(float(g.double().pow(2).sum()) for g in before))
    assert norm == pytest.approx(exact, rel=1e-6) and norm > 10  # so the clip below acts
    coeff = 1.0 / (norm + 1e-6)
    for g, b in zip(clipped, before):
        assert torch.allclose(g, b * coeff, rtol=1e-6, atol=0)
    # the functions alone: Megatron's loop takes torch.norm per tensor, then their norm
    torch.manual_seed(1)
    tensors = [torch.randn(s) for s in shapes]
    loop = torch.norm(torch.tensor([torch.norm(t) for t in tensors]))
    got, per_tensor = foreach_l2_norm(2048 * 32, None, [tensors], False)
    assert per_tensor is None and got.shape == (1,) and got.dtype == torch.float32
    assert torch.equal(got[0], loop)
    # the norm lands where Megatron's overflow buffer is (device="cuda" there), not the grads'
    flag = torch.zeros(1, dtype=torch.int, device="meta")
    assert foreach_l2_norm(2048 * 32, flag, [tensors], False)[0].device.type == "meta"
    copies = [t.clone() for t in tensors]
    foreach_scale(0, None, [copies, copies], 0.25)  # in place
    assert all(torch.equal(c, t * 0.25) for c, t in zip(copies, tensors))
    low = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    foreach_scale(0, None, [tensors, low], 1.0)  # main params -> bf16 model params
    assert all(torch.equal(lo, t.to(torch.bfloat16)) for lo, t in zip(low, tensors))
    foreach_scale(0, None, [tensors, copies], 3.0)
    assert all(torch.equal(c, t * 3.0) for c, t in zip(copies, tensors))


def _mlp_pair():
    """Megatron's MLP and GatedMLP with the same weights, on one rank: outputs and gradients."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from engine.models.builder import build_model
    from engine.models.local_modules import GatedMLP
    from parallel.mesh import Layout, init_mesh
    from tests.tiny_models import tiny_config

    init_mesh(Layout(), seed=1)
    config = TransformerConfig(num_layers=1, hidden_size=16, ffn_hidden_size=24, num_attention_heads=2,
                               gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               add_bias_linear=False, use_cpu_initialization=True)
    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    torch.manual_seed(0)
    ours, theirs = GatedMLP(config, subs), MLP(config, subs)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(5, 2, 16)
    results = []
    for mlp in (ours, theirs):
        xi = x.clone().requires_grad_()
        out, bias = mlp(xi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), bias, xi.grad, [p.grad for p in mlp.parameters()]))
    with torch.no_grad(), torch.profiler.profile() as prof:  # a forward-only pass (reference)
        forward_only = ours(x)[0]
    products = sum(e.count for e in prof.key_averages() if e.key == "aten::mm")
    with torch.no_grad():
        forward_only_theirs = theirs(x)[0]
    built = build_model(tiny_config("llama"))[0]
    # training with Megatron's gradient-accumulation fusion (parallel/cpu.py's stand-in): weight
    # gradients added into main_grad over two micro-batches, DDP's flag set
    fused = dataclasses.replace(config, gradient_accumulation_fusion=True)
    ours_f, theirs_f = GatedMLP(fused, subs), MLP(fused, subs)
    theirs_f.load_state_dict(ours.state_dict())
    ours_f.load_state_dict(ours.state_dict())
    accumulated = []
    for mlp in (ours_f, theirs_f):
        torch.manual_seed(1)
        for p in mlp.parameters():
            p.main_grad, p.grad_added_to_main_grad = torch.randn_like(p), False
        with torch.profiler.profile() as prof:
            for _ in range(2):
                xi = torch.randn(5, 2, 16, requires_grad=True)
                out, _ = mlp(xi)
                out.backward(torch.randn_like(out))
        accumulated.append(([p.main_grad for p in mlp.parameters()],
                            [p.grad_added_to_main_grad for p in mlp.parameters()], xi.grad,
                            sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm_"))))
    return (results, {type(m).__name__ for m in built.modules() if isinstance(m, MLP)},
            (forward_only, forward_only_theirs, products), accumulated)


def test_the_gated_mlp_is_megatrons_swiglu_mlp():
    """GatedMLP (one autograd function for SwiGLU) against Megatron's MLP on the same weights:
    the same output and the same input and weight gradients; the local spec builds it. Without
    gradients on the CPU it runs fc1's gate and up halves as two products (three with fc2's),
    with Megatron's output still; in training too, its weight gradients added into main_grad as
    Megatron's fused linear adds them."""
    from tests.multirank import run_on_ranks
    ((ours, theirs), swapped, (forward_only, forward_only_theirs, products), accumulated), = \
        run_on_ranks(_mlp_pair, 1)
    (grads, flags, dx, ops), (grads_theirs, flags_theirs, dx_theirs, ops_theirs) = accumulated
    for a, b in zip(grads, grads_theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert flags == flags_theirs == [True, True]
    torch.testing.assert_close(dx, dx_theirs, rtol=1e-6, atol=1e-6)
    # per micro-batch: fc1 as 2 forward products, 2 input-gradient and 2 weight-gradient ones,
    # against Megatron's 1 + 1 + 1; fc2's 3 on both sides
    assert (ops, ops_theirs) == (2 * 9, 2 * 6)
    torch.testing.assert_close(forward_only, forward_only_theirs, rtol=1e-6, atol=1e-6)
    assert products == 3
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-6)
    assert ours[1] is None and theirs[1] is None
    torch.testing.assert_close(ours[2], theirs[2], rtol=1e-6, atol=1e-6)
    for a, b in zip(ours[3], theirs[3]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert swapped == {"GatedMLP"}


def _accumulated_wgrad():
    """A Megatron ColumnParallelLinear with gradient_accumulation_fusion on CPU (parallel/cpu.py's
    stand-in for apex's kernel): two backward passes into a main_grad that starts non-zero."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    config = TransformerConfig(num_layers=1, hidden_size=6, num_attention_heads=1,
                               gradient_accumulation_fusion=True, use_cpu_initialization=True)
    layer = ColumnParallelLinear(6, 4, config=config, init_method=torch.nn.init.normal_, bias=False,
                                 gather_output=True)
    start = torch.randn(4, 6)
    layer.weight.main_grad = start.clone()
    layer.weight.grad_added_to_main_grad = False  # set by Megatron's DDP on every trained parameter
    xs = [torch.randn(3, 2, 6) for _ in range(2)]
    gs = [torch.randn(3, 2, 4) for _ in range(2)]
    for x, g in zip(xs, gs):
        out, _ = layer(x)
        out.backward(g)
    return start, xs, gs, layer.weight.main_grad, layer.weight.grad_added_to_main_grad


def test_cpu_gradient_accumulation_fusion_adds_into_main_grad():
    """main_grad += grad_output^T input for every backward, written out; Megatron's flag that
    the gradient is already in main_grad (so DDP's hook does not add it again) is set."""
    from tests.multirank import run_on_ranks
    (start, xs, gs, main_grad, added), = run_on_ranks(_accumulated_wgrad, 1)
    want = start + sum(g.reshape(-1, 4).t() @ x.reshape(-1, 6) for x, g in zip(xs, gs))
    torch.testing.assert_close(main_grad, want, rtol=1e-6, atol=1e-6)
    assert added is True


def _update_with_a_nan(nan_rank, distributed, clip_grad):
    """One update_policy of a real ActorWorker at DP 2, rank `nan_rank`'s first advantage NaN
    (None: every value finite). Returns (skipped updates, grad norm, the largest parameter
    change, the float64 norm of the reduced gradients before the step (plain optimizer: the
    whole buffer), the all-reduces over more than one rank during the optimizer step)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from engine.workers.actor import ActorWorker
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global
    from tests.test_ppo_update import B, R, make_batch, make_configs
    from tests.tiny_models import tiny_config

    init_mesh(Layout(), seed=1)
    actor_cfg, _, model_cfg = make_configs()
    actor_cfg = dataclasses.replace(
        actor_cfg, megatron=dataclasses.replace(actor_cfg.megatron, use_distributed_optimizer=distributed),
        optim=dataclasses.replace(actor_cfg.optim, clip_grad=clip_grad))
    worker = ActorWorker(tiny_config("llama"), actor_cfg, model_cfg, response_length=R)
    rank = ps.get_data_parallel_rank()
    mine = make_batch(worker.hf_config.vocab_size).index_select(list(range(rank * B // 2, (rank + 1) * B // 2)))
    worker.mini_batch_size_per_rank = len(mine)
    mine["old_log_probs"] = worker.compute_log_prob(mine, micro_batch_size=2)
    mine["ref_log_prob"] = mine["old_log_probs"] - 0.1 * mine["noise"] * mine["response_mask"]
    if rank == nan_rank:
        mine["advantages"][0, 0] = float("nan")  # every response has its first token
    before = {k: v.clone() for k, v in iter_global(worker.chunks, "param")}
    seen, collectives = {}, []
    step, all_reduce = worker.optimizer_step, dist.all_reduce

    def counted(tensor, *args, group=None, **kwargs):
        if dist.get_world_size(group) > 1:
            collectives.append(tensor.numel())
        return all_reduce(tensor, *args, group=group, **kwargs)

    def watched():
        seen["norm"] = float(torch.cat([b.grad_data.double() for c in worker.chunks for b in c.buffers]).norm())
        dist.all_reduce = counted
        try:
            return step()
        finally:
            dist.all_reduce = all_reduce
    worker.optimizer_step = watched
    metrics = worker.update_policy(mine)
    change = max(float((v - before[k]).abs().max()) for k, v in iter_global(worker.chunks, "param"))
    return metrics["actor/skipped_updates"], metrics.get("actor/grad_norm", float("nan")), change, \
        seen["norm"], len(collectives)


@pytest.mark.parametrize("distributed", [False, True])
def test_the_gradient_norm_is_the_finite_check(distributed):
    """Megatron's step with its gradient norm as the NaN / Inf check (step_unless_nonfinite): a
    NaN loss term on one rank skips the step on both (nothing moves); finite gradients step with
    the norm of the reduced gradients, clipped or not; and the optimizer step makes one
    all-reduce over the ranks (the distributed optimizer's norm over its shards), none with the
    plain one (replicas hold equal gradients): the separate finite check's pass and flag are gone."""
    from tests.multirank import run_on_ranks
    for skipped, norm, change, _, collectives in run_on_ranks(_update_with_a_nan, 2, 1, distributed, 1.0):
        assert skipped == 1 and math.isnan(norm) and change == 0.0
        assert collectives == int(distributed)
    for clip in (1.0, 0.0):
        runs = run_on_ranks(_update_with_a_nan, 2, None, distributed, clip)
        for skipped, norm, change, by_hand, collectives in runs:
            assert skipped == 0 and change > 0 and math.isfinite(norm) and norm == runs[0][1]
            if not distributed:  # the whole reduced gradient is in each replica's buffer
                assert norm == pytest.approx(by_hand, rel=1e-5)
            assert collectives == int(distributed)


def _one_rank_linears_against_megatrons():
    """Each column / row linear of a real actor (trained weights) and of a reference (frozen
    weights, as LoRA's base) run as OneRankLinear and as Megatron's own class on the same input
    (a packed [t, 1, h] view with a non-canonical stride in its size-1 dimension) and output
    gradient: (name, was the lean path taken, outputs equal, input gradients equal, main_grad
    additions equal, the placeholder flag set) per linear; outputs with and without gradients.
    Frozen weights have no main_grad: those two entries are True there."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, layers

    from engine.config import MegatronConfig, ModelConfig
    from engine.models import local_modules
    from engine.workers.actor import ReferenceWorker
    from parallel.mesh import Layout, init_mesh
    from tests.test_checkpoint import make_actor
    from tests.tiny_models import tiny_config

    init_mesh(Layout(), seed=1)
    workers = {"actor": make_actor(),
               "ref": ReferenceWorker(tiny_config("llama"), MegatronConfig(params_dtype="float32"),
                                      ModelConfig())}
    calls = []  # Megatron's linear autograd functions (trained and frozen weights)
    functions = (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight)
    real = [f.apply for f in functions]
    for f, apply in zip(functions, real):
        f.apply = lambda *a, _apply=apply: (calls.append(1), _apply(*a))[1]
    out = []
    try:
        for kind, worker in workers.items():
            for name, linear in worker.chunks[0].named_modules():
                if not isinstance(linear, (local_modules.LeanColumnLinear, local_modules.LeanRowLinear)):
                    continue
                trained = linear.weight.requires_grad
                torch.manual_seed(len(out))
                x0 = torch.randn(1, 29, linear.weight.shape[1]).transpose(0, 1)  # strides (h, 29 h, 1)
                grad = torch.randn(29, 1, linear.weight.shape[0])
                runs = []
                for cls in (type(linear), ColumnParallelLinear if isinstance(linear, ColumnParallelLinear)
                            else RowParallelLinear):
                    lean, linear.__class__ = linear.__class__, cls
                    calls.clear()
                    if trained:
                        linear.weight.main_grad.zero_()
                    x = x0.clone().as_strided(x0.shape, x0.stride()).requires_grad_(True)
                    y, _ = linear(x)
                    y.backward(grad)
                    with torch.no_grad():  # the reference's and the log-probs' forward
                        y_no_grad = linear(x0)[0]
                    runs.append((torch.cat([y.detach(), y_no_grad]), x.grad,
                                 linear.weight.main_grad.clone() if trained else None, len(calls),
                                 linear.weight.grad_added_to_main_grad if trained else True))
                    linear.__class__ = lean
                (y1, dx1, g1, c1, f1), (y2, dx2, g2, c2, f2) = runs
                out.append((f"{kind}:{name}", c1 == 0 and c2 == 2, torch.equal(y1, y2), torch.equal(dx1, dx2),
                            not trained or (torch.equal(g1, g2) and bool(g1.abs().sum() > 0)), f1 and f2))
    finally:
        for f, apply in zip(functions, real):
            f.apply = apply
    return out


def test_one_rank_linears_are_megatrons_bit_for_bit():
    """On one TP rank on the CPU, Megatron's column / row linears run as OneRankLinear (no
    identity regions, no Megatron autograd function): the same output, input gradient and
    weight gradient added into main_grad as Megatron's own linear, bit for bit, with its
    placeholder-gradient flag set; for frozen weights too (whose Megatron path rounds a
    non-canonically strided input's product as one flat product, not as matmul would)."""
    from tests.multirank import run_on_ranks
    rows = run_on_ranks(_one_rank_linears_against_megatrons, 1)[0]
    for kind in ("actor", "ref"):
        assert {r[0].rsplit(".", 1)[-1] for r in rows if r[0].startswith(kind)} >= \
            {"linear_qkv", "linear_proj", "linear_fc2"}, rows
    for name, lean_taken, *equal in rows:
        assert lean_taken and all(equal), (name, lean_taken, equal)
