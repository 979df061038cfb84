#!/usr/bin/env bash
# `make gpu-check`, or without make: `bash tools/gpu_check.sh`. Every check this GPU machine can
# run, unattended, each under a timeout, then one JSON report (gpu-check/report.json) and a
# printed table: pass / fail / skipped with reason.
#
#   1. env        torch, CUDA, the GPUs, which optional packages are present
#   2. pytest     pytest -m gpu over GPU_TESTS (tests/gpu and the compiled Triton kernels'
#                 tests), each test under its own timeout when pytest-timeout is importable
#   3. grpo       a 2-step GRPO run of recipes/gpu_check_grpo.yaml on one GPU, through SGLang
#                 when it can serve here, else the transformers rollout on CUDA (rollout.name=hf);
#                 passes only when the rollout's probabilities of its own tokens agree with the
#                 trainer's (tools/gpu_report.py: training/rollout_probs_diff_max); its step 2
#                 runs under torch's profiler (global_profiler): grpo/step2_rank0.txt
#   4. benchmark  tools/benchmark.py step on the largest dense model that fits one GPU in a few
#                 minutes: tokens/s/GPU, MFU (whole step and actor update), peak memory, phases
#   5. attention  tools/benchmark.py attention: packed attention under Trident's SDPA order and
#                 cuDNN first, lengths new at every call and fixed (tools/bench_attention.py)
#
# The whole run ends inside BUDGET seconds (9 minutes) even when every step hits its limit: a
# step's limit is cut to what is left of the budget, and a step with too little left is skipped.
# Small report files go to $GPU_CHECK_OUT (gpu-check/); the GRPO checkpoint goes apart, to
# $GPU_CHECK_CKPT (gpu-check-ckpt/), so a copy of the report stays small.
#
# It never installs torch or reaches the network: it runs from this source tree with the
# packages present, plus wheels of small dependencies in .whl/ beside the tree (made on a
# machine with network access by `make gpu-wheels PYVER=3.12`, for the GPU machine's Python),
# installed with --no-deps into a scratch directory put before the caller's PYTHONPATH.
# A machine without a GPU exits 0. Tests only: GPU_CHECK_CPU=1 runs it on CPU anyway,
# GPU_CHECK_STEPS picks steps, GPU_CHECK_GRPO_ARGS appends overrides to the GRPO run.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

PY="${PYTHON:-python3}"
OUT="${GPU_CHECK_OUT:-gpu-check}"
CKPT="${GPU_CHECK_CKPT:-gpu-check-ckpt}"
STEPS="${GPU_CHECK_STEPS:-env pytest grpo benchmark attention}"
read -r -a GRPO_ARGS <<< "${GPU_CHECK_GRPO_ARGS:-}"
GPU_TESTS="tests/test_kernels_logprob.py tests/gpu"  # every file with a gpu-marked test, quick ones first
BUDGET=510          # seconds for the steps: with the report (20 s + kill), under 9 minutes
KILL_AFTER=5        # seconds a timed-out command gets after SIGTERM before SIGKILL
TEST_TIMEOUT=120    # seconds per gpu test (pytest-timeout): a spawned one starts CUDA per rank, twice
STEP_TIMEOUTS="env=20 pytest=250 grpo=180 benchmark=110 attention=75"  # seconds, each cut to what is left;
# grpo: 99 s after the pytest step; alone (second H200 run) it finished its 2 steps but ran past 130 s
# third H200 run: env 6, pytest 160, grpo 86, benchmark 81 s; attention ran past 40 s (rows now end at 6 s)
START=$(date +%s)

if [[ "${GPU_CHECK_CPU:-0}" != 1 ]] && ! timeout -k "$KILL_AFTER" 20 "$PY" -c \
        'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-check: no GPU here (torch sees no CUDA device): nothing to check"
    exit 0
fi

rm -rf "$OUT" "$CKPT" && mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    site="${TMPDIR:-/tmp}/trident-gpu-site"
    timeout -k "$KILL_AFTER" 40 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$site" .whl/*.whl > "$OUT/wheels.log" 2>&1 \
        || echo "gpu-check: installing .whl/ failed (see $OUT/wheels.log)"
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

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

# skip NAME REASON: a check this machine cannot run
skip() {
    echo "$1 skipped 0 $2" >> "$OUT/steps.txt"
}

# step NAME COMMAND...: run under its timeout (cut to the budget left), log to $OUT/NAME.log,
# record "NAME rc seconds limit"
step() {
    local name=$1 limit left start rc
    shift
    wanted "$name" || return 0
    limit=$(limit_of "$name")
    left=$(( BUDGET - ($(date +%s) - START) - KILL_AFTER ))
    if (( left < 10 )); then skip "$name" "no time left in the ${BUDGET}s budget"; return 0; fi
    if (( limit > left )); then limit=$left; fi
    start=$(date +%s)
    timeout --kill-after="$KILL_AFTER" "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name $rc $(( $(date +%s) - start )) $limit" >> "$OUT/steps.txt"
}

has() {
    timeout -k "$KILL_AFTER" 20 "$PY" -c \
        "import importlib.util as u, sys; sys.exit(0 if u.find_spec('$1') else 1)" 2>/dev/null
}

step env "$PY" tools/gpu_report.py env "$OUT/env.json"

if has megatron.core; then
    # pytest-timeout registers itself through its entry point (from .whl/ too: pip writes its
    # dist-info there); naming it again with -p registers it twice, which pytest refuses
    per_test=()
    if has pytest_timeout; then per_test=(--timeout "$TEST_TIMEOUT"); fi
    # shellcheck disable=SC2086  # GPU_TESTS is a list of paths
    step pytest "$PY" -m pytest -m gpu $GPU_TESTS -v -rs -p no:cacheprovider "${per_test[@]}" \
        --junitxml "$OUT/pytest.xml"
    rollout=hf  # SGLang where it can serve here (engine/rollout/registry.py decides), else transformers
    if timeout -k "$KILL_AFTER" 30 "$PY" -c \
        'import sys; from engine.rollout.registry import sglang_runs_here as ok; sys.exit(0 if ok() else 1)' \
        2>/dev/null; then rollout=sglang; fi
    step grpo "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m engine.train \
        recipes/gpu_check_grpo.yaml "actor_rollout_ref.rollout.name=$rollout" \
        "trainer.log_dir=$OUT/grpo" "trainer.default_local_dir=$CKPT" global_profiler.tool=torch \
        "global_profiler.steps=[2]" "global_profiler.save_path=$CKPT/profile" "${GRPO_ARGS[@]}"
    # the profile's tables beside the report; its trace (megabytes) stays with the checkpoint
    cp "$CKPT"/profile/*.txt "$OUT/grpo/" 2>/dev/null
    step benchmark "$PY" tools/benchmark.py step --workload gpu --nproc 1 --steps 2 --warmup 1 \
        --json "$OUT/benchmark.json" "actor_rollout_ref.rollout.name=$rollout"
    step attention "$PY" tools/benchmark.py attention --json "$OUT/attention.json"
else
    for name in pytest grpo benchmark attention; do
        wanted "$name" && skip "$name" "megatron-core is not importable: put its wheel in .whl/ (make gpu-wheels PYVER=3.12)"
    done
fi

timeout -k "$KILL_AFTER" 20 "$PY" tools/gpu_report.py report "$OUT"
