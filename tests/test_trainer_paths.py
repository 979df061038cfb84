"""Trainer paths no other test drives, each through the real trainer on 2 CPU ranks and checked
against an independent reference written here:

* REINFORCE++, REINFORCE++-baseline, ReMax: the advantages the actor update receives equal the
  written formula applied to rewards this file computes itself (its own reward function), over
  the global batch (whitening across both DP ranks); ReMax's greedy baseline rollout happens
  (the engine gets a second, greedy request for the same prompts) and its reward is subtracted.
* ppo_epochs=2: the update equals two full-batch steps of the written PPO loss with torch's
  AdamW on the transformers model (one process), and differs from one step.
* trainer.profile_comm: seconds blocked in collectives, per phase, including the ones Megatron
  issues from names bound at its import (its gradient reduce, the distributed optimizer's
  gather) and without turning asynchronous collectives synchronous.
"""
import math
import os

import pytest
import torch

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
N = 2  # responses per prompt
BASE = ["data.train_batch_size=8", f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.temperature=0.8",
        f"custom_reward_function.path={os.path.abspath(__file__)}",
        "custom_reward_function.name=compute_score"]
CAPTURED = ("input_ids", "attention_mask", "responses", "response_mask", "token_level_scores",
            "token_level_rewards", "advantages", "old_log_probs", "ref_log_prob")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The run's reward (custom_reward_function): spread over [-1.5, 1.5] by the text, so that
    advantages are neither all zero nor all equal on an untrained model."""
    return ((sum(map(ord, solution_str)) * 7919) % 13) / 4.0 - 1.5


def _trainer(overrides, tmp):
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed
    world = dist.get_world_size()
    cfg = load_config(DEMO, [f"trainer.n_gpus_per_node={world}", "trainer.logger=[]",
                             "trainer.test_freq=-1", "trainer.save_freq=-1",
                             "trainer.resume_mode=disable", f"trainer.default_local_dir={tmp}/ckpt",
                             f"trainer.log_dir={tmp}/logs/{dist.get_rank()}", *BASE, *overrides])
    set_seed(cfg.trainer.seed)
    return Trainer(*build(cfg, world))


def _spy_update(t, before=None):
    """Record the batch the actor update receives (and call `before()` first)."""
    seen = {}
    update = t.actor.update_policy

    def spy(batch, **kw):
        if before is not None:
            before()
        seen.update({k: batch[k].clone() for k in CAPTURED if k in batch})
        seen["uid"] = list(batch["uid"])
        return update(batch, **kw)
    t.actor.update_policy = spy
    return seen


def _spy_generate(t):
    """Record every request the rollout engine gets: (prompts, sampling, responses)."""
    calls = []
    generate = t.ctx.run_engine

    def spy(engine, prompt_ids, sampling, keys):
        out = generate(engine, prompt_ids, sampling, keys)
        calls.append(dict(prompts=[list(p) for p in prompt_ids], n=sampling.n,
                          greedy=sampling.greedy, temperature=sampling.temperature,
                          responses=[list(r) for r in out.responses]))
        return out
    t.ctx.run_engine = spy
    return calls


def _finish(t):
    t.colocated.to_training()
    t.rollout.shutdown()


def _estimator_step(estimator, tmp, overrides=()):
    from megatron.core import parallel_state as ps
    t = _trainer([f"algorithm.adv_estimator={estimator}", *overrides], tmp)
    seen, calls = _spy_update(t), _spy_generate(t)
    metrics = t.train_step(t.loader.next_batch())
    _finish(t)
    return dict(dp_rank=ps.get_data_parallel_rank(), seen=seen, calls=calls, metrics=metrics)


def _global(results):
    """The DP ranks' captured rows concatenated in DP-rank order (the step's prompt order)."""
    ranks = sorted(results, key=lambda r: r["dp_rank"])
    out = {k: torch.cat([r["seen"][k] for r in ranks]) for k in ranks[0]["seen"] if k != "uid"}
    out["uid"] = [u for r in ranks for u in r["seen"]["uid"]]
    return out


# -- an independent reference: the rewards and the written formulas -----------------------------

def _texts(responses, mask):
    from engine.tasks import build_tokenizer
    tok = build_tokenizer()
    rows = []
    for ids, m in zip(responses, mask):
        row = ids[m.bool()].tolist()
        rows.append(row[:-1] if row and row[-1] == tok.eos_token_id else row)
    return tok.batch_decode(rows, skip_special_tokens=False)


def _scores(responses, mask):
    return torch.tensor([compute_score("arith", s, None) for s in _texts(responses, mask)],
                        dtype=torch.float64)


def _check_scores(g):
    """The trainer's token-level scores are this file's reward on each row's last valid token."""
    mask = g["response_mask"]
    scores = _scores(g["responses"], mask)
    last = mask.cumsum(-1).argmax(-1)  # the first position holding the full count
    want = torch.zeros(mask.shape, dtype=torch.float64)
    want[torch.arange(len(mask)), last] = scores
    torch.testing.assert_close(g["token_level_scores"].double(), want, rtol=0, atol=1e-6)
    assert len(set(scores.tolist())) > 2, "degenerate rewards: the check would prove little"
    return scores


