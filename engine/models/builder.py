"""Build this rank's Megatron GPTModel chunks (actor / reference / critic) from a HF config.

The layout comes from megatron's parallel_state (initialised by `parallel.mesh.init_mesh`); one
chunk per virtual pipeline stage. TransformerEngine's layer spec is used when TE is importable on
a GPU, Megatron's local spec (with Trident's norm and core attention) otherwise.

Tests: tests/test_layouts.py, tests/test_fusions.py, tests/test_reshard.py, tests/gpu/test_fusions_gpu.py
"""
import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer import ModuleSpec, TransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from engine.models.arch import ArchSpec, arch_spec, rope_inv_freq
from engine.models.local_modules import (CoreAttention, Norm, install_fast_thd_rope, use_gated_mlp,
                                         use_one_rank_linears)
from parallel import cpu as cpu_compat
from parallel import fsdp


def use_te_spec(te_importable: bool, cuda: bool) -> bool:
    """TransformerEngine's layer spec needs both TE and a GPU; everything else gets Megatron's
    local spec with Trident's norm and core attention (`decoder_block_spec`)."""
    return bool(te_importable and cuda)


def _importable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken install
        return False


def te_available():
    return use_te_spec(_importable("transformer_engine"), torch.cuda.is_available())


# ------------------------------------------------------------------------------------------
# Megatron's kernel fusions. Recipe key (each model's megatron section):
#     actor_rollout_ref.actor.megatron.fusions: {gradient_accumulation_fusion: false, ...}
# A name absent (or null) is decided by what is installed; true asks for it and fails with a
# message when it cannot run here; false turns it off.
# ------------------------------------------------------------------------------------------
FUSIONS = ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
           "apply_rope_fusion", "gradient_accumulation_fusion", "persist_layer_norm")


@dataclass(frozen=True)
class FusionSupport:
    """What the fused kernels need, as found on this machine (`installed_fusion_support`)."""
    cuda: bool = False
    te: bool = False              # TE: fused RoPE for bshd / thd
    apex_wgrad: bool = False      # fused_weight_gradient_mlp_cuda (apex --cuda_ext)
    apex_layer_norm: bool = False  # apex's persistent layer norm (apex.contrib.layer_norm)
    softmax_kernels: bool = False  # scaled_(upper_triang_)masked_softmax_cuda
    triton: bool = False          # MLA's fused YaRN RoPE
    cpu_wgrad: bool = False       # parallel/cpu.py's CPU stand-in for fused_weight_gradient_mlp_cuda


def installed_fusion_support() -> FusionSupport:
    return FusionSupport(
        cuda=torch.cuda.is_available(), te=_importable("transformer_engine"),
        apex_wgrad=_importable("fused_weight_gradient_mlp_cuda"),
        apex_layer_norm=_importable("fast_layer_norm") and _importable("apex"),
        softmax_kernels=(_importable("scaled_masked_softmax_cuda")
                         and _importable("scaled_upper_triang_masked_softmax_cuda")),
        triton=_importable("triton"))


def _fusion_reasons(support: FusionSupport, model: dict) -> dict:
    """For each fusion, None if it can run with this model here, else why not."""
    if not support.cuda:
        reasons = {name: "needs a CUDA GPU" for name in FUSIONS}
        if support.cpu_wgrad:
            reasons["gradient_accumulation_fusion"] = None
        return reasons
    act, gated = model.get("activation_func"), model.get("gated_linear_unit", False)
    bias = model.get("add_bias_linear", False)
    act_ok = (act is F.silu and gated) or (act is F.gelu and (gated or bias))
    mla = model.get("multi_latent_attention", False)
    if mla:
        # Megatron's fused MLA RoPE is a Triton kernel for YaRN only, and marked experimental:
        # it runs when asked for, and is not chosen by default.
        rope = ("needs YaRN RoPE and Triton for multi-latent attention"
                if model.get("rope_type") != "yarn" or not support.triton else
                "experimental for multi-latent attention in Megatron; ask for it explicitly")
    elif model.get("rope_type") == "yarn" or model.get("mscale", 1.0) != 1.0:
        # Megatron sends packed (THD) sequences to TE's fused RoPE without YaRN's mscale
        rope = "TE's fused RoPE for packed sequences leaves out YaRN's mscale"
    else:
        rope = None if support.te else "needs TransformerEngine's fused RoPE"
    return {
        # FusedScaleMaskSoftmax's CUDA kernels (apex / Megatron-LM builds); Trident's specs use
        # TE's or its own attention, so this is inert unless Megatron's local attention is used
        "masked_softmax_fusion": None if support.softmax_kernels else
        "needs the scaled_masked_softmax_cuda kernels (apex --cuda_ext)",
        "bias_activation_fusion": None if act_ok else
        "needs SwiGLU, or GeLU with gated units or linear biases",
        "bias_dropout_fusion": None,  # Megatron's jit-fused bias-dropout-add: any CUDA device
        "apply_rope_fusion": rope,
        # Megatron's own ColumnParallelLinear (the output layer, also under TE's spec) refuses
        # to build without apex's extension, so TE alone is not enough
        "gradient_accumulation_fusion": None if support.apex_wgrad else
        "needs apex's fused_weight_gradient_mlp_cuda (apex --cpp_ext --cuda_ext)",
        "persist_layer_norm": None if support.apex_layer_norm else
        "needs apex's persistent layer norm (apex.contrib.layer_norm)",
    }


