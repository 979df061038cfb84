"""Test double of the parameters SGLang builds for a block-FP8 model directory, and of loading
into them.

Mirrors sglang/srt/layers/quantization/fp8.py: with ``quantization_config`` {quant_method: fp8,
weight_block_size: [bn, bk]} in config.json (``Fp8Config.from_config``; ``ignored_layers`` /
``modules_to_not_convert`` stay unquantised) every linear layer gets ``Fp8LinearMethod``'s
parameters (``create_weights``): ``weight`` in float8_e4m3fn and ``weight_scale_inv``, float32
of [ceil(out / bn), ceil(in / bk)]. The real loader copies whatever arrives into them (a bf16
tensor is cast to fp8 with no scale: garbage, silently); the double refuses it. The linears are
named as DeepSeek-V3's release quantises them (``*_proj.weight``, ``*_proj_with_mqa.weight``; the
router gate, embeddings, norms and lm_head are not linears of this method). What is loaded is
dequantised for the CPU model that generates (``process_weights_after_loading`` keeps FP8 on GPU).
"""
import json
import math
import os
import re

import torch

LINEAR = re.compile(r"_proj(_with_mqa)?\.weight$")
SCALE = "_scale_inv"


class Fp8Linears:
    """The FP8 parameters expected for `model_path` (none when it is not block-FP8)."""

    def __init__(self, model_path):
        path = os.path.join(str(model_path), "config.json")
        quant = {}
        if os.path.isfile(path):
            with open(path) as f:
                quant = json.load(f).get("quantization_config") or {}
        self.block = tuple(quant["weight_block_size"]) if quant.get("quant_method") == "fp8" else None
        self.ignored = list(quant.get("ignored_layers") or quant.get("modules_to_not_convert") or [])
        self.pending = {}  # a weight or a scale waiting for its partner

    def is_fp8(self, name: str) -> bool:
        return (self.block is not None and bool(LINEAR.search(name))
                and not any(name.startswith(prefix) for prefix in self.ignored))

    def load(self, named):
        """The (name, tensor) the model's parameters take; raises ValueError as a load failure."""
        out = []
        for name, t in named:
            base = name[:-len(SCALE)] if name.endswith(SCALE) else name
            if not self.is_fp8(base):
                if name.endswith(SCALE):
                    raise ValueError(f"{name}: no FP8 linear of this model has such a scale")
                out.append((name, t))
                continue
            if name == base and t.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{name}: a {t.dtype} tensor for an FP8 linear: this model directory is "
                                 f"block-FP8 (quantization_config), so the parameter is float8_e4m3fn with "
                                 f"{name}{SCALE} blocks of {list(self.block)}")
            if name != base and t.dtype != torch.float32:
                raise ValueError(f"{name}: {t.dtype}, the block scales are float32")
            self.pending[name] = t
            weight, scale = self.pending.get(base), self.pending.get(base + SCALE)
            if weight is None or scale is None:
                continue
            want = tuple(math.ceil(n / b) for n, b in zip(weight.shape, self.block))
            if tuple(scale.shape) != want:
                raise ValueError(f"{base}{SCALE}: shape {tuple(scale.shape)}, weight {tuple(weight.shape)} in "
                                 f"blocks of {list(self.block)} needs {want}")
            del self.pending[base], self.pending[base + SCALE]
            from engine.models.fp8 import Dequantised
            out.append((base, Dequantised(weight, scale, self.block)[:, :]))
        return out

    def finish(self):
        if self.pending:
            raise ValueError(f"{sorted(self.pending)[:3]}: an FP8 weight or scale without its partner at the "
                             f"end of the update")
