"""Run a test function on N gloo ranks, with worker processes shared across the test session.

Importing torch + megatron costs seconds per process, so one pool of worker processes is
spawned per world size and kept for the whole pytest session; each call ships a module-level
function (pickled by reference) to every rank and returns the per-rank results. Every call
has a hard timeout: a hung collective kills the pool and fails the test instead of hanging CI.

    from tests.multirank import run_on_ranks
    results = run_on_ranks(my_fn, 2, arg1, kw=...)   # [result_rank0, result_rank1]

Inside `my_fn`, torch.distributed is already initialised (gloo, `world_size` ranks) and
megatron's model-parallel state is reset before each call.
"""
import atexit
import multiprocessing as mp
# imported before our atexit hook is registered: its own exit hook joins non-daemon children,
# so it must run after ours (atexit is last-in, first-out) or an idle pool blocks the exit
import multiprocessing.util  # noqa: F401
import os
import socket
import traceback
from datetime import timedelta

DEFAULT_TIMEOUT_S = float(os.environ.get("TRIDENT_TEST_TIMEOUT", "240"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank, world_size, port, inbox, outbox):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    import gc
    import queue
    parent = os.getppid()
    while True:
        try:
            job = inbox.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test session died: do not linger
                break
            continue
        if job is None:
            break
        fn, args, kwargs = job
        try:
            _reset_model_parallel()
            result = ("ok", fn(*args, **kwargs))
        except BaseException:  # report everything, the parent raises it
            result = ("error", traceback.format_exc())
        try:
            _reset_model_parallel()
        except BaseException:
            pass
        outbox.put(result)
    gc.unfreeze()  # the exit's last collection finalises native objects (nanobind reports any it misses)
    dist.destroy_process_group()


def _reset_model_parallel():
    import gc

    from parallel.mesh import destroy_mesh
    destroy_mesh()  # every group of the last call, with its gloo threads
    gc.collect()
    release_wrappers()
    gc.collect()
    # what survives (imports, caches: ~500k objects) stays for the session: frozen, the next
    # call's collections (this one, return_to_device's per phase) skip it, ~0.3 s CPU each
    gc.freeze()


def release_wrappers():
    """Empty every Megatron DDP wrapper the last call left behind. DDP hooks each parameter's
    gradient accumulator with a closure over the wrapper (megatron/core/distributed/
    distributed_data_parallel.py, `_make_backward_post_hook`); the accumulator is a C++ autograd
    node, so the collector cannot see that cycle and the model outlives the call, with its
    process groups and their gloo threads, each waking every 10 ms while idle
    (gloo/transport/tcp/loop.cc): ~16 threads a rank per MoE layout. Emptying the wrapper drops
    the model and its groups; the wrapper shell itself stays (a few hundred bytes)."""
    import gc
    import sys
    ddp = sys.modules.get("megatron.core.distributed.distributed_data_parallel")
    if ddp is None:
        return 0
    # by type: isinstance reads __class__, which warns on torch's deprecated aliases
    wrappers = [o for o in gc.get_objects() if issubclass(type(o), ddp.DistributedDataParallel)]
    for w in wrappers:
        w.__dict__.clear()
    return len(wrappers)


class _Pool:
    def __init__(self, world_size):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        port = _free_port()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.outboxes = [ctx.Queue() for _ in range(world_size)]
        # Not daemons: megatron's checkpoint writer starts processes of its own, which daemonic
        # processes may not. Workers exit when the session closes them or when it dies.
        self.procs = [ctx.Process(target=_worker_main, daemon=False,
                                  args=(r, world_size, port, self.inboxes[r], self.outboxes[r]))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, args, kwargs, timeout):
        import queue
        import time
        for box in self.inboxes:
            box.put((fn, args, kwargs))
        results, deadline = [], time.monotonic() + timeout
        for rank, box in enumerate(self.outboxes):
            while True:
                try:
                    results.append(box.get(timeout=max(0.1, min(5.0, deadline - time.monotonic()))))
                    break
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        why = f"rank(s) {dead} died" if dead else f"timed out after {timeout:.0f}s"
                        raise TimeoutError(f"{fn.__name__} on {self.world_size} ranks: {why} "
                                           f"(waiting for rank {rank})")
        errors = [f"--- rank {r} ---\n{v}" for r, (kind, v) in enumerate(results) if kind == "error"]
        if errors:
            raise RuntimeError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [v for _, v in results]

    def close(self, graceful=True):
        # processes the workers started (megatron's checkpoint writer keeps a multiprocessing
        # Manager) would outlive a killed worker as orphans: note them first, end them last
        children = self._descendants()
        for p, box in zip(self.procs, self.inboxes):
            if graceful and p.is_alive():
                box.put(None)
        for p in self.procs:
            p.join(timeout=5 if graceful else 0.1)
            if p.is_alive():
                p.kill()
        for child in children:
            try:
                child.kill()
            except Exception:  # already gone
                pass

    def _descendants(self):
        import psutil
        found = []
        for p in self.procs:
            try:
                found += psutil.Process(p.pid).children(recursive=True)
            except psutil.Error:
                pass
        return found


POOLS = {}


def run_on_ranks(fn, world_size, *args, timeout=DEFAULT_TIMEOUT_S, **kwargs):
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the list of results."""
    pool = POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(graceful=False)
        pool = POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except TimeoutError:
        pool.close(graceful=False)  # a rank may be stuck in a collective: start afresh next time
        POOLS.pop(world_size, None)
        raise
    except RuntimeError:
        # ranks finished (with an error) but collectives may now be out of step: restart them
        pool.close(graceful=False)
        POOLS.pop(world_size, None)
        raise


@atexit.register
def _close_all():
    for pool in POOLS.values():
        pool.close()
    POOLS.clear()


def in_fresh_process(fn, *args, timeout=DEFAULT_TIMEOUT_S):
    """fn(*args) in a new interpreter of its own (spawned, no process group), for what is
    process-wide and must start untouched: the C allocator's policy, resident memory."""
    import concurrent.futures

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)
