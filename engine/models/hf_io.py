"""Read and write HuggingFace safetensors checkpoints directly from / into Megatron model chunks.

Loading: every rank opens the checkpoint's files and reads only the rows / columns of each
tensor it owns (`parallel.shards.load_global` slicing a `weights.LazyGlobal`). The checkpoint
is validated first: readable headers, every expected tensor present with its shape, nothing
left unused.

Saving: global tensors are gathered over TP and streamed to rank 0 one at a time in a fixed
order (computed from the config), split into HF tensors, and written in shards of about
`shard_size_mb` into a temporary directory that is renamed into place at the end. Peak extra
memory on rank 0: the largest global tensor plus one output shard.

Tests: tests/test_hf_parity.py, tests/test_convert_checkpoint.py, tests/test_fp8_checkpoint.py
"""
import glob
import json
import os
import re
import shutil
import tempfile
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from engine.errors import ModelError, UserError
from engine.models import fp8, lora, weights
from parallel import fsdp
from parallel.shards import gather_global, load_global, local_shards

INDEX_FILE = "model.safetensors.index.json"
# Files beside the weights that a HF model directory needs (tokenizer, generation defaults).
_SIDE_FILES = ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt",
               "generation_config.json", "chat_template*", "added_tokens.json")
_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_BUFFERS = re.compile(r"\.router\.expert_bias$")  # persistent buffers that are checkpoint weights


# ----------------------------------------------------------------------------------- reading
def _no_safetensors_message(hf_dir):
    """Why a directory without safetensors cannot be read, with the command that fixes it."""
    present = os.listdir(hf_dir)
    if any(re.match(r"pytorch_model.*\.bin$", n) for n in present):
        new = hf_dir.rstrip("/") + "-safetensors"
        return (f"{hf_dir!r} holds PyTorch .bin weights (pytorch_model*.bin) but no "
                "*.safetensors, and Trident reads safetensors only: convert once with "
                f"transformers, AutoModelForCausalLM.from_pretrained({hf_dir!r})"
                f".save_pretrained({new!r}) (and the same with AutoTokenizer), then pass {new!r}")
    if any(n.endswith(".gguf") for n in present):
        return (f"{hf_dir!r} holds a .gguf file but no *.safetensors; convert it with "
                "python tools/convert_checkpoint.py gguf-to-hf --gguf FILE.gguf --out NEW_DIR")
    return (f"{hf_dir!r} holds no *.safetensors files; pass a HuggingFace model directory "
            "(config.json + model*.safetensors)")


