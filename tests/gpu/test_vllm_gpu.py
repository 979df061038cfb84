"""vLLM (engine/rollout/vllm.py) on a GPU: after the trainer's weight sync, greedy generation equals
the training model's argmax on the same prefix; the same again after release / resume and a
second sync (the colocated schedule). Each case runs tests/gpu/vllm_rollout_main.py under torchrun
(vLLM's external_launcher joins torchrun's ranks). Skipped without vllm or CUDA."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,  # make gpu-check runs it (tools/gpu_check.sh GPU_TESTS: tests/gpu)
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install vllm==0.34.0 on a GPU machine)"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HERE = os.path.dirname(os.path.abspath(__file__))


def _run(tmp_path, gpus):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(gpus), os.path.join(HERE, "vllm_rollout_main.py"), str(out)],
                          capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check(results, gpus):
    from tests.gpu.vllm_rollout_main import LOGP_TOL, PROMPTS, STEPS

    assert [r["rank"] for r in results] == list(range(gpus))
    for r in results:  # every rank of the group gets the group's output (DP 1)
        assert r["buckets"] > 1 and r["buckets_again"] == r["buckets"]
        assert [len(t) for t in r["responses"]] == [STEPS] * len(PROMPTS)
        assert all(row["agree"] for row in r["rows"]), (r["responses"], r["expected"], r["rows"])
        assert all(row["logp_err"] < LOGP_TOL for row in r["rows"]), r["rows"]
        assert r["second"] == r["responses"]  # resumed and resynced: the same greedy tokens
        assert r["freed"] > 0  # sleep gave the weights and KV cache back to the device


def test_vllm_greedy_after_a_sync_is_the_training_argmax(tmp_path):
    _check(_run(tmp_path, 1), 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_vllm_tp2_greedy_after_a_sync_is_the_training_argmax(tmp_path):
    _check(_run(tmp_path, 2), 2)
