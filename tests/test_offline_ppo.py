"""Offline PPO / GRPO from logged responses (data.offline_path) through the real trainer on 2
gloo ranks, against the on-policy path: the step's responses are logged with the current
policy's own log-probs as the behaviour policy's, and the offline step then makes the same
update bit for bit; with another behaviour policy the truncated IS weights are capped at
rollout_is_threshold and enter the policy loss (its value checked against the formula); with
IcePop's band the tokens outside it leave the loss; in bypass mode PPO's ratio is taken against
the logged policy."""
import math
import os

import pytest
import torch

from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "recipes", "tiny_cpu_demo.yaml")
# one mini-batch of 8 prompts x 4, and the old log-probs from their own pass in both paths (the
# update's shortcut would take them from its forward: the same values, another rounding)
STEP = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.on_policy_old_log_prob=false",
        "trainer.logger=[]", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume_mode=disable"]


def _trainer(overrides, tmp):
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train import build
    from engine.trainer import Trainer, set_seed
    cfg = load_config(DEMO, [f"trainer.default_local_dir={tmp}/ckpt", f"trainer.log_dir={tmp}/logs/{dist.get_rank()}",
                             *STEP, *overrides])
    set_seed(cfg.trainer.seed)
    derived, components = build(cfg, 2)
    return Trainer(derived, components)


