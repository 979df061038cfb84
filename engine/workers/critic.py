"""The PPO critic: a Megatron model with a scalar value head; values and the clipped value loss.

The value of response token j is read at the position that predicts it (the state before the
token is generated), the same positions the actor's log-probs use.
"""
from collections import defaultdict

import torch
from megatron.core import parallel_state as ps

from engine.algorithms.losses import LossNormaliser, value_loss
from engine.batch import Batch
from engine.workers.base import MegatronWorker, global_counts


class CriticWorker(MegatronWorker):
    mini_batch_size_per_rank = None  # set by the trainer from engine.config.derive
    supports_context_parallel = True

    def __init__(self, hf_config, critic_cfg, model_cfg, *, total_steps=1, pad_token_id=0,
                 response_length=None):
        super().__init__(hf_config, megatron_cfg=critic_cfg.megatron, model_cfg=model_cfg,
                         head="value", optim_cfg=critic_cfg.optim, total_steps=total_steps,
                         pad_token_id=pad_token_id)
        self.cfg = critic_cfg
        self.response_length = response_length

    def _values(self, output, mb):
        # under CP, every rank's values gathered in order; the loss on them is the same on every
        # CP rank and its gradient reaches each rank for its own tokens (see gather_cp)
        return mb.to_padded(self.gather_cp(output.reshape(-1)[mb.positions].float(), mb))

    @torch.no_grad()
    def compute_values(self, batch: Batch, *, micro_batch_size=None, max_tokens=None):
        for c in self.chunks:
            c.eval()
        micro = self.micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)

        def head(output, mb):
            v = self._values(output, mb)
            return v.sum() * 0.0, dict(rows=mb.rows, values=v.cpu())

        infos = self.run(micro, head, forward_only=True)
        full = None
        if self.is_last_stage:
            full = torch.zeros(len(batch), batch["responses"].shape[1])
            for info in infos:
                full[info["rows"]] = info["values"]
        return self.broadcast_from_last_stage(full, (len(batch), batch["responses"].shape[1]))

    def update_critic(self, batch: Batch, *, micro_batch_size=None, max_tokens=None):
        """batch: input_ids, attention_mask, responses, response_mask, values, returns."""
        cfg = self.cfg
        micro_batch_size, max_tokens = self.start_update(micro_batch_size, max_tokens)
        history = defaultdict(list)
        n, size = len(batch), self.mini_batch_size_per_rank or len(batch)
        for _ in range(cfg.ppo_epochs or 1):
            for start in range(0, n, size):
                mini = batch.index_select(list(range(start, min(start + size, n))))
                norm = global_counts(LossNormaliser.from_mask(
                    mini["response_mask"], self.response_length), ps.get_data_parallel_group())

                def head(output, mb, mini=mini, norm=norm):
                    mask, old, returns = (mini[k][mb.rows].to(output.device)
                                          for k in ("response_mask", "values", "returns"))
                    loss, clipfrac = value_loss(self._values(output, mb), old, returns,
                                                mask.float(), cfg.cliprange_value,
                                                cfg.loss_agg_mode, norm)
                    return loss, dict(vf_loss=loss.detach(), vf_clipfrac=clipfrac.detach())

                self.zero_grad()
                infos = self.run(self.micro_batches(mini, micro_batch_size=micro_batch_size,
                                                    max_tokens=max_tokens), head,
                                 forward_only=False)
                grad_norm, lr, _ = self.optimizer_step()
                values = torch.zeros(2, dtype=torch.float64)
                if self.is_last_stage:
                    for info in infos:
                        values += torch.stack([info["vf_loss"].double(),
                                               info["vf_clipfrac"].double()]).cpu()
                values = self.broadcast_from_last_stage(self.dp_all_reduce(values), (2,),
                                                        torch.float64)
                history["critic/vf_loss"].append(float(values[0]))
                history["critic/vf_clipfrac"].append(float(values[1]))
                history["critic/grad_norm"].append(grad_norm)
                history["critic/lr"].append(lr)
        return {k: sum(v) / len(v) for k, v in history.items()}