def fusion_flags(support: FusionSupport, model: dict, overrides: Optional[dict] = None) -> dict:
    """The six TransformerConfig fusion switches for `model` (TransformerConfig keyword
    arguments: activation, gating, MLA, rope type): each fusion that can run here is on,
    except experimental ones; `overrides` (the recipe's `fusions` dict) turns any off, or on
    when it can run."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(FUSIONS))
    if unknown:
        raise ValueError(f"megatron.fusions: unknown {unknown}; known: {', '.join(FUSIONS)}")
    reasons = _fusion_reasons(support, model)
    flags = {}
    for name in FUSIONS:
        want = overrides.get(name)
        if want and reasons[name] and not reasons[name].startswith("experimental"):
            raise ValueError(f"megatron.fusions.{name}=true: {reasons[name]}; set it to false "
                             "or leave it unset")
        flags[name] = bool(want) if want is not None else reasons[name] is None
    return flags


class TridentGPTModel(GPTModel):
    """GPTModel whose last stage can return hidden states (for the fused log-prob kernel) or
    scalar values (critic / reward model) instead of full-vocabulary logits.

    head="lm":    logits [b, s, V/tp] by default; with `return_hidden=True`, the final hidden
                  states [b, s, h] (sequence-parallel shards gathered) so the caller can run
                  the chunked log-prob kernel against `output_weight()` without [tokens, vocab].
    head="value": values [b, s] in fp32 from a scalar head replicated over TP.
    """

    def __init__(self, *args, head: str = "lm", **kwargs):
        if head not in ("lm", "value"):
            raise ValueError(f"head={head!r}; use 'lm' or 'value'")
        super().__init__(*args, **kwargs)
        self.head = head
        self.return_hidden = False
        if head == "value" and self.post_process:
            self.output_layer = None  # a critic never needs the [vocab, hidden] projection
            self.value_head = torch.nn.Linear(self.config.hidden_size, 1, bias=False,
                                              dtype=self.config.params_dtype)
            torch.nn.init.normal_(self.value_head.weight, std=self.config.init_method_std)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        if self.head == "value" and self.post_process:
            # Megatron's LanguageModule marks the last stage's output layer for checkpoints; a
            # value head has none (KeyError). Off for the call: nothing else here reads it.
            self.post_process = False
            try:
                out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            finally:
                self.post_process = True
        else:
            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        fsdp.fix_checkpoint_offsets(out, self, prefix)  # strategy fsdp / fsdp2 (parallel/fsdp.py)
        return out

    def output_weight(self):
        """This rank's vocab shard of the output projection (tied or not); a fully sharded one
        gathered for the log-prob kernels, which read it outside the model's forward."""
        if self.share_embeddings_and_output_weights:
            return fsdp.for_compute(self.shared_embedding_or_output_weight())
        return fsdp.for_compute(self.output_layer.weight)

    def _postprocess(self, hidden_states, **kwargs):
        if not self.post_process or (self.head == "lm" and not self.return_hidden):
            return super()._postprocess(hidden_states=hidden_states, **kwargs)
        if self.config.sequence_parallel:
            # Every TP rank needs the whole sequence; the heads that follow reduce their own
            # gradient over TP (kernel) or compute it identically on every rank (value head),
            # so the backward of this gather splits rather than sums.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        hidden = hidden_states.transpose(0, 1)  # [s, b, h] -> [b, s, h]
        if self.head == "value":
            return self.value_head(hidden).squeeze(-1).float()
        return hidden


