"""The measured GPU peak: a bf16 matmul timed with CUDA events lands below the datasheet's dense
bf16 figure and within reach of it (a timing or sync mistake is off by orders of magnitude)."""
import pytest
import torch

from engine.perf import measure_cuda_matmul_flops, peak_flops_per_rank, table_peak_flops

pytestmark = pytest.mark.gpu


def test_measured_bf16_peak_is_plausible():
    measured = peak_flops_per_rank("cuda", torch.float32)  # fp32 training still quotes bf16
    table = table_peak_flops(torch.cuda.get_device_name())
    if table is None:
        pytest.skip(f"no datasheet figure for {torch.cuda.get_device_name()}")
    assert 0.3 * table < measured < 1.1 * table, (measured, table)
    small = measure_cuda_matmul_flops(n=1024, seconds=0.2)
    assert small < measured * 1.1  # a small product cannot beat the large one by much
