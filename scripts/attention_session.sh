#!/usr/bin/env bash
# One device call for the attention work of a session: GPU tests (TESTS_K selects), the backward under memcheck, and
# benchmarks/attention_vs_cudnn.py with BENCH_ARGS. Everything lands in $OUT/attention.tar.gz plus a summary.
set -uo pipefail
OUT=${OUT:-$PWD/.out}; R=$OUT/r; mkdir -p "$R"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 KERNELKIT_CACHE=/tmp/kk-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$R/nvidia-smi.txt" 2>&1
t0=$(date +%s)
if [ -n "${TESTS_K:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -x -m gpu tests/test_attention_hopper.py ${TESTS_EXTRA:-} -k "$TESTS_K" \
    >"$R/gpu-tests.txt" 2>&1; echo "tests rc=$? $(tail -1 "$R/gpu-tests.txt") ($(( $(date +%s) - t0 ))s)" | tee -a "$R/summary.txt"
fi
if [ "${MEMCHECK:-1}" = 1 ]; then
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 python3 scripts/memcheck_attention_bwd.py \
    >"$R/memcheck-attention-bwd.txt" 2>&1; echo "memcheck rc=$? $(grep -c OK "$R/memcheck-attention-bwd.txt") OK ($(( $(date +%s) - t0 ))s)" | tee -a "$R/summary.txt"
  tail -3 "$R/memcheck-attention-bwd.txt"
fi
if [ -n "${BENCH_ARGS:-}" ]; then
  timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/attention_vs_cudnn.py --out "$R/bench.json" $BENCH_ARGS ${BENCH_ROWS:+--rows "$BENCH_ROWS"} 2>&1 | grep -v Warning | tee "$R/bench.txt"
  echo "bench done ($(( $(date +%s) - t0 ))s)" | tee -a "$R/summary.txt"
fi
tar -czf "$OUT/attention.tar.gz" -C "$OUT" r
cp "$R/summary.txt" "$OUT/" 2>/dev/null; true
