"""The StepContext: the one port between the loop (engine/trainer.py) and what a step does.

A step's parts (experience sources, the reward model, validation) never see the trainer; they
get this object, which owns the step's phases, sampling, prompt shares, generation, scoring and
weight sync:

    with ctx.phase("old_log_prob"):      # memory schedule, timer, launcher, fault hooks, comm
        ...
    batch = ctx.generate(prompts, ctx.sampling())
    extra = ctx.score(batch)             # the reward phase: batch["token_level_scores"] set
    stats = ctx.sync_weights()           # the update_weights phase (colocated engines)

Phase names are verl's timer names (engine/config/phases.py PHASE_NAMES); each phase's seconds
land in `timings` as `timing_s/<name>`. Phases nest (a separate pool's weight send inside its
generation, the reference pass inside an implicit reward model's scoring): leaving an inner
phase puts memory, the launcher's and the fault hooks' phase back to the outer one's.

Tests: tests/test_step_context.py, tests/test_trainer_paths.py, tests/test_layering.py,
tests/test_balance_batch.py
"""
import contextlib
import dataclasses
from typing import Any, Callable, Optional

import torch

from engine import faults
from engine.config.phases import PHASE_NAMES, PHASES
from engine.experience.balance import balance_batch
from engine.experience.scoring import reward_extra_metrics, score_once_per_replica
from engine.metrics import Timer
from engine.phase import set_phase
from engine.profiler import phase_range
from engine.rollout.batches import sampling_params, training_batch
from parallel.cpu import suspended as cpu_function_mode_suspended

IDLE = "training"  # the launcher's name for a rank between phases


def engine_generate(engine, prompt_ids, sampling, keys):
    """One engine's generate call. The rollout engine runs no Megatron code, so on CPU it runs
    without parallel.cpu's per-op device rewriting (a no-op elsewhere)."""
    with cpu_function_mode_suspended():
        return engine.generate(prompt_ids, sampling, keys=keys)


def _moves_memory(name):
    """Whether entering phase `name` moves memory (the sync moves it in its own order)."""
    return name in PHASES and name != "update_weights"


