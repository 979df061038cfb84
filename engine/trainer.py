"""The PPO loop: rollout -> old / ref log-probs, values -> rewards (+ in-reward KL) ->
advantages -> critic and actor updates -> weight sync; timing, metrics, checkpoints.

Every step of one iteration is a method taking and returning a `Batch`, so each can be run,
timed and tested alone. Data parallelism splits a step's prompts by DP rank (all n responses
of a prompt stay on one rank, so group advantages are local); generation is split over the
rollout groups (one engine each, on the group's leader) and each DP replica receives exactly
the responses it trains on (engine/rollout/group.py).

What a step's parts need (phases, sampling, generation, scoring, the weight sync) reaches them
through the StepContext (engine/experience/context.py), never through this object.

Tests: tests/test_trainer_paths.py, tests/test_actor_formula.py, tests/test_e2e.py, tests/test_layering.py
"""
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.algorithms.advantages import compute_advantage
from engine.algorithms.kl import KLGuard, make_kl_controller
from engine.algorithms.correction import loss_batch, mismatch_metrics
from engine.algorithms.losses import apply_kl_penalty
from engine.data import PromptLoader
from engine.experience.context import StepContext
from engine.experience.pool import connect
from engine.experience.scoring import replica_groups
from engine.experience.sources import build_experience
from engine.guards import StepGuard
from engine.loop import Loop
from engine.rollout.colocated import HybridEngine
from engine.metrics import (Timer, compute_data_metrics, compute_throughput_metrics,
                            peak_memory_gb, reduce_over_dp)
from engine.rollout.multi_turn import multi_turn_metrics
from engine.perf import CommTimer, model_flops_params, step_flops
from engine.validation import validate, validate_from


