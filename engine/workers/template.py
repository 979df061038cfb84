"""What actor, critic, reference and reward model share around their heads: a forward-only pass
gathered into per-row tensors on every rank, and the epoch / mini-batch / optimizer-step loop of
an update, with the two guards every update needs:

* non-finite gradients skip the optimizer step on every rank together (`optimizer_step`), and
  the loop counts the skipped steps;
* an out-of-memory in a micro-batch (agreed on by every rank in parallel.schedule) retries the
  mini-batch with half the micro-batch (or half the token budget; below one sequence, dynamic
  batching gives way to micro-batches of half the rows), up to `oom_retries` times; the size
  that worked is kept for the next steps (`worker.split`).

Tests: tests/test_ppo_update.py, tests/test_dp_invariance.py, tests/test_faults.py,
tests/test_balance_batch.py, tests/test_sft.py
"""
from collections import defaultdict

import torch

from engine.algorithms.losses import LossNormaliser
from parallel.schedule import MicroBatchOOM


def forward_rows(worker, batch, head, keys, widths, micro_batch_size=None, max_tokens=None):
    """Run `batch` forward only; `head(output, mb)` returns a dict with 'rows' and a CPU tensor
    per key of `keys`, [rows, widths[key]] (or [rows] for width None). Returns {key: [B, ...]}
    on every rank (the last pipeline stage computes them, the others receive them)."""
    for c in worker.chunks:
        c.eval()
    micro = worker.micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)

    def loss_head(output, mb):
        info = head(output, mb)
        return output.reshape(-1)[:1].sum() * 0.0, info

    infos = worker.run(micro, loss_head, forward_only=True)
    out = {}
    for key in keys:
        shape = (len(batch),) if widths.get(key) is None else (len(batch), widths[key])
        full = None
        if worker.is_last_stage:
            full = torch.zeros(shape)
            for info in infos:
                full[info["rows"]] = info[key]
        out[key] = worker.broadcast_from_last_stage(full, shape)
    return out


def _halved(worker, mini, split):
    micro, tokens = split
    if tokens is not None:
        longest = int(mini["attention_mask"].sum(-1).max())
        if tokens // 2 >= longest:
            return None, tokens // 2
        rows = max(len(g) for g in worker.micro_groups(mini, None, tokens))
        return max(1, rows // 2), None  # dynamic batching off: half the largest micro-batch
    if micro > 1:
        return micro // 2, None
    raise RuntimeError(f"{worker.name}: out of memory with micro-batches of one sequence; lower "
                       "data.max_response_length or raise the model's parallelism (TP / PP / CP)")


def mini_batch_layout(n, size):
    """(m, strided): a rank's n rows make m mini-batches of `size` rows; strided (mini_batch_rows):
    runs of m consecutive rows give one row each to every mini-batch, else contiguous chunks."""
    size = size or n
    m = -(-n // size)
    return m, not n % size and m > 1


def mini_batch_rows(n, size, *, epoch=0, shuffle=False, seed=0, positions=None):
    """This DP rank's rows (of its n) in each mini-batch of `size` rows per rank, such that
    mini-batch k holds the same rows of the global batch at every DP size.

    The global batch is split over DP ranks in contiguous shards, so contiguous local chunks
    would put other global rows together at DP 2 than at DP 1. Instead, with m = n / size
    mini-batches, each run of m consecutive global rows gives one row to every mini-batch
    (a rank's n rows are whole runs): by position, or with `shuffle` by the order of keys drawn
    for every global row from (seed + epoch). n not a multiple of size: contiguous chunks.
    `positions`: the global rows whose keys order this rank's rows (default its contiguous
    shard; trainer.balance_batch moves whole runs between ranks and keeps their rows')."""
    m, strided = mini_batch_layout(n, size)
    size = size or n
    if not strided:
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    order = torch.arange(n).view(size, m)  # [run, place in run]
    if shuffle:
        from megatron.core import parallel_state as ps
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        keys = torch.rand(dp * n, generator=torch.Generator().manual_seed(seed + epoch))
        mine = keys[rank * n:(rank + 1) * n] if positions is None else keys[torch.as_tensor(positions).cpu()]
        order = order.gather(1, mine.view(size, m).argsort(dim=1))
    return [order[:, k].tolist() for k in range(m)]


def train_epochs(worker, batch, loss_head, reduce, *, epochs, mini_size, response_length,
                 micro_batch_size=None, max_tokens=None, order_seed=None, oom_retries=0):
    """`epochs` passes over `batch` in mini-batches of `mini_size` rows; one optimizer step each.
    `norm` (a LossNormaliser) counts the tokens trained on (`response_mask`) over the mini-batch
    on all DP ranks.

    loss_head(output, mb, mini, norm) -> (loss, info); reduce(infos) -> {metric: float} of one
    mini-batch. Returns the metrics averaged over the optimizer steps taken, plus
    '<name>/grad_norm', '<name>/lr', '<name>/skipped_updates' (non-finite, summed) and
    '<name>/oom_retries'."""
    from megatron.core import parallel_state as ps

    from engine.workers.base import global_counts
    split = (micro_batch_size, max_tokens)
    if worker.split is not None:  # an earlier out-of-memory settled on a smaller size
        split = worker.split
    history, skipped, retries = defaultdict(list), 0, 0
    n = len(batch)
    for epoch in range(epochs):
        for rows in mini_batch_rows(n, mini_size, epoch=epoch, shuffle=order_seed is not None,
                                    seed=order_seed or 0, positions=batch["step_row"] if "step_row" in batch else None):
            mini = batch.index_select(rows)
            norm = global_counts(LossNormaliser.from_mask(mini["response_mask"], response_length),
                                 ps.get_data_parallel_group())
            while True:
                worker.zero_grad()
                try:
                    micro = worker.micro_batches(mini, micro_batch_size=split[0], max_tokens=split[1])
                    infos = worker.run(micro, lambda out, mb: loss_head(out, mb, mini, norm),
                                       forward_only=False, agree_on_oom=oom_retries > 0)
                    break
                except MicroBatchOOM:
                    if retries >= oom_retries:
                        raise
                    retries += 1
                    worker.free_memory()
                    split = _halved(worker, mini, split)
                    worker.split = split
                    worker.log(f"out of memory in a micro-batch: retrying with "
                               f"{'micro-batches of %d sequences' % split[0] if split[0] else '%d tokens' % split[1]}")
            grad_norm, lr, applied = worker.optimizer_step()
            for k, v in reduce(infos).items():
                history[k].append(v)
            if applied:
                history[f"{worker.name}/grad_norm"].append(grad_norm)
            skipped += not applied
            history[f"{worker.name}/lr"].append(lr)
    out = {k: sum(v) / len(v) for k, v in history.items()}
    out[f"{worker.name}/skipped_updates"] = float(skipped)
    out[f"{worker.name}/oom_retries"] = float(retries)
    return out