def read_index(hf_dir: str) -> Dict[str, Tuple[str, Tuple[int, ...], str]]:
    """hf_name -> (file, shape, dtype) from the safetensors headers of a HF model directory."""
    if not os.path.isdir(hf_dir):
        raise ModelError(f"HF checkpoint directory {hf_dir!r} does not exist")
    index_path = os.path.join(hf_dir, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise ModelError(_no_safetensors_message(hf_dir))
    out = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.exists(path):
            raise ModelError(f"{INDEX_FILE} lists {name!r}, which is missing from {hf_dir!r}")
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    s = f.get_slice(key)
                    out[key] = (path, tuple(s.get_shape()), s.get_dtype())
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ModelError(f"{path}: not a readable safetensors file ({e}); it is probably "
                             "truncated or corrupt: download or copy it again") from e
    return out


# A scalar-head model (critic, reward model) reads its head from a sequence-classification
# checkpoint's `score.weight` [1, hidden] when there is one; a critic started from a causal LM
# keeps its freshly initialised head, and neither needs the LM head.
SCORE_HEAD = "score.weight"
VALUE_HEAD = "value_head.weight"


def sequence_classification_config(hf_config, pad_token_id):
    """A copy of a causal-LM config as the `*ForSequenceClassification` with one label that a
    value-head model (a trained reward model) is saved as; transformers finds each sequence's
    last token through `pad_token_id`."""
    import copy

    from engine.models.arch import architecture_of
    cfg = copy.deepcopy(hf_config)
    cfg.architectures = [architecture_of(cfg).replace("ForCausalLM", "ForSequenceClassification")]
    cfg.num_labels = 1
    cfg.pad_token_id = pad_token_id
    return cfg


def head_of(hf_config) -> str:
    """'value' for a sequence-classification (reward model) config, else 'lm'."""
    archs = getattr(hf_config, "architectures", None) or []
    return "value" if any(a.endswith("ForSequenceClassification") for a in archs) else "lm"


def _hf_order(hf_config, value_head: bool):
    """Global tensors in save order with their shapes; a value-head model has the score head
    in place of the output layer."""
    shapes = weights.global_shapes(hf_config)
    if value_head:
        shapes.pop("output_layer.weight", None)
        shapes[VALUE_HEAD] = (1, hf_config.hidden_size)
    return shapes


def _to_hf(hf_config, name, tensor):
    if name == VALUE_HEAD:
        return [(SCORE_HEAD, tensor)]
    return weights.megatron_to_hf(hf_config, name, tensor)


def validate_checkpoint(hf_config, index, head: str = "lm") -> None:
    """One clear error unless the checkpoint holds exactly the tensors this config needs
    (block-wise fp8 weights with their `*_scale_inv` scales count as those tensors)."""
    scales = fp8.validate(hf_config, index)
    try:
        _check_names(hf_config, {n: v for n, v in index.items() if n not in scales}, head)
    except ValueError:
        fp8.check_supported(hf_config)  # a quantised checkpoint explains a mismatch better
        raise


def _check_names(hf_config, index, head):
    expected = dict(weights.expected_hf_tensors(hf_config))
    if head == "value":
        for name in [n for n in expected if n not in index and n.startswith("lm_head.")]:
            expected.pop(name)  # a reward-model checkpoint has a score head instead
        if SCORE_HEAD in index:
            expected[SCORE_HEAD] = (1, hf_config.hidden_size)
    missing = sorted(set(expected) - set(index))
    if missing:
        raise ModelError(f"checkpoint is missing {len(missing)} tensor(s) the config needs, e.g. "
                         f"{missing[:3]}; is config.json the one saved with these weights?")
    wrong = [(n, index[n][1], expected[n]) for n in expected if tuple(index[n][1]) != tuple(expected[n])]
    if wrong:
        n, got, want = wrong[0]
        raise ModelError(f"{n}: shape {tuple(got)} in {index[n][0]}, the config implies "
                         f"{tuple(want)} ({len(wrong)} tensor(s) disagree); is config.json the "
                         "one saved with these weights?")
    unused = sorted(n for n in set(index) - set(expected) if not weights.ignored_hf_tensor(hf_config, n))
    if unused:
        raise ModelError(f"checkpoint holds {len(unused)} tensor(s) this config does not use, "
                         f"e.g. {unused[:3]}; is config.json the one saved with these weights?")


def _global_buffers(chunks):
    """(buffer, global name) of the persistent buffers that are checkpoint weights."""
    out = []
    for chunk in chunks:
        model = chunk
        while not hasattr(model, "decoder") and hasattr(model, "module"):
            model = model.module
        for name, buf in model.named_buffers():
            if not _BUFFERS.search(name):
                continue
            m = _LAYER.match(name)
            layer = model.decoder.layers[int(m.group(2))]
            out.append((buf, f"{m.group(1)}{layer.layer_number - 1}{m.group(3)}"))
    return out


def load_config(hf_dir):
    import transformers
    try:
        return transformers.AutoConfig.from_pretrained(hf_dir)
    except Exception as e:
        raise ModelError(f"cannot read the HF config in {hf_dir!r}: {e}") from e


@torch.no_grad()
def load_hf_weights(chunks, hf_dir: str, hf_config=None) -> None:
    """Fill this rank's model chunks from the HF safetensors checkpoint in `hf_dir`, reading
    only the slices this rank owns. Validates the checkpoint against the config first."""
    hf_config = hf_config or load_config(hf_dir)
    index = read_index(hf_dir)
    head = "value" if any(s.global_name == VALUE_HEAD for _, s in local_shards(chunks)) else "lm"
    validate_checkpoint(hf_config, index, head)
    handles = {}

    def read(hf_name):
        path = index[hf_name][0]
        if path not in handles:
            handles[path] = safe_open(path, framework="pt")
        return handles[path].get_slice(hf_name)

    read = fp8.dequantising_reader(read, index, hf_config)

    def get(global_name):
        if lora.is_adapter_name(global_name):
            return None  # LoRA adapters keep their initialisation: the checkpoint is the base
        if global_name == VALUE_HEAD:
            return read(SCORE_HEAD) if SCORE_HEAD in index else None  # None: keep the init
        return weights.megatron_from_hf(hf_config, global_name, read)

    try:
        load_global(chunks, get)
        for buf, name in _global_buffers(chunks):
            buf.copy_(get(name)[...])
    finally:
        handles.clear()


# ----------------------------------------------------------------------------------- writing
def _save_dtype(hf_config, dtype):
    if dtype is not None:
        return dtype
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else torch.float32


def _owned(chunks):
    """global name -> (tensor, Shard or None) of what this rank holds."""
    mine = {}
    for param, shard in local_shards(chunks):
        mine.setdefault(shard.global_name, (fsdp.value(param).detach(), shard))
    for buf, name in _global_buffers(chunks):
        mine.setdefault(name, (buf, None))
    return mine


def _gather_group_ranks(shard):
    from megatron.core import parallel_state as ps
    if shard is None or shard.dim is None or shard.count == 1:
        return None
    group = ps.get_expert_tensor_parallel_group() if shard.expert else ps.get_tensor_model_parallel_group()
    return dist.get_process_group_ranks(group)


def fail_together(error: Optional[str], cls=ValueError):
    """Raise the same error on every rank if any rank found one (no rank left waiting)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise cls(first)


def copy_side_files(src_dir: Optional[str], dst_dir: str):
    """Tokenizer and generation files from a HF model directory (config.json is written anew)."""
    if not src_dir:
        return
    for pattern in _SIDE_FILES:
        for path in glob.glob(os.path.join(src_dir, pattern)):
            if os.path.isfile(path):
                shutil.copy2(path, os.path.join(dst_dir, os.path.basename(path)))


def check_new_output_dir(out_dir: str) -> Optional[str]:
    """Why `out_dir` cannot be written, or None. Missing parents are fine: they are created
    (as save_pretrained does) unless something in the way is a file or is read-only."""
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        return f"output directory {out_dir!r} already exists and is not empty; choose a new path"
    ancestor = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return f"output directory {out_dir!r} cannot be created: {ancestor!r} is a file; choose another path"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"output directory {out_dir!r} cannot be created: {ancestor!r} is not writable; choose another path"
    return None


def make_parent_dirs(out_dir: str) -> str:
    """Create the missing parents of `out_dir` (not `out_dir` itself); returns the parent."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    return parent


def atomic_output_dir(out_dir: str) -> str:
    """A fresh temporary sibling of `out_dir` (same filesystem, so renaming is atomic)."""
    parent = make_parent_dirs(out_dir)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.tmp-", dir=parent)


def publish(tmp_dir: str, out_dir: str):
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    os.rename(tmp_dir, out_dir)


class _ShardWriter:
    """Accumulates HF tensors and writes ~`limit` bytes per safetensors file (rank 0)."""

    def __init__(self, directory, limit_bytes):
        self.dir, self.limit = directory, limit_bytes
        self.pending, self.pending_bytes, self.files, self.weight_map = {}, 0, [], {}
        self.total_bytes = 0

    def add(self, name, tensor):
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self):
        if not self.pending:
            return
        part = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, os.path.join(self.dir, part), metadata={"format": "pt"})
        self.files.append((part, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self):
        self.flush()
        n = len(self.files)
        for i, (part, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(self.dir, part), os.path.join(self.dir, final))
            self.weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": dict(sorted(self.weight_map.items()))}
        with open(os.path.join(self.dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)


@torch.no_grad()
def save_hf_weights(chunks, hf_config, out_dir: str, shard_size_mb: float = 2000, **kw) -> None:
    """`write_hf_weights` with a fully sharded model's parameters gathered (parallel/fsdp.py)."""
    with fsdp.gathered(chunks):
        write_hf_weights(chunks, hf_config, out_dir, shard_size_mb, **kw)


def write_hf_weights(chunks, hf_config, out_dir: str, shard_size_mb: float = 2000, *,
                     source_dir: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                     progress: Optional[Callable[[int, int, int], None]] = None) -> None:
    """Write the model held by all ranks' chunks as a HF checkpoint into `out_dir` (collective:
    every rank calls it). Tensors are cast to `dtype` (default: the config's dtype; the router's
    expert bias stays fp32). `source_dir`: a HF model directory whose tokenizer files are copied.
    `progress(tensors_done, tensors_total, bytes_done)` is called on rank 0. A value-head model
    (a reward model) is saved with its head as `score.weight`, under the config that
    `sequence_classification_config` makes."""
    rank = dist.get_rank()
    spec = lora.spec_of(chunks)
    # a LoRA model is written merged (W + scale B A); every rank holds the small full adapters
    adapters = lora.full_adapters(chunks) if spec is not None else {}
    mine = {n: v for n, v in _owned(chunks).items() if not lora.is_adapter_name(n)}
    metas = [None] * dist.get_world_size()
    dist.all_gather_object(metas, {n: str(t.dtype).replace("torch.", "") for n, (t, _) in mine.items()})
    fail_together(check_new_output_dir(out_dir) if rank == 0 else None, UserError)
    value_head = any(VALUE_HEAD in m for m in metas)
    shapes = _hf_order(hf_config, value_head)
    order = list(shapes)
    if value_head and not any(a.endswith("ForSequenceClassification")  # a caller's bug
                              for a in getattr(hf_config, "architectures", None) or []):
        raise ValueError("a value-head model is saved as a sequence-classification model; pass "
                         "the config from hf_io.sequence_classification_config(hf_config, pad)")
    held = set().union(*[set(m) for m in metas])
    absent = [n for n in order if n not in held]
    extra = sorted(held - set(order))
    if absent or extra:  # a bug: the chunks were built from this config
        fail_together(f"the model chunks do not match the config: missing {absent[:3]}, "
                      f"unknown {extra[:3]}; build the model from this config")

    tmp = atomic_output_dir(out_dir) if rank == 0 else None
    save_dtype = _save_dtype(hf_config, dtype)
    writer = _ShardWriter(tmp, int(shard_size_mb * 2 ** 20)) if rank == 0 else None
    ok = False
    try:
        for i, name in enumerate(order):
            owner = min(r for r, m in enumerate(metas) if name in m)
            full = None
            if name in mine:
                tensor, shard = mine[name]
                group = _gather_group_ranks(shard)
                if group is None:
                    full = tensor if rank == owner else None
                elif owner in group:
                    full = gather_global(tensor, shard)
            if owner != 0:
                if rank == owner:
                    dist.send(full.contiguous(), dst=0)
                elif rank == 0:
                    full = torch.empty(shapes[name], dtype=getattr(torch, metas[owner][name]))
                    dist.recv(full, src=owner)
            if rank == 0:
                full = lora.merge(name, full, adapters, spec, hf_config) if adapters else full
                for hf_name, t in _to_hf(hf_config, name, full):
                    keep_fp32 = name.endswith("router.expert_bias")
                    writer.add(hf_name, t.to(torch.float32 if keep_fp32 else save_dtype))
                if progress:
                    progress(i + 1, len(order), writer.total_bytes)
        if rank == 0:
            writer.finish()
            fp8.unquantised_config(hf_config).save_pretrained(tmp)  # the tensors are not fp8
            copy_side_files(source_dir, tmp)
            publish(tmp, out_dir)
        ok = True
    finally:
        if rank == 0 and not ok and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
