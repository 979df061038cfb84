"""The rollout layer: engines that generate (SGLang, vLLM-to-come, transformers on CPU / CUDA),
where they run (topology), and the hand-offs of weights and memory between training and them.

Tests: tests/test_rollout_cpu.py, tests/test_rollout_topology.py, tests/test_rollout_groups.py
"""
