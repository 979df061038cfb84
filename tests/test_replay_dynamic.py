"""Replay buffer + PF-PPO (algorithm.replay) and DAPO dynamic sampling (algorithm.filter_groups)
through the real trainer on 2 gloo ranks: each step's batch composition counted and checked
against what was generated (recorded at the trainer's own generate), the weights the update
uses against their formulas, balanced DP batches, and a run resumed from its checkpoint (replay
buffer in the trainer state) that ends where an uninterrupted one does."""
import json
import os

import pytest
import torch

from tests.multirank import run_on_ranks
from tests.test_offline_ppo import Recording

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
SMALL = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "trainer.test_freq=-1"]
REPLAY = ["algorithm.replay.enable=true", "algorithm.replay.capacity=2", "algorithm.replay.ratio=0.5",
          "algorithm.replay.filter=best_worst", "algorithm.replay.keep=0.5"]


def _trainer(overrides, tmp, logger="[]"):
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed
    cfg = load_config(DEMO, [f"trainer.default_local_dir={tmp}/ckpt", f"trainer.log_dir={tmp}/logs/{dist.get_rank()}",
                             f"trainer.logger={logger}", *SMALL, *overrides])
    set_seed(cfg.trainer.seed + dist.get_rank())
    derived, components = build(cfg, 2)
    return Trainer(derived, components)


def _record_generation(t):
    """The trainer's generate, keeping what it returned (a wrapper of the real method)."""
    generated, real = [], t.ctx.generate

    def generate(prompts, sampling, n=None):
        out = real(prompts, sampling, n=n)
        generated.append(out)
        return out
    t.ctx.generate = generate
    return generated


def _rows(batch):
    scores = batch["token_level_scores"].sum(-1).tolist()
    return [(u if not isinstance(u, tuple) else list(u), tuple(r[m.bool()].tolist()), s)
            for u, r, m, s in zip(batch["uid"], batch["responses"], batch["response_mask"], scores)]


def _replay_steps(tmp, steps):
    t = _trainer(REPLAY + ["algorithm.rollout_correction.rollout_is=token", "trainer.resume_mode=disable",
                           "trainer.save_freq=-1"], tmp)
    generated = _record_generation(t)
    t.experience = Recording(t.experience)
    out = []
    for _ in range(steps):
        m = t.train_step(t.loader.next_batch())
        t.step_count += 1
        _, batch = t.experience.batches[-1]
        from engine.algorithms.advantages import compute_advantage
        plain, _ = compute_advantage("grpo", token_level_rewards=batch["token_level_rewards"],
                                     response_mask=batch["response_mask"], group_index=list(batch["uid"]))
        out.append(dict(metrics=m, generated=_rows(generated[-1]), trained=_rows(batch),
                        advantages=batch["advantages"], plain=plain, old=batch["old_log_probs"],
                        behaviour=batch["rollout_log_probs"], mask=batch["response_mask"]))
    return out


