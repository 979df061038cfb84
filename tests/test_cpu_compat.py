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


def test_threads_share_the_nodes_cores_among_all_launched_processes():
    from parallel.cpu import threads_per_process
    # 1 training + 1 pool rank on 2 cores: one thread each (the trainer once took 2 as the only
    # training rank, and the pair ran 4 spinning OpenMP threads on 2 cores)
    assert threads_per_process({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, 2) == 1
    assert threads_per_process({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}, 16) == 4  # per node
    assert threads_per_process({"WORLD_SIZE": "2"}, 8) == 4  # launched without torchrun's variable
    assert threads_per_process({}, 2) == 2 and threads_per_process({"WORLD_SIZE": "4"}, 2) == 1
