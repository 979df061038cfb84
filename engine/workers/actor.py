"""The PPO actor (and the frozen reference): log-probs through the pipeline, and the policy update.

The update is a property of the data, not of the layout: every micro-batch loss is a sum
divided by the mini-batch's *global* token / sequence counts (all micro-batches, all DP ranks),
and the schedule neither averages over micro-batches nor over DP ranks. Splitting the batch
differently (micro-batch size, dynamic batching, DP, PP) therefore gives the same gradients.
"""
from collections import defaultdict

import torch
from megatron.core import parallel_state as ps

from engine.algorithms.kl import kl_penalty
from engine.algorithms.losses import (LossNormaliser, entropy_bonus, kl_loss, policy_loss,
                                      policy_loss_gspo, policy_token_losses, token_weights)
from engine.batch import Batch
from engine.workers.base import MegatronWorker, global_counts
from kernels.logprob import linear_logprob_entropy, linear_token_loss


class LogProbModel(MegatronWorker):
    """A language model whose last stage returns hidden states; log-probs come from the fused
    chunked kernel against this rank's vocab shard (never the [tokens, vocab] logits)."""

    supports_context_parallel = True

    def _logprob_entropy(self, hidden, mb, temperature, with_entropy):
        model = self.models[-1]
        h = hidden.reshape(-1, hidden.shape[-1])[mb.positions]
        # one chunk when unfused (at least 1: a CP rank may hold no prediction of a micro-batch)
        chunk = None if self.model_cfg.use_fused_kernels else max(h.shape[0], 1)
        lp, ent = linear_logprob_entropy(
            h, model.output_weight(), mb.labels, temperature=temperature,
            tp_group=ps.get_tensor_model_parallel_group(), chunk_tokens=chunk,
            compute_entropy=with_entropy)
        return lp, ent

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch, *, temperature=1.0, micro_batch_size=None,
                         max_tokens=None, with_entropy=False):
        """Log-probs [B, R] of the responses (and entropies when asked), on every rank."""
        for c in self.chunks:
            c.eval()
        micro = self.micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
        width = batch["responses"].shape[1]

        def head(hidden, mb):
            lp, ent = self._logprob_entropy(hidden, mb, temperature, with_entropy)
            info = dict(rows=mb.rows, log_prob=mb.to_padded(self.gather_cp(lp.float(), mb)).cpu())
            if with_entropy:
                info["entropy"] = mb.to_padded(self.gather_cp(ent.float(), mb)).cpu()
            return lp.sum() * 0.0, info

        infos = self.run(micro, head, forward_only=True)
        out = {}
        keys = ["log_prob"] + (["entropy"] if with_entropy else [])
        for key in keys:
            full = None
            if self.is_last_stage:
                full = torch.zeros(len(batch), width)
                for info in infos:
                    full[info["rows"]] = info[key]
            out[key] = self.broadcast_from_last_stage(full, (len(batch), width))
        return out if with_entropy else out["log_prob"]


