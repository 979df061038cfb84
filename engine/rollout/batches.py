"""From the rollout to training: sampling parameters from the config, and the routed responses of
this DP replica's prompts laid out as a training Batch (verl's layout: prompt left-padded,
response right-padded).

Tests: tests/test_trainer_paths.py, tests/test_rollout_groups.py, tests/test_offline_ppo.py
"""
import torch

from engine.batch import Batch
from engine.data import left_pad
from engine.rollout.base import SamplingParams

VERSIONS = "rollout_versions"  # the batch key of each response token's policy version


def with_versions(share, versions):
    """`share` (RolloutOutput.share: responses, log-probs, routing, masks, stats) with `versions`
    (per response, the policy version of each token: engine/experience/staleness.py) sixth."""
    share = tuple(share) + (None,) * (5 - len(share))
    return share[:5] + (versions,)


def sampling_params(rollout_cfg, stop_token_ids, step, train=True, greedy=False):
    """Training sampling (a seed per step), validation sampling (`val_kwargs`), or greedy."""
    r = rollout_cfg
    if train and not greedy:
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.response_length, stop_token_ids=tuple(stop_token_ids),
                              seed=r.seed + 1000003 * step, do_sample=r.do_sample, ignore_eos=r.ignore_eos)
    v = r.val_kwargs
    return SamplingParams(n=1 if greedy else v.n, temperature=0.0 if greedy else v.temperature,
                          top_p=v.top_p, top_k=v.top_k, max_new_tokens=r.response_length,
                          stop_token_ids=tuple(stop_token_ids), seed=r.seed,
                          do_sample=False if greedy else v.do_sample)


def training_batch(prompts, got, rows, n, pad_id, prompt_length, response_length, raw_chat=False):
    """Batch of `rows` (this replica's prompt indices) x n samples from `got` (prompt index ->
    RolloutOutput.share: responses, log-probs, routed experts, loss masks, stats and, from a
    separate pool, per-token policy versions: `with_versions`), engine/rollout/group.py).
    `response_mask` is verl's: the tokens trained on (a multi-turn rollout's model
    tokens); `attention_mask` holds every valid token, observations included. `raw_chat`
    (data.return_raw_chat) keeps each row's prompt as written (chat messages or text)."""
    prompt_ids, prompt_mask = left_pad([prompts.input_ids[i] for i in rows for _ in range(n)],
                                       pad_id, prompt_length)
    resp_list = [got[i][0][j] for i in rows for j in range(n)]
    lp_list = [got[i][1][j] for i in rows for j in range(n)]
    # a multi-turn rollout's loss masks (1 = model token, 0 = observation); else every token's 1
    masks = [None if len(got[i]) < 4 or got[i][3] is None else got[i][3][j] for i in rows for j in range(n)]
    resp = torch.full((len(resp_list), response_length), pad_id, dtype=torch.long)
    valid = torch.zeros(len(resp_list), response_length, dtype=torch.long)
    rmask = torch.zeros(len(resp_list), response_length, dtype=torch.long)
    rlp = torch.zeros(len(resp_list), response_length)
    for k, (t, lp, m) in enumerate(zip(resp_list, lp_list, masks)):
        t = t[:response_length]
        resp[k, :len(t)] = torch.tensor(t, dtype=torch.long)
        valid[k, :len(t)] = 1
        rmask[k, :len(t)] = 1 if m is None else torch.tensor(m[:response_length], dtype=torch.long)
        rlp[k, :len(t)] = torch.tensor(lp[:response_length])
    extra = {}
    if any(got[i][2] is not None for i in rows):  # MoE routing recorded for actor.router_replay
        extra["routed_experts"] = [got[i][2][j] for i in rows for j in range(n)]
    if any(len(got[i]) > 4 and got[i][4] is not None for i in rows):  # multi-turn: per trajectory
        extra["multi_turn"] = [got[i][4][j] for i in rows for j in range(n)]
    tensors = {}
    if any(len(got[i]) > 5 and got[i][5] is not None for i in rows):  # a pool's token versions
        versions = torch.full((len(resp_list), response_length), -1, dtype=torch.long)
        for k, v in enumerate(got[i][5][j] for i in rows for j in range(n)):
            v = v[:response_length]
            versions[k, :len(v)] = torch.tensor(v, dtype=torch.long)
        tensors[VERSIONS] = versions
    if raw_chat:
        extra["raw_prompt"] = [prompts.raw_prompts[i] for i in rows for _ in range(n)]
    return Batch(
        tensors=dict(input_ids=torch.cat([prompt_ids, resp], 1),
                     attention_mask=torch.cat([prompt_mask, valid], 1),
                     responses=resp, response_mask=rmask, rollout_log_probs=rlp, prompt_mask=prompt_mask,
                     **tensors),
        non_tensors=dict(
            uid=[prompts.indices[i] for i in rows for _ in range(n)],
            ground_truth=[prompts.ground_truths[i] for i in rows for _ in range(n)],
            data_source=[prompts.data_sources[i] for i in rows for _ in range(n)],
            extra_info=[prompts.extra_infos[i] for i in rows for _ in range(n)], **extra))
