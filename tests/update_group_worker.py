"""The SGLang double's TP workers for the weight-update group (also run by tests/gpu on CUDA):
one process per TP rank, as sglang's scheduler processes are. Each joins the way sglang's worker does (WeightUpdater.
init_weights_update_group -> init_custom_process_group: a TCP rendezvous at the sender, a store
prefixed with the group's name, torch's process-group constructor, at rank rank_offset + tp_rank)
and receives each bucket tensor by tensor, broadcast from rank 0, in manifest order."""
import multiprocessing


def start(master_address, master_port, ranks, world_size, group_name, backend, devices=None):
    """[(connection, process)] of the workers, once all have joined (the sender too); worker i
    receives into devices[i] (default: the CPU)."""
    ctx = multiprocessing.get_context("spawn")
    workers = []
    for i, rank in enumerate(ranks):
        ours, theirs = ctx.Pipe()
        device = devices[i] if devices else "cpu"
        proc = ctx.Process(target=_main, args=(theirs, master_address, master_port, rank, world_size,
                                               group_name, backend, device), daemon=True)
        proc.start()
        workers.append((ours, proc))
    for conn, _ in workers:
        reply = conn.recv()
        if reply != "joined":
            raise RuntimeError(f"a TP worker could not join {group_name}: {reply}")
    return workers


def stop(workers):
    for conn, proc in workers:
        if proc.is_alive():
            conn.send(None)
            proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _main(conn, master_address, master_port, rank, world_size, group_name, backend, device):
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    torch.set_num_threads(1)
    if device != "cpu":
        torch.cuda.set_device(device)  # NCCL binds the group to the current GPU
    try:
        timeout = timedelta(seconds=300)
        store, rank, world_size = next(dist.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                       timeout=timeout))
        store.set_timeout(timeout)
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), dist.PrefixStore(group_name, store),
                                          group_name=group_name, backend_options=None, timeout=timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    except Exception as e:  # noqa: BLE001 - reported to the engine, which raises
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send("joined")
    while (request := conn.recv()) is not None:
        names, dtypes, shapes = request
        weights = [torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                   for dtype, shape in zip(dtypes, shapes)]
        works = [dist.broadcast(w, src=0, group=pg, async_op=True) for w in weights]
        for work in works:
            work.wait()
        conn.send([(n, w.cpu()) for n, w in zip(names, weights)])
    dist.destroy_process_group(pg)
