"""Where a built model's parameters live. On a GPU, Megatron's own layers allocate on the current
CUDA device (use_cpu_initialization=False); Trident's norms, made without a device, went unnoticed
on CPU and broke the first GPU run's reference forward (no DDP buffer took them over, as it does
the actor's)."""
import torch

from tests.multirank import run_on_ranks
from tests.tiny_models import tiny_config


def _built_as_on_a_gpu(family, head):
    from engine.models.builder import build_model
    from parallel.mesh import Layout, init_mesh

    init_mesh(Layout())
    # Megatron's GPU path: every layer asks torch.cuda.current_device() for its parameters'
    # device; "meta" stands in for the GPU (after parallel/cpu.py's own answer, which is the CPU),
    # and only while building: the rank processes serve later tests
    cpu_answer, torch.cuda.current_device = torch.cuda.current_device, lambda: "meta"
    try:
        chunks = build_model(tiny_config(family), head=head,
                             config_overrides=dict(use_cpu_initialization=False, perform_initialization=False))
    finally:
        torch.cuda.current_device = cpu_answer
    return sorted({p.device.type for c in chunks for p in c.parameters()})


def test_every_parameter_of_a_model_built_as_on_a_gpu_is_on_the_gpu():
    """The whole model through Megatron's GPU initialisation path: the reference's norms and the
    critic's value head were made on the CPU there, and Megatron's MoE router makes its weight
    there on purpose; build_model returns every parameter on the model's device."""
    for family, head in [("llama", "lm"), ("llama", "value"), ("qwen3_moe", "lm"), ("mixtral", "lm")]:
        (devices,) = run_on_ranks(_built_as_on_a_gpu, 1, family, head)
        assert devices == ["meta"], (family, head, devices)
