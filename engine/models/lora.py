"""LoRA adapters on the Megatron actor's linear layers (tensor-parallel aware).

    spec = LoraSpec.from_config(model_cfg, seed)      # None when model.lora_rank == 0
    add_adapters(chunks, spec, hf_config)             # before DDP: freezes every base weight
    with adapters_disabled(chunks): ...               # the base model (the reference policy)

Each adapted Megatron linear y = W x gets y += (alpha / r) B A x, with A [r, in], B [out, r]
held *inside* the linear module as `lora_A.weight` / `lora_B.weight`, so Megatron's own
machinery (DDP, optimizer, PP layer offsets in checkpoints) sees them as ordinary parameters
and the base names stay untouched. Layout of the pieces:

- column parallel (linear_qkv, linear_fc1): A replicated, B split on output rows [out/tp, r].
  The rank-r activation A x enters the TP region through Megatron's copy (its backward
  all-reduces the partial dA of each output shard) or, under sequence parallelism, its
  all-gather (then each rank's dA covers its tokens only: A carries `sequence_parallel`, so
  Megatron sums it over TP as it does for norms).
- row parallel (linear_proj, linear_fc2): A split on input columns [r, in/tp], B replicated;
  the partial A x is all-reduced (reduce-scattered under SP, then B is `sequence_parallel`).

B's rows follow the fused weight's own row order: Megatron's interleaved per-query-group
[q; k; v] for linear_qkv, [gate; up] for a gated fc1 (split per half over TP like the weight),
so `B A` has exactly the weight's layout and `weights.megatron_to_hf` maps a merged weight to
HF names. HF targets that are only part of a fused weight (q_proj and v_proj without k_proj)
mask B's other rows: they get no gradient and stay zero.

Initialisation (PEFT's default): B = 0, so the adapted model starts as the base; A kaiming-
uniform(a=sqrt(5)) drawn for the *global* [r, in] from a generator seeded by (seed, name), so
every TP / DP / PP layout holds the same adapters.

Tests: tests/test_lora.py, tests/test_lora_export.py
"""
import contextlib
import math
import re
import zlib
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn.functional as F

# HF module name -> the Megatron linear holding it (fused: q/k/v -> linear_qkv, gate/up -> fc1)
HF_TO_MEGATRON = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
                  "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
                  "down_proj": "linear_fc2"}
MEGATRON_TO_HF = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                  "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
ALL_LINEAR = "all-linear"  # verl / PEFT: every linear layer of the blocks (not the LM head)
COLUMN = ("linear_qkv", "linear_fc1")
_PATHS = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
          "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}
_MODULE = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention\.linear_qkv|self_attention\."
                     r"linear_proj|mlp\.linear_fc1|mlp\.linear_fc2)$")
ADAPTER = re.compile(r"\.lora_[AB]\.weight$")
TARGET_KEY = "actor_rollout_ref.model.target_modules"


def is_adapter_name(name: str) -> bool:
    return bool(ADAPTER.search(name))


