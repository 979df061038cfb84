"""Validation: the held-out prompts through the rollout engines (each group's leader generates
its share), scored by the rule rewards, averaged per data source over the whole set.

`data.val_batch_size` prompts at a time (null: all at once), so a large validation set does not
ask the rollout for more sequences than it holds.

Tests: tests/test_e2e.py, tests/test_config_acts.py, tests/test_rollout_pool.py
"""
from collections import defaultdict

import torch
import torch.distributed as dist


def answers(out):
    """What a rule reward reads of each response: the whole response, or a multi-turn
    trajectory's last model turn (engine/rollout/multi_turn.py last_turn_mask, as in training)."""
    masks = getattr(out, "loss_masks", None)
    if not masks:
        return out.responses
    from engine.rollout.multi_turn import last_turn_mask
    last = [last_turn_mask(torch.tensor([m], dtype=torch.long))[0].tolist() if m else [] for m in masks]
    return [[t for t, keep in zip(r, mask) if keep] for r, mask in zip(out.responses, last)]


def validate(rollout, val_data, tokenizer, reward_fn, sampling, eos_ids, batch_size=None, generate=None):
    """{'val/<source>/score/mean': ..., 'val/score/mean': ...}; collective over all ranks.

    rollout: engine.rollout.group.GroupedRollout with the current weights loaded.
    """
    n = len(val_data)
    rows = [val_data[i] for i in range(n)]
    size = batch_size or n
    sums = defaultdict(lambda: [0.0, 0])  # data source -> [score sum, count] on this leader
    for start in range(0, n, size):
        chunk = rows[start:start + size]
        mine, out = rollout.generate_split([r["input_ids"] for r in chunk],
                                           list(range(start, start + len(chunk))), sampling, generate=generate)
        if out is None:
            continue
        texts = tokenizer.batch_decode([r[:-1] if r and r[-1] in eos_ids else r for r in answers(out)],
                                       skip_special_tokens=reward_fn.skip_special_tokens)
        for j, text in enumerate(texts):
            row = chunk[mine[j // sampling.n]]
            s = reward_fn.score_texts([text], [row["ground_truth"]], [row["data_source"]])[0]
            sums[row["data_source"]][0] += float(s["score"] if isinstance(s, dict) else s)
            sums[row["data_source"]][1] += 1
    return _gather(sums)


def _gather(sums):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(sums))  # a few numbers per rank
    total = defaultdict(lambda: [0.0, 0])
    for part in gathered:
        for source, (value, count) in part.items():
            total[source][0] += value
            total[source][1] += count
    metrics = {f"val/{src}/score/mean": v / c for src, (v, c) in total.items()}
    metrics["val/score/mean"] = sum(v for v, _ in total.values()) / max(1, sum(c for _, c in total.values()))
    return metrics


def validate_from(responses, val_data, tokenizer, reward_fn, eos_ids):
    """The same metrics from responses generated elsewhere (a separate rollout pool hands them to
    training rank 0: per prompt, the list of its val_kwargs.n responses; None on the other
    ranks); collective over the training ranks."""
    sums = defaultdict(lambda: [0.0, 0])
    if responses is not None:
        owners = [i for i, group in enumerate(responses) for _ in group]  # prompt of each response
        flat = [r for group in responses for r in group]
        texts = tokenizer.batch_decode([r[:-1] if r and r[-1] in eos_ids else r for r in flat],
                                       skip_special_tokens=reward_fn.skip_special_tokens)
        for i, text in zip(owners, texts):
            row = val_data[i]
            s = reward_fn.score_texts([text], [row["ground_truth"]], [row["data_source"]])[0]
            sums[row["data_source"]][0] += float(s["score"] if isinstance(s, dict) else s)
            sums[row["data_source"]][1] += 1
    return _gather(sums)
