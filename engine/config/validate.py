"""Validation: one ConfigError naming the key, the value and the fix, per mistake.

Tests: tests/test_config.py, tests/test_config_keys.py, tests/test_offline_config.py, tests/test_sft.py
"""
from __future__ import annotations

import os
from typing import Any

from engine.config.checks import check_range, divisors, fail
from engine.rollout.registry import rollout_backend

from engine.config.schema import (CRITIC_ESTIMATORS, GROUP_ESTIMATORS, LAYOUT_KEYS, ConfigError, DataConfig,
                                  DpoConfig, MegatronConfig, ModelConfig, OptimConfig, RewardModelConfig,
                                  TridentConfig)


# --------------------------------------------------------------------------------------------
# Value validation (layout-independent; layout checks live in layout_check.py)
# --------------------------------------------------------------------------------------------

def validate(cfg: TridentConfig) -> None:
    """Raise ConfigError for the first impossible value or inconsistent combination."""
    _validate_data(cfg.data)
    _validate_task(cfg)  # first: an offline task refuses PPO-only sections before they are checked
    arr = cfg.actor_rollout_ref
    if arr.actor.megatron.params_dtype is None:
        fail("actor_rollout_ref.actor.megatron.params_dtype", None,
             "the actor's parameter dtype must be set: float32, bfloat16 or float16")
    if not arr.hybrid_engine:
        fail("actor_rollout_ref.hybrid_engine", False,
             "only the colocated hybrid engine is implemented; set it to true")
    _validate_model(arr.model, "actor_rollout_ref.model", cfg.data, required=True)
    _validate_actor(cfg)
    _validate_rollout(cfg)
    ref = arr.ref
    check_range(ref, "actor_rollout_ref.ref", "log_prob_micro_batch_size_per_gpu", ge=1, optional=True)
    check_range(ref, "actor_rollout_ref.ref", "log_prob_max_token_len_per_gpu", ge=1, optional=True)
    _validate_frozen(ref.megatron, "actor_rollout_ref.ref.megatron")  # first: its keys before their ranges
    _validate_megatron(ref.megatron, "actor_rollout_ref.ref.megatron", is_actor=False)
    _validate_critic(cfg)
    _validate_lora(cfg)
    _validate_strategies(cfg)
    _validate_multi_turn(cfg)
    _validate_reward_model(cfg.reward_model, cfg.custom_reward_function, cfg.data.max_response_length)
    _validate_algorithm(cfg)
    _validate_trainer(cfg)
    from engine.config.validate_experience import validate_experience  # it builds on this module
    from engine.config.validate_profiler import validate_profiler
    validate_experience(cfg)
    validate_profiler(cfg)


def _validate_data(data: DataConfig) -> None:
    p = "data"
    for name in ("max_prompt_length", "max_response_length", "train_batch_size"):
        check_range(data, p, name, ge=1)
    check_range(data, p, "val_batch_size", ge=1, optional=True)
    check_range(data, p, "dataloader_num_workers", ge=0)
    check_range(data, p, "builtin_task_difficulty", ge=0, le=2)
    if not data.prompt_key:
        fail("data.prompt_key", data.prompt_key, "set the parquet column holding the prompt, e.g. 'prompt'")
    if not data.train_files and data.builtin_task is None and data.offline_path is None:
        fail("data.train_files", data.train_files,
             "no training data: set data.train_files to parquet file(s), data.builtin_task (e.g. 'arith') "
             "or data.offline_path (logged responses)")
    if data.train_files and data.builtin_task is not None:
        fail("data.builtin_task", data.builtin_task,
             f"data.train_files={data.train_files!r} is also set; use one source: set builtin_task=null "
             f"or train_files=[]")


def _validate_model(model: ModelConfig, prefix: str, data: DataConfig, required: bool) -> None:
    if model.path is not None and model.config is not None:
        fail(f"{prefix}.config", "{...}", f"{prefix}.path={model.path!r} is also set; model.config builds a "
             f"random model, so set only one (use {prefix}.override_config to change a pretrained config)")
    if required and model.path is None and model.config is None:
        fail(f"{prefix}.path", None, "set it to a HF model directory, or set model.config to an inline "
             "HF config dict to build a random model")
    if (required and model.config is not None and model.tokenizer_path is None
            and data.builtin_task is None):
        fail(f"{prefix}.tokenizer_path", None, "a model built from model.config has no tokenizer: set "
             "tokenizer_path or data.builtin_task")


