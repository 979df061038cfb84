"""Memory handed back to the device for a colocated SGLang engine (issue 20, item 2).

parallel/device_memory.py simulates torch's caching allocator on CPU: bytes freed by
parallel/offload.py stay reserved by the training process until its empty_cache; the SGLang
double (tests/fakes/sglang/srt/utils/torch_memory_saver_adapter.py) holds weights and KV cache
in the same per-device budget, sizes its pool as sglang does from what is free when it starts,
and refuses a resume the device cannot give. Checked against the written formula
(kv = mem_fraction_static x free at start - weights per GPU) and through the real trainer."""
import os
import sys

import pytest
import torch

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKES = os.path.join(ROOT, "tests", "fakes")
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
OFFLOAD = ["actor_rollout_ref.actor.megatron.param_offload=true",
           "actor_rollout_ref.actor.megatron.optimizer_offload=true",
           "actor_rollout_ref.ref.megatron.param_offload=true"]
FRACTION = 0.5


@pytest.fixture
def simulated(tmp_path, monkeypatch):
    from parallel import device_memory
    monkeypatch.setenv(device_memory.DIR_ENV, str(tmp_path / "devices"))
    monkeypatch.setenv(device_memory.BYTES_ENV, str(10_000))
    monkeypatch.setenv("RANK", "0")
    return device_memory


class _Holder:
    """A model's states as ModelWorker.resident_bytes() reports them."""

    def __init__(self, n):
        self.t = torch.zeros(n, dtype=torch.uint8)

    def resident_bytes(self):
        return {"params": self.t.untyped_storage().nbytes()}


def test_offloaded_bytes_stay_reserved_until_the_cache_is_emptied(simulated):
    from parallel.offload import Offloader
    holder = _Holder(4000)
    simulated.track(holder)
    assert (simulated.allocated(), simulated.reserved(), simulated.free()) == (4000, 4000, 6000)
    off = Offloader()
    assert off.offload([holder.t]) == 4000
    # freed into the cache: nothing more for another process
    assert (simulated.allocated(), simulated.reserved(), simulated.free()) == (0, 4000, 6000)
    assert simulated.return_to_device() == dict(free=10_000, reserved=0, allocated=0)
    off.reload()  # taken from the device again
    assert (simulated.reserved(), simulated.free()) == (4000, 6000)


def _config_dir(tmp_path):
    from transformers import LlamaConfig
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=50).save_pretrained(str(tmp_path / "model"))
    return str(tmp_path / "model")


def _hf_param_bytes(model_path, dtype_bytes):
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters()) * dtype_bytes


