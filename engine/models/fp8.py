"""Block-wise FP8 checkpoints, as DeepSeek-V3 is released: a linear weight `X.weight` stored as
float8 (e4m3) with `X.weight_scale_inv`, one fp32 scale per [bm, bn] block of it
(`quantization_config.weight_block_size`, the last blocks of a dimension may be shorter).
Trident trains in bf16 / fp32, so such weights are dequantised on read:
weight = fp8.float() * scale_inv (each scale spread over its block), then cast by the caller.

Tests: tests/test_fp8_checkpoint.py
"""
import copy
import math
from typing import Dict, Optional, Set, Tuple

import torch

from engine.errors import ModelError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors' names


def quantization_config(hf_config) -> Optional[dict]:
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    return q if isinstance(q, dict) else q.to_dict()


def check_supported(hf_config) -> None:
    """One clear error for a quantisation scheme other than block-wise fp8."""
    q = quantization_config(hf_config)
    if q is None:
        return
    method = q.get("quant_method")
    if method != "fp8":
        raise ModelError(f"quantization_config.quant_method={method!r} in config.json is not "
                         "supported; Trident loads unquantised (bf16 / fp32) checkpoints and "
                         "block-wise fp8 ones (DeepSeek-V3): use the unquantised release")
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "e5m2"):
        raise ModelError(f"quantization_config.fmt={fmt!r} in config.json is not supported; "
                         "fp8 checkpoints use 'e4m3' (or 'e5m2')")


def block_size(hf_config) -> Tuple[int, int]:
    q = quantization_config(hf_config) or {}
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelError(f"quantization_config.weight_block_size={block!r} in config.json: the "
                         "checkpoint holds fp8 weights with *_scale_inv blocks, so it must be "
                         "[rows, cols] of positive integers, e.g. [128, 128] as DeepSeek-V3 ships")
    return int(block[0]), int(block[1])


def scale_shape(shape, block) -> Tuple[int, int]:
    return tuple(math.ceil(n / b) for n, b in zip(shape, block))


def validate(hf_config, index: Dict[str, tuple]) -> Set[str]:
    """Check the fp8 weights of `index` (hf_name -> (file, shape, dtype)) against their scales
    and the config; returns the scale tensors they consume."""
    fp8 = {n for n, (_, _, dtype) in index.items() if dtype in FP8_DTYPES}
    scales = {n for n in index if n.endswith(SCALE_SUFFIX)}
    if not fp8 and not scales:
        return set()
    check_supported(hf_config)
    block = block_size(hf_config)
    for name in sorted(fp8):
        shape = tuple(index[name][1])
        scale = name + SCALE_SUFFIX
        if len(shape) != 2:
            raise ModelError(f"{name}: fp8 tensor of shape {shape}; only 2-D weights with "
                             f"block scales are supported")
        if scale not in index:
            raise ModelError(f"{name} is stored as {index[name][2]} without {scale}; the "
                             "checkpoint is incomplete: download or copy it again")
        want = scale_shape(shape, block)
        if tuple(index[scale][1]) != want:
            raise ModelError(f"{scale}: shape {tuple(index[scale][1])}, but weight {shape} in "
                             f"blocks of {list(block)} (quantization_config.weight_block_size) "
                             f"needs {want}; is config.json the one saved with these weights?")
    orphans = sorted(s for s in scales if s[:-len(SCALE_SUFFIX)] not in fp8)
    if orphans:
        raise ModelError(f"{orphans[0]} scales a weight that is not stored as fp8 "
                         f"({len(orphans)} such scale(s)); the checkpoint is inconsistent")
    return {n + SCALE_SUFFIX for n in fp8}


class Dequantised:
    """A lazily sliceable fp32 view of an fp8 weight: indexing reads only the fp8 rows /
    columns asked for and the scale blocks covering them (tensor-parallel ranks read theirs)."""

    def __init__(self, weight, scale, block):
        self.weight, self.scale, self.block = weight, scale, block
        self.shape = tuple(_shape(weight))

    def get_shape(self):
        return list(self.shape)

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        if key and key[-1] is Ellipsis:
            key = key[:-1]
        key = key + (slice(None),) * (2 - len(key))
        ranges = []
        for k, n in zip(key, self.shape):
            if not isinstance(k, slice) or k.step not in (None, 1):
                raise TypeError(f"fp8 weights support contiguous slices only, got {key}")
            start, stop, _ = k.indices(n)
            ranges.append((start, max(start, stop)))
        (r0, r1), (c0, c1) = ranges
        (bm, bn) = self.block
        w = torch.as_tensor(self.weight[r0:r1, c0:c1]).float()
        if w.numel() == 0:
            return w
        # the scale blocks covering rows r0..r1 and columns c0..c1
        s = torch.as_tensor(self.scale[r0 // bm:(r1 - 1) // bm + 1, c0 // bn:(c1 - 1) // bn + 1]).float()
        s = s.repeat_interleave(bn, 1)[:, c0 % bn:c0 % bn + (c1 - c0)]
        # in place, one block row at a time: no second weight-sized tensor for the scales
        for i in range(s.shape[0]):
            first = (r0 // bm + i) * bm - r0  # block row i's first row, relative to r0
            w[max(0, first):first + bm].mul_(s[i])
        return w


def _shape(x):
    return tuple(x.shape) if hasattr(x, "shape") else tuple(x.get_shape())


def dequantising_reader(read, index: Dict[str, tuple], hf_config):
    """Wrap `read(hf_name) -> slice` so fp8 weights come back dequantised (fp32)."""
    fp8 = {n for n, (_, _, dtype) in index.items() if dtype in FP8_DTYPES}
    if not fp8:
        return read
    block = block_size(hf_config)

    def reader(name):
        if name in fp8:
            return Dequantised(read(name), read(name + SCALE_SUFFIX), block)
        return read(name)
    return reader


def unquantised_config(hf_config):
    """A copy of the config without quantization_config, for checkpoints written from the
    (dequantised) model: transformers would otherwise expect fp8 tensors with scales."""
    if getattr(hf_config, "quantization_config", None) is None:
        return hf_config
    out = copy.deepcopy(hf_config)
    del out.quantization_config
    return out


WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def block_fp8_dir(model_path) -> Optional[dict]:
    """quantization_config of `model_path`'s config.json when it is block-wise fp8 (what makes
    SGLang build FP8 linears: float8 `weight` + `weight_scale_inv` blocks), else None."""
    import json
    import os
    path = os.path.join(str(model_path), "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        q = json.load(f).get("quantization_config")
    return q if isinstance(q, dict) and q.get("quant_method") == "fp8" and q.get("weight_block_size") else None


def unquantised_model_dir(model_path: str, out_dir: str) -> str:
    """A copy of a model directory without its weights and without quantization_config in
    config.json (tokenizer, generation config and code files kept): an engine started on it
    with load_format='dummy' builds bf16 linears and takes the trainer's bf16 weights."""
    import json
    import os
    import shutil
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(model_path):
        src = os.path.join(model_path, name)
        if os.path.isfile(src) and not name.endswith(WEIGHT_FILES) and name != "config.json":
            shutil.copy2(src, os.path.join(out_dir, name))
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