def test_replay_and_pf_ppo_compose_the_batch_as_configured(tmp_path):
    ranks = run_on_ranks(_replay_steps, 2, str(tmp_path), 4)
    q, n, k = 4, 4, 2  # fresh groups per rank, rollout.n, kept per group (keep 0.5)
    for step in range(4):
        m = ranks[0][step]["metrics"]
        replayed_groups = 0 if step == 0 else 2  # round(0.5 x 4) once the buffer has any
        assert m["replay/fresh_samples"] == 2 * q * k and m["replay/filtered_samples"] == 2 * q * (n - k)
        assert m["replay/replayed_samples"] == 2 * replayed_groups * k
        assert m["replay/buffer_samples"] == 2 * min(step + 1, 2) * q * k  # capacity: 2 steps
        for rank, res in enumerate(ranks):
            trained, generated = res[step]["trained"], res[step]["generated"]
            assert len(trained) == (q + replayed_groups) * k  # the same on both DP ranks
            for g in range(q):  # the fresh groups: their best and their worst response
                group = sorted(generated[g * n:(g + 1) * n], key=lambda r: r[2])
                kept = sorted(trained[g * k:(g + 1) * k], key=lambda r: r[2])
                assert [r[2] for r in kept] == [group[0][2], group[-1][2]]
            earlier = {(r[1], r[2]) for s in range(max(0, step - 2), step) for r in res[s]["trained"][:q * k]}
            for r in trained[q * k:]:  # replayed: whole groups kept by one of the last 2 steps
                assert r[0][0] == "replay" and step - 2 <= r[0][1] < step and (r[1], r[2]) in earlier
        mean = sum(r[2] for res in ranks for r in res[step]["trained"][:q * k]) / (2 * q * k)
        assert m["replay/kept_score_mean"] == pytest.approx(mean)
        # truncated IS on every row (replayed ones from older policies): advantages x min(old / mu, 2)
        for res in ranks:
            s = res[step]
            w = torch.exp(s["old"] - s["behaviour"]).clamp(max=2.0) * s["mask"]
            torch.testing.assert_close(s["advantages"], s["plain"] * w, atol=1e-6, rtol=1e-5)
    assert ranks[0][3]["metrics"]["rollout_corr/ratio_mean"] != pytest.approx(1.0, abs=1e-3)


def _reweight_step(tmp):
    t = _trainer(["algorithm.replay.enable=true", "algorithm.replay.filter=reweight",
                  "algorithm.replay.weight_pow=2", "trainer.resume_mode=disable", "trainer.save_freq=-1"], tmp)
    t.experience = Recording(t.experience)
    m = t.train_step(t.loader.next_batch())
    _, batch = t.experience.batches[-1]
    from engine.algorithms.advantages import compute_advantage
    plain, _ = compute_advantage("grpo", token_level_rewards=batch["token_level_rewards"],
                                 response_mask=batch["response_mask"], group_index=list(batch["uid"]))
    return dict(metrics=m, scores=batch["token_level_scores"].sum(-1), adv=batch["advantages"], plain=plain)


def test_pf_ppo_reweight_scales_each_response_by_its_score(tmp_path):
    ranks = run_on_ranks(_reweight_step, 2, str(tmp_path))
    scores = torch.cat([r["scores"] for r in ranks]).double()
    w = scores.abs() ** 2
    w = w * len(w) / w.sum()  # mean 1 over both ranks' responses
    for i, r in enumerate(ranks):
        mine = w[i * len(r["scores"]):(i + 1) * len(r["scores"])]
        torch.testing.assert_close(r["adv"], r["plain"] * mine[:, None].float(), atol=1e-6, rtol=1e-5)
    assert ranks[0]["metrics"]["replay/weight_max"] == pytest.approx(float(w.max()))
    assert ranks[0]["metrics"]["replay/replayed_samples"] == 0


REWARD = '''
import torch.distributed as dist
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # rank 0's prompts always score the same (dropped), so rank 1 must lend it groups; on rank 1
    # every third prompt scores the same too, the rest by the parity of the answer's length
    if dist.get_rank() == 0 or extra_info["index"] % 3 == 0:
        return 0.5
    return float(len(solution_str) % 2)
'''


def _dynamic_steps(tmp, steps):
    with open(f"{tmp}/reward.py", "w") as f:
        f.write(REWARD)
    t = _trainer(["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=12",
                  f"custom_reward_function.path={tmp}/reward.py", "trainer.resume_mode=disable",
                  "trainer.save_freq=-1"], tmp)
    generated = _record_generation(t)
    t.experience = Recording(t.experience)
    out = []
    for _ in range(steps):
        before = len(generated)
        m = t.train_step(t.loader.next_batch())
        t.step_count += 1
        out.append(dict(metrics=m, generated=[_rows(b) for b in generated[before:]],
                        trained=_rows(t.experience.batches[-1][1])))
    t.cfg.algorithm.filter_groups.max_num_gen_batches = 1  # rank 0 alone can never fill the batch
    with pytest.raises(ValueError) as err:
        t.train_step(t.loader.next_batch())
    out.append(str(err.value))
    return out


