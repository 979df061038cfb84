"""parallel/shm_reduce.py: the CPU's same-host gradient collectives through shared memory against
gloo's own (torch.distributed.distributed_c10d's functions, which the wrappers leave in place):
all-reduce and reduce-scatter with the same bits on two ranks, one result on every rank and
gloo's sum to rounding on four, all-gather of any dtype; which calls take it; and the real
ActorWorker's update (megatron-core's DDP gradient sync, with and without the distributed
optimizer's reduce-scatter and parameter all-gather) through it, parameter for parameter equal
to the same update through gloo."""
import dataclasses

import pytest
import torch

from tests.multirank import run_on_ranks


SHARED = ("all_reduce_shared", "reduce_scatter_shared", "all_gather_shared")


def _counting(module):
    """Wrap the module's shared-memory collectives to count their calls: ({name: [sizes]},
    the originals to put back)."""
    calls, inner = {name: [] for name in SHARED}, {name: getattr(module, name) for name in SHARED}

    def counted(name):
        def call(*tensors):
            calls[name].append(tensors[0].numel())
            return inner[name](*tensors)
        return call
    for name in SHARED:
        setattr(module, name, counted(name))
    return calls, inner


def _restore(module, inner):
    for name, fn in inner.items():
        setattr(module, name, fn)


