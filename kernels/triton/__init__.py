"""Triton kernels (GPU; on CPU only under TRITON_INTERPRET=1). Imported lazily by kernels/.

Tests: tests/test_kernels_logprob.py
"""
