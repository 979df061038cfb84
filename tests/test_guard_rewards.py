"""The non-finite reward guard through the real trainer (torchrun, 2 CPU ranks): a NaN score on
ONE data-parallel rank trains nothing on EVERY rank (issue 26 class 2: the guard's own effect,
where cross-rank agreement is needed), and the run goes on training afterwards."""
import torch

from tests.test_faults import run_with_faults, saved_hf_weights
from tests.test_e2e import read_records

# rank 1's 20th sample (step 2: 16 samples per rank per step) scores NaN; every other one a
# score that moves the policy
REWARD = '''
import math, os
CALLS = [0]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS[0] += 1
    if os.environ.get("RANK") == "1" and CALLS[0] == 20:
        return math.nan
    return float(len(solution_str) % 3) / 2.0
'''


def test_a_nan_reward_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    rc, out, _ = run_with_faults(tmp_path, "nanreward",
                                 ["trainer.save_freq=-1", f"custom_reward_function.path={path}",
                                  "trainer.max_nonfinite_skips=3", "trainer.collective_timeout_s=60"], 3)
    assert rc == 0, out[-3000:]
    records = read_records(tmp_path, "nanreward")
    assert [r["step"] for r in records] == [1, 2, 3]
    # rank 0 (whose metrics these are) had finite rewards at step 2 and still applied nothing
    assert [r["train/nonfinite_streak"] for r in records] == [0.0, 1.0, 0.0]
    # the update phases ran at steps 1 and 3 only, on rank 0 too (a rank that trained alone would
    # wait for its peer's gradients: the run would hang and fail)
    assert ["timing_s/update_actor" in r for r in records] == [True, False, True]
    assert ["actor/pg_loss" in r for r in records] == [True, False, True]
    assert all(torch.isfinite(t).all() for t in saved_hf_weights(tmp_path, "nanreward", 3).values())
