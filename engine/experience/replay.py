"""Replay buffer and PF-PPO policy filtration (`algorithm.replay`), around any experience
source (engine/experience/base.py).

Each step, after the fresh responses are scored:

1. PF-PPO filtration (Zhang et al. 2024, "Policy Filtration in RLHF"): within each prompt's
   group of rollout.n responses, `best` keeps the round(keep x n) highest-scoring ones,
   `best_worst` the highest and lowest halves of that many; `reweight` keeps every response and
   multiplies its policy gradient by |score|^weight_pow, scaled to mean 1 over the batch
   (verl's pf_ppo `pow` weights, applied as weights instead of a resampling).
2. round(ratio x G) groups are drawn uniformly, without replacement, from the buffer (G: this
   rank's fresh groups; fewer while it fills up) and appended to the batch. A replayed group
   keeps its logged reward and its behaviour log-probs (`rollout_log_probs`); its old log-probs,
   values and advantages are recomputed with the fresh ones (its uid made unique, so its
   advantage group is itself), and algorithm.rollout_correction weighs it against the policy
   that generated it.
3. The kept fresh groups enter the buffer, which keeps the last `capacity` steps.

Balance over DP ranks: every rank keeps the same number of responses per group, adds as many
groups per step and draws as many: equal batches everywhere, with no traffic. The draw is seeded
by (trainer.seed, step, DP rank), so a resumed run draws the same groups. The buffer is
trainer state: `state_dict` gathers every DP rank's buffer to rank 0 (which writes the trainer
state); on resume each rank takes its own back (same DP size required).

Tests: tests/test_experience_parts.py, tests/test_replay_dynamic.py, tests/test_streaming.py
"""
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.algorithms.correction import score_weights
from engine.batch import Batch
from engine.experience.base import Source

COUNTS = ("fresh_samples", "replayed_samples", "filtered_samples", "buffer_samples",
          "fresh_score_sum", "kept_score_sum", "replayed_score_sum")


