"""The trainable offline models on Megatron: a reward model (the critic's scalar head, read at
each sequence's last token as RewardModelWorker scores) and the DPO policy (the actor).

A batch holds 2 x pairs sequences, chosen at row 2i, rejected at 2i+1 (engine/data/preference.py). A
micro-batch holds whole pairs (each pair's loss needs both of its scores), so micro-batch
sizes count pairs and a dynamic token budget counts a pair's two sequences together. Every
micro-batch loss is a sum over its pairs divided by the mini-batch's global pair count (all
micro-batches, all DP ranks): micro-batching, dynamic batching, DP, TP and PP give the same
gradients, as for the PPO losses. The per-pair losses: engine/algorithms/pair_losses.py.

Tests: tests/test_offline_layouts.py, tests/test_preference_data.py, tests/test_offline_trainers.py
"""
from collections import defaultdict

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.algorithms.pair_losses import bradley_terry_loss, dpo_loss
from engine.workers.actor import ActorWorker
from engine.workers.base import MegatronWorker
from parallel.schedule import split_by_count, split_by_tokens

RM_METRICS = ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected")
DPO_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
               "rewards/margins", "logps/chosen", "logps/rejected")


def pair_groups(batch, micro_pairs=None, max_tokens=None):
    """Rows of each micro-batch: whole pairs, by count or by a token budget per micro-batch."""
    n = len(batch) // 2
    if max_tokens is None:
        pairs = split_by_count(n, micro_pairs)
    else:
        lengths = batch["attention_mask"].sum(-1).view(n, 2).sum(-1).tolist()
        if max(lengths, default=0) > max_tokens:
            raise ValueError(f"a preference pair of {max(lengths)} tokens (chosen + rejected) "
                             f"exceeds the {max_tokens}-token micro-batch budget; raise "
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu to at least "
                             f"{max(lengths)}")
        pairs = split_by_tokens(lengths, max_tokens)
    return [[2 * p + k for p in g for k in (0, 1)] for g in pairs]


class PairTraining:
    """The update loop both offline models share: mini-batches of pairs, one optimizer step
    each; `_pair_loss(output, mb, mini, pairs)` returns (loss, metric sums / pairs)."""

    pair_metric_names = ()

    def update_pairs(self, batch, mini_pairs=None):
        """One optimizer step per `mini_pairs` pairs of this rank's batch; mean metrics."""
        micro_pairs, max_tokens = self.start_update()
        n = len(batch) // 2
        mini_pairs = mini_pairs or n
        history = defaultdict(list)
        dp_group = ps.get_data_parallel_group()
        for start in range(0, n, mini_pairs):
            mini = batch.index_select(list(range(2 * start, 2 * min(start + mini_pairs, n))))
            pairs = torch.tensor([len(mini) / 2.0], dtype=torch.float64)
            dist.all_reduce(pairs, group=dp_group)  # the global pair count of this mini-batch
            micro = self.micro_batches(mini, groups=pair_groups(mini, micro_pairs, max_tokens))
            self.zero_grad()
            infos = self.run(micro, lambda out, mb: self._pair_loss(out, mb, mini, float(pairs)),
                             forward_only=False)
            grad_norm, lr, _ = self.optimizer_step()
            for k, v in self.reduce_metrics(infos).items():
                history[k].append(v)
            history["grad_norm"].append(grad_norm)
            history["learning_rate"].append(lr)
        return {k: sum(v) / len(v) for k, v in history.items()}

    def reduce_metrics(self, infos):
        """Per-micro-batch sums already divided by the global count: summed over micro-batches
        (last stage) and DP ranks, then shared with every pipeline stage."""
        values = torch.zeros(len(self.pair_metric_names), dtype=torch.float64)
        if self.is_last_stage:
            for info in infos:
                values += torch.stack([info[k].double().cpu() for k in self.pair_metric_names])
        values = self.broadcast_from_last_stage(self.dp_all_reduce(values), values.shape,
                                                values.dtype)
        return {k: float(v) for k, v in zip(self.pair_metric_names, values)}


