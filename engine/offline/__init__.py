"""Offline trainers on the PPO engine's Megatron workers: a reward model from preference pairs
(Bradley-Terry), DPO, and SFT on conversations. Selected by `trainer.task` (reward_model | dpo |
sft); same launch (`torchrun -m engine.train RECIPE.yaml`), layouts, checkpoints and metrics as
PPO.

    build.py     from a validated config: tokenizer, pairs / conversations, layout, models -> the
                 trainer
    trainer.py   RewardModelTrainer, DPOTrainer, SFTTrainer: the loop shell's hooks
                 (engine/loop.py): steps, held-out metrics, checkpoints, HF export

Their parts live with their layers: the preference pairs in engine/data/preference.py, the pair
models (micro-batching, reward model, DPO policy update) in engine/workers/pairs.py, the
Bradley-Terry and DPO losses in engine/algorithms/pair_losses.py; SFT's conversations in
engine/data/sft.py, its model and loss in engine/workers/sft.py.

Tests: tests/test_offline_trainers.py, tests/test_offline_pipeline.py, tests/test_offline_layouts.py,
tests/test_sft.py
"""
