"""Reward models on Megatron.

`RewardModelWorker`: the scalar head's value at each sequence's last token. Same model as the
critic (a language model trunk with a scalar head); a HuggingFace `*ForSequenceClassification`
checkpoint maps its `score.weight` onto the head.

`ImplicitRewardWorker` (reward_model.token_level=implicit): a frozen DPO-trained policy (its HF
causal-LM export) whose per-token reward is DPO's implicit one, beta * (log pi_dpo(y_t) -
log pi_ref(y_t)) (engine/rewards/preference.py), against the PPO reference: the initial policy
DPO started from. Both log-probs at temperature 1, as DPO trains them.

Tests: tests/test_reward_model.py, tests/test_token_rewards.py, tests/test_config_reward_tokenizer.py
"""
import torch

from engine.batch import Batch
from engine.rewards.preference import implicit_token_rewards
from engine.workers.actor import ReferenceWorker
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

    def scores_for(self, ctx, batch):
        """The reward phase's call (ctx: the StepContext): [B] scores."""
        return self.compute_scores(batch, **ctx.forward_split("reward_model"))

    @torch.no_grad()
    def compute_scores(self, batch: Batch, *, micro_batch_size=None, max_tokens=None) -> torch.Tensor:
        """[B] scores: the head's output at the last valid token of prompt + response."""
        if micro_batch_size is None and max_tokens is None:
            micro_batch_size = self.cfg.micro_batch_size_per_gpu

        def head(output, mb):
            return dict(rows=mb.rows, scores=output.reshape(-1)[mb.last_tokens].float().cpu())
        return forward_rows(self, batch, head, ["scores"], {"scores": None}, micro_batch_size, max_tokens)["scores"]


class ImplicitRewardWorker(ReferenceWorker):
    name = "reward_model"

    def __init__(self, hf_config, rm_cfg, *, beta, pad_token_id=0):
        super().__init__(hf_config, rm_cfg.megatron, rm_cfg.model, pad_token_id=pad_token_id)
        self.cfg, self.beta = rm_cfg, beta

    def scores_for(self, ctx, batch):
        """[B, R] token rewards (ctx: the StepContext). The reference runs in its own phase
        inside the reward phase (its parameters may be offloaded in the reward phase), then this
        model back in the reward phase."""
        with ctx.phase("ref"):
            ref = ctx.ref.compute_log_prob(batch, temperature=1.0, **ctx.forward_split("ref"))
        own = self.compute_log_prob(batch, temperature=1.0, **ctx.forward_split("reward_model"))
        return implicit_token_rewards(own, ref, batch["response_mask"], beta=self.beta)
