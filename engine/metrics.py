"""Metrics: TensorBoard scalars, one JSON line per step, one console progress line per step, and the
experiment trackers users already watch (wandb, swanlab, mlflow) when their packages are installed.

Metric names follow verl (critic/score/mean, actor/pg_loss, response_length/mean, timing_s/gen,
perf/throughput ...) and are the same in every sink. Only rank 0 writes; other ranks get a logger
that does nothing.

Trackers (trainer.logger: [console, wandb] ...), named by trainer.project_name / experiment_name:
  wandb    online when an API key is found (WANDB_API_KEY, or ~/.netrc from `wandb login`);
           offline when WANDB_MODE=offline or no key is found: the run is kept under the log dir
           (or WANDB_DIR) and uploaded later with `wandb sync <dir>`. WANDB_MODE / WANDB_DIR win.
  swanlab  the same rule: SWANLAB_MODE wins; no API key (SWANLAB_API_KEY or `swanlab login`)
           means offline under <log dir>/swanlog (or SWANLAB_LOG_DIR), `swanlab sync` later.
  mlflow   MLFLOW_TRACKING_URI when set; otherwise a local SQLite store <log dir>/mlflow.db
           (view: mlflow ui --backend-store-uri sqlite:///<log dir>/mlflow.db). Metric names
           keep their slashes; characters MLflow refuses become '_' ('@' becomes '_at_').

Tests: tests/test_metrics.py, tests/test_loggers.py, tests/test_trainer_parts.py, tests/test_step_context.py
"""
import importlib.util
import json
import math
import netrc
import os
import pathlib
import re
import sys
import time
from typing import Callable, NamedTuple
from urllib.parse import urlparse

BUILTIN_LOGGERS = ("console", "tensorboard", "jsonl")
DEFAULT_PROJECT, DEFAULT_EXPERIMENT = "trident", "default"  # the config's project_name / experiment_name
# (metric, short label, format) shown on the console line, when present
CONSOLE_FIELDS = (
    ("critic/score/mean", "score", "{:.3f}"),
    ("val/score/mean", "val", "{:.3f}"),
    ("actor/pg_loss", "pg_loss", "{:.4f}"),
    ("actor/ppo_kl", "kl", "{:.2e}"),
    ("actor/entropy", "entropy", "{:.3f}"),
    ("response_length/mean", "resp_len", "{:.1f}"),
    ("loss", "loss", "{:.4f}"),  # offline tasks (reward model, DPO)
    ("train/loss", "loss", "{:.4f}"),  # SFT (verl's names)
    ("val/loss", "val_loss", "{:.4f}"),
    ("accuracy", "acc", "{:.3f}"),
    ("rewards/accuracies", "acc", "{:.3f}"),
    ("val/accuracy", "val_acc", "{:.3f}"),
    ("val/rewards/accuracies", "val_acc", "{:.3f}"),
    ("timing_s/step", "step_s", "{:.2f}"),
    ("perf/throughput", "tok/s", "{:.0f}"),
)


def _to_float(value):
    torch = sys.modules.get("torch")  # not imported here: config validation imports this module
    if torch is not None and isinstance(value, torch.Tensor):
        return float(value.detach().float().mean().item()) if value.numel() else None
    if isinstance(value, bool):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None  # strings, lists ... are not scalars