def resolve_targets(target_modules) -> frozenset:
    """The HF module names (q_proj, ...) a `target_modules` value adapts; ValueError otherwise."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules or [])
    known = sorted(HF_TO_MEGATRON) + sorted(MEGATRON_TO_HF)
    if not names:
        raise ValueError(f"{TARGET_KEY}=[]: name the layers to adapt, e.g. {ALL_LINEAR!r} or "
                         "[q_proj, v_proj]")
    if ALL_LINEAR in names:
        if len(names) > 1:
            raise ValueError(f"{TARGET_KEY}={names!r}: {ALL_LINEAR!r} already means every "
                             f"linear layer; give it alone or list module names ({', '.join(known)})")
        return frozenset(HF_TO_MEGATRON)
    out = set()
    for name in names:
        if name in HF_TO_MEGATRON:
            out.add(name)
        elif name in MEGATRON_TO_HF:
            out.update(MEGATRON_TO_HF[name])
        else:
            raise ValueError(f"{TARGET_KEY}: {name!r} is not a linear layer Trident can adapt; "
                             f"use {ALL_LINEAR!r} or names from {', '.join(known)}")
    return frozenset(out)


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: frozenset  # HF module names
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def modules(self):
        """The Megatron linears that carry an adapter."""
        return tuple(m for m in _PATHS if any(HF_TO_MEGATRON[t] == m for t in self.targets))

    @classmethod
    def from_config(cls, model_cfg, seed: int = 0) -> Optional["LoraSpec"]:
        rank = int(getattr(model_cfg, "lora_rank", 0) or 0)
        if rank <= 0:
            return None
        return cls(rank, float(model_cfg.lora_alpha), resolve_targets(model_cfg.target_modules), seed)

    def as_dict(self):
        return dict(rank=self.rank, alpha=self.alpha, targets=sorted(self.targets))


def row_mask(hf_config, base_name: str, spec: LoraSpec) -> Optional[torch.Tensor]:
    """1 on the rows of the fused weight `base_name` that belong to targeted HF modules (global
    Megatron row order), or None when every row is targeted."""
    from engine.models.weights import row_blocks
    blocks = row_blocks(hf_config, base_name)
    flags = [b[0].rsplit(".", 2)[-2] in spec.targets for b in blocks]
    if all(flags):
        return None
    return torch.cat([torch.full((rows,), float(f)) for (_, _, rows), f in zip(blocks, flags)])


def _global_a(spec, base_name, r, fan_in):
    """A [r, fan_in] as PEFT draws it (kaiming-uniform, a=sqrt(5): bound 1/sqrt(fan_in)), from a
    generator of its own so no layout or rank changes the draw."""
    g = torch.Generator().manual_seed(spec.seed * 1000003 + zlib.crc32(base_name.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(r, fan_in, generator=g, dtype=torch.float64) * 2 - 1) * bound


class _Weight(torch.nn.Module):
    """Holds one adapter matrix, so its name is `lora_A.weight` as in PEFT."""

    def __init__(self, tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(tensor)


@dataclass
class _Info:
    base: str          # global name of the adapted weight
    column: bool       # column parallel (B split) or row parallel (A split)
    gated: bool        # a gated fc1: B's rows are [gate; up], each half split over TP
    sequence_parallel: bool
    scale: float
    enabled: bool = True


def _unwrap(chunk):
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _check_supported(arch, spec):
    mlp = {"linear_fc1", "linear_fc2"} & set(spec.modules)
    if mlp and any(arch.moe_layer_pattern or []):
        raise ValueError(f"{TARGET_KEY}: LoRA on MoE expert layers is not supported yet (this model "
                         "has MoE layers); target the attention only: [q_proj, k_proj, v_proj, o_proj]")
    attn = {"linear_qkv", "linear_proj"} & set(spec.modules)
    if attn and arch.multi_latent_attention:
        raise ValueError(f"{TARGET_KEY}: LoRA on multi-latent attention is not supported yet; "
                         "target the MLP only: [gate_proj, up_proj, down_proj]")


@torch.no_grad()
def add_adapters(chunks, spec: LoraSpec, hf_config):
    """Attach adapters to every targeted linear of this rank's (unwrapped) chunks and freeze
    every other parameter. Call before DDP / the optimizer are built. Returns the modules."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from engine.models.arch import arch_spec
    from parallel.shards import Shard

    _check_supported(arch_spec(hf_config), spec)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    adapted = []
    for chunk in chunks:
        model = _unwrap(chunk)
        for p in model.parameters():
            p.requires_grad_(False)
        sp = bool(model.config.sequence_parallel)
        for name, lin in list(model.named_modules()):
            m = _MODULE.match(name)
            if not m or m.group(2).rsplit(".", 1)[1] not in spec.modules:
                continue
            kind = m.group(2).rsplit(".", 1)[1]
            layer = model.decoder.layers[int(m.group(1))].layer_number - 1
            base = f"decoder.layers.{layer}.{m.group(2)}.weight"
            column = kind in COLUMN
            out_local, in_local = lin.weight.shape
            out_g, in_g = (out_local * tp, in_local) if column else (out_local, in_local * tp)
            gated = kind == "linear_fc1" and bool(model.config.gated_linear_unit)
            a_global = _global_a(spec, base, spec.rank, in_g)
            a = a_global if column else Shard("", base, (spec.rank, in_g), 1, tp_rank, tp).take(a_global)
            dtype, device = lin.weight.dtype, lin.weight.device
            lin.lora_A = _Weight(a.to(device=device, dtype=dtype).contiguous())
            lin.lora_B = _Weight(torch.zeros(out_local if column else out_g, spec.rank,
                                             dtype=dtype, device=device))
            split, whole = (lin.lora_B.weight, lin.lora_A.weight) if column else \
                (lin.lora_A.weight, lin.lora_B.weight)
            set_tensor_model_parallel_attributes(split, tp > 1, 0 if column else 1, 1)
            set_tensor_model_parallel_attributes(whole, False, 0, 1)
            # the replicated matrix sees only this rank's tokens under SP: sum its grad over TP
            whole.sequence_parallel = sp
            mask = row_mask(hf_config, base, spec)
            if mask is not None:
                mask = Shard("", base, (out_g,), 0 if tp > 1 else None, tp_rank, tp, gated=gated).take(mask)
                mask = mask.to(device=device, dtype=dtype)
            lin.register_buffer("lora_mask", mask, persistent=False)
            lin.lora_info = _Info(base, column, gated, sp, spec.scale)
            lin.lora_spec = spec
            lin.register_forward_hook(_forward_hook, with_kwargs=True)
            lin.sharded_state_dict = _sharded_state_dict(lin, lin.sharded_state_dict)
            adapted.append(lin)
    return adapted


def _forward_hook(module, args, kwargs, output):
    """y += scale * B A x with the TP communication of the layer's parallel kind (module doc)."""
    from megatron.core.tensor_parallel import mappings

    info = module.lora_info
    if not info.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    a, b = module.lora_A.weight, module.lora_B.weight
    if module.lora_mask is not None:
        b = b * module.lora_mask[:, None]
    h = F.linear(x.to(a.dtype), a)
    if info.column:
        h = (mappings.gather_from_sequence_parallel_region(h) if info.sequence_parallel
             else mappings.copy_to_tensor_model_parallel_region(h))
    else:
        h = (mappings.reduce_scatter_to_sequence_parallel_region(h) if info.sequence_parallel
             else mappings.reduce_from_tensor_model_parallel_region(h))
    return out + (F.linear(h, b) * info.scale).to(out.dtype), bias


