"""Fused kernels: log-prob + entropy from hidden states without the [tokens, vocab] logits,
and KL estimators. Imports neither engine/ nor parallel/.

Tests: tests/test_kernels_logprob.py, tests/test_kernels_kl.py
"""
from kernels.kl import kl_penalty, linear_full_kl
from kernels.logprob import linear_logprob_entropy, naive_logprob_entropy

__all__ = ["linear_logprob_entropy", "naive_logprob_entropy", "kl_penalty", "linear_full_kl"]
