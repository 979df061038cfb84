"""Inherited values: the keys whose `null` means "as another key" (engine/config/__init__.py
lists them), filled in on derive()'s copy of the config. Nothing else fills them.

Tests: tests/test_config.py, tests/test_derive_parts.py, tests/test_offline_config.py
"""
from __future__ import annotations

import copy

from engine.config.checks import fail
from engine.config.schema import CRITIC_ESTIMATORS, LAYOUT_KEYS, MegatronConfig, TridentConfig
from engine.data.rows import truncation_of

__all__ = ["resolve_megatron", "fill_inherited"]


def resolve_megatron(m: MegatronConfig, actor: MegatronConfig) -> MegatronConfig:
    """A ref/critic/reward-model megatron section with null layout keys taken from the actor."""
    out = copy.deepcopy(m)
    for name in LAYOUT_KEYS:
        if getattr(out, name) is None:
            setattr(out, name, getattr(actor, name))
    if out.expert_tensor_parallel_size is None:
        out.expert_tensor_parallel_size = out.tensor_model_parallel_size
    if out.params_dtype is None:  # the reference must see the actor's exact weights
        out.params_dtype = actor.params_dtype
    return out


def fill_inherited(out: TridentConfig) -> None:
    """Fill every null-means-auto key of `out` (a copy: derive() never writes the caller's)
    from the key it inherits; ConfigError when neither is set where one must be."""
    arr, data, rollout = out.actor_rollout_ref, out.data, out.actor_rollout_ref.rollout
    actor, critic, trainer = arr.actor, out.critic, out.trainer
    data.truncation = truncation_of(data)  # the row policy's one reading of both keys
    data.filter_overlong_prompts = data.truncation == "filter"
    rollout.prompt_length = rollout.prompt_length or data.max_prompt_length
    rollout.response_length = rollout.response_length or data.max_response_length
    for section in (rollout, arr.ref):
        if section.log_prob_micro_batch_size_per_gpu is None:
            section.log_prob_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
        if section.log_prob_use_dynamic_bsz is None:
            section.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if section.log_prob_max_token_len_per_gpu is None:
            section.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
        if not section.log_prob_use_dynamic_bsz and section.log_prob_micro_batch_size_per_gpu is None:
            prefix = "actor_rollout_ref.rollout" if section is rollout else "actor_rollout_ref.ref"
            fail(f"{prefix}.log_prob_micro_batch_size_per_gpu", None,
                 "set the per-rank log-prob micro-batch, or log_prob_use_dynamic_bsz=true")
    actor.clip_ratio_low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    actor.clip_ratio_high = actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high
    critic.enable = out.algorithm.adv_estimator in CRITIC_ESTIMATORS if critic.enable is None else critic.enable
    critic.ppo_mini_batch_size = critic.ppo_mini_batch_size or actor.ppo_mini_batch_size
    critic.ppo_micro_batch_size_per_gpu = critic.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu
    critic.ppo_epochs = critic.ppo_epochs or actor.ppo_epochs
    critic.strategy = critic.strategy or actor.strategy
    arr.ref.strategy = arr.ref.strategy or actor.strategy
    if critic.model.path is None and critic.model.config is None:
        critic.model.path, critic.model.config = arr.model.path, copy.deepcopy(arr.model.config)
        critic.model.tokenizer_path = critic.model.tokenizer_path or arr.model.tokenizer_path
    actor.megatron = resolve_megatron(actor.megatron, actor.megatron)
    for owner in (arr.ref, critic, out.reward_model):
        owner.megatron = resolve_megatron(owner.megatron, actor.megatron)
    trainer.default_local_dir = (trainer.default_local_dir
                                 or f"checkpoints/{trainer.project_name}/{trainer.experiment_name}")
    trainer.log_dir = trainer.log_dir or f"logs/{trainer.project_name}/{trainer.experiment_name}"
