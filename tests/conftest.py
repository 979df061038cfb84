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
