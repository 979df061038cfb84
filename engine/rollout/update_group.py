"""The weight-update group of a separate SGLang pool: one training rank + the TP workers of the
engines it feeds, set up once; every bucket then goes from that training rank straight into the
engines' GPUs (NCCL broadcast, rank 0 is the sender).

SGLang's workers join with ``Engine.init_weights_update_group``: a TCP rendezvous at the sender's
address, a store prefixed with the group's name, and torch's process-group constructor, at rank
``rank_offset + tp_rank``. The sender must build its end the same way (the same store keys), so
this file calls the same torch functions; each is listed in ``TORCH_API`` and
tests/test_sglang_contract.py checks them against the installed torch and against what sglang's
own ``init_custom_process_group`` calls.

Assignment: engine g of G is fed by training rank g * T // G (spread over the training ranks,
hence over their nodes); a training rank feeding several engines reaches them all with one
broadcast, engine k of its group joining at rank_offset 1 + the TP sizes of the engines before it.

Tests: tests/test_rollout_pool.py, tests/test_sglang_contract.py, tests/gpu/test_update_group_gpu.py
"""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel.mesh import node_address

# torch.distributed names used to build the sender's end (as sglang builds the workers' end)
TORCH_API = {
    "torch.distributed": ["TCPStore", "PrefixStore", "broadcast", "destroy_process_group"],
    "torch.distributed.distributed_c10d": ["_new_process_group_helper", "_world", "Backend"],
    # keyword parameters of _new_process_group_helper passed here
    "_new_process_group_helper": ["group_size", "group_rank", "global_ranks_in_group", "backend", "store",
                                  "group_name", "backend_options", "timeout"],
}


# read by torch's tcp:// rendezvous (torch/distributed/rendezvous.py), which sglang's workers use
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def feeder(index: int, count: int, senders: int) -> int:
    """The training rank that feeds item `index` of `count` (an engine, or a pool rank)."""
    return index * senders // count


@dataclass(frozen=True)
class UpdateGroup:
    """One training rank's group: its name, size and the engines' (leader, rank_offset)."""
    sender: int
    name: str
    world_size: int
    engines: tuple  # ((leader bridge rank, rank_offset), ...)


def update_groups(leaders, tps, senders: int) -> list[UpdateGroup]:
    """The update groups of a pool whose engines have these leaders (bridge ranks) and TP sizes."""
    out = []
    for j in range(senders):
        mine = [g for g in range(len(leaders)) if feeder(g, len(leaders), senders) == j]
        if not mine:
            continue
        engines, offset = [], 1
        for g in mine:
            engines.append((leaders[g], offset))
            offset += tps[g]
        out.append(UpdateGroup(sender=j, name=f"trident-weights-{j}", world_size=offset, engines=tuple(engines)))
    return out


def sender_address() -> tuple[str, int]:
    """This node's address (as the pool's nodes reach it) and a free port for the rendezvous."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return node_address(), port


def open_as_sender(address: str, port: int, world_size: int, name: str, backend: str, timeout_s: float):
    """Rank 0 of the group (blocks until every engine worker has joined). The training world must
    not be bound to a device (parallel.mesh passes no device_id), or torch would try to split this
    group from it."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world
    timeout = timedelta(seconds=timeout_s)
    # the workers' tcp:// rendezvous connects as clients; rank 0 hosts the store (what torch's
    # rendezvous does for rank 0 outside torchrun; under torchrun it would expect the agent's)
    try:
        store = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, multi_tenant=True)
    except RuntimeError as e:  # torch's DistStoreError: not every worker came
        raise RuntimeError(
            f"weight-update group {name}: waited {timeout_s:.0f} s at {address}:{port} for "
            f"{world_size - 1} SGLang TP worker(s) ({e}). The pool's nodes must reach this address "
            "(the interface routing to MASTER_ADDR); trainer.collective_timeout_s is the wait") from e
    pg, _ = _new_process_group_helper(group_size=world_size, group_rank=0, global_ranks_in_group=[],
                                      backend=Backend(backend), store=dist.PrefixStore(name, store),
                                      group_name=name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank == "global" rank here
    return pg


@contextmanager
def engine_environment(environ=os.environ):
    """The environment an SGLang engine is built in: without torchrun's
    TORCHELASTIC_USE_AGENT_STORE. The engine's scheduler processes inherit the environment as it
    is when they start; with it, torch's tcp:// rendezvous (their TP group, the weight-update
    group) would wait for a store hosted by torchrun's agent instead of hosting or reaching its
    own. Restored afterwards: this process keeps torchrun's setting for its own rendezvous."""
    saved = environ.pop(AGENT_STORE_ENV, None)
    try:
        yield
    finally:
        if saved is not None:
            environ[AGENT_STORE_ENV] = saved


def broadcast_bucket(pg, named_tensors) -> int:
    """Send one bucket, tensor by tensor in manifest order (what sglang's workers receive); the
    tensors stay alive until every broadcast has completed. Returns the bytes sent."""
    works, sent = [], 0
    for _, t in named_tensors:
        t = t.detach().contiguous()
        works.append((dist.broadcast(t, src=0, group=pg, async_op=True), t))
        sent += t.numel() * t.element_size()
    for work, _ in works:
        work.wait()
    return sent


def manifest(named_tensors) -> dict:
    """update_weights_from_distributed's description of a bucket."""
    return dict(names=[n for n, _ in named_tensors],
                dtypes=[str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
                shapes=[list(t.shape) for _, t in named_tensors])


def backend_for(tensor_device: torch.device) -> str:
    """NCCL for GPU tensors; gloo on CPU (the test double's workers)."""
    return "nccl" if tensor_device.type == "cuda" else "gloo"
