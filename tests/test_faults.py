"""Faults injected into the real trainer (torchrun, 2 CPU ranks; engine/faults.py): a NaN loss,
NaNs that force a rollback, an out-of-memory in a micro-batch, a rank that hangs or dies in a
collective, a truncated newest checkpoint. No run is lost: each finishes, or ends at once with
one line naming the rank, the phase and the collective."""
import json
import os
import re
import time

import pytest
import torch

from tests.test_e2e import _launch, _records

COMMON = ["trainer.test_freq=-1", "trainer.save_hf=true"]


def _run(tmp_path, name, extra, steps, faults=None, timeout=400):
    env_faults = {"TRIDENT_FAULTS": json.dumps(faults)} if faults else {}
    old = {k: os.environ.get(k) for k in env_faults}
    os.environ.update(env_faults)
    try:
        proc = _launch(tmp_path, name, COMMON + list(extra), steps)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    start = time.monotonic()
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out, time.monotonic() - start


def _weights(tmp_path, name, step):
    from safetensors.torch import load_file
    out = {}
    for f in sorted((tmp_path / "ckpt" / name / "hf" / f"step_{step}").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_a_nan_loss_is_skipped_and_the_run_finishes(tmp_path):
    rc, out, _ = _run(tmp_path, "nan", ["trainer.save_freq=-1"], 3, [{"kind": "nan_loss", "step": 2}])
    assert rc == 0, out[-3000:]
    records = _records(tmp_path, "nan")
    assert [r["actor/skipped_updates"] > 0 for r in records] == [False, True, False]
    assert records[-1]["train/skipped_steps"] == records[1]["actor/skipped_updates"]
    assert all(torch.isfinite(t).all() for t in _weights(tmp_path, "nan", 3).values())


def test_nans_in_a_row_roll_back_to_the_last_checkpoint_with_a_lower_lr(tmp_path):
    faults = [{"kind": "nan_loss", "step": s, "once": True} for s in (3, 4)]  # transient
    rc, out, _ = _run(tmp_path, "rollback", ["trainer.save_freq=2", "trainer.max_nonfinite_skips=2",
                                             "trainer.rollback_lr_factor=0.5"], 5, faults)
    assert rc == 0, out[-3000:]
    assert "rolled back to" in out and "global_step_2" in out
    records = _records(tmp_path, "rollback")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # steps 3-4 redone after the rollback
    assert records[-1]["train/rollbacks"] == 1 and records[-1]["train/lr_scale"] == 0.5
    assert records[-1]["actor/lr"] == pytest.approx(0.5 * records[0]["actor/lr"])
    assert all(torch.isfinite(t).all() for t in _weights(tmp_path, "rollback", 5).values())


def test_an_out_of_memory_retries_with_half_the_micro_batch(tmp_path):
    """Same final weights as a run that started at the smaller size (rank 0 alone ran out)."""
    rc, out, _ = _run(tmp_path, "oom", ["trainer.save_freq=-1"], 2,
                      [{"kind": "oom", "step": 1, "micro": 1, "rank": 0, "model": "actor"}])
    assert rc == 0, out[-3000:]
    assert "out of memory in a micro-batch: retrying with micro-batches of 2 sequences" in out
    rc, out2, _ = _run(tmp_path, "small", ["trainer.save_freq=-1",
                                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"], 2)
    assert rc == 0, out2[-3000:]
    records = _records(tmp_path, "oom")
    assert records[0]["actor/oom_retries"] == 1 and records[1]["actor/oom_retries"] == 0  # size kept
    a, b = _weights(tmp_path, "oom", 2), _weights(tmp_path, "small", 2)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)


def test_a_hung_rank_ends_the_job_with_the_rank_phase_and_collective(tmp_path):
    rc, out, seconds = _run(tmp_path, "hang", ["trainer.save_freq=-1", "trainer.collective_timeout_s=20"], 3,
                            [{"kind": "hang", "step": 2, "phase": "ref", "rank": 1}], timeout=300)
    assert rc != 0
    assert seconds < 150, seconds  # the timeout, not forever
    # rank 0 reports where it waited: its collective and its phase
    assert re.search(r"rank 0: in \w+ during phase '\w+' another rank did not answer within "
                     r"trainer.collective_timeout_s=20", out), out[-3000:]


def test_a_killed_rank_ends_the_job(tmp_path):
    rc, out, seconds = _run(tmp_path, "kill", ["trainer.save_freq=-1", "trainer.collective_timeout_s=20"], 3,
                            [{"kind": "kill", "step": 2, "phase": "update_actor", "rank": 1}], timeout=300)
    assert rc != 0 and seconds < 150, (rc, seconds, out[-2000:])


@pytest.mark.slow  # 37 s: three runs
def test_a_truncated_newest_checkpoint_resumes_from_the_previous_one(tmp_path):
    once = ["trainer.save_freq=1", "trainer.save_hf=false"]
    rc, out, _ = _run(tmp_path, "straight", once, 3)
    assert rc == 0, out[-3000:]
    straight = _records(tmp_path, "straight")
    rc, out, _ = _run(tmp_path, "cut", once, 3)
    assert rc == 0
    newest = tmp_path / "ckpt" / "cut" / "global_step_3"
    victim = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    rc, out, _ = _run(tmp_path, "cut", once + ["trainer.resume_mode=auto"], 3)
    assert rc == 0, out[-3000:]
    assert "at step 2" in out  # the damaged step-3 checkpoint was passed over
    resumed = _records(tmp_path, "cut")
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert resumed[-1][key] == pytest.approx(straight[-1][key], rel=1e-6, abs=1e-9), key