def _validate_optim(optim: OptimConfig, prefix: str) -> None:
    check_range(optim, prefix, "lr", ge=0.0)
    check_range(optim, prefix, "min_lr", ge=0.0, le=optim.lr)
    check_range(optim, prefix, "lr_warmup_steps", ge=0, allow=(-1,))
    check_range(optim, prefix, "lr_warmup_steps_ratio", ge=0.0, le=1.0)
    check_range(optim, prefix, "weight_decay", ge=0.0)
    check_range(optim, prefix, "eps", gt=0.0)
    check_range(optim, prefix, "clip_grad", gt=0.0)
    check_range(optim, prefix, "total_training_steps", ge=1, optional=True)
    if len(optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in optim.betas):
        fail(f"{prefix}.betas", optim.betas, "must be two numbers in [0, 1), e.g. [0.9, 0.999]")


def _validate_megatron(m: MegatronConfig, prefix: str, is_actor: bool) -> None:
    for name in LAYOUT_KEYS:
        value = getattr(m, name)
        nullable = (not is_actor or name in ("virtual_pipeline_model_parallel_size",
                                             "expert_tensor_parallel_size"))
        if value is None and not nullable:
            fail(f"{prefix}.{name}", None, "the actor defines the parallel layout; set it "
                 f"(e.g. {False if name == 'sequence_parallel' else 1})")
        if name != "sequence_parallel":
            check_range(m, prefix, name, ge=1, optional=True)
    check_range(m, prefix, "recompute_num_layers", ge=1, optional=True)
    if m.tp_comm_overlap:
        fail(f"{prefix}.tp_comm_overlap", True, "needs TransformerEngine userbuffers, which Trident does not "
             "initialise; set it to false (overlap_grad_reduce / overlap_param_gather overlap DP communication)")
    if not is_actor and m.seed != MegatronConfig().seed:
        fail(f"{prefix}.seed", m.seed, "one process seeds every model it builds (a random init draws "
             "after the actor's); set actor_rollout_ref.actor.megatron.seed instead and remove this")
    if m.recompute_granularity == "full" and m.recompute_method is None:
        fail(f"{prefix}.recompute_method", None, "recompute_granularity='full' needs a method: set "
             "'uniform' or 'block' (and recompute_num_layers)")
    if m.recompute_granularity != "full" and m.recompute_method is not None:
        fail(f"{prefix}.recompute_method", m.recompute_method,
             f"only used with recompute_granularity='full' (it is {m.recompute_granularity!r}); set it to null")


# Keys of a trained model that a frozen one (reference, reward model) has nothing to act on:
# no gradients, no optimizer, no backward pass to recompute for.
FROZEN_REFUSED = {"grad_offload": "it has no gradients", "optimizer_offload": "it has no optimizer",
                  "overlap_grad_reduce": "it reduces no gradients",
                  "overlap_param_gather": "it has no distributed optimizer to gather from",
                  "use_distributed_optimizer": "it has no optimizer",
                  "recompute_granularity": "it runs forward passes only (nothing to recompute)",
                  "recompute_method": "it runs forward passes only (nothing to recompute)",
                  "recompute_num_layers": "it runs forward passes only (nothing to recompute)"}


def _validate_frozen(m: MegatronConfig, prefix: str) -> None:
    default = MegatronConfig()
    for name, why in FROZEN_REFUSED.items():
        if getattr(m, name) != getattr(default, name):
            fail(f"{prefix}.{name}", getattr(m, name), f"the model is frozen and {why}; remove it "
                 f"(param_offload is what a frozen model offloads)")


def _validate_multi_turn(cfg: TridentConfig) -> None:
    """What multi-turn rollouts (engine/rollout/multi_turn.py) run with."""
    p = "actor_rollout_ref.rollout.multi_turn"
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    check_range(mt, p, "max_assistant_turns", ge=1, optional=True)
    check_range(mt, p, "max_user_turns", ge=0, optional=True)
    check_range(mt, p, "max_tool_response_length", ge=1)
    if not mt.tool_timeout_s > 0:
        fail(f"{p}.tool_timeout_s", mt.tool_timeout_s, "give the seconds a tool call may run, e.g. 30")
    if not mt.enable:
        return
    from engine.agents.parsers import PARSERS  # the registry names the formats
    if mt.format not in PARSERS:
        fail(f"{p}.format", mt.format, f"use one of {', '.join(sorted(PARSERS))}")
    for key in ("tool_config_path", "interaction_config_path"):
        path = getattr(mt, key)
        if path is not None and not os.path.isfile(path):
            fail(f"{p}.{key}", path, "no such file; give verl's YAML (see tests/agent_configs/)")
    if cfg.actor_rollout_ref.actor.router_replay:
        fail("actor_rollout_ref.actor.router_replay", True, f"with {p}.enable the observations are not "
             "routed by the rollout; turn one of them off")


