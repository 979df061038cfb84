"""Each tools/benchmark.py subcommand run as a user runs it, at its smallest size, and the JSON its
--json writes checked against what the run must have measured (independent references: the
kernels' checksums recomputed here, the model's size from transformers, the SGLang double's own
record of the engine it built). `all` (every subcommand at its defaults: minutes and GBs) is not
run here."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "tools", "benchmark.py")
FAKES = os.path.join(ROOT, "tests", "fakes")


def _bench(tmp_path, *args, env=None, timeout=300):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, BENCH, *args, "--json", str(out)], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


# ~20 s; make test keeps the caller's-path run of tests/test_gpu_check.py and the other JSON tests
@pytest.mark.slow
def test_step_json_through_the_sglang_double_on_the_callers_path(tmp_path):
    """The trainer is launched with the caller's PYTHONPATH kept (gpu_check.sh puts megatron-core
    from .whl/ there; here the SGLang double is only importable through it)."""
    log = tmp_path / "sglang.jsonl"
    report = _bench(tmp_path, "step", "--workload", "tiny", "--nproc", "1", "--steps", "1", "--warmup", "0",
                    "actor_rollout_ref.rollout.name=sglang",
                    env=dict(PYTHONPATH=FAKES, TRIDENT_FAKE_SGLANG_LOG=str(log)))
    kinds = [json.loads(line)["kind"] for line in log.read_text().splitlines()]
    assert kinds.count("init") == 1 and "update_weights_from_tensor" in kinds
    assert report["workload"] == "tiny" and report["nproc"] == 1
    assert report["steps"] == 1
    assert report["step_s"] > 0 and report["tokens_per_s_per_rank"] > 0 and report["tokens_per_step"] > 0
    # throughput is tokens over the step's time, per rank
    assert report["tokens_per_s_per_rank"] == pytest.approx(report["tokens_per_step"] / report["step_s"], rel=0.05)
    assert {"gen", "update_actor"} <= set(report["phases_s"])
    assert sum(report["phases_s"].values()) <= report["step_s"] * 1.01
    assert report["wall_s"] > report["step_s"]


# ~25 s quiet (the trainer, then the plain loop); the table's arithmetic is checked fast below
@pytest.mark.slow
def test_step_baseline_json_times_the_same_phases_as_trident(tmp_path):
    """--baseline: the plain loop timed phase by phase under Trident's names; it runs the old
    log-prob pass exactly when Trident does (the tiny recipe's 4 mini-batches: off-policy)."""
    report = _bench(tmp_path, "step", "--workload", "tiny", "--nproc", "1", "--steps", "1",
                    "--warmup", "0", "--baseline")
    base = report["baseline"]
    assert set(report["phases_s"]) >= {"gen", "old_log_prob", "ref", "update_actor", "update_weights"}
    assert set(base["phases_s"]) == {"gen", "old_log_prob", "ref", "update_actor", "update_weights", "other"}
    assert base["phases_s"]["update_weights"] == 0.0  # the loop generates with the trained model
    # one rank: every core on both sides (the trainer's parallel/cpu.py threads_per_process)
    assert base["threads"] == os.cpu_count()
    assert all(base["phases_s"][p] > 0 for p in ("gen", "old_log_prob", "ref", "update_actor"))
    assert sum(base["phases_s"].values()) == pytest.approx(base["step_s"], rel=0.05)
    for phase, seconds in base["phases_s"].items():
        ours = report["compared_phases_s"][phase]
        if phase != "other":
            assert ours == report["phases_s"][phase]
        assert report["ratios"][phase] == (pytest.approx(seconds / ours) if ours > 0 else None)
    assert report["speedup_vs_transformers"] == pytest.approx(base["step_s"] / report["step_s"])
    # the same by CPU seconds, both sides measured in their own processes
    cpu = base["cpu_phases_s"]
    assert set(cpu) == set(base["phases_s"]) and cpu["update_weights"] == 0.0
    assert all(cpu[p] > 0 for p in ("gen", "old_log_prob", "ref", "update_actor"))
    assert set(report["cpu_phases_s"]) == set(report["phases_s"]) - {"reward", "adv"} | (
        set(report["cpu_phases_s"]) & {"reward", "adv"})
    assert report["cpu_speedup_vs_transformers"] == pytest.approx(base["cpu_step_s"] / report["cpu_step_s"])
    for phase, seconds in cpu.items():
        ours = report["compared_cpu_phases_s"][phase]
        assert report["cpu_ratios"][phase] == (pytest.approx(seconds / ours) if ours > 0 else None)
    # page faults per phase, both sides (rank 0): a step's are at least any one phase's
    for faults in (report["page_faults"], base["page_faults"]):
        assert {"gen", "ref", "update_actor", "step"} <= set(faults)
        assert all(n >= 0 for n in faults.values()) and faults["step"] >= max(faults.values())


def test_rounds_report_the_median_of_each_ratio():
    """--rounds: each phase's median over the rounds (three worked by hand), the step's too; a
    round without a ratio for a phase (Trident's time 0) leaves it out."""
    from tools.bench_step import median_ratios
    rounds = [{"ratios": {"gen": 1.0, "ref": 0.5, "update_weights": None}, "speedup_vs_transformers": 0.8,
               "cpu_ratios": {"gen": 1.1, "ref": 0.6, "update_weights": None}, "cpu_speedup_vs_transformers": 0.9},
              {"ratios": {"gen": 0.7, "ref": 0.9, "update_weights": None}, "speedup_vs_transformers": 0.7,
               "cpu_ratios": {"gen": 0.8, "ref": 0.9, "update_weights": None}, "cpu_speedup_vs_transformers": 0.85},
              {"ratios": {"gen": 0.9, "ref": 0.6, "update_weights": None}, "speedup_vs_transformers": 1.0,
               "cpu_ratios": {"gen": 0.95, "ref": 0.7, "update_weights": None}, "cpu_speedup_vs_transformers": 0.95}]
    med = median_ratios(rounds)
    assert med["ratios"] == {"gen": 0.9, "ref": 0.6, "update_weights": None, "step": 0.8}
    assert med["cpu_ratios"] == {"gen": 0.95, "ref": 0.7, "update_weights": None, "step": 0.9}
    assert "cpu_ratios" not in median_ratios([{k: v for k, v in r.items() if not k.startswith("cpu")}
                                              for r in rounds])


def test_baseline_comparison_per_phase():
    """compare_baseline on figures worked by hand: Trident's phases it has no counterpart for
    (reward, adv) fall in `other`; an on-policy step (no old_log_prob either side) lists none."""
    sys.path.insert(0, ROOT)
    from tools.bench_step import compare_baseline
    summary = {"step_s": 4.0, "phases_s": {"gen": 1.0, "ref": 0.5, "reward": 0.1, "adv": 0.1,
                                           "update_actor": 2.0, "update_weights": 0.2}}
    base = {"step": 5.0, "gen": 2.0, "ref": 0.5, "update_actor": 2.2}
    out = compare_baseline(summary, base)
    assert out["baseline"]["phases_s"] == pytest.approx(
        {"gen": 2.0, "ref": 0.5, "update_actor": 2.2, "update_weights": 0.0, "other": 0.3})
    assert out["compared_phases_s"] == pytest.approx(
        {"gen": 1.0, "ref": 0.5, "update_actor": 2.0, "update_weights": 0.2, "other": 0.3})
    assert out["ratios"] == pytest.approx({"gen": 2.0, "ref": 1.0, "update_actor": 1.1,
                                           "update_weights": 0.0, "other": 1.0})
    assert out["speedup_vs_transformers"] == pytest.approx(1.25) and out["baseline_step_s"] == 5.0
    assert "cpu_ratios" not in out  # no CPU figures given: none compared
    summary.update(cpu_step_s=2.2, cpu_phases_s={"gen": 0.5, "ref": 0.5, "update_actor": 1.0,
                                                 "update_weights": 0.1})
    base.update({"cpu/step": 3.0, "cpu/gen": 1.0, "cpu/ref": 0.25, "cpu/update_actor": 1.5})
    out = compare_baseline(summary, base)
    assert out["baseline"]["cpu_phases_s"] == pytest.approx(
        {"gen": 1.0, "ref": 0.25, "update_actor": 1.5, "update_weights": 0.0, "other": 0.25})
    assert out["compared_cpu_phases_s"] == pytest.approx(
        {"gen": 0.5, "ref": 0.5, "update_actor": 1.0, "update_weights": 0.1, "other": 0.1})
    assert out["cpu_ratios"] == pytest.approx({"gen": 2.0, "ref": 0.5, "update_actor": 1.5,
                                               "update_weights": 0.0, "other": 2.5})
    assert out["cpu_speedup_vs_transformers"] == pytest.approx(3.0 / 2.2)
    assert "page_faults" not in out["baseline"]
    base.update({"faults/gen": 7, "faults/ref": 0, "faults/step": 9})  # the loop's own names, unprefixed
    assert compare_baseline(summary, base)["baseline"]["page_faults"] == {"gen": 7, "ref": 0, "step": 9}


def test_kernels_json_checksums_match_a_log_softmax_computed_here(tmp_path):
    tokens, hidden, vocab = 48, 16, 200
    report = _bench(tmp_path, "kernels", "--tokens", str(tokens), "--hidden", str(hidden), "--vocab",
                    str(vocab), "--repeat", "1", "--chunk-tokens", "16")
    assert report["shape"] == dict(tokens=tokens, hidden=hidden, vocab=vocab, dtype="float32",
                                   temperature=1.0, chunk_tokens=16)
    gen = torch.Generator().manual_seed(0)  # the worker's inputs, drawn in the same order
    h = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    logp = (h @ w.T).double().log_softmax(-1)
    want_lp = float(logp.gather(-1, labels[:, None]).sum())
    want_ent = float(-(logp.exp() * logp).sum())
    for path in ("naive", "fused", "single"):
        assert report[path]["logprob_sum"] == pytest.approx(want_lp, rel=1e-5), path
        assert report[path]["entropy_sum"] == pytest.approx(want_ent, rel=1e-5), path
        assert report[path]["time_s"] > 0 and len(report[path]["times_s"]) == 2  # warm-up + 1
    for path in ("fused", "single"):
        ratios = report[f"{path}_ratios"]
        assert ratios["time"] == pytest.approx(report[path]["time_s"] / report["naive"]["time_s"])
        assert ratios["max_checksum_rel_diff"] < 1e-4


@pytest.mark.slow  # ~1 min on 2 cores; resharding itself is tested fast in tests/test_reshard.py
def test_reshard_json_moves_the_whole_model_in_buckets(tmp_path):
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, ROOT)
    from tools.bench_reshard import model_config

    report = _bench(tmp_path, "reshard", "--size-mb", "2", "--bucket-mb", "0.5", "--hidden", "32",
                    "--vocab", "256", "--repeat", "1")
    args = type("Args", (), dict(size_mb=2, hidden=32, vocab=256))
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config(args)).parameters())
    assert report["model_mb"] == pytest.approx(params * 4 / 2 ** 20, rel=1e-6)
    assert report["world_size"] == 2 and len(report["layouts"]) == 2
    for layout, r in report["layouts"].items():
        assert r["buckets"] >= math.ceil(report["model_mb"] / 0.5), layout  # 0.5 MiB buckets
        assert r["gb_per_s"] == pytest.approx(report["model_mb"] * 2 ** 20 / r["seconds"] / 1e9)
        assert r["ratio_to_copy"] == pytest.approx(r["seconds"] / report["copy_s"])


