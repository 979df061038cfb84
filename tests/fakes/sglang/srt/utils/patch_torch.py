"""Test double: real sglang makes CUDA IPC handles name GPUs by UUID; nothing to do on CPU."""
CALLS = []


def monkey_patch_torch_reductions():
    CALLS.append(1)
