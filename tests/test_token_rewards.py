"""Token-level rewards from preference models in PPO (reward_model.token_level), through the real
trainer's reward phase (StepContext.score) on 2 gloo ranks, against transformers' own forward of the same HF
checkpoints and engine/rewards/preference.py's formulas:

* margin: a reward model's score (LlamaForSequenceClassification) spread evenly over the
  response tokens (margin_token_rewards), alone (reward_model.rule_reward=false);
* implicit: DPO's beta * (log pi_dpo - log pi_ref) per token (implicit_token_rewards), the DPO
  policy a second frozen model, the reference the PPO policy's initial weights, plus the rule
  reward on the last token.
"""
import os

import pytest
import torch

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
SMALL = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "trainer.test_freq=-1", "trainer.logger=[]",
         "trainer.save_freq=-1", "trainer.resume_mode=disable", "reward_model.enable=true",
         "reward_model.micro_batch_size_per_gpu=16", "actor_rollout_ref.model.config=null"]


def _hf_models(tmp):
    """A tiny random policy, a DPO policy (other weights) and a reward model, as HF checkpoints."""
    import transformers

    from engine.tasks import save_tokenizer
    tok = None
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=20,
                                   max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                   pad_token_id=None)  # one unpadded sequence at a time: the last token
    for name, cls, seed in (("policy", transformers.LlamaForCausalLM, 1), ("dpo", transformers.LlamaForCausalLM, 2),
                            ("rm", transformers.LlamaForSequenceClassification, 3)):
        torch.manual_seed(seed)
        model = cls(transformers.LlamaConfig(**dict(cfg.to_dict(), num_labels=1)))
        model.save_pretrained(f"{tmp}/{name}")
        tok = save_tokenizer(f"{tmp}/{name}")
    return tok


def _scores(tmp, *extra):
    import torch.distributed as dist
    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed
    cfg = load_config(DEMO, [f"actor_rollout_ref.model.path={tmp}/policy", f"trainer.default_local_dir={tmp}/ck",
                             f"trainer.log_dir={tmp}/logs/{dist.get_rank()}", *SMALL, *extra])
    set_seed(cfg.trainer.seed)
    t = Trainer(*build(cfg, 2))
    prompts = t.loader.next_batch()
    t.ctx.begin_step()
    batch, _ = t.experience.collect(t.ctx, prompts)
    extra_info = t.ctx.score(batch)  # the reward phase
    scores = batch["token_level_scores"]
    kl_passes = []  # the step's own reference pass (for a KL term), apart from the implicit reward's
    real = t.reference_pass

    def counted(batch):
        kl_passes.append(1)
        return real(batch)
    t.reference_pass = counted
    metrics = t.train_step(t.loader.next_batch())  # and a whole step through it
    return dict(scores=scores, model_score=extra_info["model_score"], metrics=metrics, kl_passes=len(kl_passes),
                **{k: batch[k] for k in ("input_ids", "attention_mask", "responses", "response_mask")},
                ground_truth=list(batch["ground_truth"]))


def _hf_log_probs(model, row_ids, row_mask, response_mask):
    """Each response token's log-prob under `model` (one unpadded sequence at a time)."""
    out = torch.zeros(response_mask.shape)
    for i in range(len(row_ids)):
        ids = row_ids[i][row_mask[i].bool()]
        n = int(response_mask[i].sum())
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)
        out[i, :n] = logp[len(ids) - n - 1:len(ids) - 1].gather(-1, ids[len(ids) - n:, None])[:, 0]
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("token_rewards")
    return tmp, _hf_models(str(tmp))


def test_margin_spreads_the_reward_model_score_over_the_response(models):
    import transformers

    from engine.rewards.preference import margin_token_rewards
    tmp, _ = models
    ranks = run_on_ranks(_scores, 2, str(tmp), f"reward_model.model.path={tmp}/rm", "reward_model.token_level=margin",
                         "reward_model.rule_reward=false")
    rm = transformers.AutoModelForSequenceClassification.from_pretrained(f"{tmp}/rm").eval()
    for r in ranks:
        with torch.no_grad():  # the score at the last token of prompt + response
            hf = torch.stack([rm(input_ids=ids[m.bool()][None]).logits[0, 0]
                              for ids, m in zip(r["input_ids"], r["attention_mask"])])
        mask = r["response_mask"]
        want = margin_token_rewards(mask, mask, margin=hf[:, None])[0]
        torch.testing.assert_close(r["scores"], want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(r["scores"].sum(-1), hf, atol=2e-5, rtol=1e-4)
        assert (r["scores"][mask.bool()] != 0).all()  # on every token, not the last one only
        assert "reward_extra/model_score/mean" in r["metrics"] and "reward_extra/rule_score/mean" not in r["metrics"]


def test_implicit_is_the_dpo_log_ratio_per_token_plus_the_rule_reward(models):
    import transformers

    from engine.rewards.manager import RewardManager
    from engine.rewards.preference import implicit_token_rewards
    tmp, tok = models
    ranks = run_on_ranks(_scores, 2, str(tmp), f"reward_model.model.path={tmp}/dpo",
                         "reward_model.token_level=implicit", "algorithm.dpo.beta=0.2",
                         "actor_rollout_ref.actor.use_kl_loss=false")
    dpo = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/dpo").eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/policy").eval()
    for r in ranks:
        mask = r["response_mask"]
        lp_dpo = _hf_log_probs(dpo, r["input_ids"], r["attention_mask"], mask)
        lp_ref = _hf_log_probs(ref, r["input_ids"], r["attention_mask"], mask)
        rule, _ = RewardManager(tok)(r["responses"], mask, ground_truths=r["ground_truth"],
                                     data_sources=["arith"] * len(mask))
        want = implicit_token_rewards(lp_dpo, lp_ref, mask, beta=0.2) + rule
        torch.testing.assert_close(r["scores"], want, atol=2e-5, rtol=1e-4)
        assert r["model_score"] == pytest.approx((want - rule).sum(-1).tolist(), abs=1e-4)
        assert float((want - rule).abs().sum()) > 0.1  # the two models differ
        assert "actor/pg_loss" in r["metrics"] and r["kl_passes"] == 0  # no KL: no extra ref pass
