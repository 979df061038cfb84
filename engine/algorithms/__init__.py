"""Pure PPO math: advantage estimators, losses, loss aggregation and KL estimators.

No distributed state lives here; every function takes tensors and returns tensors, and each is
tested against its written formula. Losses are split-invariant: a micro-batch's loss is its SUM
divided by a global normaliser (see `engine.algorithms.losses.LossNormaliser`).

Tests: tests/test_advantages.py, tests/test_losses.py, tests/test_kl_controllers.py
"""
