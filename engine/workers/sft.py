"""The policy trained by supervised fine-tuning (trainer.task=sft): the actor's model, its
micro-batching and packing, a token-mean negative log-likelihood over the assistant's tokens.

A batch holds conversations as a multi-turn rollout's trajectories (engine/data/sft.py):
`response_mask` [B, R] is the loss mask (the assistant's tokens), `attention_mask` every valid
token. The loss of a micro-batch is

    - sum over its predictions t of response_mask_t * log p(token_t) / N

with N the mini-batch's loss tokens on all micro-batches and DP ranks (the LossNormaliser of
engine/workers/template.py), so micro-batching, packing, dynamic batching, DP, TP
and PP give the same gradients, as for the PPO losses (engine/algorithms/losses.py). The
log-probs come from the single-pass fused kernel (kernels/logprob.py linear_token_loss: never
the [tokens, vocab] logits; `use_fused_kernels=false`: one chunk of every prediction), so a
masked token's gradient is exactly zero. The epoch loop, the non-finite skip and the
out-of-memory retry are the actor's (engine/workers/template.py train_epochs).

Tests: tests/test_sft.py
"""
import torch
from megatron.core import parallel_state as ps

from engine.workers.actor import ActorWorker
from engine.workers.template import train_epochs
from kernels.logprob import linear_token_loss

SFT_METRICS = ("loss",)


def masked_nll_sum(log_probs, mask):
    """- sum of mask * log_probs, a masked token contributing exactly nothing (even -inf)."""
    return -torch.where(mask != 0, log_probs * mask, torch.zeros_like(log_probs)).sum()


def sft_token_loss(hidden, weight, labels, token_weight, tp_group=None, chunk_tokens=None):
    """- sum_t token_weight_t * log softmax(hidden_t @ weight.T)[labels_t], by the single-pass
    fused kernel (chunk_tokens None: its default chunks, never all the logits at once; an int:
    that many tokens a chunk, `use_fused_kernels=false` passes them all). hidden [T, H] at the
    predictions, weight [V_local, H] (this rank's vocab shard), labels [T] global ids."""
    loss, _, _ = linear_token_loss(
        hidden, weight, labels, lambda start, end, lp, ent: masked_nll_sum(lp, token_weight[start:end]),
        tp_group=tp_group, chunk_tokens=chunk_tokens)
    return loss


class SFTWorker(ActorWorker):
    supports_context_parallel = False  # the CP path needs TransformerEngine: not tested yet

    def update_sft(self, batch, mini_size=None, *, micro_batch_size=None, max_tokens=None):
        """One optimizer step per `mini_size` conversations of this rank's batch (None: one for
        the whole batch). Returns `loss` (the mean over steps of each step's token-mean NLL),
        `actor/grad_norm`, `actor/lr`, `actor/skipped_updates`, `actor/oom_retries`."""
        micro_batch_size, max_tokens = self.start_update(micro_batch_size, max_tokens)
        return train_epochs(self, batch, self._sft_loss, self._reduce_metrics, epochs=1,
                            mini_size=mini_size, response_length=None,
                            micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                            oom_retries=self.oom_retries)

    def _sft_loss(self, hidden, mb, mini, norm):
        mask = mini["response_mask"][mb.rows].to(hidden.device).float()
        weight = mb.own_predictions(mb.to_flat(mask)) / max(norm.global_token_count, 1.0)
        h = hidden.reshape(-1, hidden.shape[-1])[mb.positions]
        loss = sft_token_loss(h, self.models[-1].output_weight(), mb.labels, weight,
                              tp_group=ps.get_tensor_model_parallel_group(),
                              chunk_tokens=self._chunk(h.shape[0]))
        return loss, {"loss": loss.detach()}

    def metric_names(self):
        return list(SFT_METRICS)
