#!/usr/bin/env bash
# Everything that needs a GPU, in one call, within ~9.5 minutes on one H200 (torch 2.11, Triton
# 3.6, no internet): nothing is installed or downloaded; ringattn runs from src/.
#
#   bash scripts/gpu_bench.sh [OUT_DIR]        # default: results/gpu-<UTC date>
#   bash scripts/gpu_bench.sh "$OUT"            # through the device tool: outputs come back
#   PYTHON=.venv/bin/python GPU_BENCH_DRY_RUN=1 bash scripts/gpu_bench.sh /tmp/dry
#                                               # every stage at toy sizes, on a CPU (~40 s)
#
# Stages (each under its own time limit, all under one deadline; a stage that fails or runs out
# of time is recorded and the next one runs):
#   env      nvidia-smi, python/torch/triton/cuDNN versions
#   tests    pytest: every test marked gpu (Triton merge on CUDA, emulated ring on CUDA within the
#            bf16 gates, ...) and the CUDA block-kernel tests of tests/test_kernels.py
#   sweep    ringattn bench: MHA 32x128 bf16, causal zigzag and full, 4k-64k tokens per rank,
#            fwd and fwd+bwd, vs SDPA cuDNN and flash        -> bench_mha.json (+ .png)
#   million  ringattn bench --million: emulated 8-way ring over 1,048,576 causal tokens, 8 heads
#            x 128 (32 heads would not fit the time), checked against monolithic cuDNN
#                                                             -> million.json
#   check    ringattn check on 1 GPU (bf16, fp16; W = 1)
#   extra    GQA 32:8 causal sweep, and the merge decomposition at 4k/8k (kernels only / torch
#            merge / Triton merge)                            -> bench_gqa.json, bench_merge_*.json
#   apps     scripts/bench/gpu_apps.py: train --compile, train --hf --dtype bfloat16, generate --hf,
#            generate --checkpoint with and without --offload-kv, on the GPU at toy sizes
#                                                             -> apps.json, apps_*.log
#            (serve needs fastapi/uvicorn, which the GPU image lacks: carry wheels to add it)
# Every stage's output goes to OUT_DIR/<stage>.log; OUT_DIR/SUMMARY.txt lists status and seconds.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}"
DEADLINE_S="${GPU_BENCH_DEADLINE_S:-570}"  # the device tool stops a command at 600 s
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"  # PYTHON=... to pick another
export PY
SUMMARY="$OUT/SUMMARY.txt"
: > "$SUMMARY"

# run NAME BUDGET_S CMD...: at most BUDGET_S seconds and never past the deadline
run() {
    local name="$1" budget="$2"
    shift 2
    local left=$((DEADLINE_S - SECONDS))
    ((budget > left)) && budget=$left
    if ((budget < 15)); then
        echo "$name SKIPPED (deadline: ${left}s left)" | tee -a "$SUMMARY"
        return
    fi
    local start=$SECONDS
    echo "== $name (limit ${budget}s): $*" | tee -a "$OUT/$name.log"
    timeout --signal=TERM --kill-after=10 "$budget" "$@" >> "$OUT/$name.log" 2>&1
    local rc=$?
    local status="ok"
    ((rc == 124 || rc == 137)) && status="TIMEOUT"
    ((rc != 0 && rc != 124 && rc != 137)) && status="FAIL(rc=$rc)"
    echo "$name $status $((SECONDS - start))s" | tee -a "$SUMMARY"
    tail -n 25 "$OUT/$name.log"
}

env_report() {
    nvidia-smi || true
    "$PY" - <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import triton
    print("triton", triton.__version__)
except Exception as err:
    print("triton: not importable:", err)
try:
    import pytest
    print("pytest", pytest.__version__)
except Exception:
    print("pytest: not installed (the tests stage is skipped)")
PY
}

gpu_tests() {
    if ! "$PY" -c "import pytest" 2>/dev/null; then
        echo "pytest is not installed on this machine: carry a pytest wheel to run this stage"
        return 3
    fi
    local rc=0
    "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests || rc=$?
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py -k cuda || rc=$?
    return $rc
}

# GPU_BENCH_DRY_RUN=1: the same stages at toy sizes, to check this script on a CPU machine
if [[ "${GPU_BENCH_DRY_RUN:-0}" == 1 ]]; then
    MHA=2:2 GQA=4:2 SIZES=2x64,4x32 SMALL=2x64 GQA_SIZES=2x64,4x32 DIM=32
    MILLION=(--seq-len 1024 --head-dim 32)
else
    MHA=32:32 GQA=32:8 SIZES=8x4096,8x8192,4x16384,4x32768,2x65536 SMALL=8x4096,8x8192
    GQA_SIZES=8x4096,8x8192,4x16384 DIM=128 MILLION=()
fi
export -f env_report gpu_tests  # `timeout` runs commands, not functions: through bash -c
BENCH=("$PY" -m ringattn bench --head-dim "$DIM")
run env 30 bash -c env_report
run tests 120 bash -c gpu_tests
run sweep 170 "${BENCH[@]}" --heads "$MHA" --sizes "$SIZES" --masks causal,full \
    --repeats 3 --warmup 1 --json "$OUT/bench_mha.json" --plot "$OUT/bench_mha.png"
run million 130 "$PY" -m ringattn bench --million --heads 8:8 "${MILLION[@]}" \
    --json "$OUT/million.json"
run check 90 "$PY" -m ringattn check --nproc 1 --dtypes bfloat16,float16
run extra_gqa 60 "${BENCH[@]}" --heads "$GQA" --sizes "$GQA_SIZES" --masks causal \
    --repeats 3 --json "$OUT/bench_gqa.json"
INTERPRET=()  # the dry run forces the Triton merge through Triton's CPU interpreter
[[ "${GPU_BENCH_DRY_RUN:-0}" == 1 ]] && INTERPRET=(env TRITON_INTERPRET=1)
for merge in none torch triton; do
    run "extra_merge_$merge" 30 "${INTERPRET[@]}" "${BENCH[@]}" --heads "$MHA" --sizes "$SMALL" \
        --masks causal,full --passes fwd --baselines cudnn --merge "$merge" --repeats 5 \
        --json "$OUT/bench_merge_$merge.json"
done
APPS=("$PY" scripts/bench/gpu_apps.py "$OUT")
[[ "${GPU_BENCH_DRY_RUN:-0}" == 1 ]] && APPS+=(--dry-run)
run apps 150 "${APPS[@]}"
echo "total ${SECONDS}s; outputs in $OUT" >> "$SUMMARY"
echo "===== SUMMARY"
cat "$SUMMARY"
