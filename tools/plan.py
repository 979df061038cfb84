"""Per-rank memory plan of a recipe's Megatron layout; proposes layouts that fit.

    python tools/plan.py RECIPE.yaml [--gpus N] [--gpu-mem GiB] [--search] [--exact] [key=value ...]

What one model holds per rank (weights, grads, optimizer, activations by Korthikanti et al.)
is tools/plan_memory.py's; this file adds the phases of the memory schedule
(engine/config/phases.py), the rollout engines, the layout search, and one weight sync
(engine/rollout/transfer.py: today's bytes per GPU vs the transfer plan's, messages, and the
time estimated from --nvlink-gbps / --internode-gbps).

The rollout engines start before the training models, on a device holding only the CUDA
context and NCCL buffers (RESERVE_GIB), and size their memory as their backend does
(tools/plan_rollout.py): SGLang from what is free then, weights + KV pool =
gpu_memory_utilization x (GPU memory - RESERVE_GIB); vLLM from the whole device, weights +
activation peak + KV cache = gpu_memory_utilization x GPU memory. The training state that is not offloaded
(param/grad/optimizer_offload) stays beside them while they generate. Per phase the plan gives
what is allocated and what is reserved: the training process keeps the most it allocated since
its cache was last handed back to the device (before every rollout resume: engine/config/phases.py
cache_emptied). A layout fits when every phase's reserved memory fits under the GPU memory less
RESERVE_GIB (CUDA context, NCCL buffers, allocator fragmentation).

Tests: tests/test_plan.py, tests/test_plan_vllm.py, tests/test_phases.py, tests/test_recipes.py,
    tests/test_transfer_plan.py
"""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from engine.config import ConfigError, apply_override, derive, load_config  # noqa: E402
from engine.config.phases import PHASES, ROLLOUT_PHASES, RUNS  # noqa: E402
from engine.errors import ArgumentParser, check_output_file, positive, run_main  # noqa: E402
from tools.plan_memory import (DTYPE_BYTES, Shape, full_kl_bytes, model_memory,  # noqa: E402
                               shape_of, total_params)
from tools.plan_rollout import VLLM, engine_memory, fit_problems, utilization_that_fits  # noqa: E402

STATE_KEYS = {"params": "weights", "grads": "grads", "optimizer": "optimizer"}

GIB = 1 << 30
RESERVE_GIB = 2.0
HF_CONFIGS = os.path.join(ROOT, "recipes", "hf_configs")


# --------------------------------------------------------------------------------------------
# The model: HF config -> Megatron shape
# --------------------------------------------------------------------------------------------

