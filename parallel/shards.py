"""Where each local parameter sits in the global (unpartitioned) Megatron model.

Every parameter of this rank's model chunks is described by a `Shard`: its *global name* (the
name it has in a single-process model: global layer and expert indices) and how the local
tensor is cut out of the global one (split dimension, piece index, piece count, and whether it
is a gated fc1 whose gate and up halves are split separately). Loading, resharding, checkpoint
conversion and the layout tests all go through this one description.

Model-agnostic: it reads only Megatron's own module attributes (`layer_number`,
`local_expert_indices`, `tensor_model_parallel`, `partition_dim`).

Tests: tests/test_layouts.py, tests/test_reshard.py, tests/test_ppo_update.py
"""
import re
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from parallel import fsdp

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")
# a gated fc1's rows are [gate; up]; so are the rows of a LoRA B on it (lora_B.weight)
_GATED_FC1 = re.compile(r"(^|\.)(mlp|shared_experts|local_experts\.\d+)\.linear_fc1\."
                        r"(weight|bias|lora_B\.weight)$")


@dataclass(frozen=True)
class Shard:
    local_name: str
    global_name: str
    global_shape: Tuple[int, ...]
    dim: Optional[int] = None      # split dimension; None = replicated over the TP group
    index: int = 0                 # this rank's piece
    count: int = 1                 # number of pieces
    expert: bool = False           # expert parameter: TP group is the expert-TP group
    gated: bool = False            # [gate; up] rows, each split into `count` pieces

    def take(self, full):
        """This rank's piece of `full` (a tensor, or anything sliceable like safetensors')."""
        if self.dim is None or self.count == 1:
            return full[...] if not isinstance(full, torch.Tensor) else full
        size = self.global_shape[self.dim]
        if self.gated:
            half, piece = size // 2, size // 2 // self.count
            parts = [_slice(full, self.dim, start + self.index * piece, piece)
                     for start in (0, half)]
            return torch.cat(parts, dim=self.dim)
        piece = size // self.count
        return _slice(full, self.dim, self.index * piece, piece)

    def assemble(self, pieces: List[torch.Tensor]) -> torch.Tensor:
        """The global tensor from all ranks' pieces, in rank order."""
        if self.dim is None or self.count == 1:
            return pieces[0]
        if self.gated:
            halves = [p.chunk(2, dim=self.dim) for p in pieces]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=self.dim)
        return torch.cat(pieces, dim=self.dim)


def _slice(full, dim, start, length):
    index = [slice(None)] * len(full.shape if hasattr(full, "shape") else full.get_shape())
    index[dim] = slice(start, start + length)
    out = full[tuple(index)]
    return out if isinstance(out, torch.Tensor) else torch.as_tensor(out)


def _module_at(model, dotted):
    mod = model
    for part in dotted.split("."):
        mod = getattr(mod, part) if not part.isdigit() else mod[int(part)]
    return mod


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder") and not hasattr(model, "embedding"):
        model = model.module
    return model


def local_shards(chunks) -> List[Tuple[torch.nn.Parameter, Shard]]:
    """(parameter, Shard) for every parameter of this rank's model chunks."""
    from megatron.core import parallel_state as ps

    tp_size, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    etp_size = ps.get_expert_tensor_parallel_world_size()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    out = []
    for chunk in chunks:
        model = _unwrap(chunk)
        tied = getattr(model, "share_embeddings_and_output_weights", False)
        for name, param in model.named_parameters():
            global_name = name
            m = _LAYER.match(name)
            if m:
                layer = _module_at(model, f"{m.group(1)}{m.group(2)}")
                global_name = f"{m.group(1)}{layer.layer_number - 1}{m.group(3)}"
                local_e, e = _LOCAL_EXPERT.match(name), _LOCAL_EXPERT.match(global_name)
                if e:
                    # the MoE module is found by its local name; only the name changes
                    moe = _module_at(model, local_e.group(1)[: -len(".experts.local_experts.")])
                    expert = moe.local_expert_indices[int(e.group(2))]
                    global_name = f"{e.group(1)}{expert}{e.group(3)}"
            if tied and name == "output_layer.weight":
                global_name = "embedding.word_embeddings.weight"  # last stage's copy of it
            expert = ".experts." in name
            size, rank = (etp_size, etp_rank) if expert else (tp_size, tp_rank)
            split = getattr(param, "tensor_model_parallel", False) and size > 1
            dim = getattr(param, "partition_dim", 0) if split else None
            shape = list(param.shape)
            if dim is not None:
                shape[dim] *= size
            out.append((param, Shard(
                local_name=name, global_name=global_name, global_shape=tuple(shape),
                dim=dim, index=rank if split else 0, count=size if split else 1, expert=expert,
                gated=bool(split and _GATED_FC1.search(name) and model.config.gated_linear_unit),
            )))
    return out


@torch.no_grad()
def load_global(chunks, get: Callable[[str], object]):
    """Fill every local parameter with its piece of the global tensor `get(global_name)`.

    `get` may return a tensor or a lazily sliceable object (safetensors' `get_slice`), so each
    rank reads only the bytes it owns, or None to leave that parameter as it is.
    """
    for param, shard in local_shards(chunks):
        full = get(shard.global_name)
        if full is None:  # the source has nothing for this parameter: it keeps its value
            continue
        piece = shard.take(full)
        if tuple(piece.shape) != tuple(param.shape):
            raise ValueError(f"{shard.global_name}: the piece for this rank has shape "
                             f"{tuple(piece.shape)}, the model expects {tuple(param.shape)}")
        fsdp.write(param, piece)


def gather_global(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The global tensor assembled from every TP (or expert-TP) rank's `tensor` (collective)."""
    if shard.dim is None or shard.count == 1:
        return tensor
    from megatron.core import parallel_state as ps

    group = (ps.get_expert_tensor_parallel_group() if shard.expert
             else ps.get_tensor_model_parallel_group())
    pieces = [torch.empty_like(tensor) for _ in range(shard.count)]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return shard.assemble(pieces)


def iter_global(chunks, which: str = "param") -> Iterator[Tuple[str, torch.Tensor]]:
    """(global name, full TP-gathered tensor) of this rank's parameters or their gradients.

    PP and EP ranks yield different names; replicas (DP, or the tied embedding on first and last
    stage) yield the same name. Collective over TP (and over DP for a fully sharded model): all
    those ranks must iterate together.
    """
    with fsdp.gathered(chunks):
        for param, shard in local_shards(chunks):
            if which == "param":
                t = fsdp.value(param).detach()
            else:
                t = getattr(param, "main_grad", None)
                t = param.grad if t is None else t
                if fsdp.is_sharded(t):
                    t = t.full_tensor()
                if t is None:
                    t = torch.zeros(param.shape, dtype=param.dtype)
            yield shard.global_name, gather_global(t.detach(), shard)
