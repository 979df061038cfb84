#!/usr/bin/env bash
# `make gpu-check`: every check this GPU machine can run, unattended, each under a timeout, then
# one JSON report (gpu-check/report.json) and a printed table: pass / fail / skipped with reason.
#
#   1. env        torch, CUDA, the GPUs, which optional packages are present
#   2. pytest     pytest -m gpu (tests/gpu: SGLang, TE, Triton compiled, CP, fusions, ...)
#   3. grpo       a 2-step GRPO run of recipes/gpu_check_grpo.yaml on one GPU, through SGLang
#                 when it is installed, else the transformers rollout on CUDA (rollout.name=hf)
#   4. benchmark  tools/benchmark.py step on the largest dense model that fits one GPU in a few
#                 minutes: tokens/s/GPU, MFU (whole step and actor update), peak memory, phases
#
# It never installs torch or reaches the network: it runs from this source tree with the
# packages present, plus wheels of small dependencies in .whl/ beside the tree (made on a
# machine with network access by `make gpu-wheels PYVER=3.12`, for the GPU machine's Python),
# installed with --no-deps into a scratch directory. A machine without a GPU exits 0.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PY="${PYTHON:-python3}"
OUT="${GPU_CHECK_OUT:-gpu-check}"
STEP_TIMEOUTS="env=30 pytest=170 grpo=120 benchmark=170"  # seconds; with the wheels, under 9 minutes

if ! timeout 60 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-check: no GPU here (torch sees no CUDA device): nothing to check"
    exit 0
fi

rm -rf "$OUT" && mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    site="${TMPDIR:-/tmp}/trident-gpu-site"
    timeout 45 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl > "$OUT/wheels.log" 2>&1 || echo "gpu-check: installing .whl/ failed (see $OUT/wheels.log)"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

limit_of() {
    local pair
    for pair in $STEP_TIMEOUTS; do
        if [[ "${pair%%=*}" == "$1" ]]; then echo "${pair#*=}"; return; fi
    done
    echo 60
}

# step NAME COMMAND...: run under its timeout, log to $OUT/NAME.log, record "NAME rc seconds"
step() {
    local name=$1 limit start rc
    shift
    limit=$(limit_of "$name")
    start=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name $rc $(( $(date +%s) - start )) $limit" >> "$OUT/steps.txt"
}

# skip NAME REASON: a check this machine cannot run
skip() {
    echo "$1 skipped 0 $2" >> "$OUT/steps.txt"
}

step env "$PY" tools/gpu_report.py env "$OUT/env.json"
has() { "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('$1') else 1)" 2>/dev/null; }

if has megatron.core; then
    step pytest "$PY" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider --junitxml "$OUT/pytest.xml"
    rollout=hf
    if has sglang; then rollout=sglang; fi
    step grpo "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m engine.train \
        recipes/gpu_check_grpo.yaml "actor_rollout_ref.rollout.name=$rollout" \
        "trainer.log_dir=$OUT/grpo" "trainer.default_local_dir=$OUT/grpo-ckpt"
    step benchmark "$PY" tools/benchmark.py step --workload gpu --nproc 1 --steps 2 --warmup 1 \
        --json "$OUT/benchmark.json" "actor_rollout_ref.rollout.name=$rollout"
else
    skip pytest "megatron-core is not importable: put its wheel in .whl/ (make gpu-wheels PYVER=3.12)"
    skip grpo "megatron-core is not importable"
    skip benchmark "megatron-core is not importable"
fi

"$PY" tools/gpu_report.py report "$OUT"