def _swap_local_modules(spec):
    """Replace the local spec's torch norm and core attention by Trident's (see local_modules)."""
    if spec is WrappedTorchNorm:
        return Norm
    if spec is DotProductAttention:
        return CoreAttention
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=_swap_local_modules(spec.module),
                                   submodules=_swap_local_modules(spec.submodules))
    if isinstance(spec, list):
        return [_swap_local_modules(s) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _swap_local_modules(getattr(spec, f.name))
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def transformer_config(arch: ArchSpec, *, params_dtype=torch.float32, sequence_parallel=False,
                       recompute_granularity=None, recompute_method=None,
                       recompute_num_layers=None, overrides: Optional[dict] = None,
                       fusions: Optional[dict] = None, support: Optional[FusionSupport] = None):
    """TransformerConfig for `arch` at the layout of the current parallel_state. `fusions`:
    the recipe's per-fusion switches (see `fusion_flags`); `support`: what is installed
    (probed when not given)."""
    cuda = torch.cuda.is_available()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    kwargs = dict(
        arch.transformer,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp if (vpp or 1) > 1 else None,
        context_parallel_size=ps.get_context_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not cuda,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Losses are sums normalised by global token counts computed by the caller, so the
        # schedule must neither average over micro-batches nor DDP over data-parallel ranks.
        calculate_per_token_loss=True,
        **fusion_flags(support or (installed_fusion_support() if cuda else
                                   FusionSupport(cpu_wgrad=cpu_compat.is_enabled())),
                       arch.transformer, fusions),
        moe_token_dispatcher_type="alltoall" if cuda else "allgather",
        # gloo matches point-to-point messages between two ranks in posting order; megatron's
        # batched p2p posts sends and receives in an order that, with pp=2 and virtual stages
        # (both neighbours are the same rank), pairs an activation with a gradient. Its
        # unbatched path orders even/odd ranks so messages pair correctly.
        batch_p2p_comm=cuda,
        recompute_granularity=recompute_granularity,
        recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
    )
    if arch.transformer.get("num_moe_experts") is None:
        kwargs["moe_token_dispatcher_type"] = "alltoall"  # unused by dense models
    # Pipeline stages exchange shapes first when micro-batches differ in length; megatron's
    # allgather dispatcher (the one that runs on gloo) forbids that, so MoE models on CPU pad
    # every micro-batch of a schedule call to one length instead.
    kwargs["variable_seq_lengths"] = kwargs.get("moe_token_dispatcher_type") != "allgather"
    if arch.multi_latent_attention:
        kwargs["rotary_base"] = arch.rotary_base  # MLA builds its rotary embedding from config
        kwargs.pop("multi_latent_attention", None)
        kwargs.update(overrides or {})
        return MLATransformerConfig(**kwargs)
    kwargs.update(overrides or {})
    return TransformerConfig(**kwargs)


def decoder_block_spec(config, *, use_te: bool, vp_stage=None, unfuse_norms=False):
    """The decoder block spec: TE's layers, or Megatron's local ones with Trident's norm and
    core attention swapped in (see local_modules). `unfuse_norms`: TE's norm-fused linears
    split into a norm and a linear (LoRA adapters must see the normalised input)."""
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                       normalization=config.normalization, vp_stage=vp_stage)
    if not use_te:
        return _swap_local_modules(block)
    return _unfuse_te_norms(block) if unfuse_norms else block


def _unfuse_te_norms(block):
    """TELayerNormColumnParallelLinear (linear_qkv, linear_fc1) -> TENorm in the layer's
    input / pre-MLP norm slot + TEColumnParallelLinear, as Megatron's MLA spec lays them out.
    The norm's parameters then carry the local names, which weights.py reads as well."""
    from megatron.core.extensions.transformer_engine import (TEColumnParallelLinear,
                                                             TELayerNormColumnParallelLinear, TENorm)

    def unfuse(layer):
        sub, changes = layer.submodules, {}
        for slot, linear, norm in (("self_attention", "linear_qkv", "input_layernorm"),
                                   ("mlp", "linear_fc1", "pre_mlp_layernorm")):
            part = getattr(sub, slot)
            if (isinstance(part, ModuleSpec) and getattr(part.submodules, linear, None)
                    is TELayerNormColumnParallelLinear):
                changes[slot] = dataclasses.replace(part, submodules=dataclasses.replace(
                    part.submodules, **{linear: TEColumnParallelLinear}))
                changes[norm] = TENorm
        return dataclasses.replace(layer, submodules=dataclasses.replace(sub, **changes))
    return dataclasses.replace(block, layer_specs=[unfuse(spec) for spec in block.layer_specs])


