"""HuggingFace safetensors <-> Megatron dist_checkpointing conversion.

    # HF -> Megatron at TP=2 (the layout's 2 CPU ranks spawned here unless --nproc says
    # otherwise; or run the same under torchrun)
    python tools/convert_checkpoint.py hf-to-mcore --hf HF_DIR --out CKPT --tp 2
    # Megatron -> HF (any layout the checkpoint can be read at; default one process)
    python tools/convert_checkpoint.py mcore-to-hf --ckpt CKPT --out HF_OUT
    # a LoRA run (actor_rollout_ref.model.lora_rank > 0): its checkpoint holds adapters only
    python tools/convert_checkpoint.py lora-to-hf --ckpt RUN/global_step_N --base BASE_HF --out OUT
    python tools/convert_checkpoint.py lora-to-hf --ckpt RUN/global_step_N --format peft \
        --hf-config BASE_HF --out ADAPTER_DIR

hf-to-mcore builds the model at the layout asked for, each rank reads only its slices of the
HF tensors (engine.models.hf_io), and saves `dist_checkpointing` shards plus
`trident_meta.json` (source layout, dtype) and `hf_config/` (config + tokenizer files), which
mcore-to-hf uses unless --hf-config is given. mcore-to-hf loads the checkpoint at the layout
asked for and streams global tensors, one at a time, into HF safetensors shards. Peak memory
per rank: its share of the model, plus (rank 0) the largest tensor and one output shard.
Every argument is checked before any tensor is read; missing parents of --out are created.
MoE models default to expert tensor parallel 1 (--etp). Every mistake in the input is one line,
`error: ...`, exit code 2 (engine/errors.py), and leaves no partial output directory (outputs
are written into a temporary sibling and renamed at the end).

Tests: tests/test_convert_checkpoint.py, tests/test_hf_parity.py, tests/test_fp8_checkpoint.py,
tests/test_lora_export.py
"""
import argparse
import json
import math
import os
import shutil
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from engine.errors import ArgumentParser, UsageError, UserError, report, run_main  # noqa: E402
from tools.convert_formats import log_rank0, torch_dtype_of, gguf_to_hf, lora_meta, lora_to_hf  # noqa: E402

META_FILE = "trident_meta.json"
HF_CONFIG_DIR = "hf_config"
def _state_dict_of(chunks):
    """Megatron's nesting: one chunk -> "model", virtual stages -> "model0", "model1", ..."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _shared_tmp_dir(out_dir):
    """Rank 0 makes the temporary output directory; every rank learns its path."""
    import torch.distributed as dist

    from engine.models import hf_io
    box = [None, None]
    if dist.get_rank() == 0:
        box[1] = hf_io.check_new_output_dir(out_dir)
        if box[1] is None:
            box[0] = hf_io.atomic_output_dir(out_dir)
    dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise UsageError(f"--out: {box[1]}")
    return box[0]


def hf_to_mcore(hf_dir, out_dir, layout, params_dtype="auto"):
    """Convert on the current process group (collective). Returns this rank's model chunks."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from engine.models import fp8, hf_io
    from engine.models.arch import arch_spec
    from engine.models.builder import build_model
    from parallel.mesh import init_mesh

    hf_config = hf_io.load_config(hf_dir)
    arch_spec(hf_config)  # unsupported architectures fail here, before any work
    index = hf_io.read_index(hf_dir)
    hf_io.validate_checkpoint(hf_config, index, hf_io.head_of(hf_config))
    init_mesh(layout)
    dtype = torch_dtype_of(params_dtype, hf_config)
    chunks = build_model(hf_config, head=hf_io.head_of(hf_config), params_dtype=dtype,
                         sequence_parallel=layout.sequence_parallel)
    hf_io.load_hf_weights(chunks, hf_dir, hf_config)
    log_rank0(f"loaded {len(index)} HF tensors from {hf_dir}")
    tmp = _shared_tmp_dir(out_dir)
    try:
        dist_checkpointing.save(_state_dict_of(chunks), tmp)
        dist.barrier()
        if dist.get_rank() == 0:
            meta = dict(format="megatron dist_checkpointing", params_dtype=str(dtype).replace("torch.", ""),
                        source=os.path.abspath(hf_dir), layout=dict(layout.__dict__),
                        world_size=dist.get_world_size())
            with open(os.path.join(tmp, META_FILE), "w") as f:
                json.dump(meta, f, indent=2)
            cfg_dir = os.path.join(tmp, HF_CONFIG_DIR)
            os.makedirs(cfg_dir)
            fp8.unquantised_config(hf_config).save_pretrained(cfg_dir)  # weights now dequantised
            hf_io.copy_side_files(hf_dir, cfg_dir)
            hf_io.publish(tmp, out_dir)
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    log_rank0(f"wrote Megatron checkpoint {out_dir} (layout {layout})")
    return chunks


