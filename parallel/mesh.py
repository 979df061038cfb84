"""torch.distributed + megatron-core parallel_state for a TP/PP/VPP/CP/EP/ETP/DP layout.

The layout is given as plain sizes (the engine maps its config onto `Layout`); this module
knows nothing about PPO. On a machine without CUDA it uses gloo and enables `parallel.cpu`.

The layout rules live here and only here (`Layout.check`): which sizes tile a world, and which
fit a model's shape (Megatron's rules). A broken rule is a `LayoutError` naming the size, its
value and the fix, written with the caller's names for the sizes (the recipe's keys, a tool's
flags); engine/config/layout_check.py turns it into the recipe's one-line message.

Tests: tests/test_mesh_layout.py, tests/test_config.py, tests/test_convert_checkpoint.py,
tests/test_multirank.py
"""
import math
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

    def check(self, world_size: Optional[int] = None, *, num_layers: Optional[int] = None,
              num_experts: Optional[int] = None, num_attention_heads: Optional[int] = None,
              num_query_groups: Optional[int] = None, names: Optional[dict] = None) -> None:
        """Raise LayoutError for the first rule `world_size` ranks (default: self.world_size)
        and the model's shape, where known, break. num_experts: None = unknown, 0 = dense.
        `names`: how the caller calls the sizes (SIZE_NAMES' keys), for the messages."""
        n = dict(SIZE_NAMES, **(names or {}))
        world = self.world_size if world_size is None else world_size

        def fail(size, value, fix):
            raise LayoutError(size, value, fix, n)
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            fail("world_size", world, "must be a positive int (the number of ranks)")
        tp, pp, cp, ep, etp, vpp = self.tp, self.pp, self.cp, self.ep, self.expert_tp, self.vpp
        # TP x PP x CP must divide the world: each size against what the previous ones leave
        left, used = world, []
        for size, value in (("tp", tp), ("pp", pp), ("cp", cp)):
            if left % value:
                given = "".join(f" with {n[k]}={v}" for k, v in used)
                room = f" ({left} ranks left for it)" if used else ""
                fail(size, value, f"does not divide world size {world}{given}{room}; use {divisor_choices(left)}")
            left //= value
            used.append((size, value))
        # Megatron's expert grid (expert-DP x EP x ETP) covers the TP x CP x DP ranks of a PP stage
        stage = world // pp
        if stage % etp:
            fail("etp", etp, f"does not divide world size {world} / {n['pp']} {pp} = {stage} ranks per "
                 f"stage; use {divisor_choices(stage)}")
        if stage % (ep * etp):
            fail("ep", ep, f"{n['ep']} x {n['etp']} = {ep} x {etp} must divide world size {world} / "
                 f"{n['pp']} {pp} = {stage}; use {n['ep']} {divisor_choices(stage // etp)}")
        if vpp is not None:
            if pp < 2:
                fail("vpp", vpp, f"interleaving needs {n['pp']} > 1; set it to null or raise PP")
            if num_layers is not None and num_layers % (pp * vpp):
                fail("vpp", vpp, f"the model's {num_layers} layers do not split into {n['pp']} {pp} x "
                     f"{vpp} chunks; choose PP x VPP dividing {num_layers}")
        # TP divides the attention heads; the key/value groups are a multiple or a divisor of TP
        if num_attention_heads is not None and num_attention_heads % tp:
            fail("tp", tp, f"must divide the model's {num_attention_heads} attention heads (each "
                 f"tensor-parallel rank holds whole heads); use "
                 f"{divisor_choices(math.gcd(num_attention_heads, world))}")
        if num_query_groups is not None and num_query_groups % tp and tp % num_query_groups:
            fail("tp", tp, f"must be a multiple or a divisor of the model's {num_query_groups} key/value "
                 f"heads; use {divisor_choices(math.gcd(num_query_groups, world))}")
        if num_layers is not None and num_layers % pp:
            fail("pp", pp, f"the model's {num_layers} layers do not split evenly over {pp} stages; use a "
                 f"divisor of {num_layers} that divides world size {world}")
        if num_experts is not None:
            if num_experts == 0 and ep > 1:
                fail("ep", ep, "the model is dense (no experts); set it to 1")
            if num_experts > 0 and num_experts % ep:
                fail("ep", ep, f"must divide the model's {num_experts} experts; use a divisor of {num_experts}")
        if self.sequence_parallel and tp < 2:
            fail("sequence_parallel", True, f"needs {n['tp']} > 1 (it is {tp}); set "
                 f"{n['sequence_parallel']}=false or raise TP")
        if num_experts and tp > 1 and not self.sequence_parallel:
            fail("sequence_parallel", self.sequence_parallel, f"an MoE model ({num_experts} experts) with "
                 f"{n['tp']}={tp} needs sequence parallelism in Megatron; set {n['sequence_parallel']}=true")


