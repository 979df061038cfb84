"""Context parallelism (needs TransformerEngine attention and 2 GPUs): CP=2 logits equal CP=1.

Megatron splits the sequence into 2 x CP chunks and gives CP rank r chunks r and 2CP-1-r
(load balancing for causal attention); each rank's logits are compared with the same
positions of the single-rank forward.
"""
import os
import socket

import pytest
import torch

pytestmark = pytest.mark.gpu

SEQ, BATCH = 64, 2


def _needs():
    if torch.cuda.device_count() < 2:
        pytest.skip("context parallelism needs 2 GPUs")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        pytest.skip("context parallelism needs TransformerEngine (pip install -e .[gpu])")


def _rank(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from engine.models.builder import build_model
    from parallel.mesh import Layout, init_mesh
    from parallel.shards import load_global, local_shards
    from tests.test_layouts import _weight_for
    from tests.tiny_models import tiny_config

    torch.cuda.set_device(rank)
    hf = tiny_config("llama", max_position_embeddings=SEQ)
    tokens = torch.randint(0, hf.vocab_size, (BATCH, SEQ),
                           generator=torch.Generator().manual_seed(0)).cuda()
    logits = {}
    for cp in (1, 2):
        init_mesh(Layout(cp=cp), seed=1)
        [model] = build_model(hf, params_dtype=torch.float32)
        model.cuda().eval()
        shapes = {s.global_name: s.global_shape for _, s in local_shards([model])}
        load_global([model], lambda n: _weight_for(n, shapes[n]).cuda())
        pos = torch.arange(SEQ, device="cuda").expand(BATCH, SEQ)
        batch = get_batch_on_this_cp_rank({"tokens": tokens, "position_ids": pos})
        with torch.no_grad():
            logits[cp] = (model(batch["tokens"], batch["position_ids"], None).float().cpu(),
                          batch["position_ids"][0].cpu())
        ps.destroy_model_parallel()
    full, _ = logits[1]
    part, positions = logits[2]
    out.put((rank, (part - full[:, positions]).abs().max().item()))
    dist.destroy_process_group()


def test_cp2_logits_equal_single_rank():
    _needs()
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    diffs = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    # fp32 with TE's attention kernels: a different summation order than the unsplit forward
    assert max(diffs.values()) < 1e-4, diffs
