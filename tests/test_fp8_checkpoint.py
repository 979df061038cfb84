"""Block-wise FP8 checkpoints (DeepSeek-V3's release format): float8_e4m3fn weights with
`weight_scale_inv` blocks are dequantised on direct load and by the converter, equal to loading
the same weights dequantised by a plain per-block loop here; ragged last blocks and
tensor-parallel slices that start inside a block included. Bad fp8 checkpoints get one clear
error."""
import json
import math
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from engine.models import fp8, hf_io, weights
from tests.multirank import run_on_ranks
from tests.test_hf_parity import deepseek_v3_config, read_all, save_random_model

BLOCK = [4, 8]  # rectangular, so a rows / columns mix-up shows; dividing none of the odd dims
QUANTISED = re.compile(r"_proj(_with_mqa)?\.weight$")  # linear layers, as in the release
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def odd_deepseek_config():
    # dims that are not multiples of the block: ragged last blocks everywhere
    return deepseek_v3_config(num_hidden_layers=2, hidden_size=36, intermediate_size=22,
                              moe_intermediate_size=10, q_lora_rank=10, kv_lora_rank=10,
                              qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=6)


def quantise(w, bm, bn):
    """Per-block absmax fp8 quantisation: (fp8 tensor, fp32 scale_inv [ceil(r/bm), ceil(c/bn)])."""
    rows, cols = math.ceil(w.shape[0] / bm), math.ceil(w.shape[1] / bn)
    q, s = torch.empty(w.shape, dtype=torch.float8_e4m3fn), torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            s[i, j] = blk.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def dequantise(q, s, bm, bn):
    out = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
            out[rows, cols] = q[rows, cols].float() * s[i, j]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(fp8 checkpoint dir, the same weights dequantised in fp32, number of fp8 tensors)."""
    root = tmp_path_factory.mktemp("fp8")
    src, q_dir, ref_dir = (str(root / n) for n in ("src", "fp8", "ref"))
    save_random_model(odd_deepseek_config(), src)
    tensors = read_all(src)
    quantised, reference = {}, {}
    for name, t in tensors.items():
        if QUANTISED.search(name):
            q, s = quantise(t, *BLOCK)
            quantised[name], quantised[name + "_scale_inv"] = q, s
            reference[name] = dequantise(q, s, *BLOCK)
        else:
            quantised[name] = reference[name] = t
    config = json.load(open(os.path.join(src, "config.json")))
    for d, ts, cfg in ((q_dir, quantised, dict(config, quantization_config=dict(
            activation_scheme="dynamic", fmt="e4m3", quant_method="fp8", weight_block_size=BLOCK))),
            (ref_dir, reference, config)):
        os.makedirs(d)
        save_file(ts, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    n = sum(1 for t in quantised.values() if t.dtype == torch.float8_e4m3fn)
    return q_dir, ref_dir, n


def test_lazy_dequantised_slices_match_the_block_loop():
    torch.manual_seed(0)
    w = torch.randn(13, 19)
    q, s = quantise(w, *BLOCK)
    full = dequantise(q, s, *BLOCK)
    view = fp8.Dequantised(q, s, tuple(BLOCK))
    assert torch.equal(view[...], full)
    for rows, cols in [((0, 13), (0, 19)), ((3, 9), (5, 17)), ((12, 13), (18, 19)), ((5, 6), (0, 19))]:
        got = view[slice(*rows), slice(*cols)]
        assert torch.equal(got, full[slice(*rows), slice(*cols)]), (rows, cols)
    assert (full - w).abs().max() < 0.1 * w.abs().max()  # really a quantisation of w


def _load_both(q_dir, ref_dir, layout_kwargs, work):
    from engine.models.builder import build_model
    from parallel.mesh import Layout, init_mesh
    from tools.convert_checkpoint import hf_to_mcore, mcore_to_hf

    layout = Layout(**layout_kwargs)
    loaded = []
    for d in (q_dir, ref_dir):
        init_mesh(layout)
        chunks = build_model(hf_io.load_config(d), params_dtype=torch.float32,
                             sequence_parallel=layout.sequence_parallel)
        hf_io.load_hf_weights(chunks, d)
        loaded.append({k: v.clone() for c in chunks for k, v in c.state_dict().items()
                       if isinstance(v, torch.Tensor)})
    # the converter: fp8 HF -> Megatron at this layout -> HF at TP=EP=1
    hf_to_mcore(q_dir, os.path.join(work, "mcore"), layout, params_dtype="float32")
    mcore_to_hf(os.path.join(work, "mcore"), os.path.join(work, "back"), Layout())
    return loaded


def test_fp8_load_equals_dequantised_load_and_converts(checkpoints, tmp_path):
    q_dir, ref_dir, n_fp8 = checkpoints
    assert n_fp8 > 30
    # TP=2 slices rows / columns that start inside a block (e.g. o_proj's 24 columns by 8)
    results = run_on_ranks(_load_both, 2, q_dir, ref_dir,
                           dict(tp=2, ep=2, etp=1, sequence_parallel=True), str(tmp_path))
    for from_fp8, from_ref in results:
        assert set(from_fp8) == set(from_ref)
        for k in from_ref:
            assert torch.equal(from_fp8[k], from_ref[k]), k
    reference, back = read_all(ref_dir), read_all(str(tmp_path / "back"))
    assert set(back) == set(reference)  # no *_scale_inv left: the output is plain fp32
    for k, t in reference.items():
        assert back[k].dtype == torch.float32 and torch.equal(back[k], t), k
    config = json.load(open(tmp_path / "back" / "config.json"))
    assert "quantization_config" not in config


def _fp8_index(q_dir, edit=None):
    index = hf_io.read_index(q_dir)
    return edit(dict(index)) if edit else index


def test_bad_fp8_checkpoints_are_named(checkpoints):
    q_dir, _, _ = checkpoints
    cfg = hf_io.load_config(q_dir)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    hf_io.validate_checkpoint(cfg, _fp8_index(q_dir))  # the good one passes

    def drop_scale(ix):
        ix.pop(name + "_scale_inv")
        return ix
    with pytest.raises(ValueError, match=rf"{re.escape(name)} is stored as F8_E4M3 without "
                                         rf"{re.escape(name)}_scale_inv"):
        hf_io.validate_checkpoint(cfg, _fp8_index(q_dir, drop_scale))

    def wrong_scale(ix):
        path, _, dtype = ix[name + "_scale_inv"]
        ix[name + "_scale_inv"] = (path, (1, 1), dtype)
        return ix
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight_scale_inv: shape \(1, 1\).*blocks of "
                                         r"\[4, 8\].*needs \(12, 2\)"):
        hf_io.validate_checkpoint(cfg, _fp8_index(q_dir, wrong_scale))

    cfg.quantization_config = dict(cfg.quantization_config, weight_block_size=None)
    with pytest.raises(ValueError, match=r"quantization_config\.weight_block_size=None.*\[128, 128\]"):
        hf_io.validate_checkpoint(cfg, _fp8_index(q_dir))


def test_other_quantisation_is_refused_by_name():
    cfg = odd_deepseek_config()
    cfg.quantization_config = dict(quant_method="awq", bits=4)
    index = {n: ("x", s, "F32") for n, s in weights.expected_hf_tensors(cfg).items()}
    index["model.layers.0.mlp.up_proj.qweight"] = ("x", (2, 2), "I32")
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method='awq'.*unquantised"):
        hf_io.validate_checkpoint(cfg, index)


# -- the SGLang rollout of a block-FP8 model directory -------------------------------------

FAKES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakes")


@pytest.fixture
def double(monkeypatch):
    """The recording SGLang double as `sglang` (one process, one GPU: WORLD_SIZE=1)."""
    import sys
    monkeypatch.syspath_prepend(FAKES)
    monkeypatch.setenv("WORLD_SIZE", "1")
    import sglang
    sglang.RECORDS.clear()
    yield sglang
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        sys.modules.pop(name)


def _shared(double, tensors):
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    from sglang.srt.utils.common import MultiprocessingSerializer as S
    return [(n, LocalSerializedTensor(values=[S.serialize(t)])) for n, t in tensors.items()]


def test_double_expects_sglang_fp8_parameters(checkpoints, double):
    """Given the FP8 directory the double holds FP8 linears: float8 `weight` + float32
    `weight_scale_inv` blocks load (and dequantise to the reference weights); a bf16 weight or
    a scale of the wrong shape for such a linear is refused."""
    from tests.test_hf_parity import read_all
    q_dir, ref_dir, n_fp8 = checkpoints
    quantised, reference = read_all(q_dir), read_all(ref_dir)
    engine = double.Engine(model_path=q_dir, tp_size=1, load_format="dummy", dtype="float32")
    try:
        engine.begin_weight_update()
        linear = next(n for n in quantised if QUANTISED.search(n))
        ok, message = engine.update_weights_from_tensor(_shared(double, {linear: reference[linear].bfloat16()}))
        assert not ok and "float8_e4m3fn" in message and linear in message
        bad = {linear: quantised[linear], linear + "_scale_inv": quantised[linear + "_scale_inv"][:, :-1]}
        ok, message = engine.update_weights_from_tensor(_shared(double, bad))
        assert not ok and "needs" in message
        engine.fp8.pending.clear()
        known = set(engine.rollout.checkpoint_names())  # the checkpoint also stores buffers
        ok, message = engine.update_weights_from_tensor(_shared(double, {
            n: t for n, t in quantised.items() if n.removesuffix("_scale_inv") in known}))
        assert ok, message
        assert engine.end_weight_update()[0]
        held = dict(engine.rollout.model.state_dict())
        assert sum(1 for n in quantised if n.endswith("_scale_inv")) == n_fp8 > 0
        for name in (linear, "model.embed_tokens.weight"):
            assert torch.equal(held[name], reference[name].to(held[name].dtype)), name
    finally:
        engine.shutdown()


def test_rollout_of_an_fp8_dir_loads_in_bf16_from_the_sync(checkpoints, double, capsys):
    """The adapter starts SGLang on the FP8 directory's config without quantization_config
    (said in the log) and streams the trainer's unquantised weights, which then load."""
    from engine.models.hf_io import load_config
    from engine.rollout.sglang import SGLangRollout
    from tests.test_hf_parity import read_all
    q_dir, ref_dir, _ = checkpoints
    rollout = SGLangRollout(load_config(q_dir), model_path=q_dir, dtype="float32")
    try:
        rollout.begin_weight_update()
        known = set(rollout.engine.rollout.checkpoint_names())
        rollout.update_weights([(n, t) for n, t in read_all(ref_dir).items() if n in known])  # the trainer's
        rollout.finish_weight_update()
        init = [e for e in double.RECORDS if e["kind"] == "init"][0]
        engine_dir = init["kwargs"]["model_path"]
        assert engine_dir != q_dir and "quantization_config" not in json.load(open(f"{engine_dir}/config.json"))
        assert not any(f.endswith(".safetensors") for f in os.listdir(engine_dir))
        out = capsys.readouterr().out
        assert f"{q_dir} is block-FP8" in out and "loads it in bf16" in out
    finally:
        rollout.shutdown()
    with pytest.raises(ValueError, match="load_format='dummy'"):
        SGLangRollout(load_config(q_dir), model_path=q_dir, load_format="auto")