def _whiten(x, mask):
    """(x - mean) / sqrt(unbiased var + 1e-8) over the valid tokens of the whole batch."""
    vals = [float(x[i, j]) for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return ((x - mean) / math.sqrt(var + 1e-8)) * mask


def _discounted(rewards, mask, gamma):
    out = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = 0.0
        for j in reversed(range(rewards.shape[1])):
            if mask[i, j]:
                running = float(rewards[i, j]) + gamma * running
                out[i, j] = running
    return out


def test_reinforce_plus_plus_trains_on_whitened_discounted_returns(tmp_path):
    gamma = 0.7
    g = _global(run_on_ranks(_estimator_step, 2, "reinforce_plus_plus", str(tmp_path),
                             [f"algorithm.gamma={gamma}"]))
    mask = g["response_mask"].double()
    _check_scores(g)
    rewards = g["token_level_rewards"].double()  # no KL in the reward: the scores themselves
    torch.testing.assert_close(rewards, g["token_level_scores"].double())
    assert (mask.sum(-1) > 1).any(), "no response longer than one token: gamma would not act"
    want = _whiten(_discounted(rewards, mask, gamma), mask)
    torch.testing.assert_close(g["advantages"].double(), want, rtol=0, atol=1e-5)


def test_reinforce_plus_plus_baseline_trains_on_whitened_group_centred_scores(tmp_path):
    g = _global(run_on_ranks(_estimator_step, 2, "reinforce_plus_plus_baseline", str(tmp_path)))
    mask = g["response_mask"].double()
    scores = _check_scores(g)
    uids = g["uid"]
    assert len(set(uids)) == len(uids) // N
    centred = torch.stack([scores[i] - scores[[k for k, u in enumerate(uids) if u == uids[i]]].mean()
                           for i in range(len(uids))])
    want = _whiten(centred[:, None] * mask, mask)
    torch.testing.assert_close(g["advantages"].double(), want, rtol=0, atol=1e-5)


def test_remax_subtracts_the_reward_of_a_greedy_rollout(tmp_path):
    results = run_on_ranks(_estimator_step, 2, "remax", str(tmp_path))
    g = _global(results)
    greedy = {}
    for r in results:
        # the sampled request, then the greedy baseline: the same prompts, one response each
        sampled, base = r["calls"]
        assert (sampled["n"], sampled["greedy"], sampled["temperature"]) == (N, False, 0.8)
        assert (base["n"], base["greedy"]) == (1, True)
        assert base["prompts"] == sampled["prompts"] and len(base["responses"]) == len(base["prompts"])
        greedy.update({tuple(p): resp for p, resp in zip(base["prompts"], base["responses"])})
    mask = g["response_mask"].double()
    scores = _check_scores(g)
    P = g["input_ids"].shape[1] - g["responses"].shape[1]
    prompts = [tuple(ids[:P][a[:P].bool()].tolist()) for ids, a in zip(g["input_ids"], g["attention_mask"])]
    base_resp = [torch.tensor(greedy[p]) for p in prompts]
    baselines = torch.stack([_scores(r[None], torch.ones(1, len(r)))[0] for r in base_resp])
    assert not torch.equal(baselines, torch.zeros_like(baselines))
    want = (scores - baselines)[:, None] * mask  # one outcome reward: the return-to-go is the score
    torch.testing.assert_close(g["advantages"].double(), want, rtol=0, atol=1e-6)


# -- ppo_epochs: two full-batch steps of the written loss, torch's AdamW, transformers -----------

CLIP_LOW, CLIP_HIGH, CLIP_C, KL_COEF, ENT_COEF, TEMP = 0.15, 0.25, 3.0, 0.05, 0.01, 0.8
LR, BETAS, EPS, WD, CLIP_GRAD = 4e-3, (0.8, 0.95), 1e-4, 0.1, 0.5
EPOCHS = [f"actor_rollout_ref.actor.{k}" for k in (
    "ppo_epochs=2", f"clip_ratio_low={CLIP_LOW}", f"clip_ratio_high={CLIP_HIGH}",
    f"clip_ratio_c={CLIP_C}", "use_kl_loss=true", "kl_loss_type=low_var_kl",
    f"kl_loss_coef={KL_COEF}", f"entropy_coeff={ENT_COEF}", f"optim.lr={LR}",
    f"optim.betas=[{BETAS[0]},{BETAS[1]}]", f"optim.eps={EPS}", f"optim.weight_decay={WD}",
    f"optim.clip_grad={CLIP_GRAD}", "optim.lr_warmup_steps=0")]


def _epochs_step(tmp):
    from megatron.core import parallel_state as ps

    from engine.models.hf_io import save_hf_weights
    t = _trainer(EPOCHS, tmp)
    seen = _spy_update(t, before=lambda: save_hf_weights(t.actor.chunks, t.hf_config, f"{tmp}/before"))
    metrics = t.train_step(t.loader.next_batch())
    save_hf_weights(t.actor.chunks, t.hf_config, f"{tmp}/after")
    steps = t.actor.scheduler.num_steps
    _finish(t)
    return dict(dp_rank=ps.get_data_parallel_rank(), seen=seen, metrics=metrics, scheduler_steps=steps)


def _row_outputs(model, g):
    """Per row: log-probs of its response tokens at temperature TEMP and the entropies there,
    from the row's valid tokens alone (no padding reaches the model)."""
    R = g["responses"].shape[1]
    logps, ents = torch.zeros(g["responses"].shape), torch.zeros(g["responses"].shape)
    for i, (ids, attn) in enumerate(zip(g["input_ids"], g["attention_mask"])):
        n = int(g["response_mask"][i].sum())
        prompt = ids[:-R][attn[:-R].bool()]
        seq = torch.cat([prompt, g["responses"][i, :n]])
        logits = model(seq[None]).logits[0, len(prompt) - 1:len(seq) - 1] / TEMP
        lp = torch.log_softmax(logits.float(), -1)
        logps[i, :n] = lp.gather(-1, seq[len(prompt):, None])[:, 0]
        ents[i, :n] = -(lp.exp() * lp).sum(-1)
    return logps, ents


def _written_loss(logp, ent, old, ref, adv, mask):
    """PPO clip (clip-higher, dual-clip), minus the entropy bonus, plus low_var_kl (k3, clamped
    to +-10), each a mean over every valid token of the mini-batch (token-mean)."""
    ratio = torch.exp(torch.clamp(logp - old, -20, 20))
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * CLIP_C), pg)
    log_r = torch.clamp(ref - logp, -20, 20)
    kl = torch.clamp(torch.exp(log_r) - log_r - 1, -10, 10)
    count = mask.sum()
    pg_loss = (pg * mask).sum() / count
    return (pg_loss - ENT_COEF * (ent * mask).sum() / count + KL_COEF * (kl * mask).sum() / count,
            pg_loss)


