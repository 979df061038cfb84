"""The weight-update group of a separate SGLang pool (engine/rollout/update_group.py) on this
machine's torch and GPUs: the sender built with torch's own group constructor (a private name,
checked here on the GPU stack's torch), a worker process joining as SGLang's TP workers do, and one
bucket of CUDA tensors broadcast to it, bit for bit. NCCL from GPU 0 to GPU 1 where there are two
(NCCL refuses two ranks on one GPU); on one GPU, gloo from CUDA tensors."""
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu


def roundtrip(backend, sender_device, worker_device):
    """(bytes sent, the bucket, what the worker received)."""
    import torch.distributed as dist

    from engine.rollout.update_group import broadcast_bucket, manifest, open_as_sender, sender_address
    from tests import update_group_worker
    name = "trident-weights-0"
    g = torch.Generator().manual_seed(0)
    bucket = [("model.embed_tokens.weight", torch.randn(64, 32, generator=g).to(sender_device, torch.bfloat16)),
              ("model.layers.0.mlp.up_proj.weight", torch.randn(48, 32, generator=g).to(sender_device)),
              ("model.norm.weight", torch.randn(32, generator=g).to(sender_device))]
    address, port = sender_address()
    joined = {}
    thread = threading.Thread(target=lambda: joined.update(workers=update_group_worker.start(
        address, port, [1], 2, name, backend, [worker_device])))
    thread.start()  # the worker joins while the sender hosts the rendezvous
    pg = open_as_sender(address, port, 2, name, backend, timeout_s=120)
    thread.join(timeout=120)
    workers = joined["workers"]
    try:
        described = manifest(bucket)
        conn = workers[0][0]
        conn.send((described["names"], described["dtypes"], described["shapes"]))
        sent = broadcast_bucket(pg, bucket)
        received = dict(conn.recv())
    finally:
        update_group_worker.stop(workers)
        dist.destroy_process_group(pg)
    return sent, bucket, received


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_bucket_of_cuda_tensors_reaches_a_worker_over_the_update_group():
    two = torch.cuda.device_count() >= 2
    sent, bucket, received = roundtrip("nccl" if two else "gloo", "cuda:0", "cuda:1" if two else "cuda:0")
    assert sent == sum(t.numel() * t.element_size() for _, t in bucket)
    assert list(received) == [n for n, _ in bucket]
    for name, t in bucket:
        assert received[name].dtype == t.dtype and torch.equal(received[name], t.cpu()), name
