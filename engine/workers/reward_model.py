"""A reward model on Megatron: the scalar head's value at each sequence's last token.

Same model as the critic (a language model trunk with a scalar head); a HuggingFace
`*ForSequenceClassification` checkpoint maps its `score.weight` onto the head.
"""
import torch

from engine.batch import Batch
from engine.workers.base import MegatronWorker
from engine.workers.template import forward_rows


class RewardModelWorker(MegatronWorker):
    name = "reward_model"
    def __init__(self, hf_config, rm_cfg, *, pad_token_id=0):
        super().__init__(hf_config, megatron_cfg=rm_cfg.megatron, model_cfg=rm_cfg.model,
                         head="value", pad_token_id=pad_token_id)
        self.cfg = rm_cfg
        for p in (p for c in self.chunks for p in c.parameters()):
            p.requires_grad_(False)

    @torch.no_grad()
    def compute_scores(self, batch: Batch, *, micro_batch_size=None, max_tokens=None) -> torch.Tensor:
        """[B] scores: the head's output at the last valid token of prompt + response."""
        if micro_batch_size is None and max_tokens is None:
            micro_batch_size = self.cfg.micro_batch_size_per_gpu

        def head(output, mb):
            return dict(rows=mb.rows, scores=output.reshape(-1)[mb.last_tokens].float().cpu())
        return forward_rows(self, batch, head, ["scores"], {"scores": None}, micro_batch_size, max_tokens)["scores"]