def _validate_strategies(cfg: TridentConfig) -> None:
    """What each model's `strategy` runs with (parallel/fsdp.py for fsdp / fsdp2)."""
    arr = cfg.actor_rollout_ref
    actor = arr.actor.megatron
    models = [("actor_rollout_ref.actor", arr.actor.strategy, actor, True)]
    models.append(("actor_rollout_ref.ref", arr.ref.strategy or arr.actor.strategy, arr.ref.megatron, False))
    if cfg.critic.enable is not False:
        models.append(("critic", cfg.critic.strategy or arr.actor.strategy, cfg.critic.megatron, True))
    models.append(("reward_model", "megatron", cfg.reward_model.megatron, False))
    for prefix, strategy, meg, trains in models:
        m = f"{prefix}.megatron"
        size = lambda name: getattr(meg, name) if getattr(meg, name) is not None else getattr(actor, name)  # noqa: E731
        if strategy == "megatron":
            for name, default in (("reshard_after_forward", True), ("forward_prefetch", False)):
                if getattr(meg, name) != default:
                    fail(f"{m}.{name}", getattr(meg, name), f"only read with {prefix}.strategy fsdp / fsdp2 "
                         "(the fully sharded strategies); remove it, or set the strategy"
                         if prefix != "reward_model" else "only read by the fully sharded strategies, and "
                         "the reward model runs on Megatron-core's layout; remove it")
            continue
        where = f"{prefix}.strategy={strategy!r}"
        for name, why in (("pipeline_model_parallel_size", "pipeline stages"),
                          ("virtual_pipeline_model_parallel_size", "virtual pipeline stages"),
                          ("expert_model_parallel_size", "expert parallelism")):
            if (size(name) or 1) > 1:
                fail(f"{m}.{name}", size(name), f"{where} shards the whole model over data parallel, "
                     f"without {why}; set it to 1 (tensor / context parallel combine with it), or "
                     f"{prefix}.strategy=megatron")
        for name in ("overlap_grad_reduce", "overlap_param_gather"):
            if getattr(meg, name):
                fail(f"{m}.{name}", True, f"{where}: FSDP overlaps its own parameter all-gather and "
                     "gradient reduce-scatter with compute (forward_prefetch for the forward); remove it")
        if (meg.fusions or {}).get("gradient_accumulation_fusion"):
            fail(f"{m}.fusions.gradient_accumulation_fusion", True, f"{where}: fully sharded "
                 "parameters have no gradient buffer to accumulate into; remove it")
        if trains and not meg.use_distributed_optimizer:
            fail(f"{m}.use_distributed_optimizer", False, f"{where} always shards the optimizer state "
                 "with the parameters; remove it (or use strategy megatron for a replicated optimizer)")
        if prefix == "actor_rollout_ref.actor" and arr.model.lora_rank > 0:
            fail(f"{prefix}.strategy", strategy, "LoRA adapters train under strategy megatron only; "
                 "set actor_rollout_ref.actor.strategy=megatron (the frozen base is small per rank with TP)")


def _validate_actor(cfg: TridentConfig) -> None:
    actor, p = cfg.actor_rollout_ref.actor, "actor_rollout_ref.actor"
    _validate_ppo_batching(actor, p, cfg, micro_required=True)
    check_range(actor, p, "ppo_epochs", ge=1)
    check_range(actor, p, "clip_ratio", gt=0.0)
    check_range(actor, p, "clip_ratio_low", gt=0.0, optional=True)
    check_range(actor, p, "clip_ratio_high", gt=0.0, optional=True)
    check_range(actor, p, "clip_ratio_c", gt=1.0)
    check_range(actor, p, "entropy_coeff")
    check_range(actor, p, "kl_loss_coef", ge=0.0)
    _validate_optim(actor.optim, f"{p}.optim")
    _validate_megatron(actor.megatron, f"{p}.megatron", is_actor=True)
    if "model" not in actor.checkpoint.save_contents:
        fail(f"{p}.checkpoint.save_contents", actor.checkpoint.save_contents,
             "a checkpoint always holds the model; list 'model' (plus 'optimizer' and 'extra' to resume exactly)")


