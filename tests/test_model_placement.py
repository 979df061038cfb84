"""Where a built model's tensors live. On a GPU, Megatron's own layers allocate on the current
CUDA device (use_cpu_initialization=False); a module of Trident's that allocated on the CPU
instead went unnoticed on CPU and broke the first GPU run's reference forward (its norms were
on the CPU: no DDP buffer took them over, as it does the actor's)."""
import types

import torch

from tests.multirank import run_on_ranks
from tests.tiny_models import tiny_config


def _config(on_cpu):
    return types.SimpleNamespace(normalization="RMSNorm", params_dtype=torch.bfloat16,
                                 sequence_parallel=False, use_cpu_initialization=on_cpu)


def test_norm_is_built_where_megatrons_layers_are(monkeypatch):
    from engine.models.local_modules import Norm

    # megatron/core/tensor_parallel/layers.py: device=torch.cuda.current_device() unless
    # use_cpu_initialization; "meta" stands in for the GPU on this machine
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
    for normalization in ("RMSNorm", "LayerNorm"):
        on_gpu = Norm(types.SimpleNamespace(**{**vars(_config(False)), "normalization": normalization}), 8)
        assert {p.device.type for p in on_gpu.parameters()} == {"meta"}
        assert all(p.dtype == torch.bfloat16 for p in on_gpu.parameters())
    assert Norm(_config(True), 8).weight.device.type == "cpu"


def _stray_tensors():
    from engine.models.builder import build_model, tensors_off_device
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout())
    chunks = build_model(tiny_config("llama"))
    clean = tensors_off_device(chunks, torch.device("cpu"))
    norm = chunks[0].decoder.final_layernorm
    norm.weight = torch.nn.Parameter(torch.ones_like(norm.weight, device="meta"))
    return clean, tensors_off_device(chunks, torch.device("cpu"))


def test_a_tensor_off_the_models_device_is_named():
    (clean, stray), = run_on_ranks(_stray_tensors, 1)
    assert clean == []
    assert stray == ["chunk 0 decoder.final_layernorm.weight on meta"]