def mcore_to_hf(ckpt_dir, out_dir, layout, hf_config_dir=None, shard_size_mb=2000, dtype="auto"):
    """Convert on the current process group (collective)."""
    from megatron.core import dist_checkpointing

    from engine.models import hf_io
    from engine.models.builder import build_model
    from parallel.mesh import init_mesh

    from engine.checkpoint.state import check_model_matches

    meta_path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isdir(ckpt_dir) or not os.path.exists(os.path.join(ckpt_dir, "metadata.json")):
        raise UsageError(f"--ckpt {ckpt_dir!r} is not a Megatron dist checkpoint (no metadata.json)")
    check_dist_checkpoint_files(ckpt_dir)
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    hf_config_dir = hf_config_dir or os.path.join(ckpt_dir, HF_CONFIG_DIR)
    hf_config = hf_io.load_config(hf_config_dir)
    error = hf_io.check_new_output_dir(out_dir)
    if error:
        raise UsageError(f"--out: {error}")
    init_mesh(layout)
    params_dtype = torch_dtype_of(meta.get("params_dtype", "auto"), hf_config)
    # a sequence-classification config (a trained reward model) builds the value head
    chunks = build_model(hf_config, head=hf_io.head_of(hf_config), params_dtype=params_dtype,
                         sequence_parallel=layout.sequence_parallel)
    check_model_matches(chunks, ckpt_dir, fix="pass --hf-config with the config of the model it was "
                        "saved from")
    state = dist_checkpointing.load(_state_dict_of(chunks), ckpt_dir)
    for key, chunk in zip(sorted(state) if len(chunks) > 1 else ["model"], chunks):
        chunk.load_state_dict(state[key], strict=True)
    del state

    def progress(done, total, nbytes):
        if done == total or done % max(1, total // 20) == 0:
            print(f"  {done}/{total} tensors, {nbytes / 2 ** 20:.1f} MiB written", flush=True)

    hf_io.save_hf_weights(chunks, hf_config, out_dir, shard_size_mb, source_dir=hf_config_dir,
                          dtype=None if dtype == "auto" else torch_dtype_of(dtype), progress=progress)
    log_rank0(f"wrote HF checkpoint {out_dir}")


def peak_rss_mib():
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    from engine.perf import peak_rss_bytes
    return peak_rss_bytes() / 2**20


def _layout(args):
    from parallel.mesh import Layout
    return Layout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp,
                  sequence_parallel=args.tp > 1 and args.sequence_parallel)


def _run(args):
    import torch.distributed as dist
    layout = _layout(args)
    if args.command == "hf-to-mcore":
        hf_to_mcore(args.hf, args.out, layout, params_dtype=args.dtype)
    elif args.command == "lora-to-hf":
        lora_to_hf(args.ckpt, args.out, layout, base_dir=args.base, hf_config_dir=args.hf_config,
                   fmt=args.format, shard_size_mb=args.shard_size_mb, dtype=args.dtype)
    else:
        mcore_to_hf(args.ckpt, args.out, layout, hf_config_dir=args.hf_config,
                    shard_size_mb=args.shard_size_mb, dtype=args.dtype)
    if args.report_memory:
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak_rss_mib())
        log_rank0(f"peak RSS per rank (MiB): {', '.join(f'{p:.0f}' for p in peaks)}")


