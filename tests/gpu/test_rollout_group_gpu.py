"""Rollout TP 2 with real SGLang on two GPUs: one engine on the group leader, the hand-off
inside the group, greedy generation equal to the training logits' argmax."""
import json
import os
import subprocess
import sys

import pytest
import torch

from engine.rollout.registry import sglang_installed

pytestmark = pytest.mark.gpu
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.skipif(not sglang_installed(), reason="sglang is not installed")
def test_rollout_tp2_group_generates_the_training_argmax(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(HERE, "rollout_group_main.py"), str(out)],
                          capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    leader, member = json.loads(out.read_text())
    assert leader["holds_engine"] and not member["holds_engine"]
    assert leader["buckets"] > 1 and all(leader["agree"]), (leader["responses"], leader["expected"])
