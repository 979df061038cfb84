"""parallel/shm_reduce.py: the CPU's same-host gradient all-reduce through shared memory against
gloo's own all-reduce (torch.distributed.distributed_c10d.all_reduce, which the wrapper leaves
in place): the same bits on two ranks, one result on every rank and gloo's sum to rounding on
four; which calls take it; and the real ActorWorker's update (megatron-core's DDP gradient sync)
through it, parameter for parameter equal to the same update through gloo."""
import dataclasses

import pytest
import torch

from tests.multirank import run_on_ranks


def _counting(module):
    """Wrap module.all_reduce_shared to count its calls; returns the list of sizes reduced."""
    calls, inner = [], module.all_reduce_shared

    def counted(tensor, group):
        calls.append(tensor.numel())
        return inner(tensor, group)
    module.all_reduce_shared = counted
    return calls, inner


def _against_gloo(segment_bytes, sizes, dtypes):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from parallel import shm_reduce
    saved = shm_reduce.SEGMENT_BYTES
    shm_reduce.SEGMENT_BYTES = segment_bytes  # small slots: a tensor goes in many pieces
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        assert shm_reduce.register(group)
        calls, inner = _counting(shm_reduce)
        rank, out = dist.get_rank(), []
        try:
            gen = torch.Generator().manual_seed(100 + rank)
            for dtype in dtypes:
                for n in sizes:  # back to back: consecutive pieces alternate the slots' turns
                    x = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) * (rank + 1)
                    want = x.clone()
                    c10d.all_reduce(want, group=group)  # gloo
                    got = x.clone()
                    assert dist.all_reduce(got, group=group) is None
                    out.append((got, want))
            routed = len(calls)
            # what stays on gloo: another op, an async call, a strided view, a small tensor,
            # an integer tensor, a group not registered
            x = torch.randn(2 * shm_reduce.MIN_ELEMENTS, generator=gen)
            dist.all_reduce(x.clone(), op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(x.clone(), group=group, async_op=True).wait()
            dist.all_reduce(x.clone()[::2], group=group)
            dist.all_reduce(x[:100].clone(), group=group)
            dist.all_reduce(torch.ones(shm_reduce.MIN_ELEMENTS, dtype=torch.int64), group=group)
            dist.all_reduce(x.clone())
            assert len(calls) == routed
        finally:
            shm_reduce.all_reduce_shared = inner
        return dict(out=out, routed=routed)
    finally:
        shm_reduce.SEGMENT_BYTES = saved


def test_two_ranks_get_gloos_bits_in_one_or_many_pieces():
    from parallel import shm_reduce
    # a 2-rank turn holds 8 KiB / 2 = 1024 float32s per slot: 65 536 .. 200 003 elements make
    # 64 .. 196 pieces with an odd last one; float64 has half as many per piece
    sizes = [shm_reduce.MIN_ELEMENTS, 3 * shm_reduce.MIN_ELEMENTS + 7, 200_003]
    results = run_on_ranks(_against_gloo, 2, 16 << 10, sizes, [torch.float32, torch.float64])
    for r in results:
        assert r["routed"] == 2 * len(sizes)
        for got, want in r["out"]:
            assert torch.equal(got, want)
    for (a, _), (b, _) in zip(results[0]["out"], results[1]["out"]):
        assert torch.equal(a, b)


def test_four_ranks_agree_bit_for_bit_and_with_gloo_to_rounding():
    from parallel import shm_reduce
    results = run_on_ranks(_against_gloo, 4, 1 << 20, [shm_reduce.MIN_ELEMENTS + 3],
                           [torch.float32])
    for r in results:
        for got, want in r["out"]:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # another order of the sum
    for r in results[1:]:
        assert torch.equal(r["out"][0][0], results[0]["out"][0][0])


def _unavailable(shm_dir):
    import torch.distributed as dist

    from parallel import shm_reduce
    saved = shm_reduce.SHM_DIR
    shm_reduce.SHM_DIR = shm_dir
    try:
        return shm_reduce.register(dist.new_group([0, 1]))
    finally:
        shm_reduce.SHM_DIR = saved


def test_no_shared_memory_leaves_the_group_on_gloo(tmp_path):
    assert run_on_ranks(_unavailable, 2, str(tmp_path / "absent")) == [False, False]


def _actor_update(shared):
    import torch.distributed as dist

    from engine.workers.actor import ActorWorker
    from parallel import shm_reduce
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global, load_global, local_shards
    from tests.test_layouts import weight_for
    from tests.test_ppo_update import R, make_batch, make_configs
    from tests.tiny_models import tiny_config

    init_mesh(Layout(), seed=1)
    actor_cfg, _, model_cfg = make_configs(use_kl_loss=False)
    meg = dataclasses.replace(actor_cfg.megatron, use_distributed_optimizer=False)  # all-reduce
    hf = tiny_config("llama")
    worker = ActorWorker(hf, dataclasses.replace(actor_cfg, megatron=meg), model_cfg, response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n, shapes[n]))  # the same start in both runs
    if not shared:
        shm_reduce.forget_all()
    calls, inner = _counting(shm_reduce)
    smallest, shm_reduce.MIN_ELEMENTS = shm_reduce.MIN_ELEMENTS, 1024  # the tiny model's 43 K
    try:
        batch = make_batch(hf.vocab_size, seed=3 + dist.get_rank())  # each rank its own data
        batch["old_log_probs"] = worker.compute_log_prob(batch, micro_batch_size=4)
        worker.update_policy(batch)
    finally:
        shm_reduce.all_reduce_shared, shm_reduce.MIN_ELEMENTS = inner, smallest
    return calls, {k: v.clone() for k, v in iter_global(worker.chunks, "param")}


def test_the_actors_gradient_sync_takes_it_and_updates_as_gloo_does():
    shared = run_on_ranks(_actor_update, 2, True)
    gloo = run_on_ranks(_actor_update, 2, False)
    for (calls, params), (gloo_calls, gloo_params) in zip(shared, gloo):
        assert calls and not gloo_calls  # megatron-core's DDP sync went through shared memory
        assert params.keys() == gloo_params.keys()
        for name in params:
            assert torch.equal(params[name], gloo_params[name]), name
    assert all(torch.equal(shared[0][1][k], shared[1][1][k]) for k in shared[0][1])


@pytest.mark.parametrize("n", [1, 5, 1 << 17])
def test_bounds_cover_the_tensor_once(n):
    from parallel.shm_reduce import chunk_bounds
    for world in (1, 2, 3, 4):
        bounds = chunk_bounds(n, world)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
