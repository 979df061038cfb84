"""The PPO actor (and the frozen reference): log-probs through the pipeline, and the policy update.

The update is a property of the data, not of the layout: every micro-batch loss is a sum
divided by the mini-batch's *global* token / sequence counts (all micro-batches, all DP ranks),
and the schedule neither averages over micro-batches nor over DP ranks. Splitting the batch
differently (micro-batch size, dynamic batching, DP, PP) therefore gives the same gradients.

Exact KL to the reference (`kl_loss_type` full / full+, kernels/kl.py): the reference pass keeps
its final hidden states at the response predictions (`ref_hidden`: one [len_i, H] host tensor
per row, on the last pipeline stage, where the actor's loss runs; every TP rank holds them
whole, CP ranks gathered) and a host copy of its output-weight shard (batch.meta
`ref_output_weight`). The update moves the weight to the device once and each micro-batch's
hidden states when it runs, and adds linear_full_kl's per-token KL with the same token weights
as every other term.

Tests: tests/test_ppo_update.py, tests/test_actor_formula.py, tests/test_full_kl_actor.py, tests/test_lora.py
"""
import numpy as np
import torch
from megatron.core import parallel_state as ps

from engine import faults
from engine.algorithms.kl import KL_KINDS, kl_penalty, linear_full_kl
from engine.algorithms.losses import POLICY_LOSSES, entropy_bonus, kl_loss, token_weights
from engine.batch import Batch
from engine.workers.base import MegatronWorker
from engine.workers.template import train_epochs
from kernels.logprob import linear_logprob_entropy, linear_token_loss


class LogProbModel(MegatronWorker):
    """A language model whose last stage returns hidden states; log-probs come from the fused
    chunked kernel against this rank's vocab shard (never the [tokens, vocab] logits)."""

    supports_context_parallel = True

    def _chunk(self, n_tokens):
        # one chunk when unfused (at least 1: a CP rank may hold no prediction of a micro-batch)
        return None if self.model_cfg.use_fused_kernels else max(n_tokens, 1)

    def _logprob_entropy(self, hidden, mb, temperature, with_entropy):
        model = self.models[-1]
        h = hidden.reshape(-1, hidden.shape[-1])[mb.positions]
        lp, ent = linear_logprob_entropy(
            h, model.output_weight(), mb.labels, temperature=temperature,
            tp_group=ps.get_tensor_model_parallel_group(), chunk_tokens=self._chunk(h.shape[0]),
            compute_entropy=with_entropy)
        return lp, ent

    def _full_kl(self, hidden, mb, ref_hidden_rows, ref_weight, temperature):
        """Exact per-token KL(pi || ref) at this rank's predictions of `mb` (flat, fp32),
        differentiable in this model's hidden states and weight. `ref_hidden_rows`: the rows'
        reference hidden states ([len_i, H], host), `ref_weight`: its shard, on the device."""
        if ref_weight is None or any(t is None for t in ref_hidden_rows):
            raise ValueError("kl kind full / full+ needs the reference's hidden states and output "
                             "weight in the batch (`ref_hidden`, meta `ref_output_weight`): run the "
                             "reference with ReferenceWorker.forward_outputs(with_hidden=True)")
        h = hidden.reshape(-1, hidden.shape[-1])[mb.positions]
        # all predictions of the micro-batch in response order; this CP rank's share of them
        ref_h = mb.own_predictions(torch.cat(list(ref_hidden_rows)).to(h.device))
        return linear_full_kl(h, self.models[-1].output_weight(), ref_h, ref_weight,
                              temperature=temperature, tp_group=ps.get_tensor_model_parallel_group(),
                              chunk_tokens=self._chunk(h.shape[0]))

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch, *, temperature=1.0, micro_batch_size=None,
                         max_tokens=None, with_entropy=False):
        """Log-probs [B, R] of the responses (and entropies when asked), on every rank."""
        out = self.forward_outputs(batch, temperature=temperature, micro_batch_size=micro_batch_size,
                                   max_tokens=max_tokens, with_entropy=with_entropy)
        return out if with_entropy else out["log_prob"]

    @torch.no_grad()
    def forward_outputs(self, batch: Batch, *, temperature=1.0, micro_batch_size=None,
                        max_tokens=None, with_entropy=False, with_hidden=False, with_full_kl=False):
        """A forward pass over the responses. On every rank: `log_prob` [B, R], `entropy` [B, R]
        (with_entropy), `full_kl` [B, R], the exact KL to the reference whose `ref_hidden` the
        batch holds (with_full_kl). On the last pipeline stage only (where losses run; other
        stages never read them): `hidden`, per row the final hidden states at its response
        predictions ([len_i, H], host memory, in the model's dtype), and `output_weight`, a
        host copy of this rank's vocab shard of the output layer (with_hidden)."""
        for c in self.chunks:
            c.eval()
        micro = self.micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
        width = batch["responses"].shape[1]
        ref_weight = None
        if with_full_kl and self.is_last_stage:
            ref_weight = batch.meta.get("ref_output_weight")
            ref_weight = None if ref_weight is None else ref_weight.to(self.device)

        def head(hidden, mb):
            lp, ent = self._logprob_entropy(hidden, mb, temperature, with_entropy)
            # per-token results stay on the device until every micro-batch has run: one host
            # copy per pass, not a sync between micro-batches (they are [rows, R], small)
            info = dict(rows=mb.rows, log_prob=mb.to_padded(self.gather_cp(lp.float(), mb)))
            if with_entropy:
                info["entropy"] = mb.to_padded(self.gather_cp(ent.float(), mb))
            if with_full_kl:
                kl = self._full_kl(hidden, mb, batch["ref_hidden"][mb.rows], ref_weight, temperature)
                info["full_kl"] = mb.to_padded(self.gather_cp(kl, mb))
            if with_hidden:  # whole sequences on every CP rank: the actor's split may differ
                h = self.gather_cp(hidden.reshape(-1, hidden.shape[-1])[mb.positions], mb)
                info["hidden"] = h.cpu().split(mb.response_lengths)
            return lp.sum() * 0.0, info

        infos = self.run(micro, head, forward_only=True)
        out = {}
        keys = ["log_prob"] + (["entropy"] if with_entropy else []) + (
            ["full_kl"] if with_full_kl else [])
        for key in keys:
            full = None
            if self.is_last_stage:
                full = torch.zeros(len(batch), width, device=self.device)
                for info in infos:
                    full[torch.as_tensor(info["rows"], device=self.device)] = info[key].float()
                full = full.cpu()
            out[key] = self.broadcast_from_last_stage(full, (len(batch), width))
        if with_hidden and self.is_last_stage:
            rows = np.empty(len(batch), dtype=object)  # element-wise: tensors, not an array
            for info in infos:
                for r, h in zip(info["rows"], info["hidden"]):
                    rows[r] = h
            out["hidden"] = rows
            out["output_weight"] = self.models[-1].output_weight().detach().to("cpu", copy=True)
        return out


