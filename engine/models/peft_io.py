"""A LoRA actor's adapters as a PEFT adapter directory (adapter_config.json +
adapter_model.safetensors), loadable with `peft.PeftModel.from_pretrained(base, dir)`.

Megatron's fused linears share one A: linear_qkv's A serves q_proj, k_proj and v_proj, and
B's rows split by the weight's own row blocks (weights.row_blocks: per query group [q; k; v],
[gate; up] for fc1). Each targeted HF module gets (A, its rows of B): PEFT's delta
scale * B_q A is then exactly the q rows of the fused scale * B A. Modules that were not
targeted (their rows masked to zero) are left out, as PEFT would not have them.

Tests: tests/test_lora_export.py
"""
import json
import os
from typing import Optional

import torch
import torch.distributed as dist

from engine.models import hf_io, lora
from engine.models.weights import row_blocks

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's names: the wrapped model's module paths


def peft_tensors(adapters, hf_config, spec: lora.LoraSpec) -> dict:
    """{PEFT tensor name: tensor} from full adapters {Megatron weight name: (A, B)}."""
    out = {}
    for base, (a, b) in sorted(adapters.items()):
        pieces, offset = {}, 0
        for hf_name, start, rows in row_blocks(hf_config, base):
            if hf_name.rsplit(".", 2)[-2] in spec.targets:
                pieces.setdefault(hf_name, []).append((start, b[offset:offset + rows]))
            offset += rows
        for hf_name, parts in pieces.items():
            stem = PREFIX + hf_name[: -len(".weight")]
            out[stem + ".lora_A.weight"] = a.clone()  # shared by q / k / v: one copy each
            out[stem + ".lora_B.weight"] = torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])])
    return out


def adapter_config(spec: lora.LoraSpec, base_model: Optional[str]) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank,
            "lora_alpha": spec.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": sorted(spec.targets), "fan_in_fan_out": False,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "inference_mode": True,
            "base_model_name_or_path": base_model}


@torch.no_grad()
def save_peft_adapter(chunks, hf_config, out_dir: str, base_model: Optional[str] = None,
                      dtype: Optional[torch.dtype] = None) -> None:
    """Write the chunks' adapters as a PEFT directory (collective: every rank calls it; rank 0
    writes into a temporary sibling renamed into place at the end)."""
    from safetensors.torch import save_file

    spec = lora.spec_of(chunks)
    error = None if spec else "the model has no LoRA adapters (lora_rank 0): nothing to export"
    if dist.get_rank() == 0 and error is None:
        error = hf_io.check_new_output_dir(out_dir)
    hf_io.fail_together(error)
    adapters = lora.full_adapters(chunks)
    if dist.get_rank() == 0:
        tensors = peft_tensors(adapters, hf_config, spec)
        tensors = {k: (t.to(dtype) if dtype else t).contiguous() for k, t in tensors.items()}
        tmp = hf_io.atomic_output_dir(out_dir)
        save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(adapter_config(spec, base_model), f, indent=2)
        hf_io.copy_side_files(base_model, tmp)
        hf_io.publish(tmp, out_dir)
    dist.barrier()
