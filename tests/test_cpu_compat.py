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



FAULTS = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, transformers
torch.set_num_threads(1)
from parallel import cpu
if sys.argv[1] == "default":  # glibc's own behaviour
    cpu.keep_freed_memory = lambda *a, **k: False
from parallel.mesh import init_mesh, Layout
init_mesh(Layout())  # parallel.cpu.enable()
from engine.models.builder import build_model
cfg = transformers.LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=688, vocab_size=64, max_position_embeddings=512)
model = build_model(cfg)[0]
ids = torch.randint(0, 64, (16, 64))
def minflt():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
def step():
    model(ids, torch.arange(64).expand_as(ids), None).float().sum().backward()
step(); step()
start = minflt()
for _ in range(5):
    step()
print(minflt() - start)
"""


def test_a_steps_activations_reuse_freed_memory_instead_of_faulting_pages_in():
    """parallel.cpu.enable keeps freed blocks in the heap (keep_freed_memory): after two warm-up
    forward + backward passes of a small Megatron model, five more fault few pages in; with
    glibc's defaults each pass maps and faults its activations in again (7k-20k pages seen
    here for the five, against 0-1.7k)."""
    import os
    import subprocess
    import sys

    from tests.multirank import free_port
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    faults = {how: int(subprocess.run([sys.executable, "-c", FAULTS, how, str(free_port())], check=True,
                                      capture_output=True, text=True, env=env, timeout=300).stdout.split()[-1])
              for how in ("default", "keep")}
    assert faults["keep"] * 3 < faults["default"], faults