# The sizes' names in LayoutError messages unless the caller passes its own (Layout.check's names).
SIZE_NAMES = {"world_size": "world_size", "tp": "tp", "pp": "pp", "vpp": "vpp", "cp": "cp", "ep": "ep",
              "etp": "etp", "sequence_parallel": "sequence_parallel"}


class LayoutError(ValueError):
    """A layout rule broken: `size` (a SIZE_NAMES key) has `value`; `fix` says what to do,
    in the caller's names. str(): '<name>=<value>: <fix>'."""

    def __init__(self, size: str, value, fix: str, names: Optional[dict] = None):
        self.size, self.value, self.fix = size, value, fix
        super().__init__(f"{dict(SIZE_NAMES, **(names or {}))[size]}={value!r}: {fix}")


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def divisor_choices(n: int) -> str:
    """The divisors of n as a choice: '1', '1 or 2', '1, 2 or 4'."""
    ds = [str(d) for d in divisors(n)]
    return ds[0] if len(ds) == 1 else ", ".join(ds[:-1]) + " or " + ds[-1]


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


# Joining the world waits for the slowest rank's start (imports, tokenizer, data: tens of seconds
# on a loaded machine), so it gets at least this long; the collectives after it get the run's
# collective timeout, however short (a hang is then found in seconds, not after the start's slack)
RENDEZVOUS_TIMEOUT_S = 300.0


def init_distributed(timeout_s: float = 600.0, ranks: Optional[range] = None, name: str = "world"):
    """Initialise torch.distributed from torchrun's environment (or as a single process).
    Joining waits up to max(`timeout_s`, RENDEZVOUS_TIMEOUT_S); every collective, `timeout_s`.

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
    join = max(timeout_s, RENDEZVOUS_TIMEOUT_S)
    dist.init_process_group(backend, timeout=timedelta(seconds=join))
    if join > timeout_s:
        # torch has no public setter; this one (torch >= 2.2) sets the default group's backends
        from torch.distributed.distributed_c10d import _set_pg_timeout
        _set_pg_timeout(timedelta(seconds=timeout_s))


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
    if not torch.cuda.is_available():
        # megatron-core's gradient sync (DDP over data x context parallel ranks) through shared
        # memory when the group's ranks share a host, not gloo's loopback TCP
        from parallel import shm_reduce
        shm_reduce.register(ps.get_data_parallel_group(with_context_parallel=True))
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
        # groups destroy_model_parallel leaves referenced (megatron-core 0.16's parallel_state.py):
        # each would keep its gloo threads alive
        for name, empty in (("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", None),
                            ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO", None),
                            ("_HYBRID_DP_CP_GROUPS", {})):
            if hasattr(ps, name):
                setattr(ps, name, empty)
    rope = sys.modules.get("megatron.core.models.common.embeddings.rotary_pos_embedding")
    if rope is not None and hasattr(rope.RotaryEmbedding.forward, "cache_clear"):
        # an lru_cache on the method: it keeps its last 32 modules (and their CP group) alive
        rope.RotaryEmbedding.forward.cache_clear()
    if "torch.distributed.tensor" in sys.modules:
        # DTensor caches sharding results by mesh *value*: a later mesh over the same ranks
        # (a new layout in this process: tests) would reuse outputs naming destroyed groups
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
        _clear_sharding_prop_cache()
        _redistribute._gen_transform_infos.cache_clear()
    if "parallel.shm_reduce" in sys.modules:
        sys.modules["parallel.shm_reduce"].forget_all()
    if dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
