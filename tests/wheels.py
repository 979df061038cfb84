"""A pinned wheel downloaded once, without its dependencies, for the contract tests that read a
GPU library's Python sources (tests/test_sglang_contract.py, tests/test_vllm_contract.py).

    path = pinned_wheel("vllm", "0.34.0", "manylinux_2_28_x86_64")

It lands in .cache/<package>-<version>/ (git-ignored). A download that fails or times out fails
the test: a contract that cannot be checked is not green.

Tests: tests/test_sglang_contract.py, tests/test_vllm_contract.py
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pinned_wheel(package: str, version: str, platform: str, timeout_s: int = 300) -> str:
    """Path of `package`==`version`'s wheel for CPython 3.11 on `platform` (any platform's wheel
    has the same Python sources: one is pinned so the download is deterministic)."""
    cache = os.path.join(ROOT, ".cache", f"{package}-{version}")

    def found():
        return sorted(f for f in os.listdir(cache) if f.endswith(".whl")) if os.path.isdir(cache) else []
    if not found():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.11", "--platform", platform, f"{package}=={version}", "-d", cache, "-q"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"downloading {package}=={version} from PyPI timed out: the contract cannot be checked")
        if done.returncode != 0 or not found():
            pytest.fail(f"cannot download {package}=={version} (no PyPI access?): {done.stderr.strip()[-300:]}")
    return os.path.join(cache, found()[0])
