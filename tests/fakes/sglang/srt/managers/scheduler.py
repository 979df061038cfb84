"""Test double of one SGLang scheduler process (one per TP rank).

Mirrors, without their work: sglang/srt/managers/scheduler.py ``run_scheduler_process`` (the
process target, reporting ``{"status": "ready"}`` on its pipe), which builds the model runner;
sglang/srt/distributed/bootstrap.py ``init_parallel_runtime`` / ``_init_parallel_groups`` (rank
= tp_rank on a world of tp_size, joined at the engine's ``tcp://`` address) and
sglang/srt/distributed/parallel_state.py ``init_distributed_environment``
(``torch.distributed.init_process_group(backend, init_method, world_size, rank, timeout)``).
The rendezvous is torch's own, in a process that inherited the engine's environment at start,
so what breaks it on the GPU breaks it here. gloo stands in for NCCL; the wait is bounded
(real sglang waits ``dist_timeout``, default torch's) so a broken start fails a test instead of
hanging it.
"""
import os

# torch's tcp:// rendezvous turns into a client of torchrun's agent store when this is "True"
# (torch/distributed/rendezvous.py); nobody hosts that store at the engine's port
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def run_scheduler_process(conn, dist_init_method, world_size, rank, gpu_id, timeout_s):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=dist_init_method, world_size=world_size, rank=rank,
                                timeout=timedelta(seconds=timeout_s))
        dist.barrier()  # every TP rank is in: what the model's first all-reduce needs
    except Exception as e:  # noqa: BLE001 - reported to the engine, which raises
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if os.environ.get(AGENT_STORE_ENV) == "True":
            why += (f" -- this process inherited {AGENT_STORE_ENV}=True (torchrun's), so torch's "
                    f"tcp:// rendezvous waited for torchrun's agent store instead of hosting its own; "
                    f"build the engine without {AGENT_STORE_ENV} in its environment")
        conn.send({"status": "error", "message": f"TP rank {rank} could not join its group at "
                                                 f"{dist_init_method} within {timeout_s:.0f} s: {why}"})
        return
    conn.send({"status": "ready", "tp_rank": rank, "gpu_id": gpu_id, "pid": os.getpid(),
               AGENT_STORE_ENV: os.environ.get(AGENT_STORE_ENV)})
    try:
        conn.recv()  # None: shut down; EOF: the engine's process is gone
    except EOFError:
        pass
    dist.destroy_process_group()