def hf_config_of(model_cfg):
    """The transformers config of a recipe's model: inline `config`, the `path`'s config.json,
    or (when the path is not on this machine) recipes/hf_configs/<last path component>/."""
    import transformers

    if model_cfg.config is not None:
        from engine.loading import load_hf_config
        return load_hf_config(model_cfg)
    path = os.path.expanduser(model_cfg.path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        stand_in = os.path.join(HF_CONFIGS, os.path.basename(os.path.normpath(path)))
        if not os.path.isfile(os.path.join(stand_in, "config.json")):
            raise ConfigError(f"model.path={model_cfg.path!r} has no config.json here and there is no "
                              f"stand-in {stand_in}/config.json; download the model's config.json")
        path = stand_in
    hf = transformers.AutoConfig.from_pretrained(path)
    for key, value in (model_cfg.override_config or {}).items():
        setattr(hf, key, value)
    return hf


# --------------------------------------------------------------------------------------------
# Estimate
# --------------------------------------------------------------------------------------------

def _micro_tokens(section, cfg, dynamic_key="use_dynamic_bsz", prefix="ppo"):
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    if getattr(section, dynamic_key):
        return getattr(section, f"{prefix}_max_token_len_per_gpu")
    return getattr(section, f"{prefix}_micro_batch_size_per_gpu") * seq


def estimate(cfg, world_size: int, gpu_mem_gib: float, device: str = "cuda") -> dict:
    """Per-rank memory (bytes) of the recipe `cfg` (a TridentConfig) at `world_size` ranks.

    Returns the per-model breakdowns (actor, critic, ref), the training-phase peak, the rollout
    share, the rollout-phase resident state, what is free in the tighter phase and whether it fits.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}; use 'cuda' or 'cpu'")
    d = derive(cfg, world_size=world_size, cuda_available=device == "cuda")
    c, lay = d.config, d.layout
    arr = c.actor_rollout_ref
    hf = hf_config_of(arr.model)
    shape = shape_of(hf)
    from engine.perf import param_counts
    counts = param_counts(hf)
    from engine.config import validate_layout
    validate_layout(c, world_size, num_layers=shape.layers, num_experts=shape.experts)

    tokens = {"actor": _micro_tokens(arr.actor, c)}
    models = {"actor": model_memory(
        shape, arr.actor.megatron, lay, head="lm", tokens=tokens["actor"],
        n_micro=d.actor.grad_accum_steps or 1, train=True, device=device, strategy=arr.actor.strategy)}
    if d.use_critic:
        cshape = shape_of(hf_config_of(c.critic.model))
        tokens["critic"] = _micro_tokens(c.critic, c)
        models["critic"] = model_memory(
            cshape, c.critic.megatron, lay, head="value", tokens=tokens["critic"],
            n_micro=d.critic.grad_accum_steps or 1, train=True, device=device, strategy=c.critic.strategy)
    log_prob_tokens = _micro_tokens(arr.rollout, c, "log_prob_use_dynamic_bsz", "log_prob")
    if d.use_reference:
        models["ref"] = model_memory(shape, arr.ref.megatron, lay, head="lm", tokens=log_prob_tokens,
                                     n_micro=1, train=False, device=device, strategy=arr.ref.strategy)
    if c.reward_model.enable:
        rshape = shape_of(hf_config_of(c.reward_model.model))
        models["reward_model"] = model_memory(rshape, c.reward_model.megatron, lay, head="value",
                                              tokens=log_prob_tokens, n_micro=1, train=False, device=device)
    host = {}
    in_loss, in_reward = d.step.full_kl_in_loss, d.step.full_kl_in_reward  # the exact KL (KL_KINDS' metadata)
    if in_loss or in_reward:
        pbytes = DTYPE_BYTES[arr.actor.megatron.params_dtype] if device == "cuda" else 4
        host["ref_hidden"], extra = full_kl_bytes(shape, c, lay, math.ceil(tokens["actor"] / lay.cp),
                                                  device, pbytes)
        actor = models["actor"]
        actor["activations" if in_loss else "forward_activations"] += extra  # update | old pass
        actor["total"] += extra if in_loss else 0
    capacity = gpu_mem_gib * GIB - (RESERVE_GIB * GIB if device == "cuda" else 0)
    # free when the engines start (before the training models): SGLang's share is a fraction of
    # it, vLLM's a fraction of the whole device (tools/plan_rollout.py)
    engine_start_free = capacity if device == "cuda" else 0.0
    rollout = rollout_plan(c, world_size, shape, device, gpu_mem_gib * GIB if device == "cuda" else 0.0,
                           engine_start_free)
    rollout_share = rollout["share_per_gpu"]
    rollout["engine_start_free"] = engine_start_free
    bucket = arr.rollout.update_weights_bucket_megabytes * (1 << 20)
    phases, rollout_held = phase_peaks(d.phases, models, rollout, rollout_share, bucket, log_prob_tokens,
                                       shape, lay, split=True)
    training_alloc = {k: v - rollout_held[k] for k, v in phases.items()}
    reserved = {k: v + rollout_held[k] for k, v in d.phases.reserved(training_alloc).items()}
    peak_phase = max(reserved, key=reserved.get)
    training = max(v for k, v in phases.items() if k not in ROLLOUT_PHASES)
    rollout_phase = max(v for k, v in phases.items() if k in ROLLOUT_PHASES)
    free = capacity - reserved[peak_phase]
    if device == "cuda" and rollout["kv_cache_per_gpu"] <= 0:
        free = min(free, rollout["kv_cache_per_gpu"])  # the weights alone overflow SGLang's share
    # the most training keeps while the engine holds its KV cache: the engine's share must fit beside it
    awake = [p for p in phases if "kv_cache" in d.phases.rollout(p)]
    rollout["training_awake"] = max((reserved[p] - rollout_held[p] for p in awake), default=0.0)
    rollout["utilization_fit"] = utilization_that_fits(rollout, rollout["training_awake"], capacity)
    rollout["problems"] = fit_problems(rollout, rollout["training_awake"], capacity)
    if device == "cuda" and r_name(c) == VLLM:  # vLLM refuses to start without its share free, or a
        need = rollout["min_kv_tokens"] * rollout["kv_bytes_per_token"]  # cache for one sequence
        free = min(free, engine_start_free - rollout_share, rollout["kv_cache_per_gpu"] - need)
    return dict(device=device, world_size=world_size, gpu_mem_gib=gpu_mem_gib, rollout=rollout,
                layout=dict(tp=lay.tp, pp=lay.pp, vpp=lay.vpp, cp=lay.cp, ep=lay.ep, etp=lay.etp,
                            dp=lay.dp, expert_dp=lay.expert_dp,
                            sequence_parallel=bool(arr.actor.megatron.sequence_parallel)),
                models=models, phases=phases, reserved=reserved, peak_phase=peak_phase,
                schedule=d.phases.table(),
                host=host,
                total_params=counts.total, active_params=counts.active,
                training_peak=training, rollout_share=rollout_share,
                rollout_phase=rollout_phase, capacity=capacity, free=free, fits=free >= 0)


def phase_peaks(schedule, models, rollout, rollout_share, bucket, log_prob_tokens, s: Shape, lay,
                split=False):
    """Bytes allocated per GPU in each phase of the schedule (engine/config/phases.py), the one the
    trainer executes: the states it keeps resident, the running model's activations (a forward
    pass: one layer at a time plus the log-prob / value head; an update: what `model_memory`
    counts), and the rollout's weights (/ R) or its whole share once the KV cache is back; the
    sync adds one bucket of full tensors. `split`: also {phase: the rollout's part}."""
    out, held = {}, {}
    for phase in PHASES:
        if phase in ("old_log_prob", "ref", "values", "update_critic", "reward") and \
                RUNS[phase][0] not in models:
            continue
        total = 0.0
        for name, mem in models.items():
            total += sum(mem[STATE_KEYS[st]] for st in schedule.resident(phase, name))
        runner, trains = RUNS.get(phase, (None, False))
        if runner in models and phase != "update_weights":
            mem = models[runner]
            total += mem["activations"] if trains else mem["forward_activations"]
        memory = schedule.rollout(phase)
        held[phase] = (max(rollout_share, rollout["weights_per_gpu"]) if "kv_cache" in memory
                       else rollout["weights_per_gpu"] if "weights" in memory else 0.0)
        if phase == "update_weights":
            total += bucket
        out[phase] = total + held[phase]
    return (out, held) if split else out


def r_name(cfg) -> str:
    return cfg.actor_rollout_ref.rollout.name


def rollout_plan(cfg, world_size: int, s: Shape, device: str, total: float, start_free: float) -> dict:
    """The rollout engines (engine/rollout/topology.py) and what each GPU holds for them: the
    model's weights split over the engine's R GPUs and the KV cache in the rest of the engine's
    share, as its backend sizes it (tools/plan_rollout.py engine_memory: SGLang's share is
    gpu_memory_utilization x `start_free`, what was free when the engine started; vLLM's is
    gpu_memory_utilization x `total`, the whole device, and also holds its activation peak)."""
    from engine.config.devices import rollout_topology_of

    topo = rollout_topology_of(cfg, world_size, num_attention_heads=s.a)
    r, data = cfg.actor_rollout_ref.rollout, cfg.data
    dtype_bytes = DTYPE_BYTES[cfg.actor_rollout_ref.actor.megatron.params_dtype]
    weights = total_params(s) * dtype_bytes / topo.tp
    on_gpu = device == "cuda"
    mem = engine_memory(r.name, s, utilization=r.gpu_memory_utilization, total=total if on_gpu else 0.0,
                        start_free=start_free if on_gpu else 0.0, weights=weights, tp=topo.tp,
                        dtype_bytes=dtype_bytes, max_num_batched_tokens=r.max_num_batched_tokens,
                        max_num_seqs=r.max_num_seqs,
                        max_model_len=(r.prompt_length or data.max_prompt_length)
                        + (r.response_length or data.max_response_length))
    out = dict(topo.summary(), backend=r.name, **mem)
    out.pop("groups")
    return out


def weight_sync(cfg, e, nvlink_gbps: float = 400.0, internode_gbps: float = 50.0) -> dict:
    """One weight sync of the recipe at the estimate `e`'s layout (engine/rollout/transfer.py):
    today (every GPU receives the whole model) vs the transfer plan (each rollout GPU receives
    only its slices, from a training rank that holds them): GB received / sent per GPU (max,
    mean), messages, estimated seconds from the link bandwidths (GB/s per GPU)."""
    from engine.config.devices import rollout_topology_of
    from engine.rollout.transfer import transfer_plan
    from parallel.mesh import Layout

    arr = cfg.actor_rollout_ref
    hf = hf_config_of(arr.model)
    lay = e["layout"]
    layout = Layout(world_size=e["world_size"], **{k: lay[k] for k in (
        "tp", "pp", "vpp", "cp", "ep", "etp", "sequence_parallel")})
    topo = rollout_topology_of(cfg, e["world_size"], num_attention_heads=shape_of(hf).a)
    plan = transfer_plan(hf, layout, topo, bytes_per_element=DTYPE_BYTES[arr.actor.megatron.params_dtype],
                         bucket_megabytes=arr.rollout.update_weights_bucket_megabytes,
                         separate_pool=cfg.trainer.rollout_pool == "separate")
    return plan.summary(nvlink_gbps, internode_gbps)


# --------------------------------------------------------------------------------------------
# Layout search
# --------------------------------------------------------------------------------------------

def _divisors(n):
    return [i for i in range(1, n + 1) if n % i == 0]


def search(cfg, world_size: int, gpu_mem_gib: float, device: str = "cuda", top: int = 5):
    """Layouts (TP, PP, EP) that fit, best first: fewest model-parallel ranks (most DP), then
    the most headroom. TP stays within a node; MoE models search EP with expert-TP 1."""
    import copy

    shape = shape_of(hf_config_of(cfg.actor_rollout_ref.model))
    node = min(cfg.trainer.n_gpus_per_node, world_size)
    out = []
    for tp in _divisors(node):
        if shape.a % tp or shape.g % tp:
            continue
        for pp in _divisors(world_size // tp):
            if shape.layers % pp:
                continue
            eps = [e for e in _divisors(shape.experts) if (world_size // pp) % e == 0] if shape.experts else [1]
            for ep in eps:
                trial = copy.deepcopy(cfg)
                for key, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                                   ("expert_model_parallel_size", ep),
                                   ("expert_tensor_parallel_size", 1 if shape.experts else None),
                                   ("sequence_parallel", tp > 1),
                                   ("virtual_pipeline_model_parallel_size", None)):
                    apply_override(trial, f"actor_rollout_ref.actor.megatron.{key}={json.dumps(value)}")
                try:
                    e = estimate(trial, world_size, gpu_mem_gib, device)
                except ConfigError:
                    continue
                if e["fits"]:
                    out.append(e)
    out.sort(key=lambda e: (e["layout"]["tp"] * e["layout"]["pp"], -e["layout"]["ep"], -e["free"]))
    return out[:top]


# --------------------------------------------------------------------------------------------
# Meta builds (exact per-rank counts), one process per (layout, rank)
# --------------------------------------------------------------------------------------------

def meta_rank_model(hf_config, layout, world_size: int, rank: int = 0, head: str = "lm",
                    params_dtype: str = "bfloat16"):
    """(chunks, info) of `rank` at `layout` (parallel.mesh.Layout) on the meta device. Initialises
    torch.distributed: once per process (use `meta_rank_report` from another process)."""
    import torch

    from engine.models.builder import build_model
    from parallel.meta import meta_build

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[params_dtype]
    return meta_build(lambda overrides: build_model(
        hf_config, head=head, params_dtype=dtype, sequence_parallel=layout.sequence_parallel,
        config_overrides=overrides), layout, world_size, rank)


def meta_rank_report(hf_config_dict: dict, layout: dict, world_size: int, rank: int = 0,
                     head: str = "lm", timeout_s: float = 300) -> dict:
    """`meta_rank_model`'s info (JSON-safe) computed in a fresh Python process."""
    args = json.dumps(dict(hf=hf_config_dict, layout=layout, world_size=world_size, rank=rank, head=head))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--meta-rank", args],
                          capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"meta build of rank {rank} at {layout} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _meta_rank_main(args_json: str):
    import transformers

    from parallel.mesh import Layout

    a = json.loads(args_json)
    hf = dict(a["hf"])
    hf = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    _, info = meta_rank_model(hf, Layout(**a["layout"]), a["world_size"], a["rank"], a["head"])
    print(json.dumps(info))


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def _gib(x):
    return f"{x / GIB:8.2f} GiB"


_BYTE_KEYS = ("weights", "grads", "optimizer", "activations", "forward_activations", "total",
              "training_peak", "rollout_share", "rollout_phase", "capacity", "free", "weights_per_gpu",
              "kv_cache_per_gpu", "engine_start_free", "phases", "reserved", "ref_hidden", "share_per_gpu",
              "share_base", "start_free", "activation_peak_per_gpu", "training_awake")


def _in_gib(value, key=None, parent=None):
    """The estimate as JSON: byte figures in GiB (the keys in _BYTE_KEYS, and every phase)."""
    if isinstance(value, dict):
        return {k: _in_gib(v, k, key) for k, v in value.items()}
    if key in _BYTE_KEYS or parent in ("phases", "reserved"):
        return round(value / GIB, 4)
    return value


def report_text(e):
    lay = e["layout"]
    lines = [f"layout: TP={lay['tp']} PP={lay['pp']} VPP={lay['vpp']} CP={lay['cp']} EP={lay['ep']} "
             f"ETP={lay['etp']} DP={lay['dp']} EDP={lay['expert_dp']} SP={lay['sequence_parallel']} "
             f"on {e['world_size']} x {e['gpu_mem_gib']} GiB ({e['device']})"]
    for name, m in e["models"].items():
        lines.append(f"  {name:7s} stage {m['stage']}: {m['params'] / 1e9:.3f} B params "
                     f"(experts {m['expert_params'] / 1e9:.3f} B)  weights {_gib(m['weights'])}  "
                     f"grads {_gib(m['grads'])}  optimizer {_gib(m['optimizer'])}  "
                     f"activations {_gib(m['activations'])}"
                     + (f"  [{m['strategy']}: sharded over DP x CP]"
                        if m.get("strategy", "megatron") != "megatron" else ""))
    r = e["rollout"]
    head = (f"  rollout: {r['engines']} {r['backend']} engine(s) x {r['gpus_per_engine']} GPU(s) "
            f"(TP {r['gpus_per_engine']}), {r['nodes_per_engine']} node(s) per engine; per GPU: ")
    if r["backend"] == VLLM:
        lines.append(head + f"vLLM budget gpu_memory_utilization {r['utilization']:g} x "
                     f"{_gib(r['share_base']).strip()} device memory = {_gib(r['share_per_gpu']).strip()} "
                     f"(weights {_gib(r['weights_per_gpu']).strip()} + activation peak "
                     f"{_gib(r['activation_peak_per_gpu']).strip()} + KV cache {_gib(r['kv_cache_per_gpu']).strip()}"
                     f"; {r['kv_tokens']} tokens of {r['kv_bytes_per_token']} B)")
    else:
        lines.append(head + f"weights {_gib(r['weights_per_gpu'])}  KV pool {_gib(r['kv_cache_per_gpu'])} "
                     f"(gpu_memory_utilization x {_gib(r['engine_start_free']).strip()} free at engine start "
                     f"- weights)")
    if r.get("share_base"):
        lines.append(f"  training keeps {_gib(r['training_awake']).strip()} while the engine is awake; "
                     f"largest gpu_memory_utilization that fits: {r['utilization_fit']}")
    lines += [f"  NOT FITTING: {p}" for p in r.get("problems", [])]
    lines.append(f"  model: {e['total_params'] / 1e9:.2f} B parameters, {e['active_params'] / 1e9:.2f} B "
                 f"active per token")
    lines.append("  per phase (GiB per GPU, allocated / reserved with training's cache; what is resident: "
                 "engine/config/phases.py):")
    for phase, value in e["phases"].items():
        held = ", ".join(f"{m} {'+'.join(states) or '-'}" for m, states in e["schedule"][phase].items()
                         if m != "rollout")
        rollout = "+".join(e["schedule"][phase]["rollout"]) or "-"
        mark = "  <- peak" if phase == e["peak_phase"] else ""
        lines.append(f"    {phase:13s} {value / GIB:8.2f} / {e['reserved'][phase] / GIB:8.2f}   "
                     f"[{held}; rollout {rollout}]{mark}")
    if e["host"]:
        lines.append(f"  host memory per last-stage rank: reference hidden states + weight shard "
                     f"(exact KL) {_gib(e['host']['ref_hidden'])}")
    if "weight_sync" in e:
        w = e["weight_sync"]
        t, p = w["today"], w["planned"]
        lines.append(f"  weight sync per step (est. at NVLink {w['nvlink_gbps']:g} / network "
                     f"{w['internode_gbps']:g} GB/s per GPU): today {t['recv_gb_max']:.1f} GB received per "
                     f"GPU, {t['seconds']:.2f} s; transfer plan {p['recv_gb_max']:.1f} GB (max), "
                     f"{p['messages']} messages, {p['seconds']:.2f} s")
    lines += [f"  capacity       {_gib(e['capacity'])}  free {_gib(e['free'])}  -> "
              f"{'fits' if e['fits'] else 'DOES NOT FIT'}"]
    return "\n".join(lines)


def main(argv=None):
    return run_main(main_raising, argv)


def main_raising(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--meta-rank"]:
        return _meta_rank_main(argv[1])
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument("--gpus", type=positive(int, "the number of GPUs, e.g. 8"),
                   help="world size (default trainer.nnodes x n_gpus_per_node)")
    p.add_argument("--gpu-mem", type=positive(float, "the GiB of memory per GPU, e.g. 80"), default=80.0,
                   help="GiB per GPU (default 80)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--search", action="store_true", help="propose TP/PP/EP layouts that fit")
    p.add_argument("--exact", action="store_true",
                   help="also build rank 0 and the last stage on the meta device and show their counts")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON (memory in GiB)")
    p.add_argument("--nvlink-gbps", type=positive(float, "GB/s of NVLink per GPU, e.g. 400"), default=400.0,
                   help="NVLink bandwidth per GPU inside a node, GB/s, for the weight-sync time (default 400)")
    p.add_argument("--internode-gbps", type=positive(float, "GB/s of network per GPU, e.g. 50"), default=50.0,
                   help="network bandwidth per GPU between nodes, GB/s, for the weight-sync time (default 50)")
    a = p.parse_args(argv)
    if a.json:
        check_output_file(a.json, "--json")
    cfg = load_config(a.recipe, a.overrides)
    world = a.gpus or cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if a.gpus:  # keep the recipe's node size: rollout engines are placed on nodes
        node = min(cfg.trainer.n_gpus_per_node, world)
        if world % node:
            raise ConfigError(f"--gpus {world} is not a whole number of {node}-GPU nodes "
                              f"(trainer.n_gpus_per_node); use a multiple of {node}")
        cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node = world // node, node
    e = estimate(cfg, world, a.gpu_mem, a.device)
    e["weight_sync"] = weight_sync(cfg, e, a.nvlink_gbps, a.internode_gbps)
    print(report_text(e))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(_in_gib(e), f, indent=1)
    if a.exact:
        lay = e["layout"]
        layout = dict(tp=lay["tp"], pp=lay["pp"], vpp=lay["vpp"], cp=lay["cp"], ep=lay["ep"],
                      etp=lay["etp"], sequence_parallel=lay["sequence_parallel"])
        hf = hf_config_of(cfg.actor_rollout_ref.model).to_dict()
        for rank in sorted({0, world - 1}):
            info = meta_rank_report(hf, layout, world, rank)
            print(f"  meta build rank {rank} (pp stage {info['pp_rank']}): {info['params'] / 1e9:.4f} B params")
    if a.search:
        print("\nlayouts that fit, best first:")
        found = search(cfg, world, a.gpu_mem, a.device)
        print("\n".join(report_text(x) for x in found) if found
              else "  none: add GPUs or enable offload/recompute")


if __name__ == "__main__":
    sys.exit(main())