def _validate_ppo_batching(section: Any, p: str, cfg: TridentConfig, micro_required: bool) -> None:
    """Mini-batch counts prompts (verl); micro-batch counts sequences per rank."""
    check_range(section, p, "ppo_mini_batch_size", ge=1, optional=True)
    check_range(section, p, "ppo_micro_batch_size_per_gpu", ge=1, optional=True)
    check_range(section, p, "ppo_max_token_len_per_gpu", ge=1)
    mini, batch = section.ppo_mini_batch_size, cfg.data.train_batch_size
    if mini is not None and batch % mini:
        options = ", ".join(str(d) for d in divisors(batch)[-6:])
        fail(f"{p}.ppo_mini_batch_size", mini,
             f"must divide data.train_batch_size={batch} (both count prompts, so mini x rollout.n "
             f"divides train_batch_size x rollout.n); use one of {options}")
    if section.use_dynamic_bsz:
        need = cfg.data.max_prompt_length + cfg.data.max_response_length
        what = f"data.max_prompt_length + max_response_length = {need}"
        if cfg.trainer.task == "sft":
            need, what = cfg.data.max_length, f"data.max_length = {cfg.data.max_length}"
        if section.ppo_max_token_len_per_gpu < need:
            fail(f"{p}.ppo_max_token_len_per_gpu", section.ppo_max_token_len_per_gpu,
                 f"must fit one full sequence ({what}); set it to at least {need}")
    elif section.ppo_micro_batch_size_per_gpu is None and micro_required:
        fail(f"{p}.ppo_micro_batch_size_per_gpu", None,
             f"set the per-rank micro-batch (sequences), or set {p}.use_dynamic_bsz=true")


def _validate_sampling(s: Any, p: str) -> None:
    check_range(s, p, "temperature", ge=0.0)
    check_range(s, p, "top_p", gt=0.0, le=1.0)
    check_range(s, p, "top_k", ge=1, allow=(-1,))
    check_range(s, p, "n", ge=1)


def _validate_rollout(cfg: TridentConfig) -> None:
    r, p = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout"
    _validate_sampling(r, p)
    _validate_sampling(r.val_kwargs, f"{p}.val_kwargs")
    for name in ("prompt_length", "response_length", "log_prob_micro_batch_size_per_gpu",
                 "log_prob_max_token_len_per_gpu"):
        check_range(r, p, name, ge=1, optional=True)
    for name in ("tensor_model_parallel_size", "max_num_batched_tokens", "max_num_seqs",
                 "update_weights_bucket_megabytes"):
        check_range(r, p, name, ge=1)
    check_range(r, p, "gpu_memory_utilization", gt=0.0, le=1.0)
    for i, token in enumerate(r.stop_token_ids):
        if token < 0:
            fail(f"{p}.stop_token_ids[{i}]", token, "token ids are >= 0")
    try:  # a backend trainer.device cannot run (engine/rollout/registry.py decides)
        rollout_backend(r.name, cfg.trainer.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if r.deterministic and r.name == "hf":
        fail(f"{p}.deterministic", True, "the transformers rollout has no batch-invariant GPU kernels; "
             "use rollout.name=sglang (enable_deterministic_inference) or deterministic=false")


def _validate_critic(cfg: TridentConfig) -> None:
    c, p = cfg.critic, "critic"
    if c.enable is False and cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS:
        fail("critic.enable", False, f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} needs a critic; "
             "set critic.enable=true (or null), or pick an estimator without a critic such as 'grpo'")
    _validate_model(c.model, "critic.model", cfg.data, required=False)
    if not c.model.use_fused_kernels:
        fail("critic.model.use_fused_kernels", False, "the critic computes values, no log-probs, so there is no "
             "fused kernel to turn off; remove it")
    _validate_ppo_batching(c, p, cfg, micro_required=False)  # null: the actor's
    check_range(c, p, "ppo_epochs", ge=1, optional=True)
    check_range(c, p, "cliprange_value", gt=0.0)
    _validate_optim(c.optim, f"{p}.optim")
    _validate_megatron(c.megatron, f"{p}.megatron", is_actor=False)