class ActorWorker(LogProbModel):
    name = "actor"
    oom_retries = 0  # trainer.oom_retry

    def __init__(self, hf_config, actor_cfg, model_cfg, *, total_steps=1, pad_token_id=0,
                 response_length=None):
        from engine.models.lora import LoraSpec
        # LoRA: only the adapters train, checkpoints hold them (engine/checkpoint/state.py)
        self.lora = LoraSpec.from_config(model_cfg, seed=actor_cfg.megatron.seed)
        super().__init__(hf_config, megatron_cfg=actor_cfg.megatron, model_cfg=model_cfg,
                         optim_cfg=actor_cfg.optim, total_steps=total_steps,
                         pad_token_id=pad_token_id, router_replay=actor_cfg.router_replay,
                         lora=self.lora, strategy=actor_cfg.strategy)
        self.cfg = actor_cfg
        self.response_length = response_length
        self.kl_coef = actor_cfg.kl_loss_coef  # update_policy's kl_coef replaces it (trainer state)
        self._ref_weight = None  # the reference's output-weight shard during an update (full KL)

    def base_reference(self):
        """The reference policy of a LoRA actor: this model with its adapters off (no second
        model in memory)."""
        if self.lora is None:
            raise ValueError("base_reference: the actor has no LoRA adapters; build a ReferenceWorker")
        return AdaptersOffReference(self)

    mini_batch_size_per_rank = None  # set by the trainer from engine.config.derive

    def update_policy(self, batch: Batch, *, temperature=1.0, micro_batch_size=None,
                      max_tokens=None, kl_coef=None):
        """`ppo_epochs` passes over the batch in mini-batches; one optimizer step each.

        batch: input_ids, attention_mask, responses, response_mask, old_log_probs, advantages,
        and ref_log_prob when `use_kl_loss` (and for kl_loss_type full / full+ ref_hidden and
        meta ref_output_weight, see the module doc). Returns metrics averaged over optimizer
        steps.
        Without old_log_probs the update is on-policy by construction (one epoch, one mini-batch:
        the caller checks) and each token's old log-prob is its current one, detached.
        `kl_coef`: the KL loss's coefficient now (trainer state: the KL guard moves it; default
        actor.kl_loss_coef).
        """
        cfg = self.cfg
        self.kl_coef = cfg.kl_loss_coef if kl_coef is None else float(kl_coef)
        one_mini_batch = (self.mini_batch_size_per_rank or len(batch)) >= len(batch)
        if "old_log_probs" not in batch and (cfg.ppo_epochs != 1 or not one_mini_batch):
            raise ValueError("update_policy: old_log_probs are needed unless the update is one "
                             "epoch of one mini-batch (on-policy); compute them with "
                             "compute_log_prob first")
        micro_batch_size, max_tokens = self.start_update(micro_batch_size, max_tokens)
        self._ref_weight = None  # on the device for the whole update: every micro-batch reads it
        if self._uses_full_kl and self.is_last_stage and "ref_output_weight" in batch.meta:
            self._ref_weight = batch.meta["ref_output_weight"].to(self.device)
        try:
            out = train_epochs(self, batch, lambda h, mb, mini, norm: self._policy_loss(h, mb, mini, norm, temperature),
                               self._reduce_metrics, epochs=cfg.ppo_epochs, mini_size=self.mini_batch_size_per_rank,
                               response_length=self.response_length, micro_batch_size=micro_batch_size,
                               max_tokens=max_tokens, oom_retries=self.oom_retries,
                               order_seed=cfg.megatron.seed if cfg.shuffle else None)
        finally:
            self._ref_weight = None
        if cfg.use_kl_loss:
            out["actor/kl_coef"] = self.kl_coef
        return out

    @property
    def _uses_full_kl(self):
        return self.cfg.use_kl_loss and KL_KINDS[self.cfg.kl_loss_type].exact

    def _policy_loss(self, hidden, mb, mini, norm, temperature):
        loss, metrics = self._policy_loss_terms(hidden, mb, mini, norm, temperature)
        if faults.fault("nan_loss"):  # tests: a NaN loss must be skipped, never applied
            loss = loss * float("nan")
        return loss, metrics

    def _policy_loss_terms(self, hidden, mb, mini, norm, temperature):
        """The micro-batch's loss and metrics. Per-token objectives (every policy loss but
        GSPO's sequence ratio) take the single-pass kernel, which makes the gradients while the
        logits of a chunk are at hand; GSPO and `use_fused_kernels=False` differentiate the
        log-probs the usual way.

        kl_loss_type full / full+: the exact KL at this rank's predictions, differentiable for
        full (its gradient covers the whole vocabulary, so it is its own kernel's and its term is
        added beside the single pass), forward only for full+ (whose k2 gradient on the sampled
        token the single pass makes)."""
        cfg = self.cfg
        device = hidden.device

        def rows_of(key):  # this micro-batch's rows of a mini-batch field, on the model's device
            return mini[key][mb.rows].to(device) if key in mini else None

        mask = rows_of("response_mask").float()
        old = rows_of("old_log_probs")  # None: on-policy
        adv = rows_of("advantages")
        ref = rows_of("ref_log_prob") if cfg.use_kl_loss else None
        full = None  # flat, this rank's predictions
        if self._uses_full_kl:
            with torch.set_grad_enabled(cfg.kl_loss_type == "full" and torch.is_grad_enabled()):
                full = self._full_kl(hidden, mb, mini["ref_hidden"][mb.rows]
                                     if "ref_hidden" in mini else [None], self._ref_weight,
                                     temperature)
        padded = lambda t: None if t is None else mb.to_padded(self.gather_cp(t, mb))  # noqa: E731
        if POLICY_LOSSES[cfg.policy_loss].token_terms is not None and self.model_cfg.use_fused_kernels:
            loss, lp, ent = self._single_pass_loss(hidden, mb, mask, old, adv, ref, norm,
                                                   temperature, full)
            with torch.no_grad():  # metrics of whole sequences, identical on every CP rank
                log_prob = padded(lp)
                _, metrics = self._loss_terms(log_prob, padded(ent), mask,
                                              log_prob if old is None else old, adv, ref, norm,
                                              padded(None if full is None else full.detach()))
            return loss, metrics
        need_entropy = True  # reported as actor/entropy even when the bonus is off
        lp, ent = self._logprob_entropy(hidden, mb, temperature, need_entropy)
        log_prob = mb.to_padded(self.gather_cp(lp.float(), mb))
        entropy = mb.to_padded(self.gather_cp(ent.float(), mb))
        return self._loss_terms(log_prob, entropy, mask,
                                log_prob.detach() if old is None else old, adv, ref, norm,
                                padded(full))

    def _loss_terms(self, log_prob, entropy_tokens, mask, old, adv, ref, norm, full_kl=None):
        """(loss, metrics) from padded [rows, R] log-probs and entropies (and exact KLs for
        kl_loss_type full / full+)."""
        cfg = self.cfg
        pg, metrics = POLICY_LOSSES[cfg.policy_loss].loss(log_prob, old, adv, mask, cfg, cfg.loss_agg_mode, norm)
        entropy = entropy_bonus(entropy_tokens, mask, cfg.loss_agg_mode, norm)
        loss = pg - cfg.entropy_coeff * entropy
        metrics = {k: v.detach() for k, v in metrics.items()}
        metrics["actor/pg_loss"] = pg.detach()
        metrics["actor/entropy"] = entropy.detach()
        if cfg.use_kl_loss:
            kl = kl_loss(log_prob, ref, mask, cfg.kl_loss_type, cfg.loss_agg_mode, norm,
                         full_kl=full_kl)
            loss = loss + self.kl_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        return loss, metrics

    def _single_pass_loss(self, hidden, mb, mask, old, adv, ref, norm, temperature, full=None):
        """The same loss as `_loss_terms`, as a weighted sum of per-token terms fed to
        kernels.logprob.linear_token_loss. Returns (loss, flat log-probs, flat entropies).
        `full`: the exact KL at this rank's predictions (kl_loss_type full / full+).

        Under CP a rank sums the terms of the predictions it holds (with the global weights);
        the loss is linear in the terms, so the CP ranks' losses add up to the whole loss and
        the gradient all-reduce over DP x CP sums their gradients into the whole gradient."""
        cfg = self.cfg
        flat = lambda t: None if t is None else mb.own_predictions(mb.to_flat(t))  # noqa: E731
        weight = flat(token_weights(mask, cfg.loss_agg_mode, **norm.as_kwargs()))
        old, adv, ref = flat(old), flat(adv), flat(ref)
        policy_terms = POLICY_LOSSES[cfg.policy_loss].token_terms
        # full's gradient is not one of a sampled log-prob: its term is added beside the kernel
        kl_in_kernel = ref is not None and cfg.kl_loss_type != "full"
        masked_sum = lambda terms, w: torch.where(  # noqa: E731
            w != 0, terms, torch.zeros_like(terms)).mul(w).sum()  # a masked term may be inf

        def token_loss(start, end, lp, ent):
            old_lp = lp.detach() if old is None else old[start:end]
            terms = policy_terms(lp, old_lp, adv[start:end], cfg)
            if cfg.entropy_coeff:
                terms = terms - cfg.entropy_coeff * ent
            if kl_in_kernel:
                terms = terms + self.kl_coef * kl_penalty(
                    lp, ref[start:end], cfg.kl_loss_type,
                    full_kl=None if full is None else full[start:end])
            return masked_sum(terms, weight[start:end])

        model = self.models[-1]
        h = hidden.reshape(-1, hidden.shape[-1])[mb.positions]
        loss, lp, ent = linear_token_loss(h, model.output_weight(), mb.labels, token_loss,
                                          temperature=temperature,
                                          tp_group=ps.get_tensor_model_parallel_group())
        if ref is not None and not kl_in_kernel:  # gradients add up in `hidden`'s
            loss = loss + self.kl_coef * masked_sum(full, weight)
        return loss, lp, ent

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
    name = "ref"

    """The frozen reference policy: forward only, parameters offloadable between uses."""

    def __init__(self, hf_config, ref_megatron_cfg, model_cfg, *, pad_token_id=0,
                 strategy="megatron"):
        super().__init__(hf_config, megatron_cfg=ref_megatron_cfg, model_cfg=model_cfg,
                         pad_token_id=pad_token_id, strategy=strategy)
        for p in (p for c in self.chunks for p in c.parameters()):
            p.requires_grad_(False)


class AdaptersOffReference:
    """What the trainer asks of a reference, answered by a LoRA actor with its adapters off:
    the base weights are the frozen reference (verl's LoRA reference). It owns no memory: in
    the reference phase the actor's parameters are what must be on the device."""

    name = "ref"

    def __init__(self, actor):
        self.actor = actor

    def forward_outputs(self, batch, **kwargs):
        from engine.models.lora import adapters_disabled
        with adapters_disabled(self.actor.chunks):
            return self.actor.forward_outputs(batch, **kwargs)

    def compute_log_prob(self, batch, **kwargs):
        from engine.models.lora import adapters_disabled
        with adapters_disabled(self.actor.chunks):
            return self.actor.compute_log_prob(batch, **kwargs)

    def set_resident(self, states):
        # runs after the actor's own move (HybridEngine goes actor first): bring its
        # parameters back if the actor's schedule offloaded them (actor param_offload)
        params = self.actor._offloaders["params"]
        if "params" in states and params.offloaded:
            params.reload()

    def resident_bytes(self):
        return {}  # the actor's parameters, counted with the actor
