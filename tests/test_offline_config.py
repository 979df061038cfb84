"""trainer.task and the offline keys: the recipes validate and derive; every key added acts or
is refused with one message naming the key, the value and the fix."""
import os

import pytest

from engine.config import ConfigError, derive, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RM, DPO, PPO = (os.path.join(ROOT, "recipes", n) for n in
                ("tiny_rm_arith.yaml", "tiny_dpo_arith.yaml", "tiny_cpu_demo.yaml"))


def test_offline_recipes_validate_and_derive():
    for recipe, task in ((RM, "reward_model"), (DPO, "dpo")):
        cfg = load_config(recipe)
        assert cfg.trainer.task == task
        d = derive(cfg, world_size=2, dataset_len=1024)
        assert d.layout.dp == 2
        assert d.actor.mini_batch_size_per_rank == 16  # pairs per rank per optimizer step
    assert load_config(PPO).trainer.task == "ppo"  # the default


@pytest.mark.parametrize("recipe,override,match", [
    (PPO, "trainer.task=kto", r"trainer.task='kto' is not allowed: use one of 'ppo', "
                              r"'reward_model', 'dpo'"),
    (DPO, "actor_rollout_ref.rollout.n=4", r"rollout.n=4: trainer.task='dpo' trains on fixed "
                                           r"preference pairs.*remove it"),
    (RM, "actor_rollout_ref.actor.ppo_epochs=2", r"ppo_epochs=2: .*total_epochs"),
    (DPO, "actor_rollout_ref.actor.use_kl_loss=true", r"use_kl_loss=True: "),
    (RM, "critic.enable=true", r"critic.enable=True: "),
    (RM, "actor_rollout_ref.actor.shuffle=true", r"actor.shuffle=True: "),
    (RM, "reward_model.enable=true", r"reward_model.enable=True: "),
    (DPO, "algorithm.use_kl_in_reward=true", r"algorithm.use_kl_in_reward=True: "),
    (DPO, "data.margin_key=margin", r"data.margin_key='margin': .*reward model.*trainer.task="
                                    r"reward_model"),
    (PPO, "algorithm.dpo.beta=0.2", r"algorithm.dpo.beta=0.2: read by trainer.task='dpo' only"),
    (RM, "algorithm.dpo.loss_type=ipo", r"algorithm.dpo.loss_type='ipo': read by .*'dpo' only"),
    (DPO, "algorithm.dpo.loss_type=hinge", r"loss_type='hinge' is not allowed: use one of "
                                           r"'sigmoid', 'ipo'"),
    (DPO, "algorithm.dpo.beta=0", r"algorithm.dpo.beta=0.0: must be > 0.0"),
    (PPO, "data.chosen_key=better", r"data.chosen_key='better': preference pairs are read by"),
    (RM, "data.builtin_task=copy", r"data.builtin_task='copy': .*'arith' task only"),
    (DPO, "algorithm.dpo.precomputed_ref_log_probs=true",
     r"precomputed_ref_log_probs=True: the built-in task's pairs carry no ref_chosen_logps"),
    (RM, "actor_rollout_ref.actor.use_dynamic_bsz=true",
     r"ppo_max_token_len_per_gpu=16384"),  # the default budget is fine: no error (see below)
])
def test_offline_keys_are_refused_where_they_cannot_act(recipe, override, match):
    if override.endswith("use_dynamic_bsz=true"):
        load_config(recipe, [override])  # 16384 >= a pair
        with pytest.raises(ConfigError, match=r"ppo_max_token_len_per_gpu=30: a micro-batch holds "
                                              r"whole preference pairs .* = 40 tokens"):
            load_config(recipe, [override, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30"])
        return
    with pytest.raises(ConfigError, match=match):
        load_config(recipe, [override])


def test_dpo_loss_names_come_from_the_registry():
    import typing

    from engine.config import schema
    from engine.algorithms.pair_losses import DPO_LOSSES
    assert set(typing.get_args(schema.DpoLossType)) == set(DPO_LOSSES) == {"sigmoid", "ipo"}