def pf_select(scores, n, keep, mode):
    """Row indices PF-PPO keeps of `scores` ([G x n], groups of n consecutive rows), each
    group's rows in their original order."""
    if mode not in ("best", "best_worst"):
        raise ValueError(f"algorithm.replay.filter={mode!r}: pf_select takes 'best' or 'best_worst'")
    k = round(keep * n)
    rows = []
    for g in range(len(scores) // n):
        s = [float(x) for x in scores[g * n:(g + 1) * n]]
        by_score = sorted(range(n), key=lambda j: (-s[j], j))  # ties: the earlier response
        top = k if mode == "best" else (k + 1) // 2
        chosen = set(by_score[:top])
        if mode == "best_worst":
            rest = [j for j in sorted(range(n), key=lambda j: (s[j], j)) if j not in chosen]
            chosen |= set(rest[:k - top])
        rows += [g * n + j for j in sorted(chosen)]
    return rows


class ReplayBuffer:
    """This DP rank's last `capacity` steps of groups (CPU): [(step, Batch of whole groups)]."""

    def __init__(self, capacity, group_size):
        self.capacity, self.group_size, self.entries = capacity, group_size, []

    def __len__(self):
        return sum(len(b) for _, b in self.entries) // self.group_size

    def add(self, step, batch):
        self.entries.append((step, batch.to("cpu")))
        self.entries = self.entries[-self.capacity:]

    def draw(self, count, generator):
        """`count` groups uniformly without replacement, their uids made unique per step."""
        where = [(e, g) for e, (_, b) in enumerate(self.entries) for g in range(len(b) // self.group_size)]
        picks = torch.randperm(len(where), generator=generator)[:count].tolist()
        parts = []
        for i in sorted(picks):  # buffer order: the same batch whatever the permutation's order
            e, g = where[i]
            step, b = self.entries[e]
            part = b.index_select(list(range(g * self.group_size, (g + 1) * self.group_size)))
            part["uid"] = [("replay", step, u) for u in part["uid"]]
            parts.append(part)
        return parts

    def state_dict(self):
        return [{"step": step, "tensors": dict(b.tensors),
                 "non_tensors": {k: list(v) for k, v in b.non_tensors.items()}} for step, b in self.entries]

    def load_state_dict(self, entries):
        self.entries = [(int(e["step"]), Batch(e["tensors"], e["non_tensors"])) for e in entries]


class Replay(Source):
    def __init__(self, cfg, inner):
        super().__init__(cfg)
        self.inner, self.cfg = inner, cfg.algorithm.replay
        self.seed = cfg.trainer.seed
        n = cfg.actor_rollout_ref.rollout.n
        self.n = n
        self.group_size = round(self.cfg.keep * n) if self.cfg.filter in ("best", "best_worst") else n
        self.buffer = ReplayBuffer(self.cfg.capacity, self.group_size)

    @property
    def separate(self):
        return self.inner.separate

    def validate(self, ctx, prompt_ids):
        return self.inner.validate(ctx, prompt_ids)

    def finish(self):
        self.inner.finish()

    def prompts(self, ctx):
        return self.inner.prompts(ctx)

    def loader_state(self, ctx):
        return self.inner.loader_state(ctx)

    def prepare(self, ctx, prompts):
        self.inner.prepare(ctx, prompts)

    def collect(self, ctx, prompts):
        fresh, metrics = self.inner.collect(ctx, prompts)
        if "token_level_scores" not in fresh:  # the filter and the buffer need the rewards now
            metrics.update(ctx.reward_metrics(ctx.score(fresh)))
        scores = fresh["token_level_scores"].sum(-1)
        kept = fresh
        if self.cfg.filter in ("best", "best_worst"):
            kept = fresh.index_select(pf_select(scores, self.n, self.cfg.keep, self.cfg.filter))
        groups = len(fresh) // self.n
        generator = torch.Generator().manual_seed(hash((self.seed, ctx.step, ctx.dp_rank))
                                                  & ((1 << 63) - 1))
        replayed = self.buffer.draw(min(round(self.cfg.ratio * groups), len(self.buffer)), generator)
        self.buffer.add(ctx.step, kept)
        batch = Batch.concat([kept] + replayed)
        old = Batch.concat(replayed) if replayed else None
        local = [len(kept), len(batch) - len(kept), len(fresh) - len(kept),
                 len(self.buffer) * self.group_size,
                 float(scores.sum()), float(kept["token_level_scores"].sum()),
                 float(old["token_level_scores"].sum()) if old is not None else 0.0]
        total = dict(zip(COUNTS, _dp_sum(local)))
        metrics.update({f"replay/{k}": total[k] for k in COUNTS[:4]})
        for what, count in (("fresh", total["fresh_samples"] + total["filtered_samples"]),
                            ("kept", total["fresh_samples"]), ("replayed", total["replayed_samples"])):
            if count:
                metrics[f"replay/{what}_score_mean"] = total[f"{what}_score_sum"] / count
        return batch, metrics

    def after_advantages(self, ctx, batch):
        metrics = {}
        if self.cfg.filter == "reweight":
            scores = batch["token_level_scores"].sum(-1)
            raw = scores.double().abs().pow(self.cfg.weight_pow)
            total, count = _dp_sum([float(raw.sum()), float(len(raw))])
            w = score_weights(scores, self.cfg.weight_pow, total, count)
            batch["advantages"] = batch["advantages"] * w.to(batch["advantages"].dtype)[:, None]
            metrics["replay/weight_max"] = _dp_max(float(w.max()) if len(w) else 0.0)
        metrics.update(super().after_advantages(ctx, batch))
        return metrics

    # -- trainer state ---------------------------------------------------------------------
    def state_dict(self):
        """Collective: every DP rank's buffer (its first rank in the replica holds it) on rank 0."""
        first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0 \
            and ps.get_context_parallel_rank() == 0
        mine = (ps.get_data_parallel_rank(), self.buffer.state_dict()) if first else None
        every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, every, dst=0)
        if dist.get_rank() != 0:
            return {}
        buffers = dict(x for x in every if x is not None)
        return {"replay": {"dp": len(buffers), "buffers": [buffers[d] for d in range(len(buffers))]}}

    def load_state_dict(self, state):
        saved = state.get("replay")
        if saved is None:
            return
        dp = ps.get_data_parallel_world_size()
        if saved["dp"] != dp:
            raise ValueError(f"the checkpoint's replay buffer was saved by {saved['dp']} data-parallel "
                             f"ranks, this run has {dp}; resume at the same DP size, or set "
                             "algorithm.replay.enable=false to resume without it")
        self.buffer.load_state_dict(saved["buffers"][ps.get_data_parallel_rank()])


def _dp_sum(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return t.tolist()


def _dp_max(value):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    return float(t)