def test_pool_oversample_gives_a_generation_batch_of_whole_replicas():
    from tools.bench_pool import gen_batch_size
    assert gen_batch_size(1.5, 32, 2) == 48 and gen_batch_size(1.4, 32, 3) == 45  # ceil(44.8), x3
    assert gen_batch_size(1.0, 32, 2) == 32 and gen_batch_size(0.5, 32, 2) == 32  # never under B


@pytest.mark.slow
def test_pool_json_off_policy_against_on_policy(tmp_path):
    report = _bench(tmp_path, "pool", "--off-policy-steps", "0", "2", "--steps", "3", "--train-ranks", "1",
                    "--pool-ranks", "1", "--response-length", "4", timeout=600)
    on, off = report["runs"]["0"], report["runs"]["2"]
    assert on["steps"] == off["steps"] == 3 and report["ranks"] == 2 and report["baseline_k"] == 0
    assert off["ratio"] == pytest.approx(off["step_s"] / on["step_s"]) and on["ratio"] == 1.0
    assert on["staleness"] == [0, 0, 0] and off["staleness"] == [0, 1, 2]  # the trainer's log, per step
    assert on["stale_samples"] == off["stale_samples"] == 0 and 1 <= on["response_max"] <= 4


def test_pool_seeds_spread_is_the_written_statistics():
    import statistics

    from tools.bench_pool import spread
    scores = [0.25, 0.5, 0.375]
    s = spread(scores)
    assert s["mean"] == pytest.approx(statistics.mean(scores)) and s["std"] == pytest.approx(statistics.stdev(scores))
    assert (s["min"], s["max"], s["spread"]) == (0.25, 0.5, 0.25)
    assert spread([0.5])["std"] == 0.0