def _reference_update(before_dir, g, epochs):
    """`epochs` optimizer steps on the whole batch (one mini-batch): the written loss, global
    gradient clipping, AdamW with decay on matrices only (Megatron: none on norms and biases)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(before_dir, torch_dtype=torch.float32)
    mask = g["response_mask"].float()
    with torch.no_grad():
        old, _ = _row_outputs(model, g)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    rest = [p for n, p in model.named_parameters() if not (p.dim() > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=WD), dict(params=rest, weight_decay=0.0)],
                            lr=LR, betas=BETAS, eps=EPS)
    norms, pg_losses = [], []
    for _ in range(epochs):
        opt.zero_grad()
        logp, ent = _row_outputs(model, g)
        loss, pg_loss = _written_loss(logp, ent, old, old, g["advantages"].float(), mask)
        ratios = torch.exp(logp.detach() - old)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)))
        pg_losses.append(float(pg_loss.detach()))
        opt.step()
    return old, {n: p.detach() for n, p in model.state_dict().items()}, norms, pg_losses, ratios


def _hf_weights(path):
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def test_two_ppo_epochs_are_two_steps_of_the_written_loss(tmp_path):
    results = run_on_ranks(_epochs_step, 2, str(tmp_path))
    g, metrics = _global(results), results[0]["metrics"]
    assert [r["scheduler_steps"] for r in results] == [2, 2]  # one optimizer step per epoch
    before, after = _hf_weights(tmp_path / "before"), _hf_weights(tmp_path / "after")
    old, two, norms, pg_losses, ratios = _reference_update(str(tmp_path / "before"), g, epochs=2)
    _, one, _, _, _ = _reference_update(str(tmp_path / "before"), g, epochs=1)
    # the trainer's own old-log-prob and reference passes saw the weights the reference starts from
    torch.testing.assert_close(g["old_log_probs"], old, rtol=0, atol=2e-5)
    torch.testing.assert_close(g["ref_log_prob"], old, rtol=0, atol=2e-5)
    worst = {n: float((after[n] - two[n]).abs().max()) for n in after}
    moved = {n: float((after[n] - before[n]).abs().max()) for n in after}
    from_one = max(float((after[n] - one[n]).abs().max()) for n in after)
    assert max(worst.values()) < 5e-6, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert min(moved.values()) > 1e-4 and from_one > 100 * max(worst.values())
    # the second epoch's ratios fall where each clip bound decides (so a swapped or ignored
    # bound changes the update): A > 0 between 1 + low and 1 + high, A < 0 between 1 - high and 1 - low
    adv, valid = g["advantages"], g["response_mask"].bool()
    high = valid & (adv > 0) & (ratios > 1 + CLIP_LOW) & (ratios < 1 + CLIP_HIGH)
    low = valid & (adv < 0) & (ratios > 1 - CLIP_HIGH) & (ratios < 1 - CLIP_LOW)
    assert high.any() and low.any(), (int(high.sum()), int(low.sum()))
    # the metrics are means over the two optimizer steps
    assert metrics["actor/grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-4)
    assert metrics["actor/pg_loss"] == pytest.approx(sum(pg_losses) / 2, rel=1e-4, abs=1e-6)
    assert min(norms) > CLIP_GRAD  # clipping acted in both steps


# -- trainer.profile_comm -----------------------------------------------------------------------

DELAY = 1.0  # seconds rank 1 spends before it joins a collective rank 0 already waits in


def _async_collective_timed():
    import time

    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as megatron_buffers

    from engine.perf import CommTimer
    originals = (dist.all_reduce, megatron_buffers.dist_reduce_scatter_func,
                 megatron_buffers._coalescing_manager)
    timer = CommTimer().install()
    try:
        patched = (dist.all_reduce is not originals[0],
                   megatron_buffers.dist_reduce_scatter_func is not originals[1],
                   megatron_buffers._coalescing_manager is not originals[2])
        timer.phase = "update_actor"
        if dist.get_rank() == 1:
            time.sleep(DELAY)
        t0 = time.perf_counter()
        work = dist.all_reduce(torch.ones(4), async_op=True)
        issued = time.perf_counter() - t0
        work.wait()
        with megatron_buffers._coalescing_manager(None, async_ops=False):
            if dist.get_rank() == 1:
                time.sleep(DELAY)
            dist.all_reduce(torch.ones(4))  # queued: it runs (and blocks) as the block ends
    finally:
        timer.uninstall()
    restored = (dist.all_reduce, megatron_buffers.dist_reduce_scatter_func,
                megatron_buffers._coalescing_manager) == originals
    return dict(issued=issued, seconds=dict(timer.seconds), calls=timer.calls, patched=patched,
                restored=restored)


def test_comm_timer_keeps_async_collectives_async_and_times_their_wait():
    first, second = run_on_ranks(_async_collective_timed, 2)
    for r in (first, second):
        assert r["patched"] == (True, True, True) and r["restored"]
        assert r["calls"] == {"update_actor": {"all_reduce": 2}}
    # rank 0 waited for rank 1 twice: in the async handle's wait(), then at the coalesced block's end
    assert first["issued"] < 0.3 * DELAY  # issuing an async collective does not block
    assert first["seconds"]["update_actor"] >= 1.8 * DELAY
    assert second["seconds"]["update_actor"] < DELAY


def _profiled_step(tmp):
    import time

    import torch.distributed as dist
    t = _trainer(["trainer.profile_comm=true",
                  "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true"], tmp)
    loss, delayed = t.actor._policy_loss, []

    def late_loss(*args, **kwargs):  # rank 1 reaches the gradient reduce DELAY late
        if dist.get_rank() == 1 and not delayed:
            delayed.append(True)
            time.sleep(DELAY)
        return loss(*args, **kwargs)
    t.actor._policy_loss = late_loss
    try:
        metrics = t.train_step(t.loader.next_batch())
        calls = {phase: dict(ops) for phase, ops in t.comm.calls.items()}
    finally:
        t.comm.uninstall()
        _finish(t)
    return dict(metrics=metrics, calls=calls)


def test_profile_comm_reports_time_blocked_in_each_phase(tmp_path):
    first, second = run_on_ranks(_profiled_step, 2, str(tmp_path))
    m0, m1 = first["metrics"], second["metrics"]
    # rank 0 waits for rank 1 in the gradient reduce-scatter Megatron issues (from its own alias
    # of torch's function, in a coalescing block): counted as the update's blocked time
    assert m0["perf/comm_s/update_actor"] >= 0.8 * DELAY, m0["perf/comm_s/update_actor"]
    assert m1["perf/comm_s/update_actor"] < m0["perf/comm_s/update_actor"] - 0.5 * DELAY
    for r in (first, second):
        update = r["calls"]["update_actor"]
        assert update.get("reduce_scatter_tensor", 0) + update.get("_reduce_scatter_base", 0) >= 1
        assert update.get("all_gather_into_tensor", 0) + update.get("_all_gather_base", 0) >= 1
        assert update.get("all_reduce", 0) >= 1  # loss counts, metrics, the grad norm
        # outside every phase: the step's metrics reduced over DP
        assert r["calls"]["other"].get("all_reduce", 0) >= 1
        for key, blocked in r["metrics"].items():
            if key.startswith("perf/comm_s/") and key != "perf/comm_s/other":
                phase = key[len("perf/comm_s/"):]
                assert 0 <= blocked <= r["metrics"][f"timing_s/{phase}"] + 1e-3, key
