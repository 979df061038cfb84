"""Test double of how SGLang's ``Engine`` starts its scheduler processes, and of the arguments
it refuses.

Mirrors sglang/srt/entrypoints/engine.py: ``_set_envs_and_config`` (multiprocessing "spawn"),
``_launch_scheduler_processes`` (one process per TP rank of this node, on GPU
``base_gpu_id + tp_rank % tp_per_node``; a child inherits the environment as it is at
``proc.start()``), ``_calculate_rank_ranges`` (a node's TP ranks) and
``_wait_for_scheduler_ready`` (each pipe answers ``{"status": "ready"}``, a dead or failed child
raises). The TP world meets where sglang/srt/distributed/bootstrap.py
``_resolve_dist_init_method`` says: ``tcp://<dist_init_addr>``, else ``tcp://127.0.0.1:<a free
port>`` (sglang's ``PortArgs.nccl_port``).

Refused, as the real engine fails on them: a keyword that is no ServerArgs field (sglang.Engine
turns its **kwargs into the ServerArgs dataclass, sglang/srt/entrypoints/engine.py: TypeError; the
double knows the fields Trident's USED_API lists, each checked against the pinned wheel by
tests/test_sglang_contract.py, so a name sent but not listed fails here and a listed name the wheel
lacks fails there); (sglang/srt/arg_groups/validation_hook.py,
torch.cuda.set_device in the scheduler, the models' ``total_num_heads % tp_size`` asserts): a
GPU beyond this node, tp_size not split evenly over nnodes, a node_rank outside nnodes, several
nodes without dist_init_addr, attention heads that do not divide over tp_size.
"""
import contextlib
import json
import multiprocessing
import os
import socket
import time

# the bound on a TP rank's rendezvous (seconds); real sglang's is ServerArgs.dist_timeout
TIMEOUT_ENV = "TRIDENT_FAKE_SGLANG_DIST_TIMEOUT_S"


def node_gpus(environ=os.environ) -> int:
    """The GPUs this node offers an engine: CUDA_VISIBLE_DEVICES where set, else one per process
    torchrun started here (LOCAL_WORLD_SIZE; a colocated run has one GPU per rank), else WORLD_SIZE."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return len([d for d in visible.split(",") if d.strip()])
    return int(environ.get("LOCAL_WORLD_SIZE") or environ.get("WORLD_SIZE") or "1")


def rank_range(tp_size: int, nnodes: int, node_rank: int) -> range:
    """This node's TP ranks (``_calculate_rank_ranges`` with pp_size 1)."""
    per_node = tp_size // nnodes
    return range(per_node * node_rank, per_node * (node_rank + 1))


def check_arguments(kwargs: dict, environ=os.environ) -> None:
    from engine.rollout.sglang import USED_API
    unknown = sorted(set(kwargs) - set(USED_API["ServerArgs"]))
    if unknown:
        raise TypeError(f"ServerArgs.__init__() got an unexpected keyword argument {unknown[0]!r}")
    tp, nnodes, node_rank = kwargs.get("tp_size", 1), kwargs.get("nnodes", 1), kwargs.get("node_rank", 0)
    base = kwargs.get("base_gpu_id", 0)
    for key, value, low in (("tp_size", tp, 1), ("nnodes", nnodes, 1), ("base_gpu_id", base, 0),
                            ("node_rank", node_rank, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"ServerArgs.{key}={value!r}: must be an integer >= {low}")
    if tp % nnodes:
        raise ValueError(f"tp_size={tp} does not split over nnodes={nnodes}: every node runs tp_size / nnodes ranks")
    if node_rank >= nnodes:
        raise ValueError(f"node_rank={node_rank} with nnodes={nnodes}: node ranks are 0..{nnodes - 1}")
    if nnodes > 1 and not kwargs.get("dist_init_addr"):
        raise ValueError(f"nnodes={nnodes} needs dist_init_addr (host:port where the nodes' ranks meet)")
    gpus, last = node_gpus(environ), base + tp // nnodes - 1
    if last >= gpus:
        raise ValueError(f"base_gpu_id={base} + {tp // nnodes} TP rank(s) per node needs GPU {last}, "
                         f"but this node has {gpus} (GPUs 0..{gpus - 1}: CUDA_VISIBLE_DEVICES, else "
                         f"torchrun's LOCAL_WORLD_SIZE)")
    config_file = os.path.join(str(kwargs.get("model_path", "")), "config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            heads = json.load(f).get("num_attention_heads")
        if heads and heads % tp:
            raise ValueError(f"num_attention_heads={heads} of {config_file} is not divisible by tp_size={tp}")


def dist_init_method(kwargs: dict) -> str:
    if kwargs.get("dist_init_addr"):
        return f"tcp://{kwargs['dist_init_addr']}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def launch_scheduler_processes(kwargs: dict, environ=os.environ):
    """Start this node's TP ranks; returns [(connection, process, info)] once each is ready."""
    check_arguments(kwargs, environ)
    tp, nnodes, node_rank = kwargs.get("tp_size", 1), kwargs.get("nnodes", 1), kwargs.get("node_rank", 0)
    timeout_s = float(environ.get(TIMEOUT_ENV, "60"))
    method, ctx = dist_init_method(kwargs), multiprocessing.get_context("spawn")
    procs = []
    for tp_rank in rank_range(tp, nnodes, node_rank):
        ours, theirs = ctx.Pipe()
        gpu_id = kwargs.get("base_gpu_id", 0) + tp_rank % (tp // nnodes)
        proc = ctx.Process(target=_target(), args=(theirs, method, tp, tp_rank, gpu_id, timeout_s), daemon=True)
        proc.start()
        procs.append((ours, proc))
    try:
        infos = _wait_for_ready(procs, deadline=time.monotonic() + timeout_s + 300)  # + imports
    except BaseException:
        shutdown(procs)
        raise
    return [(conn, proc, info) for (conn, proc), info in zip(procs, infos)]


def _target():
    from sglang.srt.managers.scheduler import run_scheduler_process
    return run_scheduler_process


def _wait_for_ready(procs, deadline):
    infos = []
    for tp_rank, (conn, proc) in enumerate(procs):
        while not conn.poll(timeout=1.0):
            for i, (other, p) in enumerate(procs):
                if not p.is_alive() and not other.poll():  # died without a word (e.g. killed)
                    raise RuntimeError(f"scheduler process {i} died during initialization "
                                       f"(exit code {p.exitcode})")
                if i != tp_rank and not p.is_alive():
                    _status(other)  # a sibling that failed says why
            if time.monotonic() > deadline:
                raise RuntimeError(f"scheduler process {tp_rank} sent no status before the deadline")
        infos.append(_status(conn))
    return infos


def _status(conn):
    data = conn.recv()
    if data["status"] != "ready":
        raise RuntimeError(f"Initialization failed: {data['message']}")
    return data


def shutdown(procs):
    for conn, proc, *_ in procs:
        if proc.is_alive():
            try:
                conn.send(None)
            except OSError:
                pass
    for conn, proc, *_ in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


@contextlib.contextmanager
def as_started(environ_at_start: dict):
    """Processes the double starts later for its schedulers (the weight-update group's workers:
    in real sglang the scheduler processes themselves join it) get the environment the
    schedulers started with."""
    now = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ_at_start)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(now)