def test_double_sizes_its_pool_from_free_memory_and_refuses_a_short_resume(simulated, tmp_path):
    sys.path.insert(0, FAKES)
    try:
        from sglang.srt.utils.torch_memory_saver_adapter import EngineMemory
    finally:
        sys.path.remove(FAKES)
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            sys.modules.pop(name)  # later tests in this process must not find the double as sglang
    path = _config_dir(tmp_path)
    weights = _hf_param_bytes(path, 4) // 2  # float32, TP 2
    capacity = 4 * weights
    os.environ[simulated.BYTES_ENV] = str(capacity)
    book = simulated.ledger()
    book.hold(1, "train-other", weights // 4)  # rank 1's device is fuller: the minimum counts
    kw = dict(tp_size=2, mem_fraction_static=FRACTION, model_path=path, dtype="float32")
    mem = EngineMemory(kw)
    pre = capacity - weights // 4
    assert mem.pre == pre and mem.weights_bytes == weights
    assert mem.kv_pool_bytes == int(FRACTION * pre - weights)  # weights + pool = fraction x free at start
    assert [book.free(d) for d in (0, 1)] == [capacity - int(FRACTION * pre), pre - int(FRACTION * pre)]
    mem.release(None)
    assert book.free(1) == pre
    with pytest.raises(RuntimeError, match="not active"):
        mem.release(["weights"])
    book.hold(1, "train-other", capacity - weights + 1)  # one byte short of the weights on device 1
    with pytest.raises(RuntimeError, match="CUDA_ERROR_OUT_OF_MEMORY.*weights.*device 1"):
        mem.resume(["weights"])
    book.hold(1, "train-other", 0)
    mem.resume(["weights"])
    with pytest.raises(RuntimeError, match="not paused"):
        mem.resume(["weights"])
    # an engine whose weights leave nothing for the pool is refused, as sglang refuses it
    with pytest.raises(ValueError, match="no memory for the KV cache"):
        EngineMemory(dict(kw, mem_fraction_static=0.2))


# -- through the real trainer ----------------------------------------------------------------

def _trainer(overrides, tmp):
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed
    cfg = load_config(DEMO, [
        "trainer.n_gpus_per_node=2", "trainer.logger=[]", "trainer.resume_mode=disable",
        "trainer.save_freq=-1", "trainer.test_freq=-1", f"trainer.default_local_dir={tmp}/ckpt",
        f"trainer.log_dir={tmp}/logs/{dist.get_rank()}", "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", *OFFLOAD, *overrides])
    set_seed(cfg.trainer.seed)
    derived, components = build(cfg, 2)
    return Trainer(derived, components)


def _footprint():
    """Every state of the actor and the reference on a rank, by the planner's formula
    (tools/plan_memory.py, CPU: fp32 weights 4P, grads 4P, Adam 8P)."""
    from engine.config import load_config
    from tools.plan import estimate
    models = estimate(load_config(DEMO, OFFLOAD), 2, gpu_mem_gib=1, device="cpu")["models"]
    return sum(models["actor"][k] for k in ("weights", "grads", "optimizer")) + models["ref"]["weights"]


def _colocated(tmp, capacity):
    from parallel import device_memory
    os.environ.update({device_memory.DIR_ENV: f"{tmp}/devices", device_memory.BYTES_ENV: str(capacity)})
    sys.path.insert(0, FAKES)
    try:
        import sglang
        sglang.RECORDS.clear()
        t = _trainer(["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                      f"actor_rollout_ref.rollout.gpu_memory_utilization={FRACTION}"], tmp)
        t.colocated.record = True
        for _ in range(2):
            t.train_step(t.loader.next_batch())
        t.colocated.to_training()
        t.rollout.shutdown()
        model_path = next(e["kwargs"]["model_path"] for e in sglang.RECORDS if e["kind"] == "init") \
            if t.rollout.is_leader else None
        return dict(records=[e for e in sglang.RECORDS if e["kind"] != "generate"], log=t.colocated.log,
                    model_path=model_path)
    finally:
        for key in (device_memory.DIR_ENV, device_memory.BYTES_ENV):
            os.environ.pop(key, None)
        sys.path.remove(FAKES)
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            sys.modules.pop(name)


def test_colocated_engine_gets_its_share_and_training_hands_memory_back(tmp_path):
    # well below 2x: the engine's share (half the device) cannot resume beside training's cached
    # peak, and above what the training phases and the engine's share beside the offloaded state need
    capacity = int(1.2 * _footprint())
    results = run_on_ranks(_colocated, 2, str(tmp_path / "b"), capacity)
    leader = results[0]
    memory = next(e for e in leader["records"] if e["kind"] == "memory")
    weights = _hf_param_bytes(leader["model_path"], 4) // 2  # float32 over the engine's 2 GPUs
    # the engine started on an empty device: its pool is what the recipe asked for
    assert memory["pre"] == capacity and memory["weights_bytes"] == weights
    assert memory["kv_pool_bytes"] == int(FRACTION * capacity - weights)
    for rank, res in enumerate(results):  # the engine's share on both devices (its TP workers' GPUs)
        gens = [e for e in res["log"] if e["phase"] == "gen"]
        assert len(gens) == 2
        for e in gens:
            training = sum(sum(states.values()) for states in e["models"].values())
            assert e["device"]["reserved"] == training, (rank, e)  # nothing left in the cache
            assert e["device"]["free"] == capacity - training - int(FRACTION * capacity), (rank, e)


class _Cycle:
    """A tensor held only by a reference cycle: freed by a full collection, not by refcounts."""

    def __init__(self):
        self.me, self.t = self, torch.zeros(4)


def test_freezing_the_built_run_keeps_collecting_what_steps_drop():
    """freeze_long_lived (engine/train.py, once the run is built) takes what lives now out of
    the full collections of return_to_device; start-up garbage is collected first, never
    frozen, and a cycle a step drops later is still freed."""
    import gc
    import weakref

    from parallel import device_memory
    kept = [{} for _ in range(5000)]  # long-lived objects of the built run
    startup = weakref.ref(_Cycle())  # start-up garbage, unreachable already
    try:
        frozen = device_memory.freeze_long_lived()
        assert startup() is None  # collected before the freeze, not kept for ever
        assert frozen == gc.get_freeze_count() >= len(kept)
        dropped = weakref.ref(_Cycle())  # what a step leaves in a cycle
        assert dropped() is not None  # only a collection frees it
        device_memory.return_to_device()
        assert dropped() is None
    finally:
        gc.unfreeze()
    del kept