class RewardModelTrainWorker(PairTraining, MegatronWorker):
    """A language-model trunk with the scalar head, trained with the Bradley-Terry loss. Saved
    in HF sequence-classification form (head -> `score.weight`) it is what
    `reward_model.model.path` loads into RewardModelWorker."""

    pair_metric_names = RM_METRICS
    supports_context_parallel = False  # the CP path needs TransformerEngine: not tested yet

    def __init__(self, hf_config, actor_cfg, model_cfg, *, total_steps=1, pad_token_id=0):
        super().__init__(hf_config, megatron_cfg=actor_cfg.megatron, model_cfg=model_cfg,
                         head="value", optim_cfg=actor_cfg.optim, total_steps=total_steps,
                         pad_token_id=pad_token_id)
        self.cfg = actor_cfg

    def _pair_loss(self, output, mb, mini, pairs):
        scores = self.last_token_values(output, mb).float()
        chosen, rejected = scores[0::2], scores[1::2]
        margin = None
        if "pair_margin" in mini:
            margin = mini["pair_margin"][mb.rows[0::2]].to(scores.device).float()
        loss = bradley_terry_loss(chosen, rejected, margin).sum() / pairs
        with torch.no_grad():
            diff = chosen - rejected
            metrics = {"loss": loss.detach(), "accuracy": (diff > 0).float().sum() / pairs,
                       "margin": diff.sum() / pairs, "rewards/chosen": chosen.sum() / pairs,
                       "rewards/rejected": rejected.sum() / pairs}
        return loss, metrics

    @torch.no_grad()
    def compute_scores(self, batch, *, micro_batch_size=None, max_tokens=None):
        """[B] scores at each sequence's last token, on every rank of this DP replica."""
        for c in self.chunks:
            c.eval()
        micro = self.micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)

        def head(output, mb):
            s = self.last_token_values(output, mb).float()
            return s.sum() * 0.0, dict(rows=mb.rows, scores=s.cpu())

        infos = self.run(micro, head, forward_only=True)
        full = None
        if self.is_last_stage:
            full = torch.zeros(len(batch))
            for info in infos:
                full[info["rows"]] = info["scores"]
        return self.broadcast_from_last_stage(full, (len(batch),))


class DPOWorker(PairTraining, ActorWorker):
    """The policy trained with DPO against reference log-probs the batch carries
    (`ref_logps`: each response's summed log-prob under the reference)."""

    pair_metric_names = DPO_METRICS
    supports_context_parallel = False  # the CP path needs TransformerEngine: not tested yet

    def __init__(self, hf_config, actor_cfg, model_cfg, dpo_cfg, *, total_steps=1,
                 pad_token_id=0):
        super().__init__(hf_config, actor_cfg, model_cfg, total_steps=total_steps,
                         pad_token_id=pad_token_id)
        self.dpo = dpo_cfg

    def _pair_loss(self, hidden, mb, mini, pairs):
        lp, _ = self._logprob_entropy(hidden, mb, 1.0, with_entropy=False)
        seq = mb.to_padded(self.gather_cp(lp.float(), mb)).sum(-1)  # [rows] summed log-probs
        ref = mini["ref_logps"][mb.rows].to(seq.device).float()
        losses, chosen_r, rejected_r = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2],
                                                self.dpo.beta, self.dpo.loss_type)
        loss = losses.sum() / pairs
        with torch.no_grad():
            metrics = {"loss": loss.detach(), "rewards/chosen": chosen_r.sum() / pairs,
                       "rewards/rejected": rejected_r.sum() / pairs,
                       "rewards/accuracies": (chosen_r > rejected_r).float().sum() / pairs,
                       "rewards/margins": (chosen_r - rejected_r).sum() / pairs,
                       "logps/chosen": seq[0::2].detach().sum() / pairs,
                       "logps/rejected": seq[1::2].detach().sum() / pairs}
        return loss, metrics


def sequence_log_probs(worker, batch, *, micro_batch_size=None, max_tokens=None):
    """[B] each response's summed log-prob under `worker` (a policy or the reference)."""
    lp = worker.compute_log_prob(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
    return (lp * batch["response_mask"]).sum(-1)
