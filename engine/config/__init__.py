"""Typed recipe schema: dataclasses loaded from YAML plus dotted CLI overrides, then validated.

    cfg = load_config("recipes/tiny_cpu_demo.yaml", ["actor_rollout_ref.actor.kl_loss_coef=0.002"])
    d = derive(cfg, world_size=2, dataset_len=1024)   # layout checks + every derived number
    d.config.actor_rollout_ref.rollout.response_length, d.layout.dp, d.actor.grad_accum_steps

Keys follow verl's names. A few keys are `null` = "auto" and are filled in by `derive()` only
(the one place where derived values are computed); after `derive`, read `d.config`:

- rollout.prompt_length / response_length      -> data.max_prompt_length / max_response_length
- rollout.* and ref.* log_prob_* batch keys     -> the actor's ppo_* batch keys
- critic.enable                                 -> algorithm.adv_estimator == 'gae'
- critic.ppo_mini_batch_size / micro / epochs   -> the actor's
- critic.strategy / actor_rollout_ref.ref.strategy  -> the actor's
- critic.model.path / config / tokenizer_path   -> the actor's model (when both path and config are null)
- actor.clip_ratio_low / clip_ratio_high        -> actor.clip_ratio
- megatron.expert_tensor_parallel_size          -> tensor_model_parallel_size (as in Megatron)
- ref/critic/reward_model megatron layout keys  -> the actor's (one process-group layout per run)
- optim.total_training_steps, optim.lr_warmup_steps=-1, trainer.total_training_steps,
  trainer.default_local_dir / log_dir, trainer.device='auto', rollout.name='auto'

Every problem raises `ConfigError` (a ValueError) naming the dotted key, the value and the fix.

derive() is engine/config/derive.py with its four jobs beside it (devices.py, inherit.py,
steps.py, batches.py); `Derived.step` holds what every PPO step does (engine/config/steps.py).

Tests: tests/test_config.py, tests/test_config_keys.py, tests/test_derive_parts.py, tests/test_mesh_layout.py
"""
from engine.config.schema import *  # noqa: F401,F403  (the dataclasses and allowed values)
from engine.config.schema import ConfigError, TridentConfig  # noqa: F401
from engine.config.load import (all_keys, apply_override, from_dict, load_config, to_dict,  # noqa: F401
                                to_yaml)
from engine.config.layout_check import validate_layout  # noqa: F401
from engine.config.validate import validate  # noqa: F401
from engine.config.derive import (BatchPlan, Derived, Layout, StepFlags, derive,  # noqa: F401
                                  total_training_steps)
