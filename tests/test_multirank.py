"""The multi-rank harness itself: results come back per rank, a hang fails fast."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.multirank import run_on_ranks


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _rank1_never_joins():
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never arrives
    else:
        time.sleep(30)


def _raise_on_rank0():
    if dist.get_rank() == 0:
        raise ValueError("boom on rank 0")
    return "fine"


def test_results_come_back_per_rank():
    assert run_on_ranks(_all_reduce_rank, 2) == [(0, 3.0), (1, 3.0)]


def test_hung_collective_times_out():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out"):
        run_on_ranks(_rank1_never_joins, 2, timeout=5)
    assert time.monotonic() - t0 < 20
    # the pool is rebuilt and works again
    assert run_on_ranks(_all_reduce_rank, 2)[1] == (1, 3.0)


def test_error_names_the_rank():
    with pytest.raises(RuntimeError, match="(?s)rank 0.*boom on rank 0"):
        run_on_ranks(_raise_on_rank0, 2)


def _start_lingering_child():
    import multiprocessing as mp
    child = mp.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=False)
    child.start()
    return child.pid


def test_closing_a_pool_ends_the_processes_its_workers_started():
    import psutil

    from tests import multirank
    pid = run_on_ranks(_start_lingering_child, 1)[0]
    assert psutil.pid_exists(pid)
    multirank.POOLS.pop(1).close()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the worker's child outlived the pool"
        time.sleep(0.1)


def _layouts_then_census(n):
    from parallel.mesh import Layout, destroy_mesh, init_mesh
    for tp in [2, 1] * n:  # a re-initialised mesh, then destroyed: what the harness does per test
        init_mesh(Layout(tp=tp))
    destroy_mesh()
    return len(dist.distributed_c10d._world.pg_map), len(os.listdir(f"/proc/{os.getpid()}/task"))


def test_a_layout_leaves_no_process_groups_or_threads_behind():
    # megatron's destroy alone left 17 gloo groups (~50 threads) per 2-rank layout in the process
    first = run_on_ranks(_layouts_then_census, 2, 1)
    again = run_on_ranks(_layouts_then_census, 2, 4)
    for (groups, threads), (groups_after, threads_after) in zip(first, again):
        assert groups == groups_after == 1  # the default group only
        assert threads_after <= threads + 2, (threads, threads_after)


def _gloo_threads():
    return sum("gloo_tcp_loop" in open(f"/proc/self/task/{t}/comm").read()
               for t in os.listdir("/proc/self/task"))


def _build_moe_model_and_step():
    """What a layout test leaves: a MoE model under EP 2 in Megatron's DDP, one forward (the
    rotary cache) and backward (the DDP hooks). Returns this rank's gloo loop threads."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from engine.models.builder import build_model
    from parallel.mesh import Layout, init_mesh
    from tests.tiny_models import tiny_config
    init_mesh(Layout(ep=2), seed=1)
    hf = tiny_config("qwen2_moe")
    cfg = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
    chunk = build_model(hf)[0]
    model = DistributedDataParallel(chunk.config, cfg, chunk)
    ids = torch.randint(0, hf.vocab_size, (2, 8))
    model(ids, torch.arange(8).expand_as(ids), None).float().sum().backward()
    return _gloo_threads()


def test_the_harness_releases_a_calls_models_and_their_groups():
    # Megatron's DDP hooks (a cycle through C++ autograd nodes) and RotaryEmbedding.forward's
    # lru_cache kept every call's model and process groups alive: ~16 gloo threads a rank per
    # MoE call, each waking every 10 ms for the rest of the session
    run_on_ranks(_build_moe_model_and_step, 2)
    before = run_on_ranks(_gloo_threads, 2)
    for _ in range(3):
        during = run_on_ranks(_build_moe_model_and_step, 2)
    after = run_on_ranks(_gloo_threads, 2)
    assert all(d > a for d, a in zip(during, after)), (during, after)  # the call had groups
    assert after == before, (before, after)


RENDEZVOUS_PROBE = r"""
import os, sys, time
from datetime import timedelta
rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(3.0)  # joins 3 s late: past the 1 s collective timeout, within the rendezvous's
import torch.distributed as dist
from parallel.mesh import init_distributed
start = time.monotonic()
init_distributed(timeout_s=1.0)
joined = time.monotonic() - start
if rank == 1:
    time.sleep(20)  # never reaches the barrier
    os._exit(0)
start = time.monotonic()
try:
    dist.barrier()
    print("barrier passed", flush=True)
except Exception as e:
    print(f"joined {joined:.2f} failed {time.monotonic() - start:.2f} {type(e).__name__}", flush=True)
os._exit(0)
"""


def test_joining_waits_for_a_late_rank_and_a_collective_times_out_after_its_own_timeout(tmp_path):
    """parallel.mesh.init_distributed: the late rank's join is waited for (past the 1 s collective
    timeout), and then a collective a peer never enters fails after ~1 s, not the join's 300 s."""
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-c", RENDEZVOUS_PROBE], cwd=root, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", RANK=str(r),
                                       WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in (0, 1)]
    try:
        out = procs[0].communicate(timeout=30)[0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    line = [ln for ln in out.splitlines() if ln.startswith(("joined", "barrier"))]
    assert line, out[-2000:]
    _, joined, _, failed, _ = line[-1].split()
    assert float(joined) > 1.5  # rank 0 waited for the late rank beyond the collective timeout
    assert float(failed) < 10  # the barrier gave up at the collective timeout (1 s + slack)
