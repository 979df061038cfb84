"""Which Megatron fusions and which layer spec a machine gets, decided from what is installed
(passed in, so every machine's decision is checked here on the CPU)."""
import dataclasses

import pytest

from engine.models.arch import arch_spec
from engine.models.builder import FUSIONS, FusionSupport, fusion_flags, use_te_spec
from tests.multirank import run_on_ranks
from tests.test_hf_parity import deepseek_v3_config, family_config
from tests.tiny_models import tiny_config

EVERYTHING = FusionSupport(cuda=True, te=True, apex_wgrad=True, apex_layer_norm=True,
                           softmax_kernels=True, triton=True)
TE_ONLY = FusionSupport(cuda=True, te=True, triton=True)


def _model(name="llama"):
    return arch_spec(family_config(name)).transformer


def test_cpu_runs_no_fusion_and_refuses_a_requested_one():
    assert fusion_flags(FusionSupport(), _model()) == {name: False for name in FUSIONS}
    # everything installed but no GPU: still nothing
    assert not any(fusion_flags(dataclasses.replace(EVERYTHING, cuda=False), _model()).values())
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=true: needs a CUDA GPU"):
        fusion_flags(FusionSupport(), _model(), {"gradient_accumulation_fusion": True})
    assert not any(fusion_flags(FusionSupport(), _model(), {n: False for n in FUSIONS}).values())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_gpu_with_everything_installed_fuses_everything(family):
    assert fusion_flags(EVERYTHING, _model(family)) == {name: True for name in FUSIONS}


def test_gpu_with_te_only():
    flags = fusion_flags(TE_ONLY, _model())
    assert flags == dict(masked_softmax_fusion=False, bias_activation_fusion=True,
                         bias_dropout_fusion=True, apply_rope_fusion=True,
                         gradient_accumulation_fusion=False, persist_layer_norm=False)
    # Megatron's output layer needs apex's kernel for fused wgrad accumulation even under TE
    with pytest.raises(ValueError, match="fused_weight_gradient_mlp_cuda"):
        fusion_flags(TE_ONLY, _model(), {"gradient_accumulation_fusion": True})
    no_te = fusion_flags(FusionSupport(cuda=True), _model())
    assert not no_te["apply_rope_fusion"] and no_te["bias_dropout_fusion"]


def test_recipe_overrides_switch_single_fusions():
    flags = fusion_flags(EVERYTHING, _model(), {"gradient_accumulation_fusion": False,
                                                "apply_rope_fusion": None})
    assert flags["gradient_accumulation_fusion"] is False
    assert flags["apply_rope_fusion"] is True  # null = decided by what is installed
    assert sum(flags.values()) == len(FUSIONS) - 1
    with pytest.raises(ValueError, match="unknown \\['rope_fusion'\\]"):
        fusion_flags(EVERYTHING, _model(), {"rope_fusion": True})


def test_activation_and_mla_rules():
    gelu = dict(_model(), activation_func=__import__("torch").nn.functional.gelu,
                gated_linear_unit=False, add_bias_linear=False)
    assert not fusion_flags(EVERYTHING, gelu)["bias_activation_fusion"]
    assert fusion_flags(EVERYTHING, dict(gelu, add_bias_linear=True))["bias_activation_fusion"]
    # MLA: plain RoPE has no fused kernel; YaRN's (Triton) is experimental: only on request
    plain = arch_spec(deepseek_v3_config()).transformer
    yarn = arch_spec(family_config("deepseek_v3_no_q_lora_yarn")).transformer
    assert not fusion_flags(EVERYTHING, plain)["apply_rope_fusion"]
    assert not fusion_flags(EVERYTHING, yarn)["apply_rope_fusion"]
    assert fusion_flags(EVERYTHING, yarn, {"apply_rope_fusion": True})["apply_rope_fusion"]
    with pytest.raises(ValueError, match="YaRN"):
        fusion_flags(EVERYTHING, plain, {"apply_rope_fusion": True})
    with pytest.raises(ValueError, match="YaRN"):
        fusion_flags(dataclasses.replace(EVERYTHING, triton=False), yarn,
                     {"apply_rope_fusion": True})
    # a standard-attention model with YaRN (mscale): TE's THD kernel would drop the mscale
    with pytest.raises(ValueError, match="mscale"):
        fusion_flags(EVERYTHING, dict(_model(), rope_type="yarn", mscale=1.2),
                     {"apply_rope_fusion": True})


def test_te_spec_needs_te_and_cuda():
    assert use_te_spec(te_importable=True, cuda=True)
    assert not use_te_spec(te_importable=True, cuda=False)
    assert not use_te_spec(te_importable=False, cuda=True)
    assert not use_te_spec(te_importable=False, cuda=False)


def _built_on_cpu():
    """On this machine: the flags TransformerConfig receives, and the module classes built."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from engine.models.builder import build_model, te_available, transformer_config
    from engine.models.local_modules import CoreAttention, Norm
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout(), seed=1)
    arch = arch_spec(tiny_config("qwen2"))
    # rope fusion off: without TE, Megatron's own config check refuses it (on a real machine
    # the support probe is what keeps it off)
    config = transformer_config(arch, support=EVERYTHING,
                                fusions={"persist_layer_norm": False, "apply_rope_fusion": False})
    flags = {name: getattr(config, name) for name in FUSIONS}
    [model] = build_model(tiny_config("qwen2"))
    kinds = {type(m) for m in model.modules()}
    return dict(te=te_available(), flags=flags,
                cpu_flags={n: getattr(model.config, n) for n in FUSIONS},
                trident=CoreAttention in kinds and Norm in kinds,
                megatron_local=bool(kinds & {DotProductAttention, WrappedTorchNorm}))


def test_transformer_config_and_local_spec_on_this_machine():
    [res] = run_on_ranks(_built_on_cpu, 1)
    assert res["te"] is False  # no TE / no GPU here
    assert res["flags"] == dict(masked_softmax_fusion=True, bias_activation_fusion=True,
                                bias_dropout_fusion=True, apply_rope_fusion=False,
                                gradient_accumulation_fusion=True, persist_layer_norm=False)
    assert not any(res["cpu_flags"].values())
    assert res["trident"] and not res["megatron_local"]