def test_dynamic_sampling_fills_balanced_batches_of_informative_groups(tmp_path):
    ranks = run_on_ranks(_dynamic_steps, 2, str(tmp_path), 2)
    q, n = 4, 4
    for step in range(2):
        m = ranks[0][step]["metrics"]
        tries = len(ranks[0][step]["generated"])
        informative = [[], []]  # per rank, in generation order: groups whose rewards differ
        constant = 0
        for rank, res in enumerate(ranks):
            for gen in res[step]["generated"]:
                for g in range(len(gen) // n):
                    group = gen[g * n:(g + 1) * n]
                    if len({r[2] for r in group}) > 1:
                        informative[rank].append(group)
                    else:
                        constant += 1
        counts = [len(x) for x in informative]
        assert counts[0] == 0  # the reward makes rank 0 lend nothing
        assert m["batch/num_gen_batches"] == tries >= 2
        assert m["batch/filtered_groups"] == constant and m["batch/kept_groups"] == sum(counts)
        # it stopped at the first generation batch that filled the step's 8 groups
        per_try = [sum(1 for g in range(q) if len({r[2] for r in gen[g * n:(g + 1) * n]}) > 1)
                   for gen in ranks[1][step]["generated"]]
        assert sum(per_try[:-1]) < 2 * q <= sum(per_try)
        assert m["batch/rerouted_groups"] == sum(max(0, q - c) for c in counts) == q
        trained = [res[step]["trained"] for res in ranks]
        assert [len(x) for x in trained] == [q * n, q * n]  # balanced over the DP ranks
        everything = informative[1]
        for rows in trained:
            for g in range(q):
                group = rows[g * n:(g + 1) * n]
                assert len({r[2] for r in group}) > 1 and [r[1:] for r in group] in [
                    [r[1:] for r in x] for x in everything]
        assert trained[1] != trained[0]
    assert "max_num_gen_batches=1" in ranks[0][2] and "algorithm.filter_groups" in ranks[0][2]


def _fit(tmp, *extra):
    from parallel.shards import iter_global
    import torch.distributed as dist
    t = _trainer(["trainer.save_freq=2", "trainer.val_before_train=false", "data.dataloader_num_workers=1",
                  *extra], tmp, logger="[jsonl]")
    t.fit()
    records = [json.loads(x) for x in open(f"{tmp}/logs/0/metrics.jsonl")] if dist.get_rank() == 0 else None
    return dict(weights={k: v.clone() for k, v in iter_global(t.actor.chunks, "param")}, records=records)


ALL = REPLAY + ["algorithm.rollout_correction.rollout_is=token", "algorithm.filter_groups.enable=true"]


def test_replay_pf_ppo_and_dynamic_sampling_resume_exactly(tmp_path):
    straight = run_on_ranks(_fit, 2, str(tmp_path / "s"), *ALL, "trainer.total_training_steps=4",
                            "trainer.resume_mode=disable")
    run_on_ranks(_fit, 2, str(tmp_path / "r"), *ALL, "trainer.total_training_steps=2", "trainer.resume_mode=disable")
    resumed = run_on_ranks(_fit, 2, str(tmp_path / "r"), *ALL, "trainer.total_training_steps=4",
                           "trainer.resume_mode=auto")
    a, b = straight[0]["records"], resumed[0]["records"]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert b[2]["replay/replayed_samples"] > 0 and b[3]["replay/buffer_samples"] == a[3]["replay/buffer_samples"]
    for ra, rb in zip(a[2:], b[2:]):
        keys = [k for k in ra if not k.startswith(("timing_s", "perf"))]
        assert set(keys) <= set(rb)
        for k in keys:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-9), (ra["step"], k)
    for rank in range(2):
        w1, w2 = straight[rank]["weights"], resumed[rank]["weights"]
        assert all(torch.equal(w1[k], w2[k]) for k in w1)
