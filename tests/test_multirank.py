"""The multi-rank harness itself: results come back per rank, a hang fails fast."""
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
    multirank._POOLS.pop(1).close()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the worker's child outlived the pool"
        time.sleep(0.1)