# ~4 runs of 2 steps (1 + 1 ranks): minutes on shared cores
@pytest.mark.slow
def test_pool_seeds_json_reports_each_runs_held_out_score(tmp_path):
    report = _bench(tmp_path, "pool", "--seeds", "1", "2", "--off-policy-steps", "0", "1", "--steps", "2",
                    "--train-ranks", "1", "--pool-ranks", "1", timeout=1500)
    base, off = report["seeds"]["0"], report["seeds"]["1"]
    assert report["baseline_k"] == 0 and report["steps"] == 2
    for row in (base, off):
        scores = list(row["scores"].values())
        assert sorted(row["scores"]) == ["1", "2"] and all(0.0 <= x <= 1.0 for x in scores)
        assert row["mean"] == pytest.approx(sum(scores) / 2)
        assert row["spread"] == pytest.approx(max(scores) - min(scores))
        assert row["mean_within_baseline_range"] == (base["min"] <= row["mean"] <= base["max"])
        assert row["mean_vs_baseline_range"] == ("within" if row["mean_within_baseline_range"] else
                                                 "below" if row["mean"] < base["min"] else "above")
        assert row["stale_samples"] == 0
    assert base["mean_within_baseline_range"] and base["staleness_max"] == 0 and off["staleness_max"] == 1


