"""The PPO loop: rollout -> old / ref log-probs, values -> rewards (+ in-reward KL) ->
advantages -> critic and actor updates -> weight sync; timing, metrics, checkpoints.

Every step of one iteration is a method taking and returning a `Batch`, so each can be run,
timed and tested alone. Data parallelism splits a step's prompts by DP rank (all n responses
of a prompt stay on one rank, so group advantages are local); generation is split over the
rollout groups (one engine each, on the group's leader) and each DP replica receives exactly
the responses it trains on (engine/rollout/group.py).
"""
import contextlib
import os
import random
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.algorithms.advantages import compute_advantage
from engine.algorithms.kl import make_kl_controller
from engine.algorithms.losses import apply_kl_penalty
from engine.batch import Batch
from engine.data import PromptLoader, left_pad
from engine.hybrid import HybridEngine
from engine.perf import CommTimer, step_flops
from engine.phase import set_phase
from engine.metrics import MetricsLogger, Timer, compute_data_metrics, compute_throughput_metrics
from engine.rollout.base import SamplingParams
from parallel.cpu import suspended as cpu_function_mode_suspended


class KLGuard:
    """The monitoring rules users apply by hand, automated: KL above a ceiling multiplies the KL
    coefficient by `raise_factor`; entropy below a floor multiplies it by `lower_factor`."""

    def __init__(self, cfg, coef):
        self.cfg, self.coef = cfg, coef

    def update(self, kl, entropy):
        action = 0
        if kl is not None and kl > self.cfg.kl_ceiling:
            self.coef *= self.cfg.raise_factor
            action = 1
        elif entropy is not None and entropy < self.cfg.entropy_floor:
            self.coef *= self.cfg.lower_factor
            action = -1
        return {"kl_guard/kl_coef": self.coef, "kl_guard/action": action}