def _spawned_rank(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank))
    try:
        _run(args)
    except UserError as e:  # validation runs on every rank: each fails the same way
        sys.exit(report(e, rank))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    b = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    b.add_argument("--ckpt", required=True, help="Megatron dist checkpoint directory")
    b.add_argument("--hf-config", default=None,
                   help="HF directory with config.json (+ tokenizer); default: CKPT/hf_config")
    b.add_argument("--shard-size-mb", type=float, default=2000)
    c = sub.add_parser("lora-to-hf", help="LoRA run checkpoint -> merged HF weights or PEFT adapter")
    c.add_argument("--ckpt", required=True, help="global_step_N directory of a run with lora_rank > 0")
    c.add_argument("--format", choices=("merged", "peft"), default="merged",
                   help="merged: base + (alpha / r) B A as a HF model (needs --base); peft: "
                        "adapter_config.json + adapter_model.safetensors")
    c.add_argument("--base", default=None, help="the run's base HF model directory (model.path)")
    c.add_argument("--hf-config", default=None,
                   help="HF directory with config.json, for --format peft without --base")
    c.add_argument("--shard-size-mb", type=float, default=2000)
    g = sub.add_parser("gguf-to-hf", help="GGUF file -> fp32 HF safetensors (dequantised)")
    g.add_argument("--gguf", required=True)
    g.add_argument("--out", required=True, help="output directory (must not exist)")
    for s in (a, b, c):
        s.add_argument("--out", required=True, help="output directory (must not exist)")
        s.add_argument("--tp", type=int, default=1)
        s.add_argument("--pp", type=int, default=1)
        s.add_argument("--vpp", type=int, default=None)
        s.add_argument("--ep", type=int, default=1)
        s.add_argument("--etp", type=int, default=None,
                       help="expert tensor parallel size (MoE; default 1)")
        s.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                       help="with tp > 1 (Megatron requires it for MoE with TP)")
        s.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16")
        s.add_argument("--nproc", type=int, default=None,
                       help="gloo ranks to spawn here (default: the layout's size; under "
                            "torchrun, torchrun's ranks are used)")
        s.add_argument("--report-memory", action="store_true", help="print each rank's peak RSS")
    args = p.parse_args(argv)
    if args.command == "gguf-to-hf":
        return args
    for flag in ("tp", "pp", "ep", "etp", "vpp", "nproc"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag} must be >= 1, got {value}")
    return args


def _min_world(layout):
    """The fewest ranks that tile `layout`: TP x CP and the expert grid EP x ETP must both
    divide the ranks of a pipeline stage."""
    return layout.pp * math.lcm(layout.tp * layout.cp, layout.ep * layout.expert_tp)


