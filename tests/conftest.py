import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _cuda_available():
    import torch
    return torch.cuda.is_available()


# Triton kernels run on CPU through the interpreter, and only there: on CUDA the gpu tests check
# the compiled kernels (the interpreter would replace them; triton 3.6's crashes with numpy >= 2.4)
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def grpo_run(tmp_path_factory):
    """One `torchrun -m engine.train` GRPO run of the tiny recipe (tests/test_e2e.py's GRPO_RUN:
    4 steps, checkpoints at steps 2 and 4, validation at step 4, HF export, the distributed
    optimizer), read by every test that needs that run as it is: test_e2e's estimator test (its
    grpo case) and killed-run resume test (the uninterrupted run), test_launch_ray (the torchrun
    side). Returns (root, console output, metrics records); the run is root/{ckpt,logs}/grpo."""
    from tests.test_e2e import GRPO_RUN, GRPO_STEPS, run_demo
    root = tmp_path_factory.mktemp("grpo_run")
    out, records = run_demo(root, "grpo", GRPO_RUN, steps=GRPO_STEPS)
    return root, out, records


@pytest.fixture(scope="session")
def sglang_colocated_run(tmp_path_factory):
    """One torchrun run of the tiny recipe with a colocated SGLang engine of TP 2 (the recording
    double in tests/fakes, its log in root/colocated.sglang), 3 steps, HF export: the run a
    separate pool must match (test_rollout_pool) and the one whose engine must start under
    torchrun (test_sglang_double). Returns (root, metrics records)."""
    from tests.test_rollout_pool import SGLANG_TP2, pool_run
    root = tmp_path_factory.mktemp("sglang_colocated")
    return root, pool_run(root, "colocated", 2, SGLANG_TP2, sglang=True)
