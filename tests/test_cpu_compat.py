"""parallel.cpu: the CUDA-to-CPU function mode, suspending it for code that runs no Megatron, and
the C allocator keeping freed memory for the next micro-batch."""
import os
import resource

import torch

from tests.multirank import in_fresh_process, run_on_ranks

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny_cpu_demo.yaml")


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


def _mode_during_forward():
    from megatron.core import parallel_state as ps

    from parallel.mesh import Layout, init_mesh
    from tests.test_checkpoint import make_actor
    from tests.test_ppo_update import make_batch

    init_mesh(Layout(), seed=1)
    actor = make_actor()
    seen, heads = [], []
    actor.chunks[0].register_forward_pre_hook(lambda *a: seen.append(torch._C._len_torch_function_stack()))
    for name in ("_logprob_entropy", "_policy_loss"):  # the forward-only head, the update's loss
        def recorded(*args, _head=getattr(actor, name), **kwargs):
            heads.append(torch._C._len_torch_function_stack())
            return _head(*args, **kwargs)
        setattr(actor, name, recorded)
    batch = make_batch(actor.hf_config.vocab_size, seed=0)
    batch["old_log_probs"] = batch["ref_log_prob"] = actor.compute_log_prob(batch, micro_batch_size=len(batch))
    actor.update_policy(batch, micro_batch_size=len(batch))
    assert ps.get_data_parallel_world_size() == 1
    return seen, heads, torch._C._len_torch_function_stack(), torch.zeros(1, device="cuda").device.type


def test_the_models_forward_runs_without_the_device_rewrite():
    """The function mode is a Python call on every torch op (~5 % of a small model's forward
    here, tools/benchmark.py's 3m shapes; ~330 calls per micro-batch in the update's loss);
    Megatron's model forward and our heads name no CUDA device on the CPU (every layout's tests
    run them so), so engine/workers/base.py lifts the mode around both and the mode is back
    afterwards, for the schedule and the backward."""
    seen, heads, after, device = run_on_ranks(_mode_during_forward, 1)[0]
    assert seen == [0, 0] and heads == [0, 0] and after >= 1 and device == "cpu"


def _mode_during_host_work(tmp):
    """Function-mode depth inside the host-side work of one real training step on one rank."""
    import engine.experience.context as context
    import engine.workers.base as base
    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed

    cfg = load_config(DEMO, ["trainer.n_gpus_per_node=1", "trainer.logger=[]", "trainer.resume_mode=disable",
                             "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false",
                             f"trainer.default_local_dir={tmp}", f"trainer.log_dir={tmp}/logs"])
    set_seed(cfg.trainer.seed)
    t = Trainer(*build(cfg, 1))
    depth, seen = torch._C._len_torch_function_stack, {}

    def recorded(name, fn):
        def wrapped(*args, **kwargs):
            seen.setdefault(name, set()).add(depth())
            return fn(*args, **kwargs)
        return wrapped
    saved = context.training_batch, base.make_micro_batch
    context.training_batch = recorded("layout", context.training_batch)
    base.make_micro_batch = recorded("micro_batches", base.make_micro_batch)
    t.rollout.load_slices = recorded("delivery", t.rollout.load_slices)  # called by Delivery.run
    # the CPU engine's release / resume swap its parameters' storage: each a registration
    hook = torch.nn.modules.module.register_module_parameter_registration_hook(
        lambda module, name, param: seen.setdefault("rollout memory", set()).add(depth()))
    try:
        t.train_step(t.next_batch())
    finally:
        hook.remove()
        context.training_batch, base.make_micro_batch = saved
        t.rollout.shutdown()
    return seen, depth()


def test_host_work_between_phases_runs_without_the_device_rewrite(tmp_path):
    """The rest of a step's per-op mode calls (~2 900 a 3m step, 1.3 us each) were host-side
    work that names no device: the CPU engine's weight loading and memory moves, the weight
    delivery, the batch layout after generation, packing micro-batches. Each runs with the mode
    lifted; the mode is back after the step."""
    seen, after = run_on_ranks(_mode_during_host_work, 1, str(tmp_path))[0]
    assert seen == {"layout": {0}, "micro_batches": {0}, "delivery": {0}, "rollout memory": {0}}, seen
    assert after >= 1


def micro_batch_faults():
    """Page faults of one training-like micro-batch: eight 4 MiB activations held at once, then
    all freed (as a backward does); straight from glibc's malloc, which torch's CPU allocator
    calls, so that no Python object lands between the blocks and the heap's layout is the same
    each run."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(4 << 20) for _ in range(8)]
    for block in blocks:
        ctypes.memset(block, 1, 4 << 20)
    for block in blocks:
        libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


MICRO_BATCH_PAGES = (32 << 20) // resource.getpagesize()


def _faults_of_reallocating(keep, environ):
    """(applied, page faults of each of 12 micro-batches), in a fresh process: glibc's policy
    is process-wide."""
    from parallel import cpu

    applied = cpu.keep_freed_memory(environ) if keep else None
    return applied, [micro_batch_faults() for _ in range(12)]


def test_freed_memory_stays_mapped_for_the_next_micro_batch():
    pages = MICRO_BATCH_PAGES
    # glibc's default: blocks above its (dynamic) mmap threshold are unmapped on free, and a free
    # heap top above twice that threshold is trimmed: micro-batches keep faulting pages again
    _, faults = in_fresh_process(_faults_of_reallocating, False, {})
    assert min(faults) > 0.9 * pages, faults
    # kept: only the first micro-batch faults its pages
    applied, faults = in_fresh_process(_faults_of_reallocating, True, {})
    assert applied and faults[0] > 0.9 * pages and sum(faults[1:]) < 0.01 * pages, faults
    # a user's own allocator settings are left alone
    applied, faults = in_fresh_process(_faults_of_reallocating, True, {"MALLOC_TRIM_THRESHOLD_": "0"})
    assert applied is False and min(faults) > 0.9 * pages, faults