def _validate_lora(cfg: TridentConfig) -> None:
    """LoRA is the actor's (its reference is the base with adapters off: no second model)."""
    from engine.models.lora import resolve_targets
    arr, p = cfg.actor_rollout_ref, "actor_rollout_ref.model"
    check_range(arr.model, p, "lora_rank", ge=0)
    try:
        resolve_targets(arr.model.target_modules)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if arr.model.lora_rank > 0:
        check_range(arr.model, p, "lora_alpha", gt=0.0)
        if arr.ref.megatron.param_offload:
            fail("actor_rollout_ref.ref.megatron.param_offload", True,
                 f"with {p}.lora_rank={arr.model.lora_rank} the reference is the actor with its "
                 "adapters off (no reference model to offload); set it to false")
    for section in ("critic.model", "reward_model.model"):
        model = cfg.critic.model if section == "critic.model" else cfg.reward_model.model
        if model.lora_rank != 0:
            fail(f"{section}.lora_rank", model.lora_rank, "LoRA is implemented for the actor only "
                 f"({p}.lora_rank); set it to 0")
        for name in ("lora_alpha", "target_modules"):
            if getattr(model, name) != getattr(ModelConfig(), name):
                fail(f"{section}.{name}", getattr(model, name), "LoRA is implemented for the actor only "
                     f"({p}.{name}); remove it")


def _validate_reward_model(rm: RewardModelConfig, custom, max_response_length: int) -> None:
    p = "reward_model"
    check_range(rm, p, "num_workers", ge=0)
    check_range(rm, p, "micro_batch_size_per_gpu", ge=1, optional=True)
    check_range(rm.overlong_buffer, f"{p}.overlong_buffer", "len", ge=0)
    check_range(rm.overlong_buffer, f"{p}.overlong_buffer", "penalty_factor", ge=0.0)
    _validate_frozen(rm.megatron, f"{p}.megatron")
    _validate_megatron(rm.megatron, f"{p}.megatron", is_actor=False)
    if rm.token_level != "implicit" and not rm.model.use_fused_kernels:  # a value head: no log-probs
        fail(f"{p}.model.use_fused_kernels", False, "a scalar-head reward model computes no log-probs, so "
             "there is no fused kernel to turn off; remove it (it acts with token_level=implicit)")
    from engine.rewards.sandbox import config_from
    try:
        config_from(rm.sandbox)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if rm.overlong_buffer.enable and not 0 < rm.overlong_buffer.len < max_response_length:
        fail(f"{p}.overlong_buffer.len", rm.overlong_buffer.len,
             f"overlong_buffer.enable=true needs 0 < len < data.max_response_length ({max_response_length}): "
             f"the last `len` tokens before the limit carry the penalty, e.g. {max(1, max_response_length // 4)}")
    if custom.path is not None and not os.path.isfile(os.path.expanduser(custom.path)):
        fail("custom_reward_function.path", custom.path, "no such file; give the path of a Python file defining "
             f"{custom.name}(data_source, solution_str, ground_truth, extra_info)")
    if rm.reward_manager == "batch" and custom.path is None:
        fail(f"{p}.reward_manager", "batch", "'batch' calls custom_reward_function once per step with lists; "
             "set custom_reward_function.path (and .name), or use reward_manager=naive")
    if rm.model.config is not None:
        fail(f"{p}.model.config", "{...}", "a reward model is loaded from reward_model.model.path (its trained "
             "weights), never built at random; remove it (use reward_model.model.override_config to change it)")
    if rm.enable and rm.model.path is None:
        fail("reward_model.model.path", None, "reward_model.enable=true needs a reward model directory; "
             "set it, or set reward_model.enable=false to use rule rewards")
    if rm.enable and rm.micro_batch_size_per_gpu is None:
        fail("reward_model.micro_batch_size_per_gpu", None, "set the per-rank scoring micro-batch (sequences)")