class Recording:
    """The real source, keeping each step's batch (the trainer adds its fields in place)."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def collect(self, ctx, prompts):
        batch, metrics = self.inner.collect(ctx, prompts)
        self.batches.append((prompts, batch))
        return batch, metrics


def _weights(trainer):
    from parallel.shards import iter_global
    return {k: v.clone() for k, v in iter_global(trainer.actor.chunks, "param")}


def _online_then_log(tmp):
    """One on-policy step; its responses, rewards and old log-probs (the policy that generated
    them) written as logged rows, in the step's prompt order (rank 0's prompts first)."""
    import torch.distributed as dist

    from engine.data import write_prompt_parquet
    from engine.tasks import save_tokenizer
    t = _trainer([], tmp)
    t.experience = Recording(t.experience)
    start = _weights(t)
    metrics = t.train_step(t.loader.next_batch())
    prompts, batch = t.experience.batches[0]
    rows, mine = [], t.ctx.my_rows(prompts)
    for k in range(len(batch)):
        m = batch["response_mask"][k].bool()
        rows.append({"prompt": prompts.raw_prompts[mine[k // 4]],
                     "response": batch["responses"][k][m].tolist(),
                     "score": float(batch["token_level_scores"][k].sum()),
                     "rollout_log_probs": batch["old_log_probs"][k][m].tolist()})
    every = [None, None]
    dist.all_gather_object(every, rows)
    if dist.get_rank() == 0:
        write_prompt_parquet(every[0] + every[1], f"{tmp}/logged.parquet")
        save_tokenizer(f"{tmp}/tok")
    dist.barrier()
    return dict(start=start, weights=_weights(t), metrics=metrics, advantages=batch["advantages"],
                old=batch["old_log_probs"], mask=batch["response_mask"])


def _offline(tmp, path, *extra):
    t = _trainer([f"data.offline_path={path}", "data.builtin_task=null", "data.shuffle=false",
                  f"actor_rollout_ref.model.tokenizer_path={tmp}/tok", *extra], tmp)
    prompts = t.loader.next_batch()
    metrics = t.train_step(prompts)
    return dict(weights=_weights(t), metrics=metrics)


def _shifted(tmp):
    """The log with another behaviour policy: mu = pi_old - 1.5 on even response positions
    (ratio e^1.5, above the cap 2), - 0.25 on odd ones (e^0.25)."""
    import torch.distributed as dist
    import pyarrow.parquet as pq

    from engine.data import write_prompt_parquet
    if dist.get_rank() == 0:
        rows = pq.read_table(f"{tmp}/logged.parquet").to_pylist()
        for row in rows:
            row["rollout_log_probs"] = [lp - (1.5 if j % 2 == 0 else 0.25)
                                        for j, lp in enumerate(row["rollout_log_probs"])]
        write_prompt_parquet(rows, f"{tmp}/shifted.parquet")
    dist.barrier()


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offline_ppo")
    return tmp, run_on_ranks(_online_then_log, 2, str(tmp))


def test_offline_step_with_the_current_policy_as_behaviour_equals_the_on_policy_step(logged):
    tmp, online = logged
    offline = run_on_ranks(_offline, 2, str(tmp), f"{tmp}/logged.parquet",
                           "algorithm.rollout_correction.rollout_is=token")
    for on, off in zip(online, offline):
        assert on["weights"].keys() == off["weights"].keys()
        assert all(torch.equal(on["weights"][k], off["weights"][k]) for k in on["weights"])
        m = off["metrics"]
        assert m["rollout_corr/rollout_is_mean"] == 1.0 and m["rollout_corr/ratio_mean"] == 1.0
        assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
        assert "timing_s/gen" not in m and "timing_s/reward" not in m  # nothing generated or scored
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"):
            assert m[key] == on["metrics"][key], key
    # the update moved the weights at all (else equality above says nothing)
    start = online[0]["start"]
    assert any(not torch.equal(start[k], online[0]["weights"][k]) for k in start)


def test_another_behaviour_policy_is_truncated_at_the_threshold(logged):
    tmp, online = logged
    run_on_ranks(_shifted, 2, str(tmp))
    offline = run_on_ranks(_offline, 2, str(tmp), f"{tmp}/shifted.parquet",
                           "algorithm.rollout_correction.rollout_is=token",
                           "algorithm.rollout_correction.rollout_is_threshold=2.0")
    # the reference: every valid token's ratio and weight from the formula, both ranks' rows
    mask = torch.cat([r["mask"] for r in online]).bool()
    adv = torch.cat([r["advantages"] for r in online])
    even = torch.zeros_like(mask)
    even[:, 0::2] = True
    ratio = torch.where(even, torch.tensor(math.exp(1.5)), torch.tensor(math.exp(0.25)))
    weight = ratio.clamp(max=2.0)
    n = mask.sum()
    m = offline[0]["metrics"]
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(float((even & mask).sum() / n))
    assert m["rollout_corr/ratio_mean"] == pytest.approx(float(ratio[mask].sum() / n), rel=1e-5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(float(weight[mask].sum() / n), rel=1e-5)
    # one mini-batch at ratio pi / pi_old = 1: the policy loss is the weighted advantages' mean
    assert online[0]["metrics"]["actor/pg_loss"] == pytest.approx(float(-adv[mask].sum() / n), abs=1e-6)
    assert m["actor/pg_loss"] == pytest.approx(float(-(adv * weight)[mask].sum() / n), abs=1e-6)
    assert m["actor/pg_loss"] != pytest.approx(online[0]["metrics"]["actor/pg_loss"], abs=1e-4)


def _offline_two_steps(tmp, path, *extra):
    t = _trainer([f"data.offline_path={path}", "data.builtin_task=null", "data.shuffle=false",
                  f"actor_rollout_ref.model.tokenizer_path={tmp}/tok", *extra], tmp)
    metrics, weights = [], [_weights(t)]
    for _ in range(2):
        metrics.append(t.train_step(t.loader.next_batch()))
        weights.append(_weights(t))
    return dict(weights=weights, metrics=metrics)


def test_icepop_masks_the_tokens_outside_its_band_and_trains(logged):
    """IcePop (token IS + token rejection, band [0.5, 2]) on the shifted log, 2 steps of the tiny
    demo: the even positions (ratio e^1.5) leave the loss, the odd ones (e^0.25) train with
    weight e^0.25; the policy loss, the masked fractions and the mismatch metrics are their
    formulas over both ranks' tokens."""
    tmp, online = logged
    run_on_ranks(_shifted, 2, str(tmp))
    runs = run_on_ranks(_offline_two_steps, 2, str(tmp), f"{tmp}/shifted.parquet",
                        "algorithm.rollout_correction.rollout_is=token",
                        "algorithm.rollout_correction.rollout_is_threshold=5.0",
                        "algorithm.rollout_correction.rollout_rs=token",
                        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0")
    mask = torch.cat([r["mask"] for r in online]).bool()
    adv = torch.cat([r["advantages"] for r in online]).double()
    old = torch.cat([r["old"] for r in online]).double()
    even = torch.zeros_like(mask)
    even[:, 0::2] = True
    shift = torch.where(even, torch.tensor(1.5, dtype=torch.float64), torch.tensor(0.25, dtype=torch.float64))
    kept = mask & ~even
    n = mask.sum()
    m = runs[0]["metrics"][0]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(float((mask & even).sum() / n))
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0  # every row has position 0
    assert m["rollout_corr/rollout_token_veto_fraction"] == 0.0
    assert m["rollout_corr/mismatch_kl"] == pytest.approx(float(-shift[mask].sum() / n), rel=1e-5)
    diff = (old.exp() - (old - shift).exp()).abs()[mask]
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(float(diff.mean()), rel=1e-4)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(float(diff.std()), rel=1e-3)
    # one mini-batch at pi / pi_old = 1: the token mean over the kept tokens of -A x e^0.25
    want = float(-(adv * math.exp(0.25))[kept].sum() / kept.sum())
    assert m["actor/pg_loss"] == pytest.approx(want, abs=1e-6)
    assert m["actor/pg_loss"] != pytest.approx(float(-(adv * math.exp(0.25))[mask & ~even].sum() / n), abs=1e-4)
    for r in runs:  # it trains: both steps move the weights, and the second logs the metrics too
        w0, w1, w2 = r["weights"]
        assert any(not torch.equal(w0[k], w1[k]) for k in w0) and any(not torch.equal(w1[k], w2[k]) for k in w1)
        assert all(math.isfinite(r["metrics"][1][k]) for k in ("actor/pg_loss", "rollout_corr/mismatch_kl",
                                                               "rollout_corr/rollout_rs_masked_fraction"))


def test_bypass_mode_clips_against_the_rollout_policy(logged):
    """bypass_mode=true on the shifted log with token rejection (band [0.5, 2]): the even positions
    (pi_old / mu = e^1.5) leave the loss as before; the odd ones train with PPO's ratio taken
    against mu, pi / mu = e^0.25 at the update's only mini-batch (pi = pi_old there), which is past
    the clip 1 + 0.2: -1.2 A where A > 0 (clipped), -e^0.25 A where A < 0 (below the dual clip 3).
    The decoupled run (pi / pi_old = 1) gives -A instead."""
    tmp, online = logged
    run_on_ranks(_shifted, 2, str(tmp))
    band = ["algorithm.rollout_correction.rollout_rs=token",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"]
    bypass = run_on_ranks(_offline, 2, str(tmp), f"{tmp}/shifted.parquet",
                          "algorithm.rollout_correction.bypass_mode=true", *band)
    mask = torch.cat([r["mask"] for r in online]).bool()
    adv = torch.cat([r["advantages"] for r in online]).double()
    kept = mask.clone()
    kept[:, 0::2] = False
    r = math.exp(0.25)
    losses = torch.maximum(-adv * r, -adv * min(max(r, 0.8), 1.2))  # PPO's clipped term, then dual clip
    losses = torch.where(adv < 0, torch.minimum(losses, -adv * 3.0), losses)
    m = bypass[0]["metrics"]
    assert m["actor/pg_loss"] == pytest.approx(float(losses[kept].sum() / kept.sum()), abs=1e-5)
    assert m["actor/pg_clipfrac"] == pytest.approx(float((kept & (adv > 0)).sum() / kept.sum()), abs=1e-6)
    assert m["actor/pg_clipfrac"] > 0
    # pi_old's pass still ran: the rejection and the mismatch metrics are its ratios to mu
    assert "timing_s/old_log_prob" in m
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(float((mask & ~kept).sum() / mask.sum()))
    shift = torch.where(kept, 0.25, 1.5).double()
    assert m["rollout_corr/mismatch_kl"] == pytest.approx(float(-shift[mask].sum() / mask.sum()), rel=1e-5)
    decoupled = run_on_ranks(_offline, 2, str(tmp), f"{tmp}/shifted.parquet", *band)
    assert decoupled[0]["metrics"]["actor/pg_loss"] == pytest.approx(float(-adv[kept].sum() / kept.sum()), abs=1e-5)
    assert decoupled[0]["metrics"]["actor/pg_clipfrac"] == 0.0


def _offline_steps(tmp, path, *extra):
    t = _trainer([f"data.offline_path={path}", "data.builtin_task=null", "data.shuffle=true",
                  f"actor_rollout_ref.model.tokenizer_path={tmp}/tok", *extra], tmp)
    t.experience = Recording(t.experience)
    metrics = [t.train_step(t.loader.next_batch()) for _ in range(3)]
    return dict(weights=_weights(t), metrics=metrics,
                threads=[p.meta["prepared_in"] for p, _ in t.experience.batches])


def test_logged_batches_are_laid_out_in_the_prefetch_thread(logged):
    """data.dataloader_num_workers=1: the next step's logged Batch is built while the current
    step trains, and training is the same as without prefetching."""
    tmp, _ = logged
    plain = run_on_ranks(_offline_steps, 2, str(tmp), f"{tmp}/logged.parquet")
    ahead = run_on_ranks(_offline_steps, 2, str(tmp), f"{tmp}/logged.parquet", "data.dataloader_num_workers=1")
    for a, b in zip(plain, ahead):
        assert a["threads"] == ["MainThread"] * 3
        assert b["threads"][0] == "MainThread" and all(x.startswith("prefetch") for x in b["threads"][1:])
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        assert [m["actor/pg_loss"] for m in a["metrics"]] == [m["actor/pg_loss"] for m in b["metrics"]]
        assert [m["training/epoch"] for m in a["metrics"]] == [0, 1, 2]  # 8 logged prompts: one batch an epoch
