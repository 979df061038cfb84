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
    [model] = build_model(tiny_config("qwen2"), ddp_grads=True)
    [untrained] = build_model(tiny_config("qwen2"))
    kinds = {type(m) for m in model.modules()}
    return dict(te=te_available(), flags=flags,
                cpu_flags={n: getattr(model.config, n) for n in FUSIONS},
                untrained_flags={n: getattr(untrained.config, n) for n in FUSIONS},
                trident=CoreAttention in kinds and Norm in kinds,
                megatron_local=bool(kinds & {DotProductAttention, WrappedTorchNorm}))


def test_transformer_config_and_local_spec_on_this_machine():
    [res] = run_on_ranks(_built_on_cpu, 1)
    assert res["te"] is False  # no TE / no GPU here
    assert res["flags"] == dict(masked_softmax_fusion=True, bias_activation_fusion=True,
                                bias_dropout_fusion=True, apply_rope_fusion=False,
                                gradient_accumulation_fusion=True, persist_layer_norm=False)
    # on CPU only the weight-gradient accumulation runs fused (parallel/cpu.py's stand-in), and
    # only for a model Megatron's DDP trains (its main_grad buffers are what it adds into)
    assert res["cpu_flags"] == {name: name == "gradient_accumulation_fusion" for name in res["cpu_flags"]}
    assert not any(res["untrained_flags"].values())
    assert res["trident"] and not res["megatron_local"]


def test_packed_rope_equals_megatrons_per_micro_batch():
    """The THD rope (engine/models/local_modules.py) works cos / sin out once per micro-batch
    and reuses them for every layer and for q and k: each call equals Megatron's own bshd
    rotation at the token's position in its sequence, for two packings, two frequency tables
    (one rotating only part of the channels) and two dtypes, values and gradients."""
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    from engine.models.local_modules import install_fast_thd_rope
    reference = rope_utils._apply_rotary_pos_emb_bshd
    install_fast_thd_rope()
    gen = torch.Generator().manual_seed(0)

    def expected(t, cu, freqs, mscale):
        positions = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])
        return reference(t.unsqueeze(1), freqs[positions], mscale=mscale).squeeze(1)

    packings = [torch.tensor([0, 3, 8, 9], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)]
    tables = [torch.randn(16, 1, 1, 8, generator=gen), torch.randn(16, 1, 1, 4, generator=gen)]
    for cu in packings:
        for freqs in tables:  # the same cu_seqlens with another table: not the cached one
            for dtype, mscale in ((torch.float32, 1.0), (torch.float64, 1.3)):
                worked_out = []  # the cos / sin pair each call used: k's must be q's (worked out once)
                for heads in (4, 2):  # q then k: the second call reads the cached cos / sin
                    t = torch.randn(int(cu[-1]), heads, 8, generator=gen, dtype=dtype, requires_grad=True)
                    got = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, mscale=mscale)
                    worked_out.append(cu._trident_rope[2])
                    want = expected(t, cu, freqs, mscale)
                    assert torch.equal(got, want)
                    w = torch.randn(got.shape, generator=gen, dtype=dtype)
                    assert torch.equal(torch.autograd.grad((got * w).sum(), t)[0],
                                       torch.autograd.grad((want * w).sum(), t)[0])
                assert worked_out[0] is worked_out[1]