def _validate_algorithm(cfg: TridentConfig) -> None:
    a, p = cfg.algorithm, "algorithm"
    check_range(a, p, "gamma", ge=0.0, le=1.0)
    check_range(a, p, "lam", ge=0.0, le=1.0)
    check_range(a.kl_ctrl, f"{p}.kl_ctrl", "kl_coef", ge=0.0)
    check_range(a.kl_ctrl, f"{p}.kl_ctrl", "horizon", ge=1)
    check_range(a.kl_ctrl, f"{p}.kl_ctrl", "target_kl", gt=0.0)
    g = f"{p}.kl_guard"
    check_range(a.kl_guard, g, "kl_ceiling", gt=0.0)
    check_range(a.kl_guard, g, "entropy_floor", ge=0.0)
    check_range(a.kl_guard, g, "raise_factor", ge=1.0)
    check_range(a.kl_guard, g, "lower_factor", gt=0.0, le=1.0)
    w = a.kl_guard.warn_range
    if len(w) != 2 or not 0 <= w[0] <= w[1]:
        fail(f"{g}.warn_range", w, "must be [low, high] with 0 <= low <= high, e.g. [0.0005, 0.01]")
    if a.kl_guard.enable and not (cfg.actor_rollout_ref.actor.use_kl_loss or a.use_kl_in_reward):
        fail(f"{g}.enable", True, "the guard moves the KL coefficient, but there is no KL term (actor.use_kl_loss "
             "and algorithm.use_kl_in_reward are false); turn one on or set kl_guard.enable=false")
    n = cfg.actor_rollout_ref.rollout.n
    if a.adv_estimator in GROUP_ESTIMATORS and n < 2:
        fail("actor_rollout_ref.rollout.n", n, f"algorithm.adv_estimator={a.adv_estimator!r} compares the "
             "responses to one prompt, so it needs at least 2; set rollout.n >= 2 (e.g. 4)")


def _validate_trainer(cfg: TridentConfig) -> None:
    t, p = cfg.trainer, "trainer"
    from engine.metrics import check_loggers
    try:
        check_loggers(t.logger)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for name in ("nnodes", "n_gpus_per_node", "total_epochs"):
        check_range(t, p, name, ge=1)
    check_range(t, p, "total_training_steps", ge=1, optional=True)
    check_range(t, p, "test_freq", ge=1, allow=(-1,))
    check_range(t, p, "save_freq", ge=1, allow=(-1,))
    check_range(t, p, "max_actor_ckpt_to_keep", ge=1, optional=True)
    check_range(t, p, "oom_retry", ge=0)
    check_range(t, p, "max_nonfinite_skips", ge=1)
    check_range(t, p, "rollback_lr_factor", gt=0.0, le=1.0)
    check_range(t, p, "collective_timeout_s", ge=1)
    launched = t.nnodes * t.n_gpus_per_node
    if t.rollout_pool == "separate" and not 1 <= t.rollout_pool_ranks < launched:
        fail("trainer.rollout_pool_ranks", t.rollout_pool_ranks, f"a separate pool needs between 1 and "
             f"{launched - 1} of the {launched} ranks (the rest train); e.g. {launched // 2}")
    if t.rollout_pool == "colocated" and t.rollout_pool_ranks:
        fail("trainer.rollout_pool_ranks", t.rollout_pool_ranks, "only read with trainer.rollout_pool=separate; "
             "set it to 0 or set rollout_pool=separate")
    if t.off_policy_steps < 0:
        fail("trainer.off_policy_steps", t.off_policy_steps, "use k >= 0 (0: on-policy; k: the pool "
             "generates up to k steps ahead, no token trained is more than k updates old)")
    if t.off_policy_steps and t.rollout_pool != "separate":
        fail("trainer.off_policy_steps", t.off_policy_steps, "overlapping generation with training needs "
             "other ranks to generate: set trainer.rollout_pool=separate and rollout_pool_ranks")
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        fail("trainer.resume_from_path", t.resume_from_path,
             "trainer.resume_mode='resume_path' needs the checkpoint directory to resume from")
    if t.resume_mode != "resume_path" and t.resume_from_path:
        fail("trainer.resume_from_path", t.resume_from_path,
             f"only read when trainer.resume_mode='resume_path' (it is {t.resume_mode!r}); set one or the other")