@dataclasses.dataclass
class StepContext:
    derived: Any              # engine.config.Derived
    colocated: Any            # engine.rollout.colocated.HybridEngine: the memory schedule and the sync
    rollout: Any              # the rollout group (None on a separate pool's training ranks)
    reward_fn: Any
    reward_model: Any         # a reward model worker, or None
    ref: Any                  # the reference worker, or None
    actor: Any
    hf_config: Any
    loader: Any               # engine.data.PromptLoader of the training prompts
    train_data: Any
    pad_id: int
    eos_ids: list
    dp: int
    dp_rank: int
    rank: int
    replicas: list            # global ranks of each DP replica
    replica_group: Any        # this replica's gloo group, or None
    total_steps: int
    watch: Any = None         # engine.guards watch: the phase a failed collective reports
    comm: Any = None          # engine.perf.CommTimer with trainer.profile_comm
    step: int = 0             # steps completed (the one being trained is step + 1)
    first_step: int = 0       # the step the run started (or resumed) from
    timings: dict = dataclasses.field(default_factory=dict)
    cpu_timings: dict = dataclasses.field(default_factory=dict)  # perf/cpu_s/<phase>
    run_engine: Callable = engine_generate  # one engine's generate call (tests wrap it)
    _stack: list = dataclasses.field(default_factory=list)

    @property
    def cfg(self):
        return self.derived.config

    # -- phases ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        """Run a phase: memory where the schedule says (update_weights moves it in the sync's
        own order: `sync_weights`), the fault hooks, the launcher's and the collective watch's
        phase, comm attribution, and its time into `timings`."""
        if name not in PHASE_NAMES:
            raise ValueError(f"unknown phase {name!r}; phases are {PHASE_NAMES}")
        self._stack.append(name)
        try:
            faults.act(name)
            self._announce(name)
            if _moves_memory(name):
                self.colocated.enter(name)
            with Timer(name, self.timings, cpu=self.cpu_timings), phase_range(name):
                yield
        finally:
            self._stack.pop()
            outer = self._stack[-1] if self._stack else None
            self._announce(outer)
            if outer is not None and _moves_memory(name) and _moves_memory(outer):
                self.colocated.enter(outer)  # the inner phase moved memory: back to the outer's

    def _announce(self, name):
        set_phase(name or IDLE)  # what a launcher reports if this rank dies here (engine.launch_ray)
        if self.watch is not None and name is not None:  # a collective between phases: the last one
            self.watch.phase = name
        if self.comm is not None:
            self.comm.phase = name or "other"

    def begin_step(self):
        """A fresh timings dict for the step about to run (and a fresh `cpu_timings`)."""
        self.timings, self.cpu_timings = {}, {}
        return self.timings

    # -- rollout --------------------------------------------------------------------------
    def sync_weights(self):
        """The colocated sync (training state out, weights in, KV cache in) as the update_weights
        phase; ends ready to generate. Returns the sync's SyncStats."""
        with self.phase("update_weights"):
            return self.colocated.sync()

    def weights(self):
        """(chunks, hf_config, bucket MiB, reshard plan): what a separate pool's weight send reads."""
        r = self.cfg.actor_rollout_ref.rollout
        return self.actor.chunks, self.hf_config, r.update_weights_bucket_megabytes, self.colocated.plan()

    def sampling(self, train=True, greedy=False, seed: Optional[int] = None):
        s = sampling_params(self.cfg.actor_rollout_ref.rollout, self.eos_ids, self.step, train=train, greedy=greedy)
        return s if seed is None else dataclasses.replace(s, seed=seed)

    def my_rows(self, prompts):
        """This DP rank's contiguous share of the step's prompts (row indices)."""
        per = len(prompts) // self.dp
        return list(range(self.dp_rank * per, (self.dp_rank + 1) * per))

    def layout(self, prompts, got, n=None, rows=None):
        """Responses `got` ({row: (ids, log-probs, routing)}) as this DP rank's training Batch."""
        r = self.cfg.actor_rollout_ref.rollout
        with cpu_function_mode_suspended():  # host tensors only, no Megatron code
            return training_batch(prompts, got, self.my_rows(prompts) if rows is None else rows,
                                  r.n if n is None else n, self.pad_id, r.prompt_length, r.response_length,
                                  raw_chat=self.cfg.data.return_raw_chat)

    def generate(self, prompts, sampling, n=None):
        """Responses for this DP rank's prompts as a training Batch (n per prompt, prompt-major).
        Each rollout group's leader generates the group's share of the step's prompts and sends
        every DP replica the responses of its own prompts (collective over all ranks)."""
        got = self.rollout.generate_for_replicas(list(prompts.input_ids), list(prompts.indices),
                                                 sampling, generate=self.run_engine)
        return self.layout(prompts, got, n=sampling.n if n is None else n)

    def balance(self, batch, metrics):
        """trainer.balance_batch: the step's whole prompt groups reordered over the DP ranks so
        their token counts are even, every global mini-batch unchanged (engine/experience/
        balance.py; collective over the DP group); global_seqlen/* into `metrics`. Off: `batch`."""
        if not self.cfg.trainer.balance_batch:
            return batch
        plans = [self.derived.actor] + ([self.derived.critic] if self.derived.critic is not None else [])
        with Timer("balance_batch", self.timings):
            batch, stats = balance_batch(batch, [p.mini_batch_size_per_rank for p in plans])
        metrics.update(stats)
        return batch

    # -- rewards --------------------------------------------------------------------------
    def score(self, batch):
        """The reward phase, the one place a batch is scored: sets batch['token_level_scores']
        and returns the reward extras. Rules by data_source plus the reward model's score, once
        per model-parallel replica (engine/experience/scoring.py); the reward model's forward
        runs on every rank."""
        with self.phase("reward"):
            batch["token_level_scores"], extra = self._scores(batch)
        rm = self.cfg.reward_model
        if rm.url and rm.remote.on_failure == "skip" and "remote_failed" in extra:  # no gradient from them
            batch["reward_skipped"] = torch.tensor([bool(v) for v in extra["remote_failed"]])
        return extra

    def rollout_ready(self):
        """Whether the rollout still holds its weights and KV cache (a reward model's phase may
        have taken them back: then the next generation needs `sync_weights` first)."""
        return self.colocated.rollout_ready()

    def _scores(self, batch):
        # [B] scores, or [B, R] token rewards (reward_model.token_level=implicit)
        model_scores = self.reward_model.scores_for(self, batch) if self.reward_model is not None else None
        return score_once_per_replica(self.reward_fn, batch, model_scores, self.cfg.reward_model.rule_reward,
                                      self.rank, self.replicas[self.dp_rank][0], self.replica_group)

    def sequence_scores(self, batch):
        """[B] sequence scores of a batch (ReMax's greedy baselines), in the reward phase."""
        self.score(batch)
        return batch["token_level_scores"].sum(-1)

    def reward_metrics(self, extra):
        """Means over the global batch of the reward extras (reward_extra/*)."""
        return reward_extra_metrics(extra, self.dp)

    def forward_split(self, model):
        """The micro-batch keyword arguments of `model`'s forward-only pass."""
        return self.derived.forward[model].kwargs()
