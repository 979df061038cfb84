"""The checkpoint formats beside HF <-> Megatron (tools/convert_checkpoint.py's other commands):
a LoRA run's adapters -> merged HF weights or a PEFT adapter, and GGUF -> HF; with the dtype
and logging helpers the commands share.

Tests: tests/test_convert_checkpoint.py, tests/test_lora_export.py
"""
import json
import os

from engine.errors import UsageError


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def torch_dtype_of(name, hf_config=None):
    if name not in _DTYPES and name not in (None, "auto"):
        raise UsageError(f"--dtype {name!r} is not supported; use auto, float32, bfloat16 or float16")
    import torch
    if name in (None, "auto"):
        d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        d = getattr(torch, d, None) if isinstance(d, str) else d
        return d if isinstance(d, torch.dtype) else torch.float32
    return getattr(torch, _DTYPES[name])


def log_rank0(msg):
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def lora_meta(step_dir):
    """The LoRA settings a trainer checkpoint (global_step_N) was saved with."""
    path = os.path.join(step_dir, "meta.json")
    if not os.path.exists(path):
        raise UsageError(f"--ckpt {step_dir!r} is not a trainer checkpoint (no meta.json); pass a "
                         "global_step_N directory of a run with actor_rollout_ref.model.lora_rank > 0")
    info = json.load(open(path)).get("workers", {}).get("actor", {}).get("lora")
    if not info:
        raise UsageError(f"--ckpt {step_dir!r} holds no LoRA actor (lora_rank was 0): its actor is a "
                         "full model; export it with the trainer's trainer.save_hf instead")
    return info


def lora_to_hf(step_dir, out_dir, layout, base_dir=None, hf_config_dir=None, fmt="merged",
               shard_size_mb=2000, dtype="auto"):
    """A LoRA run's checkpoint -> merged HF weights (base + (alpha / r) B A; needs the base
    model) or a PEFT adapter directory (collective)."""
    from megatron.core import dist_checkpointing

    from engine.models import hf_io, lora, peft_io
    from engine.models.builder import build_model
    from parallel.mesh import init_mesh

    info = lora_meta(step_dir)
    hf_config = hf_io.load_config(base_dir or hf_config_dir)
    ckpt = os.path.join(step_dir, "actor")
    saved = dist_checkpointing.load_tensors_metadata(ckpt)
    adapter_dtype = next(v.dtype for k, v in saved.items() if lora.is_adapter_name(k))
    init_mesh(layout)
    chunks = build_model(hf_config, params_dtype=adapter_dtype, sequence_parallel=layout.sequence_parallel)
    lora.add_adapters(chunks, lora.LoraSpec(info["rank"], info["alpha"], frozenset(info["targets"])),
                      hf_config)
    if fmt == "merged":
        hf_io.load_hf_weights(chunks, base_dir, hf_config)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    state = {k: lora.adapter_only(c.sharded_state_dict()) for k, c in zip(keys, chunks)}
    loaded = dist_checkpointing.load(state, ckpt)
    for key, chunk in zip(keys, chunks):
        lora.load_adapter_state(chunk, loaded[key])
    out_dtype = None if dtype == "auto" else torch_dtype_of(dtype)
    if fmt == "merged":
        hf_io.save_hf_weights(chunks, hf_config, out_dir, shard_size_mb, source_dir=base_dir,
                              dtype=out_dtype)
    else:
        peft_io.save_peft_adapter(chunks, hf_config, out_dir, base_model=base_dir, dtype=out_dtype)
    log_rank0(f"wrote {'merged HF weights' if fmt == 'merged' else 'PEFT adapter'} {out_dir}")


def gguf_to_hf(gguf_path, out_dir):
    """A GGUF file (e.g. llama.cpp quantised) -> an fp32 HF safetensors directory.

    transformers dequantises GGUF on load but refuses to save a model it considers quantised,
    so the weights are moved into a plain model built from the same config and saved from
    there, with the tokenizer (and its chat template) that the GGUF file carries.
    """
    import tempfile

    import torch
    import transformers

    from engine.models.hf_io import make_parent_dirs

    if not os.path.isfile(gguf_path):
        raise UsageError(f"--gguf {gguf_path!r} is not a file; pass the path of a .gguf file")
    if os.path.exists(out_dir):
        raise UsageError(f"--out {out_dir!r} already exists; choose a new directory")
    folder, name = os.path.split(os.path.abspath(gguf_path))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                               dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=make_parent_dirs(out_dir))  # data/ may not exist yet
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log_rank0(f"wrote {out_dir} ({sum(p.numel() for p in plain.parameters()) / 1e6:.1f}M parameters)")
    return out_dir
