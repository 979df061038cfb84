"""strategy fsdp2 on GPUs (NCCL, a CUDA device mesh, Megatron's own TorchFullyShardedDataParallel
as the CPU tests cannot run it): an actor update equals the megatron strategy's, on every GPU
there is (DP = the GPU count; one GPU still runs FSDP's units, the sum-only reduce and the
gathered output weight), fp32 and bf16."""
import pytest
import torch

from tests.gpu.spawn import run_spawned

pytestmark = pytest.mark.gpu


def _rank(rank, strategy, dtype):
    import dataclasses

    torch.cuda.set_device(rank)
    from megatron.core import parallel_state as ps

    from engine.workers.actor import ActorWorker
    from parallel.fsdp import local
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import iter_global, load_global, local_shards
    from tests.test_layouts import weight_for
    from tests.test_ppo_update import B, R, make_batch, make_configs
    from tests.tiny_models import tiny_config

    init_mesh(Layout(), seed=1)
    actor_cfg, _, model_cfg = make_configs(clip_ratio_low=0.15, clip_ratio_high=0.3)
    meg = dataclasses.replace(actor_cfg.megatron, params_dtype=dtype)
    worker = ActorWorker(tiny_config("llama"), dataclasses.replace(actor_cfg, strategy=strategy, megatron=meg),
                         model_cfg, response_length=R)
    shapes = {s.global_name: s.global_shape for _, s in local_shards(worker.chunks)}
    load_global(worker.chunks, lambda n: weight_for(n, shapes[n]))
    batch = make_batch(worker.hf_config.vocab_size)
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = batch.index_select(list(range(r * B // dp, (r + 1) * B // dp)))
    worker.mini_batch_size_per_rank = len(mine)
    old = worker.compute_log_prob(mine, micro_batch_size=3)
    mine["old_log_probs"] = old + mine["noise"] * mine["response_mask"]
    mine["ref_log_prob"] = old - 0.5 * mine["noise"] * mine["response_mask"]
    metrics = worker.update_policy(mine)
    held = sum(local(p).numel() for c in worker.chunks for p in c.parameters())
    return dict(old=old.float().cpu(), metrics=metrics, held=held,
                weights={n: t.float().cpu() for n, t in iter_global(worker.chunks)})


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_fsdp2_update_equals_megatrons_on_the_gpus(dtype, tol):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    world = min(torch.cuda.device_count(), 2)
    meg = run_spawned(_rank, world, "megatron", dtype)
    fsdp = run_spawned(_rank, world, "fsdp2", dtype)
    for m, f in zip(meg, fsdp):
        assert torch.allclose(m["old"], f["old"], atol=tol)
        assert m["metrics"]["actor/grad_norm"] == pytest.approx(f["metrics"]["actor/grad_norm"], rel=10 * tol)
        worst = max(float((m["weights"][n] - f["weights"][n]).abs().max()) for n in m["weights"])
        assert worst < tol
        assert f["held"] * world == m["held"]
