"""What the CPU simulation of parallel/device_memory.py stands for, measured on a GPU with
torch.cuda.mem_get_info (what another process, e.g. SGLang's scheduler allocating through
torch_memory_saver's cuMemCreate, could take): storage freed by parallel/offload.py stays in
torch's caching allocator - the device gains nothing - until return_to_device()."""
import pytest
import torch

pytestmark = pytest.mark.gpu

SIZE = 512 << 20


def test_offloaded_storage_reaches_the_device_only_after_return_to_device():
    from parallel import device_memory
    from parallel.offload import Offloader

    torch.cuda.empty_cache()
    tensor = torch.ones(SIZE, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    off = Offloader()
    assert off.offload([tensor]) == SIZE
    cached = torch.cuda.mem_get_info()[0]
    assert cached - before < SIZE // 8  # freed into torch's cache, not to the device
    assert device_memory.reserved() == torch.cuda.memory_reserved() >= SIZE
    out = device_memory.return_to_device()
    after = torch.cuda.mem_get_info()[0]
    assert after - before >= SIZE * 0.95
    assert abs(out["free"] - after) < (64 << 20) and out["reserved"] == torch.cuda.memory_reserved()
    off.reload()
    assert torch.cuda.mem_get_info()[0] <= after - SIZE * 0.95
    assert bool((tensor == 1).all())