class ActorWorker(LogProbModel):
    def __init__(self, hf_config, actor_cfg, model_cfg, *, total_steps=1, pad_token_id=0,
                 response_length=None):
        from engine.models.lora import LoraSpec
        super().__init__(hf_config, megatron_cfg=actor_cfg.megatron, model_cfg=model_cfg,
                         optim_cfg=actor_cfg.optim, total_steps=total_steps,
                         pad_token_id=pad_token_id, router_replay=actor_cfg.router_replay,
                         lora=LoraSpec.from_config(model_cfg, seed=actor_cfg.megatron.seed))
        self.cfg = actor_cfg
        self.response_length = response_length

    def base_reference(self):
        """The reference policy of a LoRA actor: this model with its adapters off (no second
        model in memory)."""
        if self.lora is None:
            raise ValueError("base_reference: the actor has no LoRA adapters; build a ReferenceWorker")
        return AdaptersOffReference(self)

    def _mini_batches(self, batch, epoch):
        n = len(batch)
        order = torch.arange(n)
        if self.cfg.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                self.cfg.megatron.seed + epoch))
        size = self.mini_batch_size_per_rank or n
        return [order[i:i + size].tolist() for i in range(0, n, size)]

    mini_batch_size_per_rank = None  # set by the trainer from engine.config.derive

    def update_policy(self, batch: Batch, *, temperature=1.0, micro_batch_size=None,
                      max_tokens=None):
        """`ppo_epochs` passes over the batch in mini-batches; one optimizer step each.

        batch: input_ids, attention_mask, responses, response_mask, old_log_probs, advantages,
        and ref_log_prob when `use_kl_loss`. Returns metrics averaged over optimizer steps.
        Without old_log_probs the update is on-policy by construction (one epoch, one mini-batch:
        the caller checks) and each token's old log-prob is its current one, detached.
        """
        cfg = self.cfg
        if "old_log_probs" not in batch and (cfg.ppo_epochs != 1 or len(self._mini_batches(batch, 0)) != 1):
            raise ValueError("update_policy: old_log_probs are needed unless the update is one "
                             "epoch of one mini-batch (on-policy); compute them with "
                             "compute_log_prob first")
        micro_batch_size, max_tokens = self.start_update(micro_batch_size, max_tokens)
        history = defaultdict(list)
        dp_group = ps.get_data_parallel_group()
        for epoch in range(cfg.ppo_epochs):
            for rows in self._mini_batches(batch, epoch):
                mini = batch.index_select(rows)
                norm = global_counts(LossNormaliser.from_mask(
                    mini["response_mask"], self.response_length), dp_group)
                micro = self.micro_batches(mini, micro_batch_size=micro_batch_size,
                                           max_tokens=max_tokens)
                self.zero_grad()
                infos = self.run(micro, lambda h, mb: self._policy_loss(h, mb, mini, norm,
                                                                        temperature),
                                 forward_only=False)
                grad_norm, lr, _ = self.optimizer_step()
                stats = self._reduce_metrics(infos)
                for k, v in stats.items():
                    history[k].append(v)
                history["actor/grad_norm"].append(grad_norm)
                if cfg.use_kl_loss:
                    history["actor/kl_coef"].append(cfg.kl_loss_coef)
                history["actor/lr"].append(lr)
        return {k: sum(v) / len(v) for k, v in history.items()}

    def _policy_loss(self, hidden, mb, mini, norm, temperature):
        """The micro-batch's loss and metrics. Per-token objectives (every policy loss but
        GSPO's sequence ratio) take the single-pass kernel, which makes the gradients while the
        logits of a chunk are at hand; GSPO and `use_fused_kernels=False` differentiate the
        log-probs the usual way."""
        cfg = self.cfg
        device = hidden.device

        def rows_of(key):  # this micro-batch's rows of a mini-batch field, on the model's device
            return mini[key][mb.rows].to(device) if key in mini else None

        mask = rows_of("response_mask").float()
        old = rows_of("old_log_probs")  # None: on-policy
        adv = rows_of("advantages")
        ref = rows_of("ref_log_prob") if cfg.use_kl_loss else None
        if cfg.policy_loss != "gspo" and self.model_cfg.use_fused_kernels:
            loss, lp, ent = self._single_pass_loss(hidden, mb, mask, old, adv, ref, norm,
                                                   temperature)
            with torch.no_grad():  # metrics of whole sequences, identical on every CP rank
                log_prob = mb.to_padded(self.gather_cp(lp, mb))
                _, metrics = self._loss_terms(log_prob, mb.to_padded(self.gather_cp(ent, mb)),
                                              mask, log_prob if old is None else old, adv, ref,
                                              norm)
            return loss, metrics
        need_entropy = True  # reported as actor/entropy even when the bonus is off
        lp, ent = self._logprob_entropy(hidden, mb, temperature, need_entropy)
        log_prob = mb.to_padded(self.gather_cp(lp.float(), mb))
        entropy = mb.to_padded(self.gather_cp(ent.float(), mb))
        return self._loss_terms(log_prob, entropy, mask,
                                log_prob.detach() if old is None else old, adv, ref, norm)

    def _loss_terms(self, log_prob, entropy_tokens, mask, old, adv, ref, norm):
        """(loss, metrics) from padded [rows, R] log-probs and entropies."""
        cfg = self.cfg
        if cfg.policy_loss == "gspo":
            pg, metrics = policy_loss_gspo(log_prob, old, adv, mask,
                                           clip_ratio_low=cfg.clip_ratio_low,
                                           clip_ratio_high=cfg.clip_ratio_high,
                                           loss_agg_mode=cfg.loss_agg_mode, normaliser=norm)
        else:
            pg, metrics = policy_loss(log_prob, old, adv, mask, clip_ratio=cfg.clip_ratio,
                                      clip_ratio_low=cfg.clip_ratio_low,
                                      clip_ratio_high=cfg.clip_ratio_high,
                                      clip_ratio_c=cfg.clip_ratio_c,
                                      loss_agg_mode=cfg.loss_agg_mode, normaliser=norm)
        entropy = entropy_bonus(entropy_tokens, mask, cfg.loss_agg_mode, norm)
        loss = pg - cfg.entropy_coeff * entropy
        metrics = {k: v.detach() for k, v in metrics.items()}
        metrics["actor/pg_loss"] = pg.detach()
        metrics["actor/entropy"] = entropy.detach()
        if cfg.use_kl_loss:
            kl = kl_loss(log_prob, ref, mask, cfg.kl_loss_type, cfg.loss_agg_mode, norm)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        return loss, metrics

    def _single_pass_loss(self, hidden, mb, mask, old, adv, ref, norm, temperature):
        """The same loss as `_loss_terms`, as a weighted sum of per-token terms fed to
        kernels.logprob.linear_token_loss. Returns (loss, flat log-probs, flat entropies).

        Under CP a rank sums the terms of the predictions it holds (with the global weights);
        the loss is linear in the terms, so the CP ranks' losses add up to the whole loss and
        the gradient all-reduce over DP x CP sums their gradients into the whole gradient."""
        cfg = self.cfg
        flat = lambda t: None if t is None else mb.own_predictions(mb.to_flat(t))  # noqa: E731
        weight = flat(token_weights(mask, cfg.loss_agg_mode, **norm.as_kwargs()))
        old, adv, ref = flat(old), flat(adv), flat(ref)

        def token_loss(start, end, lp, ent):
            old_lp = lp.detach() if old is None else old[start:end]
            terms = policy_token_losses(lp, old_lp, adv[start:end], cfg.clip_ratio,
                                        cfg.clip_ratio_low, cfg.clip_ratio_high,
                                        cfg.clip_ratio_c)[0]
            if cfg.entropy_coeff:
                terms = terms - cfg.entropy_coeff * ent
            if ref is not None:
                terms = terms + cfg.kl_loss_coef * kl_penalty(lp, ref[start:end], cfg.kl_loss_type)
            w = weight[start:end]
            # where, not multiply: a masked token's term may be inf and inf * 0 is NaN
            return torch.where(w != 0, terms, torch.zeros_like(terms)).mul(w).sum()

        model = self.models[-1]
        h = hidden.reshape(-1, hidden.shape[-1])[mb.positions]
        return linear_token_loss(h, model.output_weight(), mb.labels, token_loss,
                                 temperature=temperature,
                                 tp_group=ps.get_tensor_model_parallel_group())

    def metric_names(self):
        names = ["actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                 "actor/ppo_kl", "actor/entropy"]
        return names + (["actor/kl_loss"] if self.cfg.use_kl_loss else [])

    def _reduce_metrics(self, infos):
        """Per-micro-batch metrics are already divided by global counts: sum them over
        micro-batches (last stage) and DP ranks, then share with every pipeline stage."""
        names = self.metric_names()
        values = torch.zeros(len(names), dtype=torch.float64)
        if self.is_last_stage:
            for info in infos:
                values += torch.stack([info[k].double() for k in names]).cpu()
        values = self.dp_all_reduce(values)
        values = self.broadcast_from_last_stage(values, values.shape, values.dtype)
        return {k: float(v) for k, v in zip(names, values)}


class ReferenceWorker(LogProbModel):
    """The frozen reference policy: forward only, parameters offloadable between uses."""

    def __init__(self, hf_config, ref_megatron_cfg, model_cfg, *, pad_token_id=0):
        super().__init__(hf_config, megatron_cfg=ref_megatron_cfg, model_cfg=model_cfg,
                         pad_token_id=pad_token_id)
        for p in (p for c in self.chunks for p in c.parameters()):
            p.requires_grad_(False)


class AdaptersOffReference:
    """What the trainer asks of a reference, answered by a LoRA actor with its adapters off:
    the base weights are the frozen reference (verl's LoRA reference). Nothing to offload."""

    def __init__(self, actor):
        self.actor = actor

    def compute_log_prob(self, batch, **kwargs):
        from engine.models.lora import adapters_disabled
        with adapters_disabled(self.actor.chunks):
            return self.actor.compute_log_prob(batch, **kwargs)

    def offload(self):
        return None

    def reload(self):
        return None