class Trainer(Loop):
    def __init__(self, derived, components):
        """derived: engine.config.Derived; components: engine.train.Components."""
        self.derived = derived
        self.cfg = cfg = derived.config
        c = components
        self.tokenizer, self.hf_config = c.tokenizer, c.hf_config
        self.actor, self.ref, self.critic = c.actor, c.ref, c.critic
        self.rollout, self.reward_fn, self.reward_model = c.rollout, c.reward_fn, c.reward_model
        self.train_data, self.val_data = c.train_data, c.val_data
        self.peak_flops = c.peak_flops
        world, rank = dist.get_world_size(), dist.get_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        alg = cfg.algorithm
        self.kl_ctrl = make_kl_controller(alg.kl_ctrl) if alg.use_kl_in_reward else None
        arr = cfg.actor_rollout_ref
        self.kl_loss_coef = arr.actor.kl_loss_coef  # trainer state: the KL guard may move it
        guarded = self.kl_loss_coef if arr.actor.use_kl_loss else alg.kl_ctrl.kl_coef
        self.kl_guard = KLGuard(alg.kl_guard, guarded) if alg.kl_guard.enable else None
        self.comm = CommTimer().install() if cfg.trainer.profile_comm else None
        # the ranks sharing this DP index (TP x PP x CP) hold the same data: rewards are scored
        # once per replica, on its first rank, and broadcast in this group
        replicas, replica_group = replica_groups(rank, world, self.dp_rank)
        # where a step's batch comes from (engine/experience/); it may prepare it as the loader
        # makes the prompt batch (in the prefetch thread with data.dataloader_num_workers > 0)
        pool = connect(derived, c.bridge, world, replicas) if c.bridge is not None else None
        self.experience = build_experience(cfg, pool)
        self.loader = PromptLoader(self.train_data, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                   seed=cfg.data.seed, prefetch=cfg.data.dataloader_num_workers,
                                   prepare=lambda prompts: self.experience.prepare(self.ctx, prompts))
        self.guard = StepGuard(cfg.trainer.max_nonfinite_skips, cfg.trainer.rollback_lr_factor)
        for worker in (self.actor, self.critic):
            if worker is not None:
                worker.oom_retries = cfg.trainer.oom_retry
        workers = {"actor": self.actor, "critic": self.critic, "ref": self.ref,
                   "reward_model": self.reward_model}
        self.colocated = HybridEngine(self.actor.chunks, self.rollout, self.hf_config,
                                      arr.rollout.update_weights_bucket_megabytes, derived.phases,
                                      {k: w for k, w in workers.items() if w is not None},
                                      layout=derived.layout, topology=derived.rollout_topology)
        self.eos_ids = [self.tokenizer.eos_token_id] + list(arr.rollout.stop_token_ids)
        self.ctx = StepContext(
            derived, self.colocated, self.rollout, self.reward_fn, self.reward_model, self.ref, self.actor,
            self.hf_config, self.loader, self.train_data, c.pad_id, self.eos_ids,
            self.dp, self.dp_rank, rank, replicas, replica_group, cfg.trainer.total_training_steps,
            watch=c.watch, comm=self.comm)
        if arr.rollout.multi_turn.enable:  # trajectories with tools (engine/rollout/tool_actor.py)
            from engine.rollout import tool_actor
            self.ctx.run_engine = tool_actor.from_config(arr.rollout.multi_turn, self.tokenizer,
                                                         arr.rollout.response_length, self.eos_ids,
                                                         self.ctx.run_engine)
        Loop.__init__(self, cfg, checkpoints=c.checkpoints)  # the shell: logger, step count, cadence
        self.actor.mini_batch_size_per_rank = derived.actor.mini_batch_size_per_rank
        if self.critic is not None:
            self.critic.mini_batch_size_per_rank = derived.critic.mini_batch_size_per_rank
        self.flags = derived.step  # what every step runs, decided once (engine/config/steps.py)

    @property
    def step_count(self):
        """Steps trained so far (the StepContext's count: the step's parts read it there)."""
        return self.ctx.step

    @step_count.setter
    def step_count(self, value):
        self.ctx.step = value

    @property
    def first_step(self):
        """The step this process started (or resumed) from."""
        return self.ctx.first_step

    @first_step.setter
    def first_step(self, value):
        self.ctx.first_step = value

    # -- the shell's hooks (engine/loop.py runs fit: resume, cadence, logging) ----------------
    def next_batch(self):
        return self.experience.prompts(self.ctx)

    def after_step(self, metrics):
        """The step guard: a step that applied nothing (non-finite values) `max_nonfinite_skips`
        times in a row refuses the step and the shell rolls back."""
        return self.guard.after_step(metrics, metrics.pop("train/applied_update") > 0)

    def export_hf(self):
        from engine.models.hf_io import save_hf_weights
        out = os.path.join(self.cfg.trainer.default_local_dir, "hf", f"step_{self.step_count}")
        source = self.cfg.actor_rollout_ref.model.path
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with self.ctx.phase("save_checkpoint"):
            dist.barrier()
            save_hf_weights(self.actor.chunks, self.hf_config, out, source_dir=source)
            if self.rank == 0 and not source:  # a built-in task's tokenizer
                self.tokenizer.save_pretrained(out)

    def shutdown(self):
        if self.comm is not None:  # torch.distributed's functions back as they were
            self.comm.uninstall()
        self.experience.finish()

    def train_step(self, prompts):
        """One PPO iteration on a batch of prompts, a column of phases; returns its metrics."""
        ctx = self.ctx
        timings = ctx.begin_step()
        with Timer("step", timings, cpu=ctx.cpu_timings):
            batch, metrics = self.experience.collect(ctx, prompts)  # update_weights, gen (...)
            batch = ctx.balance(batch, metrics)  # trainer.balance_batch: even tokens per DP rank
            if "token_level_scores" not in batch:  # else logged, or scored by the source
                metrics.update(ctx.reward_metrics(ctx.score(batch)))  # reward
            if self.ref is not None and self.flags.full_kl_in_reward:
                self.reference_pass(batch)  # ref (its hidden states feed the exact KL below)
            if not self.flags.reuse_old_log_prob:  # else update_policy takes its own, detached
                metrics.update(self.old_log_prob_pass(batch))  # old_log_prob
            if self.ref is not None and self.flags.kl_uses_ref and not self.flags.full_kl_in_reward:
                self.reference_pass(batch)  # ref
            if self.critic is not None:
                with ctx.phase("values"):
                    batch["values"] = self.critic.compute_values(batch, **ctx.forward_split("critic"))
            with ctx.phase("adv"):
                metrics.update(self.compute_rewards(batch))
                batch = self.compute_advantages(batch)
                metrics.update(self.experience.after_advantages(ctx, batch))  # IS, PF-PPO weights
            # NaN / Inf rewards (a broken verifier, a reward model gone bad) train nothing
            finite = self.guard.finite(batch["token_level_rewards"])
            metrics["train/applied_update"] = 0.0
            if finite and self.critic is not None:
                with ctx.phase("update_critic"):
                    metrics.update(self.critic.update_critic(batch, **self.derived.critic.update.kwargs()))
            if finite:
                with ctx.phase("update_actor"):
                    metrics.update(self.actor.update_policy(
                        loss_batch(batch, batch["policy_keep"]) if "policy_keep" in batch else batch,
                        temperature=self.cfg.actor_rollout_ref.rollout.temperature,
                        kl_coef=self.kl_loss_coef, **self.derived.actor.update.kwargs()))
                steps = self.derived.actor.ppo_epochs * self.derived.actor.mini_batches_per_epoch
                metrics["train/applied_update"] = float(metrics["actor/skipped_updates"] < steps)
        return self.step_metrics(prompts, batch, timings, metrics)

    # -- steps -----------------------------------------------------------------------------
    def reference_pass(self, batch):
        """Reference log-probs; for the exact KL also its hidden states and output-weight shard
        (host memory, last pipeline stage only: see engine/workers/actor.py)."""
        with self.ctx.phase("ref"):
            out = self.ref.forward_outputs(
                batch, temperature=self.cfg.actor_rollout_ref.rollout.temperature,
                with_hidden=self.flags.keep_ref_hidden, **self.ctx.forward_split("ref"))
        batch["ref_log_prob"] = out["log_prob"]
        if "hidden" in out:
            batch["ref_hidden"] = out["hidden"]
            batch.meta["ref_output_weight"] = out["output_weight"]

    def old_log_prob_pass(self, batch):
        """The actor's log-probs of the responses before the update (and the exact in-reward KL
        from the reference's hidden states); the rollout-vs-training mismatch metrics."""
        with self.ctx.phase("old_log_prob"):
            out = self.actor.forward_outputs(
                batch, temperature=self.cfg.actor_rollout_ref.rollout.temperature,
                with_full_kl=self.flags.full_kl_in_reward, **self.ctx.forward_split("actor"))
            batch["old_log_probs"] = out["log_prob"]
            if self.flags.full_kl_in_reward:
                batch["old_full_kl"] = out["full_kl"]
        if "rollout_log_probs" not in batch:
            return {}
        return mismatch_metrics(batch["old_log_probs"], batch["rollout_log_probs"],
                                batch["response_mask"], ps.get_data_parallel_group())

    def compute_rewards(self, batch):
        """token_level_rewards = scores, minus the in-reward KL penalty when configured."""
        if self.kl_ctrl is None:
            batch["token_level_rewards"] = batch["token_level_scores"]
            return {}
        rewards, metrics = apply_kl_penalty(
            batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
            batch["response_mask"], self.kl_ctrl.value, self.cfg.algorithm.kl_penalty,
            full_kl=batch["old_full_kl"] if self.flags.full_kl_in_reward else None)
        batch["token_level_rewards"] = rewards
        kl = torch.tensor([float(metrics["actor/reward_kl_penalty"])])
        dist.all_reduce(kl, group=ps.get_data_parallel_group())
        current = float(kl) / self.dp
        self.kl_ctrl.update(current, n_steps=len(batch) * self.dp)
        return {"actor/reward_kl_penalty": current,
                "actor/reward_kl_penalty_coeff": float(metrics["actor/reward_kl_penalty_coeff"])}

    def compute_advantages(self, batch):
        alg = self.cfg.algorithm
        adv, ret = compute_advantage(
            alg.adv_estimator, token_level_rewards=batch["token_level_rewards"],
            values=batch["values"] if "values" in batch else None,
            response_mask=batch["response_mask"], group_index=list(batch["uid"]),
            gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
            reward_baselines=batch["reward_baselines"] if "reward_baselines" in batch else None,
            batch_sum=self._dp_sum)
        if "reward_skipped" in batch:  # a reward service failed them (on_failure=skip): they train nothing
            adv = adv * (~batch["reward_skipped"]).to(adv)[:, None]
        batch["advantages"], batch["returns"] = adv, ret
        return batch

    @staticmethod
    def _dp_sum(t):
        """Sum over the DP ranks (whitening statistics of the global batch, not this shard's:
        the advantages must not depend on the DP size). TP / CP ranks hold the same data."""
        dist.all_reduce(t, group=ps.get_data_parallel_group())
        return t

    # -- metrics ---------------------------------------------------------------------------
    def step_metrics(self, prompts, batch, timings, metrics):
        """The step's metrics (its phases' own, in `metrics`) completed with the global batch's
        data metrics, timings, collectives (profile_comm), throughput / MFU, the KL guard (which
        reads the update's KL and entropy from them) and the data policy's counts."""
        metrics.update(self._global_data_metrics(batch))
        metrics.update(timings)
        metrics.update(self.ctx.cpu_timings)  # perf/cpu_s/<phase>: CPU seconds of this process
        if self.comm is not None:  # seconds blocked in collectives, per phase
            metrics.update({f"perf/comm_s/{k}": v for k, v in self.comm.seconds.items()})
            self.comm.seconds.clear()
        metrics.update(self._perf_metrics(batch, timings))
        if self.kl_guard is not None:
            metrics.update(self._apply_kl_guard(metrics))
        metrics["training/epoch"] = prompts.epoch
        # what the data policy (data.truncation) did to the training set's bad rows
        metrics.update(self.train_data.filter_counts)
        metrics["data/truncated_prompts"] = self.train_data.num_truncated
        return metrics

    def _global_data_metrics(self, batch):
        local = compute_data_metrics(
            batch["token_level_scores"], batch["token_level_rewards"], batch["advantages"],
            batch["returns"], batch["response_mask"], prompt_mask=batch["prompt_mask"],
            values=batch["values"] if "values" in batch else None,
            max_response_length=self.cfg.actor_rollout_ref.rollout.response_length)
        # token means: weighted by each shard's valid tokens, so the global batch's token mean
        if "multi_turn" in batch.non_tensors:  # equal-sized shards: means reduce as means
            local.update(multi_turn_metrics(batch.non_tensors["multi_turn"]))
        tokens = float(batch["response_mask"].sum())
        token_means = ("critic/advantages/mean", "critic/returns/mean", "critic/values/mean")
        return reduce_over_dp(local, self.dp, weights={k: tokens for k in token_means})

    def _perf_metrics(self, batch, timings):
        step_time = timings["timing_s/step"]
        tokens = torch.tensor([float(batch["attention_mask"].sum())])
        dist.all_reduce(tokens, group=ps.get_data_parallel_group())
        total = float(tokens)
        actor = self.cfg.actor_rollout_ref.actor
        _, active = model_flops_params(self.hf_config)  # the whole model's, per token (MoE: top-k)
        flops = step_flops(self.actor_params, total, active_params=active, ppo_epochs=actor.ppo_epochs,
                           critic_epochs=self.cfg.critic.ppo_epochs or actor.ppo_epochs,
                           critic=self.critic is not None, ref=self.ref is not None,
                           old_log_prob=not self.flags.reuse_old_log_prob)
        out = compute_throughput_metrics(total, step_time, self.world, flops=flops,
                                         peak_flops_per_rank=self.peak_flops)
        out["perf/peak_flops_per_rank"] = self.peak_flops or 0.0
        update_s = timings.get("timing_s/update_actor", 0.0)
        if self.peak_flops and update_s > 0:  # the actor update alone: forward + backward per epoch
            out["perf/mfu/actor_update"] = (6.0 * active * total * actor.ppo_epochs
                                            / (update_s * self.world * self.peak_flops))
        out.update(peak_memory_gb())
        return out

    @property
    def actor_params(self):
        return model_flops_params(self.hf_config)[0]

    def _apply_kl_guard(self, metrics):
        kl = metrics.get("actor/kl_loss", metrics.get("actor/reward_kl_penalty"))
        if not self.cfg.actor_rollout_ref.actor.use_kl_loss and self.kl_ctrl is not None:
            # compose: the guard's rules act on the controller's value as it stands after this
            # step's update (an adaptive controller moves it; writing back the guard's own stale
            # copy would freeze the controller)
            self.kl_guard.coef = self.kl_ctrl.value
        out = self.kl_guard.update(kl, metrics.get("actor/entropy"))
        if self.cfg.actor_rollout_ref.actor.use_kl_loss:
            self.kl_loss_coef = self.kl_guard.coef
        elif self.kl_ctrl is not None:
            self.kl_ctrl.value = self.kl_guard.coef
        return out

    # -- validation --------------------------------------------------------------------------
    def validate(self):
        if self.val_data is None or len(self.val_data) == 0:
            return {}
        ctx = self.ctx
        if self.experience.separate:  # a separate pool (engine/experience/pool.py, streaming.py)
            prompt_ids = [self.val_data[i]["input_ids"] for i in range(len(self.val_data))]
            return validate_from(self.experience.validate(ctx, prompt_ids), self.val_data, self.tokenizer,
                                 self.reward_fn, self.eos_ids)
        ctx.sync_weights()
        with ctx.phase("testing"):
            return validate(self.rollout, self.val_data, self.tokenizer, self.reward_fn,
                            ctx.sampling(train=False), self.eos_ids,
                            batch_size=self.cfg.data.val_batch_size, generate=ctx.run_engine)

    # -- checkpoints -------------------------------------------------------------------------
    def loader_state(self):
        return self.experience.loader_state(self.ctx)

    def extra_state(self):
        # no RNG here: this dict is rank 0's; the checkpoint manager saves and restores every
        # rank's own RNG states (python / numpy / torch / CUDA / Megatron's tracker)
        return {"kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl else None,
                "kl_guard": self.kl_guard.state_dict() if self.kl_guard else None,
                "kl_loss_coef": self.kl_loss_coef,
                "guard": self.guard.state_dict(),
                "experience": self.experience.state_dict(),  # collective: a replay buffer's contents
                "splits": {n: list(w.split) for n, w in self.workers().items() if w.split is not None}}

    def load_extra_state(self, state):
        if self.kl_ctrl is not None and state.get("kl_ctrl"):
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.kl_guard is not None and state.get("kl_guard") is not None:
            self.kl_guard.load_state_dict(state["kl_guard"])
        self.kl_loss_coef = float(state.get("kl_loss_coef", self.kl_loss_coef))
        self.guard.load_state_dict(state.get("guard", {}))
        self.experience.load_state_dict(state.get("experience") or {})
        for name, split in state.get("splits", {}).items():  # sizes an out-of-memory settled on
            self.workers()[name].split = tuple(split)
        # an older checkpoint's "rng" entry is rank 0's state: never copied onto every rank

    def workers(self):
        out = {"actor": self.actor}
        if self.critic is not None:
            out["critic"] = self.critic
        return out

    def checkpoint_phase(self):
        """Around a save and a rollback's load: every checkpointed model's states on the device."""
        return self.ctx.phase("save_checkpoint")

    def rollback(self):
        """`max_nonfinite_skips` steps in a row applied nothing: back to the last good
        checkpoint (its weights, data position, RNG) with a lower LR; without one, the current
        weights are the last good ones (nothing non-finite was applied): lower the LR in place."""
        guard = self.guard.state_dict()
        path = self.restore_latest()
        self.guard.load_state_dict(guard)
        scale = self.guard.lower_lr(list(self.workers().values()))
        if self.rank == 0:
            print(f"non-finite values in {self.guard.max_skips} steps in a row: "
                  f"{'rolled back to ' + path if path else 'no checkpoint to roll back to'}; "
                  f"the LR is now x{scale:g} of the recipe's (trainer.rollback_lr_factor)", flush=True)


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)

