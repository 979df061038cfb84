"""torch.distributed + megatron-core parallel_state for a TP/PP/VPP/CP/EP/ETP/DP layout.

The layout is given as plain sizes (the engine maps its config onto `Layout`); this module
knows nothing about PPO. On a machine without CUDA it uses gloo and enables `parallel.cpu`.
"""
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """The one layout object of a run (engine.config.derive makes it from the recipe)."""
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None  # model chunks per pipeline rank (interleaved schedule)
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel; None = same as tp (megatron's default)
    sequence_parallel: bool = False
    world_size: Optional[int] = None  # known once ranks are counted; dp and expert_dp need it

    @property
    def expert_tp(self):
        return self.tp if self.etp is None else self.etp

    def _world(self):
        if self.world_size is None:
            raise ValueError("this Layout has no world_size: data-parallel sizes depend on it")
        return self.world_size

    @property
    def dp(self):
        """world / (TP x PP x CP)"""
        return self._world() // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self):
        """world / (PP x EP x expert TP)"""
        return self._world() // (self.pp * self.ep * self.expert_tp)

    def check(self, world_size):
        """One clear error for a layout that cannot tile `world_size` ranks."""
        model = self.tp * self.pp * self.cp
        if world_size % model:
            raise ValueError(f"layout tp={self.tp} x pp={self.pp} x cp={self.cp} = {model} does not "
                             f"divide the world size {world_size}; choose sizes whose product divides it")
        if (world_size // self.pp) % (self.ep * self.expert_tp):
            raise ValueError(f"expert layout ep={self.ep} x etp={self.expert_tp} does not divide the "
                             f"{world_size // self.pp} ranks of a pipeline stage; lower ep or etp")
        if self.vpp is not None and self.vpp > 1 and self.pp < 2:
            raise ValueError(f"virtual pipeline size {self.vpp} needs pp > 1 (pp={self.pp}); unset vpp")
        if self.sequence_parallel and self.tp < 2:
            raise ValueError("sequence_parallel=True needs tp > 1; set sequence_parallel=False")


def device_type():
    return "cuda" if torch.cuda.is_available() else "cpu"


def node_address(environ=os.environ) -> str:
    """This node's IPv4 address as the other nodes reach it (where a rollout engine's or a
    weight-update group's peers meet): the interface that routes to the rendezvous host
    MASTER_ADDR. The hostname's own entry is no use across nodes: /etc/hosts often maps it to
    127.0.1.1 (or 127.0.0.1)."""
    import socket
    master = environ.get("MASTER_ADDR")
    if master:
        try:  # a UDP connect only picks the route and the source address; nothing is sent
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(environ.get("MASTER_PORT", "29500"))))
                return s.getsockname()[0]
        except OSError:  # not an IPv4 host, or no route: the hostname's entry
            pass
    return socket.gethostbyname(socket.gethostname())


_LAUNCH_STORE = []


def launch_store(timeout_s: float = 600.0):
    """The key-value store every launched rank reaches: torchrun's own (agent store), else one
    rank 0 serves at MASTER_ADDR:MASTER_PORT. Created once per process."""
    if not _LAUNCH_STORE:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        _LAUNCH_STORE.append(dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                           int(os.environ.get("MASTER_PORT", "29500")), world,
                                           is_master=not agent and rank == 0, timeout=timedelta(seconds=timeout_s)))
    return _LAUNCH_STORE[0]


def init_distributed(timeout_s: float = 600.0, ranks: Optional[range] = None, name: str = "world"):
    """Initialise torch.distributed from torchrun's environment (or as a single process).

    `ranks`: only these of the launched ranks form the world (this rank must be one of them),
    meeting under `name` in the launch store (a separate rollout pool trains on some ranks and
    generates on the others: two worlds, engine/rollout/pool.py bridges them)."""
    if dist.is_initialized():
        return
    if ranks is not None:
        rank = int(os.environ["RANK"])
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                store=dist.PrefixStore(f"trident-{name}/", launch_store(timeout_s)),
                                rank=rank - ranks.start, world_size=len(ranks),
                                timeout=timedelta(seconds=timeout_s))
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # NCCL for device tensors; gloo for the CPU tensors the trainer reduces (metrics, counts)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def init_mesh(layout: Layout, seed: int = 1234, timeout_s: float = 600.0):
    """Initialise megatron's model-parallel groups for `layout` and seed its RNG tracker."""
    init_distributed(timeout_s)
    layout.check(dist.get_world_size())
    if not torch.cuda.is_available():
        from parallel import cpu
        cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():  # a second layout in this process (tests, tools)
        destroy_mesh()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if (layout.vpp or 1) > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        distributed_timeout_minutes=timeout_s / 60,  # a timedelta: fractions of a minute are fine
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(seed)
    return layout


def destroy_mesh():
    """Forget megatron's groups and destroy every process group but the default one: megatron's
    destroy only drops its references, c10d keeps each group registered, and each gloo group
    keeps its threads (about 3 per group; 17 groups per 2-rank layout) for the process's life."""
    import sys
    if "megatron.core.parallel_state" in sys.modules:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    if dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
