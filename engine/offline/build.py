"""Everything an offline run needs, from a validated config: tokenizer, preference pairs or
SFT conversations, the layout, the trained model (and the DPO reference), checkpoints; returns
the trainer.

The trained model is `actor_rollout_ref.model` with the actor's optim / megatron / micro-batch
keys (micro-batch sizes count pairs, or conversations for SFT); a reward model gets the scalar
head (a sequence-classification checkpoint's `score.weight` when the path has one, else a fresh
head).

Tests: tests/test_offline_trainers.py, tests/test_offline_layouts.py, tests/test_offline_pipeline.py,
tests/test_sft.py
"""
from engine.data import pad_token_id, truncation_of
from engine.data.preference import PreferenceDataset, arith_pairs
from engine.data.sft import SFTDataset, tool_conversations
from engine.loading import data_of

BUILTIN_TRAIN_PAIRS, BUILTIN_VAL_PAIRS = 1024, 128  # as make_builtin_task's splits


def load_pair_datasets(cfg, tokenizer):
    d, task = cfg.data, cfg.trainer.task
    kw = dict(tokenizer=tokenizer, max_prompt_length=d.max_prompt_length,
              max_response_length=d.max_response_length,
              truncation=truncation_of(d),
              prompt_key=d.prompt_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key,
              margin_key=d.margin_key if task == "reward_model" else None,
              ref_columns=task == "dpo" and cfg.algorithm.dpo.precomputed_ref_log_probs,
              apply_chat_template=d.chat_template)
    if d.builtin_task:
        level = d.builtin_task_difficulty
        return (PreferenceDataset(arith_pairs(BUILTIN_TRAIN_PAIRS, d.seed, level, "train"), **kw),
                PreferenceDataset(arith_pairs(BUILTIN_VAL_PAIRS, d.seed, level, "test"), **kw))
    train = PreferenceDataset(data_of(cfg, "train", tokenizer), **kw)
    val = PreferenceDataset(data_of(cfg, "val", tokenizer), **kw) if d.val_files else None
    return train, val


def load_sft_datasets(cfg, tokenizer):
    d = cfg.data
    kw = dict(tokenizer=tokenizer, max_length=d.max_length, truncation=truncation_of(d),
              messages_key=d.messages_key, tools_key=d.tools_key)
    if d.builtin_task:
        level = d.builtin_task_difficulty
        return (SFTDataset(tool_conversations(BUILTIN_TRAIN_PAIRS, d.seed, level, "train"), **kw),
                SFTDataset(tool_conversations(BUILTIN_VAL_PAIRS, d.seed, level, "test"), **kw))
    train = SFTDataset(data_of(cfg, "train", tokenizer), **kw)
    val = SFTDataset(data_of(cfg, "val", tokenizer), **kw) if d.val_files else None
    return train, val


def build_offline(cfg, world_size):
    """The trainer of `cfg.trainer.task` ('reward_model', 'dpo' or 'sft') on this rank."""
    from engine.config import derive, validate_layout
    from engine.models.arch import arch_spec
    from engine.offline.trainer import DPOTrainer, RewardModelTrainer, SFTTrainer
    from engine.workers.pairs import DPOWorker, RewardModelTrainWorker
    from engine.workers.sft import SFTWorker
    from engine.loading import copy_weights, load_hf_config, load_tokenizer
    from parallel.mesh import init_mesh

    tokenizer = load_tokenizer(cfg)
    task = cfg.trainer.task
    load = load_sft_datasets if task == "sft" else load_pair_datasets
    train_data, val_data = load(cfg, tokenizer)
    derived = derive(cfg, world_size, dataset_len=len(train_data))
    cfg = derived.config
    arr = cfg.actor_rollout_ref
    init_mesh(derived.layout, seed=arr.actor.megatron.seed)
    hf_config = load_hf_config(arr.model, vocab_size=len(tokenizer))
    spec = arch_spec(hf_config)
    validate_layout(cfg, world_size, num_layers=spec.transformer["num_layers"],
                    num_experts=spec.num_experts or 0,
                    num_attention_heads=hf_config.num_attention_heads)
    steps = cfg.trainer.total_training_steps
    pad = pad_token_id(tokenizer)  # the run's pad id, once: the workers and the trainer get this one
    ref = None
    if task == "reward_model":
        model = RewardModelTrainWorker(hf_config, arr.actor, arr.model, total_steps=steps,
                                       pad_token_id=pad)
    elif task == "sft":
        model = SFTWorker(hf_config, arr.actor, arr.model, total_steps=steps, pad_token_id=pad)
        model.oom_retries = cfg.trainer.oom_retry
    else:
        model = DPOWorker(hf_config, arr.actor, arr.model, cfg.algorithm.dpo, total_steps=steps,
                          pad_token_id=pad)
        if not cfg.algorithm.dpo.precomputed_ref_log_probs:
            from engine.workers.actor import ReferenceWorker
            ref = ReferenceWorker(hf_config, arr.ref.megatron, arr.model, pad_token_id=pad,
                              strategy=arr.ref.strategy or "megatron")
    if arr.model.path:
        from engine.models.hf_io import load_hf_weights
        for worker in (w for w in (model, ref) if w is not None):
            load_hf_weights(worker.chunks, arr.model.path, hf_config=hf_config)
        model.optimizer.reload_model_params()
    elif ref is not None:  # the reference is the initial policy
        copy_weights(model.chunks, ref.chunks)
    checkpoints = None
    t = cfg.trainer
    if t.save_freq > 0 or t.resume_mode != "disable":
        from engine.checkpoint import CheckpointManager
        checkpoints = CheckpointManager(t.default_local_dir, keep_last=t.max_actor_ckpt_to_keep,
                                        verify=t.checkpoint_verify)
    kw = dict(tokenizer=tokenizer, hf_config=hf_config, train_data=train_data,
              val_data=val_data, model=model, pad_id=pad, checkpoints=checkpoints)
    if task == "reward_model":
        return RewardModelTrainer(derived, **kw)
    if task == "sft":
        return SFTTrainer(derived, **kw)
    return DPOTrainer(derived, ref=ref, **kw)
