"""Offline trainers on the PPO engine's Megatron workers: a reward model from preference pairs
(Bradley-Terry) and DPO. Selected by `trainer.task` (reward_model | dpo); same launch
(`torchrun -m engine.train RECIPE.yaml`), layouts, checkpoints and metrics as PPO.

    data.py      preference pairs: parquet rows -> tokenized pairs, bad-row policy, batches
    losses.py    Bradley-Terry and DPO (sigmoid / IPO) per-pair losses, pure torch
    workers.py   pair micro-batching, the trainable reward model, the DPO policy update
    trainer.py   build + the loop: steps, held-out metrics, checkpoints, HF export
"""
