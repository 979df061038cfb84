"""Metrics: TensorBoard scalars, one JSON line per step, one console progress line per step.

Metric names follow verl (critic/score/mean, actor/pg_loss, response_length/mean, timing_s/gen,
perf/throughput ...). Only rank 0 writes; other ranks get a logger that does nothing.
"""
import json
import math
import os
import sys
import time

import torch

LOGGERS = ("console", "tensorboard", "jsonl")
# (metric, short label, format) shown on the console line, when present
CONSOLE_FIELDS = (
    ("critic/score/mean", "score", "{:.3f}"),
    ("val/score/mean", "val", "{:.3f}"),
    ("actor/pg_loss", "pg_loss", "{:.4f}"),
    ("actor/ppo_kl", "kl", "{:.2e}"),
    ("actor/entropy", "entropy", "{:.3f}"),
    ("response_length/mean", "resp_len", "{:.1f}"),
    ("loss", "loss", "{:.4f}"),  # offline tasks (reward model, DPO)
    ("accuracy", "acc", "{:.3f}"),
    ("rewards/accuracies", "acc", "{:.3f}"),
    ("val/accuracy", "val_acc", "{:.3f}"),
    ("val/rewards/accuracies", "val_acc", "{:.3f}"),
    ("timing_s/step", "step_s", "{:.2f}"),
    ("perf/throughput", "tok/s", "{:.0f}"),
)


def _to_float(value):
    if isinstance(value, torch.Tensor):
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


class MetricsLogger:
    """`log(metrics, step)` to the chosen loggers under log_dir/project/experiment."""

    def __init__(self, log_dir, loggers=LOGGERS, project="trident", experiment="default", total_steps=None,
                 rank=0, stream=None):
        unknown = [name for name in loggers if name not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger has unknown logger(s) {unknown}; choose from {list(LOGGERS)}")
        self.enabled = rank == 0
        self.loggers = tuple(loggers)
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        # project / experiment are sub-folders; None when log_dir is already the run's folder
        self.run_dir = os.path.join(log_dir, *(p for p in (project, experiment) if p))
        self.jsonl_path = os.path.join(self.run_dir, "metrics.jsonl")
        self._writer = None
        self._jsonl = None
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
            parts.append(f"eta {_format_seconds(sum(recent) / len(recent) * max(self.total_steps - step, 0))}")
        return " | ".join(parts)

    def close(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


class Timer:
    """`with Timer("gen", timings):` adds the elapsed seconds to timings["timing_s/gen"]."""

    def __init__(self, name, timings):
        self.key = f"timing_s/{name}"
        self.timings = timings
        self.elapsed = 0.0

    def __enter__(self):
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self._start
        self.timings[self.key] = self.timings.get(self.key, 0.0) + self.elapsed
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
        metrics.update({"critic/values/mean": val_mean, "critic/values/max": val_max, "critic/values/min": val_min})
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
