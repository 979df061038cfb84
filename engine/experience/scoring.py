"""Rewards scored once per model-parallel replica.

The ranks sharing a DP index (TP x PP x CP) hold the same samples. A rule, custom function or
sandbox runs on the replica's first rank only and its result is broadcast in the replica's
group: a non-deterministic scorer (wall-clock sandbox, LLM judge, a random custom function)
cannot give ranks holding the same data different rewards, and the sandbox runs once per
sample, not TP x PP x CP times. The reward model's forward is model-parallel itself and runs
on every rank (its scores arrive here as `model_scores`).

Tests: tests/test_replica_scoring.py, tests/test_trainer_paths.py
"""
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from engine.metrics import reduce_over_dp
from engine.rollout.multi_turn import last_turn_mask

REWARD_EXTRAS = ("rule_score", "model_score", "overlong_reward", "overlong", "environment_reward")


def replica_groups(rank: int, world: int, dp_rank: int):
    """(global ranks of each DP replica, this replica's gloo group or None when it is one rank);
    collective over all ranks."""
    from engine.rollout.topology import replicas_of
    every = [None] * world
    dist.all_gather_object(every, dp_rank)
    replicas, mine = replicas_of(every), None
    for ranks in replicas:
        group = dist.new_group(list(ranks), backend="gloo") if len(ranks) > 1 else None
        if rank in ranks:
            mine = group
    return replicas, mine


def score_batch(reward_fn, batch, model_scores, rule_reward: bool):
    """(token_level_scores, reward extras) of this rank's samples, scored here."""
    extra_infos = list(batch["extra_info"])
    if "raw_prompt" in batch:  # data.return_raw_chat: reward functions see the prompt as written
        extra_infos = [dict(e or {}, raw_prompt=p) for e, p in zip(extra_infos, batch["raw_prompt"])]
    mask = batch["response_mask"]
    if "multi_turn" in batch:  # rule rewards read the answer: the trajectory's last model turn
        mask = last_turn_mask(mask)
    scores, extra = reward_fn(batch["responses"], mask,
                              ground_truths=list(batch["ground_truth"]) if rule_reward else None,
                              data_sources=list(batch["data_source"]),
                              extra_infos=extra_infos, model_scores=model_scores)
    if "multi_turn" in batch:  # an interaction's reward (engine/rollout/tool_actor.py), summed over
        # its turns, joins the trajectory's score on its last model token
        from engine.rewards.manager import last_token_index
        env = torch.tensor([float(s.get("reward", 0.0)) for s in batch["multi_turn"]], dtype=scores.dtype)
        scores[torch.arange(len(env)), last_token_index(batch["response_mask"].cpu())] += env.to(scores.device)
        extra = dict(extra, environment_reward=env.tolist())
    return scores, extra


def score_once_per_replica(reward_fn, batch, model_scores, rule_reward: bool, rank: int,
                           leader: int, group: Optional[object]):
    """score_batch on the replica's `leader`, broadcast to the rest of its `group` (None: this
    rank is its replica). A scorer's error reaches every rank of the replica, so none is left
    waiting for a result that never comes."""
    if group is None:
        return score_batch(reward_fn, batch, model_scores, rule_reward)
    box = [None]
    if rank == leader:
        try:
            scores, extra = score_batch(reward_fn, batch, model_scores, rule_reward)
            box = [("ok", scores.cpu(), extra)]
        except Exception as e:
            box = [("error", f"{type(e).__name__}: {e}", None)]
            dist.broadcast_object_list(box, src=leader, group=group)
            raise
    dist.broadcast_object_list(box, src=leader, group=group)
    kind, scores, extra = box[0]
    if kind == "error":
        raise RuntimeError(f"reward scoring failed on rank {leader} (this replica's scorer): {scores}")
    return scores.to(batch["responses"].device), extra


REMOTE_SUMS = {"reward_remote/requests": "remote_requests", "reward_remote/failed_samples": "remote_failed"}


def reward_extra_metrics(extra: dict, dp: int) -> dict:
    """Means over the global batch of the reward extras every rank has (same config); with a
    reward service (engine/rewards/remote.py), its step totals and request latency
    (reward_remote/*: requests and failed samples summed over the replicas, latency_s/mean over
    the samples, latency_s/max)."""
    local = {f"reward_extra/{k}/mean": float(np.mean([float(v) for v in extra[k]]))
             for k in REWARD_EXTRAS if k in extra and len(extra[k])}
    remote = "remote_failed" in extra and len(extra["remote_failed"])
    if remote:  # sums travel as means over the DP shards (one per replica), times dp below
        local.update({name: float(np.sum([float(v) for v in extra[k]])) for name, k in REMOTE_SUMS.items()})
        latency = [float(v) for v in extra["remote_latency_s"]]
        local.update({"reward_remote/latency_s/mean": float(np.mean(latency)),
                      "reward_remote/latency_s/max": float(np.max(latency))})
    out = reduce_over_dp(local, dp) if local else {}
    for name in REMOTE_SUMS if remote else ():
        out[name] = float(round(out[name] * dp))
    return out