def _against_gloo(segment_bytes, sizes, dtypes):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from parallel import shm_reduce
    saved = shm_reduce.SEGMENT_BYTES, shm_reduce.MIN_ELEMENTS
    # small slots (a tensor goes in many pieces), allowed by a small minimum
    shm_reduce.SEGMENT_BYTES, shm_reduce.MIN_ELEMENTS = segment_bytes, 1024
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        assert shm_reduce.register(group)
        calls, inner = _counting(shm_reduce)
        rank, world, out = dist.get_rank(), dist.get_world_size(), []
        try:
            gen = torch.Generator().manual_seed(100 + rank)
            for dtype in dtypes:
                for n in sizes:  # back to back: consecutive pieces alternate the slots' turns
                    m = n // world
                    x = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) * (rank + 1)
                    want = x.clone()
                    c10d.all_reduce(want, group=group)  # gloo
                    got = x.clone()
                    assert dist.all_reduce(got, group=group) is None
                    out.append((got, want))
                    # reduce-scatter, into a new tensor and into the input's own row (Megatron's)
                    want = torch.empty(m, dtype=dtype)
                    c10d.reduce_scatter_tensor(want, x[:world * m].clone(), group=group)
                    got = torch.empty(m, dtype=dtype)
                    dist.reduce_scatter_tensor(got, x[:world * m].clone(), group=group)
                    inplace = x[:world * m].clone()
                    dist.reduce_scatter_tensor(inplace[rank * m:(rank + 1) * m], inplace, group=group)
                    out += [(got, want), (inplace[rank * m:(rank + 1) * m], want)]
                    # all-gather, from a new tensor and from the output's own row
                    want = torch.empty(world * m, dtype=dtype)
                    c10d.all_gather_into_tensor(want, x[:m].clone(), group=group)
                    got = torch.empty(world * m, dtype=dtype)
                    dist.all_gather_into_tensor(got, x[:m].clone(), group=group)
                    inplace = torch.zeros(world * m, dtype=dtype)
                    inplace[rank * m:(rank + 1) * m] = x[:m]
                    dist.all_gather_into_tensor(inplace, inplace[rank * m:(rank + 1) * m], group=group)
                    out += [(got, want), (inplace, want)]
            routed = {k: len(v) for k, v in calls.items()}
            # what stays on gloo: another op, an async call, a strided view, a small tensor,
            # an integer sum, a group not registered
            x = torch.randn(2 * 65536, generator=gen)
            dist.all_reduce(x.clone(), op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(x.clone(), group=group, async_op=True).wait()
            dist.all_reduce(x.clone()[::2], group=group)
            dist.all_reduce(x[:100].clone(), group=group)
            dist.all_reduce(torch.ones(65536, dtype=torch.int64), group=group)
            dist.all_reduce(x.clone())
            dist.reduce_scatter_tensor(torch.empty(len(x) // world), x.clone(), op=dist.ReduceOp.MAX, group=group)
            dist.all_gather_into_tensor(torch.empty(len(x) * world), x.clone(), group=group, async_op=True).wait()
            assert {k: len(v) for k, v in calls.items()} == routed
        finally:
            _restore(shm_reduce, inner)
        return dict(out=out, routed=routed)
    finally:
        shm_reduce.SEGMENT_BYTES, shm_reduce.MIN_ELEMENTS = saved


def test_two_ranks_get_gloos_bits_in_one_or_many_pieces():
    from parallel import shm_reduce
    # a 2-rank turn holds 8 KiB / 2 = 1024 float32s per slot: 65 536 .. 200 003 elements make
    # 64 .. 196 pieces with an odd last one; float64 has half as many per piece
    sizes = [shm_reduce.MIN_ELEMENTS, 3 * shm_reduce.MIN_ELEMENTS + 7, 200_003]
    results = run_on_ranks(_against_gloo, 2, 16 << 10, sizes, [torch.float32, torch.float64])
    for r in results:
        assert r["routed"] == {"all_reduce_shared": 6, "reduce_scatter_shared": 12, "all_gather_shared": 12}
        for got, want in r["out"]:
            assert torch.equal(got, want)
    for i, ((a, _), (b, _)) in enumerate(zip(results[0]["out"], results[1]["out"])):
        assert torch.equal(a, b) == (i % 5 != 1 and i % 5 != 2)  # a reduce-scatter: each its own row


def test_four_ranks_agree_bit_for_bit_and_with_gloo_to_rounding():
    from parallel import shm_reduce
    results = run_on_ranks(_against_gloo, 4, 1 << 20, [4 * shm_reduce.MIN_ELEMENTS + 3],
                           [torch.float32, torch.bfloat16])
    for r in results:
        for i, (got, want) in enumerate(r["out"]):
            # float32 sums in another order than gloo's (bf16 sums stay on gloo); gathers exact
            tol = 1e-6 if i % 5 < 3 else 0
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for r in results[1:]:  # the all-reduce: one result on every rank
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


def test_the_segment_fits_the_shared_memory_there_is():
    from parallel.shm_reduce import MIN_ELEMENTS, SEGMENT_BYTES, segment_bytes
    assert segment_bytes(24 << 30, 2) == SEGMENT_BYTES  # plenty: the full segment
    assert segment_bytes(64 << 20, 2) == 16 << 20  # docker's default /dev/shm: a quarter of it
    assert segment_bytes(24 << 30, 3) % (2 * 3 * 64) == 0  # slots of whole 64-byte lines
    assert segment_bytes(4 * 4 * 4 * MIN_ELEMENTS, 2) == 4 * 4 * MIN_ELEMENTS  # slots of MIN_ELEMENTS floats
    assert segment_bytes(4 * 4 * 4 * MIN_ELEMENTS - 1024, 2) == 0  # smaller: gloo


def _actor_update(shared, distributed):
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
    meg = dataclasses.replace(actor_cfg.megatron, use_distributed_optimizer=distributed)
    hf = tiny_config("llama")
    worker = ActorWorker(hf, dataclasses.replace(actor_cfg, megatron=meg), model_cfg, response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n, shapes[n]))  # the same start in both runs
    if distributed:
        worker.optimizer.reload_model_params()
    if not shared:
        shm_reduce.forget_all()
    calls, inner = _counting(shm_reduce)
    smallest, shm_reduce.MIN_ELEMENTS = shm_reduce.MIN_ELEMENTS, 1024  # the tiny model's 43 K
    try:
        batch = make_batch(hf.vocab_size, seed=3 + dist.get_rank())  # each rank its own data
        batch["old_log_probs"] = worker.compute_log_prob(batch, micro_batch_size=4)
        worker.update_policy(batch)
    finally:
        _restore(shm_reduce, inner)
        shm_reduce.MIN_ELEMENTS = smallest
    return {k: len(v) for k, v in calls.items()}, {k: v.clone() for k, v in iter_global(worker.chunks, "param")}


@pytest.mark.parametrize("distributed", [False, True], ids=["all-reduce", "distributed-optimizer"])
def test_the_actors_gradient_sync_takes_it_and_updates_as_gloo_does(distributed):
    shared = run_on_ranks(_actor_update, 2, True, distributed)
    gloo = run_on_ranks(_actor_update, 2, False, distributed)
    # megatron-core's gradient sync went through shared memory: DDP's all-reduce, or the
    # distributed optimizer's reduce-scatter and parameter all-gather
    taken = {"reduce_scatter_shared", "all_gather_shared"} if distributed else {"all_reduce_shared"}
    for (calls, params), (gloo_calls, gloo_params) in zip(shared, gloo):
        assert {k for k, n in calls.items() if n} == taken and not any(gloo_calls.values())
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
