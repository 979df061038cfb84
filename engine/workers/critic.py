"""The PPO critic: a Megatron model with a scalar value head; values and the clipped value loss.

The value of response token j is read at the position that predicts it (the state before the
token is generated), the same positions the actor's log-probs use.

Tests: tests/test_ppo_update.py, tests/test_cp_workers.py
"""
import torch

from engine.algorithms.losses import value_loss
from engine.batch import Batch
from engine.workers.base import MegatronWorker
from engine.workers.template import forward_rows, train_epochs


class CriticWorker(MegatronWorker):
    name = "critic"
    oom_retries = 0  # trainer.oom_retry
    mini_batch_size_per_rank = None  # set by the trainer from engine.config.derive
    supports_context_parallel = True

    def __init__(self, hf_config, critic_cfg, model_cfg, *, total_steps=1, pad_token_id=0,
                 response_length=None):
        super().__init__(hf_config, megatron_cfg=critic_cfg.megatron, model_cfg=model_cfg,
                         head="value", optim_cfg=critic_cfg.optim, total_steps=total_steps,
                         pad_token_id=pad_token_id, strategy=critic_cfg.strategy or "megatron")
        self.cfg = critic_cfg
        self.response_length = response_length

    def _values(self, output, mb):
        # under CP, every rank's values gathered in order; the loss on them is the same on every
        # CP rank and its gradient reaches each rank for its own tokens (see gather_cp)
        return mb.to_padded(self.gather_cp(output.reshape(-1)[mb.positions].float(), mb))

    @torch.no_grad()
    def compute_values(self, batch: Batch, *, micro_batch_size=None, max_tokens=None):
        """Values [B, R] of the response tokens, on every rank."""
        def head(output, mb):
            return dict(rows=mb.rows, values=self._values(output, mb).cpu())
        return forward_rows(self, batch, head, ["values"], {"values": batch["responses"].shape[1]},
                            micro_batch_size, max_tokens)["values"]

    def update_critic(self, batch: Batch, *, micro_batch_size=None, max_tokens=None):
        """batch: input_ids, attention_mask, responses, response_mask, values, returns."""
        cfg = self.cfg
        micro_batch_size, max_tokens = self.start_update(micro_batch_size, max_tokens)

        def head(output, mb, mini, norm):
            mask, old, returns = (mini[k][mb.rows].to(output.device) for k in ("response_mask", "values", "returns"))
            loss, clipfrac = value_loss(self._values(output, mb), old, returns, mask.float(),
                                        cfg.cliprange_value, cfg.loss_agg_mode, norm)
            return loss, dict(vf_loss=loss.detach(), vf_clipfrac=clipfrac.detach())

        def reduce(infos):
            values = torch.zeros(2, dtype=torch.float64)
            if self.is_last_stage:
                for info in infos:
                    values += torch.stack([info["vf_loss"].double(), info["vf_clipfrac"].double()]).cpu()
            values = self.broadcast_from_last_stage(self.dp_all_reduce(values), (2,), torch.float64)
            return {"critic/vf_loss": float(values[0]), "critic/vf_clipfrac": float(values[1])}

        return train_epochs(self, batch, head, reduce, epochs=cfg.ppo_epochs or 1,
                            mini_size=self.mini_batch_size_per_rank, response_length=self.response_length,
                            micro_batch_size=micro_batch_size, max_tokens=max_tokens, oom_retries=self.oom_retries)