def _sharded_state_dict(module, original):
    """The linear's own sharded state dict, with the split adapter matrix sharded over TP (the
    linear's Megatron implementation would treat its children as replicated)."""
    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = original(prefix, sharded_offsets, metadata)
        info = module.lora_info
        key = "lora_B.weight" if info.column else "lora_A.weight"
        tensor = (module.lora_B if info.column else module.lora_A).weight
        groups = dict(tp_group=getattr(module, "tp_group", None) or ps.get_tensor_model_parallel_group(),
                      dp_cp_group=(metadata or {}).get("dp_cp_group")
                      or ps.get_data_parallel_group(with_context_parallel=True))
        fixed = make_sharded_tensors_for_checkpoint(
            {key: tensor}, prefix, {key: 0 if info.column else 1}, sharded_offsets, **groups)
        if info.gated:
            fixed[prefix + key] = apply_swiglu_sharded_factory(fixed[prefix + key], sharded_offsets)
        out.update(fixed)
        return out
    return sharded_state_dict


def adapted_modules(chunks):
    return [m for c in chunks for m in _unwrap(c).modules() if hasattr(m, "lora_info")]


def spec_of(chunks) -> Optional[LoraSpec]:
    mods = adapted_modules(chunks)
    return mods[0].lora_spec if mods else None


@contextlib.contextmanager
def adapters_disabled(chunks):
    """The base model: every adapter off (the reference policy of a LoRA actor)."""
    mods = adapted_modules(chunks)
    for m in mods:
        m.lora_info.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.lora_info.enabled = True


def adapter_only(sharded_state_dict: dict) -> dict:
    """A model's sharded state dict reduced to its adapters (a LoRA checkpoint's model part)."""
    return {k: v for k, v in sharded_state_dict.items() if is_adapter_name(k)}


def load_adapter_state(model, state: dict):
    """load_state_dict of adapters only: every adapter must be there, nothing else."""
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if is_adapter_name(k)]
    if missing or result.unexpected_keys:
        raise ValueError(f"LoRA checkpoint does not match the model: missing adapters {missing[:3]}, "
                         f"unexpected tensors {list(result.unexpected_keys)[:3]}")


# ------------------------------------------------------------------- full tensors and merges
def full_adapters(chunks, plan=None) -> Dict[str, tuple]:
    """{adapted weight's global name: (A [r, in], B [out, r])}, full tensors on every rank
    (collective; `plan`: a ReshardPlan of the adapters kept from an earlier call)."""
    from parallel.reshard import ReshardPlan, iter_buckets
    plan = plan or ReshardPlan.build(chunks, select=is_adapter_name)
    pieces = {}
    for bucket in iter_buckets(chunks, 64 << 20, plan=plan):
        pieces.update({n: t.detach().clone() for n, t in bucket})
    stems = {n.rsplit(".lora_", 1)[0] for n in pieces}
    return {s + ".weight": (pieces[s + ".lora_A.weight"], pieces[s + ".lora_B.weight"])
            for s in stems}


def merge(name, weight, adapters, spec, hf_config):
    """W + scale * (B masked) A for an adapted weight (a new tensor); `weight` itself otherwise."""
    if name not in adapters:
        return weight
    a, b = adapters[name]
    mask = row_mask(hf_config, name, spec)
    if mask is not None:
        b = b * mask.to(b)[:, None]
    compute = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    merged = torch.addmm(weight.to(compute), b.to(compute), a.to(compute), alpha=spec.scale)
    return merged.to(weight.dtype)


@dataclass(frozen=True)
class MergePlan:
    """The reshard plans of a LoRA model: base weights and adapters, built once."""
    base: object
    adapters: object

    @classmethod
    def build(cls, chunks):
        from parallel.reshard import ReshardPlan
        return cls(ReshardPlan.build(chunks, select=lambda n: not is_adapter_name(n)),
                   ReshardPlan.build(chunks, select=is_adapter_name))


def merged_buckets(chunks, bucket_bytes, plan: MergePlan, hf_config, counter=None):
    """`parallel.reshard.iter_buckets` of the base weights with every adapted weight replaced by
    W + scale B A: the merge happens on the full tensor, once per bucket, where the fused
    weight already has the layout megatron_to_hf splits (no per-layout piece arithmetic)."""
    from parallel.reshard import iter_buckets
    adapters, spec = full_adapters(chunks, plan.adapters), spec_of(chunks)
    for bucket in iter_buckets(chunks, bucket_bytes, plan=plan.base, counter=counter):
        for i, (name, tensor) in enumerate(bucket):
            if name in adapters:
                bucket[i] = (name, merge(name, tensor, adapters, spec, hf_config))
        yield bucket