class Trainer:
    def __init__(self, derived, components):
        """derived: engine.config.Derived; components: engine.train.Components."""
        self.derived = derived
        self.cfg = cfg = derived.config
        c = components
        self.tokenizer, self.hf_config = c.tokenizer, c.hf_config
        self.actor, self.ref, self.critic = c.actor, c.ref, c.critic
        self.rollout, self.reward_fn, self.reward_model = c.rollout, c.reward_fn, c.reward_model
        self.train_data, self.val_data = c.train_data, c.val_data
        self.checkpoints = c.checkpoints
        self.peak_flops = c.peak_flops
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.loader = PromptLoader(self.train_data, cfg.data.train_batch_size,
                                   shuffle=cfg.data.shuffle, seed=cfg.data.seed)
        alg = cfg.algorithm
        self.kl_ctrl = make_kl_controller(alg.kl_ctrl) if alg.use_kl_in_reward else None
        arr = cfg.actor_rollout_ref
        guarded = arr.actor.kl_loss_coef if arr.actor.use_kl_loss else alg.kl_ctrl.kl_coef
        self.kl_guard = KLGuard(alg.kl_guard, guarded) if alg.kl_guard.enable else None
        self.total_steps = cfg.trainer.total_training_steps
        self.step_count = 0
        self.comm = CommTimer().install() if cfg.trainer.profile_comm else None
        self.hybrid = HybridEngine(self.actor.chunks, self.rollout, self.hf_config,
                                   arr.rollout.update_weights_bucket_megabytes)
        self.logger = MetricsLogger(cfg.trainer.log_dir, cfg.trainer.logger, project=None,
                                    experiment=None, total_steps=self.total_steps,
                                    rank=self.rank)
        self.pad_id = self.tokenizer.pad_token_id
        self.eos_ids = [self.tokenizer.eos_token_id] + list(arr.rollout.stop_token_ids)
        self.actor.mini_batch_size_per_rank = derived.actor.mini_batch_size_per_rank
        plan = derived.actor
        # decided from the config, the same on every rank (the skipped forward has collectives)
        self.reuse_old_log_prob = (arr.actor.on_policy_old_log_prob and plan.ppo_epochs == 1
                                   and plan.mini_batches_per_epoch == 1
                                   and not alg.use_kl_in_reward)
        if self.critic is not None:
            self.critic.mini_batch_size_per_rank = derived.critic.mini_batch_size_per_rank

    # -- the loop --------------------------------------------------------------------------
    def fit(self):
        trainer = self.cfg.trainer
        self.resume()
        if trainer.val_before_train and trainer.test_freq > 0 and self.step_count == 0:
            self.logger.log(self.validate(), self.step_count)
        while self.step_count < self.total_steps:
            prompts = self.loader.next_batch()
            metrics = self.train_step(prompts)
            self.step_count += 1
            if trainer.test_freq > 0 and (self.step_count % trainer.test_freq == 0
                                          or self.step_count == self.total_steps):
                metrics.update(self.validate())
            self.logger.log(metrics, self.step_count)
            if trainer.save_freq > 0 and (self.step_count % trainer.save_freq == 0
                                          or self.step_count == self.total_steps):
                self.save()
        if trainer.save_hf:
            from engine.models.hf_io import save_hf_weights
            out = os.path.join(trainer.default_local_dir, "hf", f"step_{self.step_count}")
            source = self.cfg.actor_rollout_ref.model.path
            os.makedirs(os.path.dirname(out), exist_ok=True)
            dist.barrier()
            save_hf_weights(self.actor.chunks, self.hf_config, out, source_dir=source)
            if self.rank == 0 and not source:  # a built-in task's tokenizer
                self.tokenizer.save_pretrained(out)
        self.logger.close()
        return self.step_count

    def train_step(self, prompts):
        """One PPO iteration on a batch of prompts; returns its metrics."""
        timings = defaultdict(float)
        cfg, alg = self.cfg, self.cfg.algorithm
        with Timer("step", timings):
            with self._phase("update_weights", timings):
                sync = self.sync_weights()
            self._offload_training(True)
            with self._phase("gen", timings):
                batch = self.generate(prompts, self._sampling(train=True))
            if alg.adv_estimator == "remax":
                with self._phase("gen", timings):
                    baseline = self.generate(prompts, self._sampling(train=True, greedy=True),
                                             n=1)
                batch["reward_baselines"] = self._scores(baseline).repeat_interleave(
                    cfg.actor_rollout_ref.rollout.n)
            self.hybrid.to_training()
            self._offload_training(False)
            with self._phase("reward", timings):
                batch["token_level_scores"], extra = self.compute_scores(batch)
            if not self.reuse_old_log_prob:  # else update_policy takes its own, detached
                with self._phase("old_log_prob", timings):
                    batch["old_log_probs"] = self.actor.compute_log_prob(
                        batch, temperature=cfg.actor_rollout_ref.rollout.temperature,
                        **self._log_prob_split("rollout"))
            if self.ref is not None:
                with self._phase("ref", timings):
                    batch["ref_log_prob"] = self.ref.compute_log_prob(
                        batch, temperature=cfg.actor_rollout_ref.rollout.temperature,
                        **self._log_prob_split("ref"))
            if self.critic is not None:
                with self._phase("values", timings):
                    batch["values"] = self.critic.compute_values(batch, **self._log_prob_split("rollout"))
            metrics = {}
            with self._phase("adv", timings):
                metrics.update(self.compute_rewards(batch))
                batch = self.compute_advantages(batch)
            if self.critic is not None:
                with self._phase("update_critic", timings):
                    metrics.update(self.critic.update_critic(batch))
            with self._phase("update_actor", timings):
                metrics.update(self.actor.update_policy(
                    batch, temperature=cfg.actor_rollout_ref.rollout.temperature))
        metrics.update(self._global_data_metrics(batch))
        metrics.update(timings)
        metrics["perf/update_weights_gb"] = sync.bytes / 1e9
        if self.comm is not None:  # seconds blocked in collectives, per phase
            metrics.update({f"perf/comm_s/{k}": v for k, v in self.comm.seconds.items()})
            self.comm.seconds.clear()
        metrics.update(self._perf_metrics(batch, timings["timing_s/step"]))
        if self.kl_guard is not None:
            metrics.update(self._apply_kl_guard(metrics))
        metrics["training/epoch"] = prompts.epoch
        # what the data policy (data.truncation) did to the training set's bad rows
        metrics.update(self.train_data.filter_counts)
        metrics["data/truncated_prompts"] = self.train_data.num_truncated
        return metrics

    # -- steps -----------------------------------------------------------------------------
    def sync_weights(self):
        """The rollout engine takes its memory back and receives the actor's current weights."""
        return self.hybrid.to_rollout()

    @contextlib.contextmanager
    def _phase(self, name, timings):
        """Time a phase, and attribute the collectives it blocks in to it (profile_comm)."""
        if self.comm is not None:
            self.comm.phase = name
        set_phase(name)  # what a launcher reports if this rank dies here (engine.launch_ray)
        with Timer(name, timings):
            yield
        set_phase("training")
        if self.comm is not None:
            self.comm.phase = "other"

    def _offload_training(self, offload):
        """While the rollout engine generates, the models give back what their config offloads."""
        for worker in (self.actor, self.critic, self.ref):
            if worker is not None:
                worker.offload() if offload else worker.reload()

    def _sampling(self, train=True, greedy=False):
        r = self.cfg.actor_rollout_ref.rollout
        if train and not greedy:
            return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  max_new_tokens=r.response_length,
                                  stop_token_ids=tuple(self.eos_ids),
                                  seed=r.seed + 1000003 * self.step_count, do_sample=r.do_sample,
                                  ignore_eos=r.ignore_eos)
        v = r.val_kwargs
        return SamplingParams(n=1 if greedy else v.n, temperature=0.0 if greedy else v.temperature,
                              top_p=v.top_p, top_k=v.top_k, max_new_tokens=r.response_length,
                              stop_token_ids=tuple(self.eos_ids), seed=r.seed,
                              do_sample=False if greedy else v.do_sample)

    def _my_prompts(self, prompts):
        """This DP rank's contiguous share of the step's prompts."""
        per = len(prompts) // self.dp
        return list(range(self.dp_rank * per, (self.dp_rank + 1) * per))

    @staticmethod
    def _engine_generate(engine, prompt_ids, sampling, keys):
        # the rollout engine runs no Megatron code, so on CPU it runs without parallel.cpu's
        # per-op device rewriting (a no-op elsewhere)
        with cpu_function_mode_suspended():
            return engine.generate(prompt_ids, sampling, keys=keys)

    def generate(self, prompts, sampling, n=None, rows=None):
        """Responses for this DP rank's prompts as a training Batch (n per prompt, prompt-major).

        Each rollout group's leader generates the group's share of the step's prompts and sends
        every DP replica the responses of its own prompts (collective over all ranks).
        """
        n = sampling.n if n is None else n
        got = self.rollout.generate_for_replicas(list(prompts.input_ids), list(prompts.indices),
                                                 sampling, generate=self._engine_generate)
        self.route_bytes = self.rollout.route_bytes
        responses = {i: v[0] for i, v in got.items()}
        logps = {i: v[1] for i, v in got.items()}
        routing = {i: v[2] for i, v in got.items() if v[2] is not None}
        rows = self._my_prompts(prompts) if rows is None else rows
        r = self.cfg.actor_rollout_ref.rollout
        prompt_ids, prompt_mask = left_pad([prompts.input_ids[i] for i in rows for _ in range(n)],
                                           self.pad_id, r.prompt_length)
        resp_list = [responses[i][j] for i in rows for j in range(n)]
        lp_list = [logps[i][j] for i in rows for j in range(n)]
        width = r.response_length
        resp = torch.full((len(resp_list), width), self.pad_id, dtype=torch.long)
        rmask = torch.zeros(len(resp_list), width, dtype=torch.long)
        rlp = torch.zeros(len(resp_list), width)
        for k, (t, lp) in enumerate(zip(resp_list, lp_list)):
            t = t[:width]
            resp[k, :len(t)] = torch.tensor(t, dtype=torch.long)
            rmask[k, :len(t)] = 1
            rlp[k, :len(t)] = torch.tensor(lp[:width])
        extra = {}
        if routing:
            extra["routed_experts"] = [routing[i][j] for i in rows for j in range(n)]
        batch = Batch(
            tensors=dict(input_ids=torch.cat([prompt_ids, resp], 1),
                         attention_mask=torch.cat([prompt_mask, rmask], 1),
                         responses=resp, response_mask=rmask, rollout_log_probs=rlp,
                         prompt_mask=prompt_mask),
            non_tensors=dict(
                uid=[prompts.indices[i] for i in rows for _ in range(n)],
                ground_truth=[prompts.ground_truths[i] for i in rows for _ in range(n)],
                data_source=[prompts.data_sources[i] for i in rows for _ in range(n)],
                extra_info=[prompts.extra_infos[i] for i in rows for _ in range(n)], **extra))
        return batch

    def compute_scores(self, batch):
        """Rule rewards by data_source, plus the reward model's score when one is enabled."""
        model_scores = self.reward_model.compute_scores(batch) if self.reward_model else None
        return self.reward_fn(batch["responses"], batch["response_mask"],
                              ground_truths=list(batch["ground_truth"]),
                              data_sources=list(batch["data_source"]),
                              extra_infos=list(batch["extra_info"]), model_scores=model_scores)

    def _scores(self, batch):
        scores, _ = self.compute_scores(batch)
        return scores.sum(-1)

    def compute_rewards(self, batch):
        """token_level_rewards = scores, minus the in-reward KL penalty when configured."""
        if self.kl_ctrl is None:
            batch["token_level_rewards"] = batch["token_level_scores"]
            return {}
        rewards, metrics = apply_kl_penalty(
            batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
            batch["response_mask"], self.kl_ctrl.value, self.cfg.algorithm.kl_penalty)
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
            reward_baselines=batch["reward_baselines"] if "reward_baselines" in batch else None)
        batch["advantages"], batch["returns"] = adv, ret
        return batch

    def _log_prob_split(self, section):
        arr = self.cfg.actor_rollout_ref
        sec = arr.rollout if section == "rollout" else arr.ref
        if sec.log_prob_use_dynamic_bsz:
            return dict(max_tokens=sec.log_prob_max_token_len_per_gpu)
        return dict(micro_batch_size=sec.log_prob_micro_batch_size_per_gpu)

    # -- metrics ---------------------------------------------------------------------------
    def _global_data_metrics(self, batch):
        local = compute_data_metrics(
            batch["token_level_scores"], batch["token_level_rewards"], batch["advantages"],
            batch["returns"], batch["response_mask"], prompt_mask=batch["prompt_mask"],
            values=batch["values"] if "values" in batch else None,
            max_response_length=self.cfg.actor_rollout_ref.rollout.response_length)
        return reduce_over_dp(local, self.dp)

    def _perf_metrics(self, batch, step_time):
        tokens = torch.tensor([float(batch["attention_mask"].sum())])
        dist.all_reduce(tokens, group=ps.get_data_parallel_group())
        total = float(tokens)
        actor = self.cfg.actor_rollout_ref.actor
        flops = step_flops(self.actor_params, total, ppo_epochs=actor.ppo_epochs,
                           critic_epochs=self.cfg.critic.ppo_epochs or actor.ppo_epochs,
                           critic=self.critic is not None, ref=self.ref is not None,
                           old_log_prob=not self.reuse_old_log_prob)
        out = compute_throughput_metrics(total, step_time, self.world, flops=flops,
                                         peak_flops_per_rank=self.peak_flops)
        out["perf/peak_flops_per_rank"] = self.peak_flops or 0.0
        out.update(peak_memory_gb())
        return out

    @property
    def actor_params(self):
        if not hasattr(self, "_actor_params"):
            n = torch.tensor([float(sum(p.numel() for c in self.actor.chunks
                                        for p in c.parameters()))])
            dist.all_reduce(n, group=ps.get_model_parallel_group())
            self._actor_params = float(n)
        return self._actor_params

    def _apply_kl_guard(self, metrics):
        kl = metrics.get("actor/kl_loss", metrics.get("actor/reward_kl_penalty"))
        out = self.kl_guard.update(kl, metrics.get("actor/entropy"))
        if self.cfg.actor_rollout_ref.actor.use_kl_loss:
            self.actor.cfg.kl_loss_coef = self.kl_guard.coef
        elif self.kl_ctrl is not None:
            self.kl_ctrl.value = self.kl_guard.coef
        return out

    # -- validation --------------------------------------------------------------------------
    def validate(self):
        if self.val_data is None or len(self.val_data) == 0:
            return {}
        self.sync_weights()
        n = len(self.val_data)
        rows = [self.val_data[i] for i in range(n)]
        sampling = self._sampling(train=False)
        mine, out = self.rollout.generate_split([r["input_ids"] for r in rows], list(range(n)), sampling,
                                                generate=self._engine_generate)
        sums = defaultdict(lambda: [0.0, 0])  # data source -> [score sum, count] on this leader
        if out is not None:
            texts = self.tokenizer.batch_decode(
                [r[:-1] if r and r[-1] in self.eos_ids else r for r in out.responses],
                skip_special_tokens=self.reward_fn.skip_special_tokens)
            k = sampling.n
            for j, text in enumerate(texts):
                row = rows[mine[j // k]]
                s = self.reward_fn.score_texts([text], [row["ground_truth"]], [row["data_source"]])[0]
                sums[row["data_source"]][0] += float(s["score"] if isinstance(s, dict) else s)
                sums[row["data_source"]][1] += 1
        gathered = [None] * self.world
        dist.all_gather_object(gathered, dict(sums))  # a few numbers per rank
        total = defaultdict(lambda: [0.0, 0])
        for part in gathered:
            for source, (value, count) in part.items():
                total[source][0] += value
                total[source][1] += count
        metrics = {f"val/{src}/score/mean": v / c for src, (v, c) in total.items()}
        metrics["val/score/mean"] = (sum(v for v, _ in total.values())
                                     / max(1, sum(c for _, c in total.values())))
        self.hybrid.to_training()
        return metrics

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self):
        return {"step": self.step_count, "loader": self.loader.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl else None,
                "kl_guard": self.kl_guard.coef if self.kl_guard else None,
                "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                        "torch": torch.get_rng_state()}}

    def load_state_dict(self, state):
        self.step_count = int(state["step"])
        self.loader.load_state_dict(state["loader"])
        if self.kl_ctrl is not None and state.get("kl_ctrl"):
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.kl_guard is not None and state.get("kl_guard") is not None:
            self.kl_guard.coef = state["kl_guard"]
        rng = state.get("rng")
        if rng:
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])

    def workers(self):
        out = {"actor": self.actor}
        if self.critic is not None:
            out["critic"] = self.critic
        return out

    def save(self):
        if self.checkpoints is not None:
            self.checkpoints.save(self.step_count, self.workers(), self.state_dict())

    def resume(self):
        t = self.cfg.trainer
        path = None
        if self.checkpoints is not None:
            path = self.checkpoints.resolve(t.resume_mode, t.resume_from_path)
        if path is None:
            self.logger.start_fresh()
            return
        state = self.checkpoints.load(path, self.workers())
        self.load_state_dict(state)
        self.logger.truncate_after(self.step_count)
        if self.rank == 0:
            print(f"resumed from {path} at step {self.step_count}", flush=True)


def peak_memory_gb():
    """Peak memory of the most loaded rank: CUDA allocator peak on GPU, process RSS on CPU."""
    from engine.perf import peak_rss_bytes
    if torch.cuda.is_available():
        t = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
        key = "perf/max_memory_allocated_gb"
    else:
        t = torch.tensor([peak_rss_bytes() / 2**30])
        key = "perf/cpu_peak_rss_gb"
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {key: float(t)}


def reduce_over_dp(local, dp):
    """Mean / max / min metrics of equal-sized DP shards -> the global batch's."""
    keys = sorted(local)
    group = ps.get_data_parallel_group()
    vals = {}
    for op, pick in ((dist.ReduceOp.MAX, "/max"), (dist.ReduceOp.MIN, "/min")):
        ks = [k for k in keys if k.endswith(pick)]
        if ks:
            t = torch.tensor([local[k] for k in ks], dtype=torch.float64)
            dist.all_reduce(t, op=op, group=group)
            vals.update(zip(ks, t.tolist()))
    ks = [k for k in keys if k not in vals]
    t = torch.tensor([local[k] for k in ks], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    vals.update(zip(ks, (t / dp).tolist()))
    return vals


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)