def _format_seconds(seconds):
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _flat_config(config, prefix=""):
    """{"a": {"b": 1}} -> {"a.b": 1}: MLflow parameters are flat."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _wandb_has_credentials():
    """An API key from the environment or the ~/.netrc entry that `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class _WandbTracker:
    def __init__(self, run_dir, project, experiment, config, stream):
        import wandb
        # read here, not left to wandb: its settings are fixed at the first init in a process
        mode = os.environ.get("WANDB_MODE") or None
        where = os.environ.get("WANDB_DIR") or run_dir
        if mode is None and not _wandb_has_credentials():
            mode = "offline"
            print(f"wandb: no API key (WANDB_API_KEY or `wandb login`): logging offline under {where}/wandb; "
                  "upload later with `wandb sync`", file=stream, flush=True)
        self.run = wandb.init(project=project, name=experiment, config=config, mode=mode, dir=where)

    def log(self, scalars, step):
        self.run.log(scalars, step=step)

    def close(self):
        self.run.finish()


class _SwanlabTracker:
    def __init__(self, run_dir, project, experiment, config, stream):
        import swanlab
        mode = os.environ.get("SWANLAB_MODE") or None
        where = os.environ.get("SWANLAB_LOG_DIR") or os.environ.get("SWANLAB_LOGDIR") or os.path.join(
            run_dir, "swanlog")
        if mode is None and swanlab.Settings().api_key is None:  # env or the `swanlab login` file
            mode = "offline"
            print(f"swanlab: no API key (SWANLAB_API_KEY or `swanlab login`): logging offline under {where}; "
                  "upload later with `swanlab sync`", file=stream, flush=True)
        self.run = swanlab.init(project=project, name=experiment, config=config, mode=mode, log_dir=where)

    def log(self, scalars, step):
        self.run.log(scalars, step=step)

    def close(self):
        self.run.finish()


def mlflow_metric_name(name):
    """MLflow accepts only [/\\w.\\- :] in names: '@' -> '_at_', anything else it refuses -> '_'."""
    return re.sub(r"[^/\w.\- :]", "_", name.replace("@", "_at_"))


class _MlflowTracker:
    PARAM_CHARS = 500  # parameter values are cut here: older MLflow servers refuse longer ones

    def __init__(self, run_dir, project, experiment, config, stream):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI"), None
        if not uri:
            uri = "sqlite:///" + os.path.abspath(os.path.join(run_dir, "mlflow.db"))
            artifacts = pathlib.Path(os.path.abspath(os.path.join(run_dir, "mlartifacts"))).as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(project)
        experiment_id = (found.experiment_id if found is not None
                         else self.client.create_experiment(project, artifact_location=artifacts))
        self.run_id = self.client.create_run(experiment_id, run_name=experiment).info.run_id
        params = [Param(mlflow_metric_name(k), str(v)[:self.PARAM_CHARS])
                  for k, v in _flat_config(config or {}).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit for parameters
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, scalars, step):
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_metric_name(k), v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit for metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self):
        self.client.set_terminated(self.run_id)


class OptionalLogger(NamedTuple):
    modules: tuple  # what must be importable
    pip: str  # what to install (the same pins as setup.py's `loggers` extra)
    factory: Callable  # (run_dir, project, experiment, config, stream) -> tracker with log / close


# The one table of optional loggers: config check, error message and MetricsLogger all read it.
OPTIONAL_LOGGERS = {
    "wandb": OptionalLogger(("wandb",), "wandb==0.31.0", _WandbTracker),
    "swanlab": OptionalLogger(("swanlab",), "swanlab==0.10.3", _SwanlabTracker),
    # the local store is SQLite (MLflow's file store is in maintenance mode and refuses by default)
    "mlflow": OptionalLogger(("mlflow", "sqlalchemy", "alembic"),
                             "mlflow-skinny==3.17.2 sqlalchemy==2.1.9 alembic==1.20.1", _MlflowTracker),
}
LOGGERS = BUILTIN_LOGGERS + tuple(OPTIONAL_LOGGERS)


def check_loggers(names) -> None:
    """Refuse an unknown logger or one whose package is not installed, with the pip command."""
    for name in names:
        if name in BUILTIN_LOGGERS:
            continue
        entry = OPTIONAL_LOGGERS.get(name)
        if entry is None:
            raise ValueError(f"trainer.logger: unknown logger {name!r}; choose from {', '.join(LOGGERS)}")
        missing = [m for m in entry.modules if importlib.util.find_spec(m) is None]
        if missing:
            what = " and ".join(missing) + (" packages" if len(missing) > 1 else " package")
            raise ValueError(f"trainer.logger: {name!r} needs the {what}: pip install {entry.pip} "
                             f"(or pip install -e .[loggers])")


class MetricsLogger:
    """`log(metrics, step)` to the chosen loggers, files under log_dir (the run's folder).

    project / experiment name the run in wandb, swanlab and mlflow (trainer.project_name /
    experiment_name; None: the config's defaults); config (a dict, e.g. dataclasses.asdict(cfg))
    is recorded as the run's config / parameters there.
    """

    def __init__(self, log_dir, loggers=BUILTIN_LOGGERS, project=DEFAULT_PROJECT,
                 experiment=DEFAULT_EXPERIMENT, total_steps=None, rank=0, stream=None, config=None):
        check_loggers(loggers)  # on every rank: a missing package stops all ranks alike
        self.enabled = rank == 0
        self.loggers = tuple(loggers)
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.run_dir = log_dir
        self.jsonl_path = os.path.join(self.run_dir, "metrics.jsonl")
        self._writer = None
        self._jsonl = None
        self._trackers = []
        self._step_seconds = []
        self._last_log_time = None
        if not self.enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(log_dir=self.run_dir)
        if "jsonl" in self.loggers:
            self._jsonl = open(self.jsonl_path, "a")  # append: a resumed run continues the file
        for name in dict.fromkeys(self.loggers):
            if name in OPTIONAL_LOGGERS:
                self._trackers.append(OPTIONAL_LOGGERS[name].factory(
                    self.run_dir, project or DEFAULT_PROJECT, experiment or DEFAULT_EXPERIMENT, config,
                    self.stream))

    def log(self, metrics, step):
        if not self.enabled:
            return
        scalars = {k: v for k, v in ((k, _to_float(v)) for k, v in metrics.items()) if v is not None}
        now = time.monotonic()
        if self._last_log_time is not None:
            self._step_seconds.append(now - self._last_log_time)
        elif "timing_s/step" in scalars:
            self._step_seconds.append(scalars["timing_s/step"])
        self._last_log_time = now
        if self._writer is not None:
            for name, value in scalars.items():
                self._writer.add_scalar(name, value, global_step=step)
            self._writer.flush()
        if self._jsonl is not None:
            # JSON has no NaN/inf: write null so every line stays valid JSON
            record = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in scalars.items()}}
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        for tracker in self._trackers:
            tracker.log(scalars, step)
        if "console" in self.loggers:
            print(self.progress_line(scalars, step), file=self.stream, flush=True)

    def start_fresh(self):
        """A run starting from step 0: an earlier run's records under this name are kept aside
        as metrics.prev-<time>.jsonl, neither mixed with the new ones nor lost."""
        if not self.enabled or self._jsonl is None:
            return
        self._jsonl.close()
        if os.path.getsize(self.jsonl_path) > 0:
            stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
            while True:
                kept = os.path.join(self.run_dir, f"metrics.prev-{stamp}{f'-{n}' if n else ''}.jsonl")
                if not os.path.exists(kept):
                    break
                n += 1
            os.replace(self.jsonl_path, kept)
        self._jsonl = open(self.jsonl_path, "a")

    def truncate_after(self, step):
        """A resumed run redoes the steps after its checkpoint: drop their old JSONL records."""
        if not self.enabled or self._jsonl is None:
            return
        self._jsonl.close()
        with open(self.jsonl_path) as f:
            keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.jsonl_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, self.jsonl_path)
        self._jsonl = open(self.jsonl_path, "a")

    def progress_line(self, scalars, step):
        head = f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}"
        parts = [head] + [f"{label} {fmt.format(scalars[name])}" for name, label, fmt in CONSOLE_FIELDS
                          if name in scalars]
        if self.total_steps and self._step_seconds:
            recent = self._step_seconds[-20:]
            left = max(self.total_steps - step, 0)
            parts.append(f"eta {_format_seconds(sum(recent) / len(recent) * left)}")
        return " | ".join(parts)

    def close(self):
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def page_faults() -> int:
    """Minor page faults of this process so far (0 where getrusage is missing)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Timer:
    """`with Timer("gen", timings):` adds the elapsed seconds to timings["timing_s/gen"]; with
    `cpu=` a dict, also this process's CPU seconds (all its threads) to cpu["perf/cpu_s/gen"]:
    the figure other jobs on a shared machine barely move (tools/benchmark.py step compares
    phases by both), and the page faults it took to cpu["perf/page_faults/gen"] (memory the
    allocator handed back to the OS and the phase had to fault in again)."""

    def __init__(self, name, timings, cpu=None):
        self.key = f"timing_s/{name}"
        self.timings = timings
        self.cpu, self.cpu_key, self.faults_key = cpu, f"perf/cpu_s/{name}", f"perf/page_faults/{name}"
        self.elapsed = 0.0

    def __enter__(self):
        self._start = time.perf_counter()
        self._cpu_start = time.process_time()
        self._faults_start = page_faults() if self.cpu is not None else 0
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self._start
        self.timings[self.key] = self.timings.get(self.key, 0.0) + self.elapsed
        if self.cpu is not None:
            self.cpu[self.cpu_key] = self.cpu.get(self.cpu_key, 0.0) + time.process_time() - self._cpu_start
            self.cpu[self.faults_key] = self.cpu.get(self.faults_key, 0) + page_faults() - self._faults_start
        return False


def _masked_stats(values, mask):
    selected = values[mask.bool()].float()
    if selected.numel() == 0:
        return 0.0, 0.0, 0.0
    return selected.mean().item(), selected.max().item(), selected.min().item()


def compute_data_metrics(token_level_scores, token_level_rewards, advantages, returns, response_mask,
                         prompt_mask=None, values=None, max_response_length=None, max_prompt_length=None):
    """Batch statistics with verl's names; all tensors [B, L_response] except prompt_mask [B, L_prompt].

    Scores and rewards are per-sequence sums; advantages, returns and values are over valid tokens.
    clip_ratio is the fraction of sequences that reached the maximum length.
    """
    mask = response_mask.bool()
    scores = (token_level_scores * mask).sum(-1).float()
    rewards = (token_level_rewards * mask).sum(-1).float()
    response_length = mask.sum(-1).float()
    max_response_length = max_response_length or response_mask.shape[-1]
    adv_mean, adv_max, adv_min = _masked_stats(advantages, mask)
    ret_mean, ret_max, ret_min = _masked_stats(returns, mask)
    metrics = {
        "critic/score/mean": scores.mean().item(),
        "critic/score/max": scores.max().item(),
        "critic/score/min": scores.min().item(),
        "critic/rewards/mean": rewards.mean().item(),
        "critic/rewards/max": rewards.max().item(),
        "critic/rewards/min": rewards.min().item(),
        "critic/advantages/mean": adv_mean,
        "critic/advantages/max": adv_max,
        "critic/advantages/min": adv_min,
        "critic/returns/mean": ret_mean,
        "critic/returns/max": ret_max,
        "critic/returns/min": ret_min,
        "response_length/mean": response_length.mean().item(),
        "response_length/max": response_length.max().item(),
        "response_length/min": response_length.min().item(),
        "response_length/clip_ratio": (response_length >= max_response_length).float().mean().item(),
    }
    if values is not None:
        val_mean, val_max, val_min = _masked_stats(values, mask)
        metrics.update({"critic/values/mean": val_mean, "critic/values/max": val_max,
                        "critic/values/min": val_min})
    if prompt_mask is not None:
        prompt_length = prompt_mask.bool().sum(-1).float()
        max_prompt_length = max_prompt_length or prompt_mask.shape[-1]
        metrics.update({
            "prompt_length/mean": prompt_length.mean().item(),
            "prompt_length/max": prompt_length.max().item(),
            "prompt_length/min": prompt_length.min().item(),
            "prompt_length/clip_ratio": (prompt_length >= max_prompt_length).float().mean().item(),
        })
    return metrics


def compute_throughput_metrics(total_tokens, step_time, n_ranks, flops=None, peak_flops_per_rank=None):
    """perf/throughput = tokens / s / rank; perf/mfu = achieved FLOP/s over peak (all ranks).

    total_tokens: prompt + response tokens processed in the step, all ranks together.
    flops: model FLOPs of the step, all ranks together; peak_flops_per_rank: one device's peak FLOP/s.
    """
    if step_time <= 0 or n_ranks <= 0:
        raise ValueError(f"step_time={step_time!r} and n_ranks={n_ranks!r} must be positive")
    metrics = {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": float(step_time),
        "perf/throughput": total_tokens / (step_time * n_ranks),
    }
    if flops is not None and peak_flops_per_rank:
        metrics["perf/mfu"] = flops / (step_time * n_ranks * peak_flops_per_rank)
    return metrics


def reduce_over_dp(local, dp, weights=None):
    """Mean / max / min metrics of equal-sized DP shards -> the global batch's (collective over
    the data-parallel group). `weights` {key: this shard's weight}: those keys are means over
    units the shards hold different numbers of (tokens), so their global mean is weighted:
    sum(w * v) / sum(w); an unweighted mean of shard means would depend on the DP size."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    weights = {k: float(w) for k, w in (weights or {}).items() if k in local}
    keys = sorted(local)
    if not keys:
        return {}
    group = ps.get_data_parallel_group()
    # one collective for all three kinds: every shard's values and weights, reduced here
    mine = torch.tensor([[local[k] for k in keys], [weights.get(k, 1.0) for k in keys]],
                        dtype=torch.float64)
    shards = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, mine, group=group)
    values, w = torch.stack(shards).unbind(1)  # [shards, keys] each
    highest, lowest = values.max(0).values.tolist(), values.min(0).values.tolist()
    total, weight = (values * w).sum(0).tolist(), w.sum(0).tolist()
    vals = {}
    for i, k in enumerate(keys):
        if k.endswith("/max"):
            vals[k] = highest[i]
        elif k.endswith("/min"):
            vals[k] = lowest[i]
        elif k in weights:
            vals[k] = total[i] / weight[i] if weight[i] > 0 else 0.0
        else:
            vals[k] = total[i] / dp
    return vals


def peak_memory_gb():
    """Peak memory of the most loaded rank: CUDA allocator peak on GPU, process RSS on CPU."""
    import torch
    import torch.distributed as dist

    from engine.perf import peak_rss_bytes
    if torch.cuda.is_available():
        t = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
        key = "perf/max_memory_allocated_gb"
    else:
        t = torch.tensor([peak_rss_bytes() / 2**30])
        key = "perf/cpu_peak_rss_gb"
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {key: float(t)}