def _set_rope_frequencies(model, arch: ArchSpec):
    """Scaled RoPE (linear, llama3) as transformers computes it, in place of Megatron's plain
    frequencies; before any forward, as RotaryEmbedding caches its output per length."""
    rotary = model.rotary_pos_emb
    dim = rotary.inv_freq.shape[0] * 2
    inv_freq = rope_inv_freq(arch.rotary_base, dim, arch.rope_scaling)
    rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)


def build_model(hf_config, *, head="lm", params_dtype=torch.float32, sequence_parallel=False,
                recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                config_overrides: Optional[dict] = None,
                fusions: Optional[dict] = None, lora=None, ddp_grads=False) -> List[TridentGPTModel]:
    """This rank's model chunks (one per virtual pipeline stage) for the HF config given.
    `fusions`: the recipe's `megatron.fusions` dict (see `fusion_flags`); `lora`: a
    engine.models.lora.LoraSpec whose adapters are attached, every other parameter frozen (so
    Megatron's DDP and optimizer, built on these chunks afterwards, hold the adapters only);
    `ddp_grads`: the chunks will train under Megatron's DDP, whose main_grad buffers are what
    gradient_accumulation_fusion adds weight gradients into (without them, e.g. fully sharded
    or not trained, it is off: Megatron's backward would find no main_grad)."""
    if not ddp_grads:
        fusions = dict(fusions or {}, gradient_accumulation_fusion=False)
    arch = arch_spec(hf_config)
    config = transformer_config(arch, params_dtype=params_dtype,
                                sequence_parallel=sequence_parallel,
                                recompute_granularity=recompute_granularity,
                                recompute_method=recompute_method,
                                recompute_num_layers=recompute_num_layers,
                                overrides=config_overrides, fusions=fusions)
    use_te = te_available()
    if config.context_parallel_size > 1 and not use_te:
        raise ValueError(
            f"context_parallel_size={config.context_parallel_size} needs TransformerEngine's "
            "attention on a GPU (pip install -e .[gpu]); set "
            "actor_rollout_ref.actor.megatron.context_parallel_size=1 on this machine")
    if not use_te:
        install_fast_thd_rope()
    vpp = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        block = decoder_block_spec(config, use_te=use_te, vp_stage=stage, unfuse_norms=lora is not None)
        model = TridentGPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=arch.tie_word_embeddings and head == "lm",
            position_embedding_type="rope",
            rotary_base=arch.rotary_base,
            vp_stage=stage,
            head=head,
        )
        if arch.rope_scaling:
            _set_rope_frequencies(model, arch)
        if not use_te:
            use_gated_mlp(model)
            use_one_rank_linears(model)
        model.arch = arch
        chunks.append(model)
    if lora is not None:
        from engine.models.lora import add_adapters
        add_adapters(chunks, lora, hf_config)
    _to_model_device(chunks, config)
    return chunks


def _to_model_device(chunks, config):
    """Every parameter where Megatron's layers put theirs (megatron/core/tensor_parallel/layers.py:
    the current GPU, or with use_cpu_initialization the default device: the CPU, or meta in
    parallel/meta.py's builds), before DDP and the optimizer take them. Trident's norms and value
    head are made without a device, and Megatron's MoE router makes its weight on the CPU and
    moves it at its first forward (megatron/core/transformer/moe/router.py): a model no DDP
    buffer takes over (the reference) met them on the CPU on the first GPU run."""
    device = torch.get_default_device() if config.use_cpu_initialization else \
        torch.device(torch.cuda.current_device())
    stray = {id(p): p for c in chunks for p in c.parameters() if p.device != device}  # shared once
    for p in stray.values():
        moved = torch.nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
        moved.__dict__.update(p.__dict__)  # Megatron's attributes (TP split, sequence_parallel)
        torch.utils.swap_tensors(p, moved)  # the same object: every module holding it sees the move
