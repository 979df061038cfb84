"""On a GPU with TransformerEngine: the TE layer spec is chosen, Megatron's fusions are on as
decided from what is installed, and a tiny model's logits and gradients equal transformers'.

fp32 for the tight comparison (TF32 off through NVIDIA_TF32_OVERRIDE, so cuBLAS and TE do fp32
math); bf16 for packed (THD) sequences, which TE's varlen attention needs, compared loosely.
"""
import dataclasses

import pytest
import torch

from tests.gpu.spawn import run_spawned
from tests.test_hf_parity import family_config, save_random_model

pytestmark = pytest.mark.gpu

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe"]
LENGTHS = [7, 16, 3]  # packed sequences: prefixes of row 0
SEQ = 16


def _needs_te():
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        pytest.skip("the TE layer spec needs TransformerEngine (pip install -e .[gpu])")


def _nll(logits, ids):
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    return -lp.gather(-1, ids[:, 1:, None]).mean()


def _rank(rank, hf_dir, tokens):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from engine.models.builder import FUSIONS, build_model, installed_fusion_support, te_available
    from engine.models.hf_io import load_config, load_hf_weights
    from engine.models.weights import megatron_to_hf
    from parallel.mesh import Layout, init_mesh
    from parallel.packing import pack
    from parallel.shards import iter_global

    init_mesh(Layout(), seed=1)
    hf = load_config(hf_dir)
    out = dict(te=te_available(), support=dataclasses.asdict(installed_fusion_support()))
    [model] = build_model(hf, params_dtype=torch.float32)
    load_hf_weights([model], hf_dir, hf)
    out["flags"] = {n: getattr(model.config, n) for n in FUSIONS}
    out["te_modules"] = sorted({type(m).__name__ for m in model.modules()
                                if type(m).__module__.endswith("transformer_engine")})
    # DDP gives parameters the main_grad that fused gradient accumulation writes into
    ddp = DistributedDataParallel(model.config,
                                  DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    model.return_hidden = False
    ids = tokens.cuda()
    logits = ddp(ids, torch.arange(ids.shape[1], device="cuda").expand_as(ids), None)
    _nll(logits, ids).backward()
    out["logits"] = logits.detach().float().cpu()
    out["grads"] = {hf_name: g.float().cpu() for name, t in iter_global([ddp], "grad")
                    for hf_name, g in megatron_to_hf(hf, name, t)}

    [m16] = build_model(hf, params_dtype=torch.bfloat16)
    load_hf_weights([m16], hf_dir, hf)
    m16.return_hidden = False
    p = pack([tokens[0, :n] for n in LENGTHS])
    params = dataclasses.replace(p.params, cu_seqlens_q=p.params.cu_seqlens_q.cuda(),
                                 cu_seqlens_kv=p.params.cu_seqlens_kv.cuda())
    with torch.no_grad():
        packed = m16(p.tokens.cuda(), None, None, packed_seq_params=params)
    out["packed"] = [packed[0, o:o + n].float().cpu() for o, n in zip(p.offsets, LENGTHS)]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_te_spec_with_fusions_matches_transformers(family, tmp_path, monkeypatch):
    _needs_te()
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # inherited by the spawned rank
    model = save_random_model(family_config(family), str(tmp_path))
    tokens = torch.randint(0, model.config.vocab_size, (2, SEQ),
                           generator=torch.Generator().manual_seed(3))
    [res] = run_spawned(_rank, 1, str(tmp_path), tokens)

    assert res["te"] and res["te_modules"], "TE importable on a GPU: the TE spec must be used"
    flags, support = res["flags"], res["support"]
    assert flags["bias_activation_fusion"] and flags["bias_dropout_fusion"]
    assert flags["apply_rope_fusion"]  # TE's fused RoPE
    assert flags["gradient_accumulation_fusion"] == support["apex_wgrad"]
    assert flags["persist_layer_norm"] == support["apex_layer_norm"]

    model = model.float().eval()  # eval: no dropout; gradients still flow
    logits = model(tokens).logits
    _nll(logits, tokens).backward()
    torch.testing.assert_close(res["logits"], logits.detach(), atol=2e-4, rtol=0)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert set(res["grads"]) == set(grads)
    for name, g in grads.items():
        scale = float(g.abs().max()) + 1e-6
        assert float((res["grads"][name] - g).abs().max()) <= 2e-3 * scale, name

    with torch.no_grad():
        for n, got in zip(LENGTHS, res["packed"]):
            want = model(tokens[:1, :n]).logits[0]
            assert float((got - want).abs().max()) <= 5e-2 * float(want.abs().max()), n