def check_dist_checkpoint_files(ckpt_dir):
    """CheckpointError when a data file of the dist checkpoint is missing or shorter than its
    `.metadata` says (a truncated copy), before any rank reads it."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    from engine.checkpoint import CheckpointError
    if not os.path.exists(os.path.join(ckpt_dir, ".metadata")):
        raise CheckpointError(f"--ckpt {ckpt_dir!r} has no .metadata file (the index of its tensors); "
                              "it is incomplete: copy it again or convert again with hf-to-mcore")
    try:
        storage = FileSystemReader(ckpt_dir).read_metadata().storage_data
    except (OSError, EOFError, pickle.UnpicklingError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"--ckpt {ckpt_dir!r}: its .metadata cannot be read ({type(e).__name__}); "
                              "it is truncated or corrupt: copy it again or convert again") from None
    end = {}
    for info in storage.values():
        end[info.relative_path] = max(end.get(info.relative_path, 0), info.offset + info.length)
    for rel, need in sorted(end.items()):
        path = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"--ckpt {ckpt_dir!r}: file {rel!r} is missing; the checkpoint is "
                                  "incomplete: copy it again or convert again with hf-to-mcore")
        if os.path.getsize(path) < need:
            raise CheckpointError(f"--ckpt {ckpt_dir!r}: file {rel!r} has {os.path.getsize(path)} bytes "
                                  f"but its tensors end at byte {need}; the checkpoint is truncated: "
                                  "copy it again or convert again with hf-to-mcore")


def _check_layout_fits_model(args, spec):
    """The layout flags against the model's shape (Megatron's own rules), before any rank."""
    t = spec.transformer
    heads, groups, layers = t["num_attention_heads"], t.get("num_query_groups"), t["num_layers"]
    if heads % args.tp:
        raise UsageError(f"--tp {args.tp} does not divide the model's {heads} attention heads; use a "
                         f"divisor of {heads}")
    if groups and groups % args.tp and args.tp % groups:
        raise UsageError(f"--tp {args.tp} must be a multiple or a divisor of the model's {groups} "
                         "key/value heads")
    chunks = args.pp * (args.vpp or 1)
    if layers % chunks:
        raise UsageError(f"--pp {args.pp}{f' x --vpp {args.vpp}' if args.vpp else ''} = {chunks} does not "
                         f"divide the model's {layers} layers; use a divisor of {layers}")
    experts = spec.num_experts or 0
    if experts and experts % args.ep:
        raise UsageError(f"--ep {args.ep} does not divide the model's {experts} experts")
    if not experts and args.ep > 1:
        raise UsageError(f"--ep {args.ep}: the model is dense (no experts); use --ep 1")


def _check_layout_ranks(args, layout, world):
    try:
        layout.check(world)
    except ValueError as e:  # parallel/ knows nothing of the flags: name them here
        raise UsageError(f"--tp/--pp/--ep/--etp on {world} rank(s): {e}") from None


def _hf_config_dir(args):
    config_dir = args.hf_config or os.path.join(args.ckpt, HF_CONFIG_DIR)
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        if args.hf_config:
            raise UsageError(f"--hf-config {args.hf_config!r} has no config.json; pass a HF model directory")
        raise UsageError(f"--ckpt {args.ckpt!r} has no {HF_CONFIG_DIR}/config.json (it was not written by "
                         "hf-to-mcore); pass --hf-config with the HF directory of the model it was saved from")
    return config_dir


def _missing_parents(out_dir):
    """The directories above `out_dir` that do not exist yet, deepest last."""
    missing, parent = [], os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(parent):
        missing.insert(0, parent)
        parent = os.path.dirname(parent)
    return missing


def _prepare(args):
    """Check every argument before any work (and before ranks are spawned): inputs readable,
    output new, layout possible for the model and the ranks; fill in --etp and --nproc. The
    missing parents of --out are created last (and removed by main() if the conversion fails)."""
    if os.path.lexists(args.out):  # every command creates --out itself (atomically, at the end)
        raise UsageError(f"--out {args.out!r} already exists; choose a new directory (the conversion "
                         "creates it)")
    if args.command == "gguf-to-hf":
        if not os.path.isfile(args.gguf):
            raise UsageError(f"--gguf {args.gguf!r} is not a file; pass the path of a .gguf file")
    elif args.command == "hf-to-mcore" and not os.path.isdir(args.hf):
        raise UsageError(f"--hf {args.hf!r} is not a directory; pass a HF model directory "
                         "(config.json + *.safetensors)")
    elif args.command == "mcore-to-hf" and not os.path.exists(os.path.join(args.ckpt, "metadata.json")):
        raise UsageError(f"--ckpt {args.ckpt!r} is not a Megatron dist checkpoint (no "
                         "metadata.json); pass the --out of an hf-to-mcore run")
    if args.command != "gguf-to-hf" and args.dtype != "auto":
        torch_dtype_of(args.dtype)  # the name, before torch is imported for the model
    from engine.models import hf_io  # torch, safetensors, transformers: after the cheap checks
    from engine.models.arch import arch_spec

    if args.command == "hf-to-mcore":
        hf_config = hf_io.load_config(args.hf)
        arch_spec(hf_config)  # unsupported architectures / RoPE fail here
        hf_io.validate_checkpoint(hf_config, hf_io.read_index(args.hf), hf_io.head_of(hf_config))
    elif args.command == "lora-to-hf":
        lora_meta(args.ckpt)
        if args.format == "merged" and not args.base:
            raise UsageError("--format merged needs --base, the run's base HF model directory "
                             "(actor_rollout_ref.model.path); or use --format peft")
        source = args.base or args.hf_config
        if not source:
            raise UsageError("--format peft needs --hf-config (a directory with the model's "
                             "config.json) or --base")
        hf_config = hf_io.load_config(source)
        if args.base:
            hf_io.validate_checkpoint(hf_config, hf_io.read_index(args.base))
    elif args.command == "mcore-to-hf":
        hf_config = hf_io.load_config(_hf_config_dir(args))
        arch_spec(hf_config)
        check_dist_checkpoint_files(args.ckpt)
    error = hf_io.check_new_output_dir(args.out)
    if error:
        raise UsageError(f"--out: {error}")
    if args.command not in ("gguf-to-hf", "lora-to-hf"):
        _prepare_layout(args, hf_config, arch_spec(hf_config))
    args.new_parents = _missing_parents(args.out)
    hf_io.make_parent_dirs(args.out)


def _prepare_layout(args, hf_config, spec):
    rank0 = os.environ.get("RANK", "0") == "0"
    if args.etp is None and spec.num_experts:
        # Megatron's default (etp = tp) needs ep x tp ranks per stage; experts whole per rank
        # work at any tp and are what Megatron requires for biased expert layers anyway.
        args.etp = 1
        if rank0 and args.tp > 1:
            print(f"--etp not given: expert tensor parallel 1 for this MoE model (experts whole "
                  f"on each rank); pass --etp {args.tp} to split them over tp", flush=True)
    _check_layout_fits_model(args, spec)
    layout = _layout(args)
    if "WORLD_SIZE" in os.environ and args.nproc is None:
        _check_layout_ranks(args, layout, int(os.environ["WORLD_SIZE"]))
        return
    if args.nproc is None:
        args.nproc = _min_world(layout)
        if args.nproc > 1:
            print(f"--nproc not given: running the layout's {args.nproc} ranks here", flush=True)
    _check_layout_ranks(args, layout, args.nproc)


def _remove_new_parents(args):
    """Undo `_prepare`'s parent directories after a failed conversion (those still empty)."""
    for path in reversed(getattr(args, "new_parents", [])):
        try:
            os.rmdir(path)
        except OSError:
            break


def main(argv=None):
    return run_main(_main, argv)


def _main(argv=None):
    args = parse_args(argv)
    ok = False
    try:
        _prepare(args)
        if args.command == "gguf-to-hf":
            gguf_to_hf(args.gguf, args.out)
        elif args.nproc and args.nproc > 1:
            import torch.multiprocessing as mp
            try:
                mp.spawn(_spawned_rank, args=(args, _free_port()), nprocs=args.nproc, join=True)
            except mp.ProcessExitedException as e:  # the ranks said why (rank 0, one line)
                return 2 if e.exit_code == 2 else 1
        else:
            if "WORLD_SIZE" not in os.environ:
                os.environ.update(MASTER_PORT=str(_free_port()))
            _run(args)
        ok = True
    finally:
        if not ok and os.environ.get("RANK", "0") == "0":
            _remove_new_parents(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