def _validate_task(cfg: TridentConfig) -> None:
    """Offline tasks (engine/offline) train on preference pairs (reward_model, dpo) or
    conversations (sft): the keys only they read, and the PPO keys that would silently do
    nothing there, are refused where they cannot act."""
    task, d, dpo = cfg.trainer.task, cfg.data, cfg.algorithm.dpo
    check_range(dpo, "algorithm.dpo", "beta", gt=0.0)
    pairs = task in ("reward_model", "dpo")
    offline = pairs or task == "sft"
    where = f"trainer.task={task!r}"
    _validate_sft_keys(d, task, where)
    if not pairs:
        for key, value, default in (("chosen_key", d.chosen_key, "chosen"),
                                    ("rejected_key", d.rejected_key, "rejected")):
            if value != default:
                fail(f"data.{key}", value, f"preference pairs are read by trainer.task "
                     f"'reward_model' or 'dpo' only ({where}); remove it")
    if d.margin_key is not None and task != "reward_model":
        fail("data.margin_key", d.margin_key, f"margins enter the reward model's Bradley-Terry "
             f"loss only ({where}); set trainer.task=reward_model or remove it")
    implicit = cfg.reward_model.token_level == "implicit"  # DPO's implicit reward uses its beta
    for name in ("beta", "loss_type", "precomputed_ref_log_probs"):
        if task != "dpo" and getattr(dpo, name) != getattr(DpoConfig(), name) \
                and not (implicit and name == "beta"):
            also = " or reward_model.token_level=implicit" if name == "beta" else ""
            fail(f"algorithm.dpo.{name}", getattr(dpo, name), f"read by trainer.task='dpo' only "
                 f"({where}){also}; remove it")
    if not offline:
        return
    arr = cfg.actor_rollout_ref
    refused = [  # (key, value, is it set to something that cannot act offline)
        ("actor_rollout_ref.rollout.n", arr.rollout.n, arr.rollout.n != 1),
        ("actor_rollout_ref.actor.ppo_epochs", arr.actor.ppo_epochs, arr.actor.ppo_epochs != 1),
        ("actor_rollout_ref.actor.use_kl_loss", True, arr.actor.use_kl_loss),
        ("actor_rollout_ref.actor.router_replay", True, arr.actor.router_replay),
        ("actor_rollout_ref.actor.shuffle", True, arr.actor.shuffle),
        ("algorithm.use_kl_in_reward", True, cfg.algorithm.use_kl_in_reward),
        ("critic.enable", True, cfg.critic.enable is True),
        ("reward_model.enable", True, cfg.reward_model.enable)]
    for key, value, bad in refused:
        if bad:
            fail(key, value, f"{where} trains on fixed {'preference pairs' if pairs else 'conversations'} "
                 "(no rollout, rewards, critic or KL loss; one pass per batch: use "
                 "trainer.total_epochs); remove it")
    builtin = "arith" if pairs else "multiply"
    if d.builtin_task not in (None, builtin):
        what = "preference pairs" if pairs else "tool-using conversations"
        fail("data.builtin_task", d.builtin_task, f"{where} builds {what} from the "
             f"{builtin!r} task only; use {builtin!r} or data.train_files")
    if not pairs:
        return
    if dpo.precomputed_ref_log_probs and d.builtin_task:
        fail("algorithm.dpo.precomputed_ref_log_probs", True, "the built-in task's pairs carry no "
             "ref_chosen_logps / ref_rejected_logps columns; set it to false (the reference "
             "model computes them) or use data.train_files that have them")
    actor = arr.actor
    pair = 2 * (d.max_prompt_length + d.max_response_length)
    if actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu < pair:
        fail("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu,
             f"a micro-batch holds whole preference pairs (chosen + rejected, up to 2 x "
             f"(max_prompt_length + max_response_length) = {pair} tokens); set it to at least "
             f"{pair}")


def _validate_sft_keys(d: DataConfig, task: str, where: str) -> None:
    """SFT reads whole conversations (data.messages_key, tools_key, max_length), nothing else
    reads those, and SFT reads no prompt / response split."""
    default = DataConfig()
    if task != "sft":
        for key in ("messages_key", "tools_key", "max_length"):
            if getattr(d, key) != getattr(default, key):
                fail(f"data.{key}", getattr(d, key), f"read by trainer.task='sft' only ({where}); "
                     "remove it")
        return
    check_range(d, "data", "max_length", ge=2)
    for key in ("messages_key", "tools_key"):
        if not getattr(d, key):
            fail(f"data.{key}", getattr(d, key), "set the parquet column's name")
    for key in ("prompt_key", "max_prompt_length", "max_response_length"):
        if getattr(d, key) != getattr(default, key):
            fail(f"data.{key}", getattr(d, key), f"{where} reads whole conversations "
                 "(data.messages_key, their length limit data.max_length); remove it")