def test_rounds_take_turns_at_running_first():
    """--rounds pairs each Trident run with a loop run, the loop first in every other round
    (ABBA), round 0 reusing the Trident run already made."""
    from tools.bench_step import paired_runs
    log = []

    def runner(side):
        def run():
            log.append(side)
            return f"{side}{len(log)}"
        return run
    pairs = paired_runs(4, "T0", runner("T"), runner("L"))
    assert log == ["L", "L", "T", "T", "L", "L", "T"]
    assert pairs == [("T0", "L1"), ("T3", "L2"), ("T4", "L5"), ("T7", "L6")]
    assert paired_runs(1, "T0", runner("T"), runner("L")) == [("T0", "L8")]


def test_attention_json_times_both_orders_on_both_kinds_of_batch(tmp_path):
    """tools/benchmark.py attention at a tiny size. On the CPU the SDPA order does not apply, the
    plumbing does: every case x order timed, each ratio the quotient of its two timings; a row
    ends at --row-seconds once it has 3 timed calls (cuDNN's plan builds can take minutes)."""
    report = _bench(tmp_path, "attention", "--tokens", "96", "--heads", "4", "--kv-heads", "2",
                    "--head-dim", "8", "--longest", "20", "--calls", "50", "--row-seconds", "1e-6")
    assert set(report["calls"].values()) == {3}, report["calls"]
    assert all(t > 0 for t in report["warmup_ms"].values())
    assert (report["device"], report["tokens"], report["kv_heads"]) == ("cpu", 96, 2)
    ms = report["ms_per_call"]
    assert set(ms) == {f"{case}/{order}" for case in ("varied", "fixed")
                       for order in ("trident", "cudnn_first")}
    assert all(t > 0 for t in ms.values())
    for case in ("varied", "fixed"):
        assert report["ratios"][case] == pytest.approx(ms[f"{case}/trident"] / ms[f"{case}/cudnn_first"])


def test_baseline_sync_trains_one_model_over_the_ranks():
    """--baseline-sync: the loop's two ranks start from one model and all-reduce each
    mini-batch's gradients, so they end with the same weights on different data; without it
    each rank trains its own (the default: no gradient sync)."""
    from tools.bench_baseline import run_baseline
    from tools.bench_step import DEMO
    tiny = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "data.max_response_length=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    synced = run_baseline(DEMO, tiny, 2, 1, grad_sync=True)
    assert synced["grad_sync"] == 1 and synced["same_weights"]
    alone = run_baseline(DEMO, tiny, 2, 1)
    assert alone["grad_sync"] == 0 and not alone["same_weights"]
    # a rank that fails (here: a micro-batch that does not divide its mini-batch) ends the run
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[[01, ]+\] failed"):
        run_baseline(DEMO, tiny[:-1], 2, 1)
