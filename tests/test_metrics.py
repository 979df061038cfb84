"""Metrics: JSONL lines, TensorBoard scalars read back, the console line, and the batch statistics
against naive per-sequence loops."""
import io
import json
import math

import pytest
import torch

from engine.metrics import MetricsLogger, Timer, compute_data_metrics, compute_throughput_metrics


def _step_metrics(step):
    return {"critic/score/mean": 0.1 * step, "actor/pg_loss": torch.tensor(-0.5 + step),
            "actor/ppo_kl": 1e-3 * step, "response_length/mean": 7.0 + step, "timing_s/step": 2.0,
            "perf/throughput": 512.0, "note": "not a scalar"}


def test_logger_writes_jsonl_tensorboard_and_console(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    console = io.StringIO()
    logger = MetricsLogger(str(tmp_path / "p" / "e"), project="p", experiment="e", total_steps=10,
                           stream=console)
    for step in (1, 2, 3):
        logger.log(_step_metrics(step), step)
    logger.log({"actor/pg_loss": float("nan")}, 4)
    logger.close()

    lines = [json.loads(line) for line in open(tmp_path / "p" / "e" / "metrics.jsonl")]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line, step in zip(lines, (1, 2, 3)):
        assert line["critic/score/mean"] == pytest.approx(0.1 * step)
        assert line["actor/pg_loss"] == pytest.approx(-0.5 + step)
        assert "note" not in line
    assert lines[3]["actor/pg_loss"] is None  # NaN written as null: the line stays valid JSON

    events = EventAccumulator(str(tmp_path / "p" / "e"))
    events.Reload()
    assert {"critic/score/mean", "actor/pg_loss", "actor/ppo_kl"} <= set(events.Tags()["scalars"])
    score = events.Scalars("critic/score/mean")
    assert [e.step for e in score] == [1, 2, 3]
    assert [e.value for e in score] == pytest.approx([0.1, 0.2, 0.3])

    printed = console.getvalue().splitlines()
    assert len(printed) == 4  # one line per step
    assert printed[1].startswith("step 2/10 | score 0.200 | pg_loss 1.5000 | kl 2.00e-03")
    assert "resp_len 9.0" in printed[1] and "tok/s 512" in printed[1] and "eta " in printed[1]
    assert "pg_loss nan" in printed[3]


def test_eta_from_step_time(tmp_path):
    logger = MetricsLogger(str(tmp_path), loggers=["console"], total_steps=100, stream=io.StringIO())
    logger._step_seconds = [3.0, 3.0]  # 3 s/step, 90 steps left
    assert logger.progress_line({}, 10).endswith("eta 4m30s")


def test_only_rank0_writes(tmp_path):
    console = io.StringIO()
    logger = MetricsLogger(str(tmp_path / "run"), rank=1, stream=console)
    logger.log({"critic/score/mean": 1.0}, 1)
    logger.close()
    assert console.getvalue() == "" and not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="trainer.logger: unknown logger 'neptune'; choose from console, "):
        MetricsLogger(str(tmp_path), loggers=["console", "neptune"])


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_resume_truncates_and_a_fresh_run_keeps_the_old_records_aside(tmp_path):
    def run(steps, resume_at=None):
        logger = MetricsLogger(str(tmp_path / "exp"), ["jsonl"], stream=io.StringIO())
        if resume_at is None:
            logger.start_fresh()
        else:
            logger.truncate_after(resume_at)
        for step in steps:
            logger.log({"actor/pg_loss": float(step)}, step)
        logger.close()

    current = tmp_path / "exp" / "metrics.jsonl"
    run([1, 2, 3, 4])
    run([3, 4, 5], resume_at=2)  # a resumed run redoes the steps after its checkpoint
    assert _steps(current) == [1, 2, 3, 4, 5]
    run([1, 2])  # a new run under the same name
    assert _steps(current) == [1, 2]
    kept = list((tmp_path / "exp").glob("metrics.prev-*.jsonl"))
    assert len(kept) == 1 and _steps(kept[0]) == [1, 2, 3, 4, 5]
    run([1])  # and again: the second earlier run is kept too, under another name
    assert len(list((tmp_path / "exp").glob("metrics.prev-*.jsonl"))) == 2


def test_timer_accumulates():
    timings = {}
    for _ in range(2):
        with Timer("gen", timings) as timer:
            sum(range(10000))
        assert timer.elapsed > 0
    with Timer("update_actor", timings):
        pass
    assert set(timings) == {"timing_s/gen", "timing_s/update_actor"}
    assert timings["timing_s/gen"] >= timer.elapsed


def test_data_metrics_against_naive_loops():
    torch.manual_seed(0)
    B, L, P = 5, 6, 4
    lengths = [6, 1, 3, 6, 2]
    response_mask = torch.tensor([[1] * n + [0] * (L - n) for n in lengths])
    prompt_mask = torch.tensor([[0] * (P - n) + [1] * n for n in [4, 2, 3, 1, 4]])
    scores = torch.randn(B, L) * response_mask
    rewards, advantages, returns, values = (torch.randn(B, L) for _ in range(4))
    m = compute_data_metrics(scores, rewards, advantages, returns, response_mask, prompt_mask, values)

    seq_scores = [sum(scores[b, :lengths[b]].tolist()) for b in range(B)]
    seq_rewards = [sum(rewards[b, :lengths[b]].tolist()) for b in range(B)]
    valid = lambda t: [t[b, i].item() for b in range(B) for i in range(lengths[b])]  # noqa: E731
    assert m["critic/score/mean"] == pytest.approx(sum(seq_scores) / B, abs=1e-6)
    assert m["critic/score/max"] == pytest.approx(max(seq_scores), abs=1e-6)
    assert m["critic/score/min"] == pytest.approx(min(seq_scores), abs=1e-6)
    assert m["critic/rewards/mean"] == pytest.approx(sum(seq_rewards) / B, abs=1e-6)
    for name, tensor in (("advantages", advantages), ("returns", returns), ("values", values)):
        v = valid(tensor)
        assert m[f"critic/{name}/mean"] == pytest.approx(sum(v) / len(v), abs=1e-6)
        assert m[f"critic/{name}/max"] == pytest.approx(max(v))
        assert m[f"critic/{name}/min"] == pytest.approx(min(v))
    assert m["response_length/mean"] == pytest.approx(sum(lengths) / B)
    assert (m["response_length/max"], m["response_length/min"]) == (6, 1)
    assert m["response_length/clip_ratio"] == pytest.approx(2 / 5)
    assert m["prompt_length/mean"] == pytest.approx(14 / 5)
    assert m["prompt_length/clip_ratio"] == pytest.approx(2 / 5)
    without_values = compute_data_metrics(scores, rewards, advantages, returns, response_mask)
    assert "critic/values/mean" not in without_values


def test_throughput_and_mfu():
    m = compute_throughput_metrics(total_tokens=8000, step_time=2.0, n_ranks=4, flops=4e12,
                                   peak_flops_per_rank=1e12)
    assert m["perf/throughput"] == 8000 / 2.0 / 4
    assert m["perf/total_num_tokens"] == 8000
    assert math.isclose(m["perf/mfu"], 4e12 / 2.0 / (4 * 1e12))
    assert "perf/mfu" not in compute_throughput_metrics(10, 1.0, 1)
    with pytest.raises(ValueError, match="step_time"):
        compute_throughput_metrics(10, 0.0, 1)
