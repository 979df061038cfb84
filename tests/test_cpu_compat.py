"""parallel.cpu: the CUDA-to-CPU function mode, and suspending it for code that runs no Megatron."""
import torch

from tests.multirank import run_on_ranks


def _probe():
    from parallel import cpu

    cpu.enable()
    before = torch.zeros(1, device="cuda").device.type  # megatron's literal "cuda" lands on CPU
    with cpu.suspended():
        try:
            torch.zeros(1, device="cuda")
            inside = "cpu"
        except (AssertionError, RuntimeError):  # a CPU build of torch has no CUDA
            inside = "refused"
        with cpu.suspended():  # nested: still suspended, and the stack comes back intact
            pass
    after = torch.ones(1, device="cuda").device.type
    return before, inside, after


def test_suspended_lifts_the_device_rewrite_only_inside_the_block():
    assert run_on_ranks(_probe, 1) == [("cpu", "refused", "cpu")]
