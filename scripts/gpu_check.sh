#!/usr/bin/env bash
# One call on the GPU machine: install without network, measure the ceilings, run the GPU tests, run the
# kernels under compute-sanitizer memcheck, and run the benchmarks. Everything lands in $OUT/results.tar.gz
# (the device tool returns at most 8 files) plus a summary. The bench stage appends its rows to the GPU's
# results table (benchmarks/results/<gpu>.csv) and packs the table: copy results/<gpu>.csv over the
# checkout's to commit them. Test and sanitizer logs are for reading, not committing; other outputs worth
# keeping go to benchmarks/experiments/<gpu>/<date>-<topic>/.
#
#   STAGES=doctor,test,sanitize,bench,profile,host,flce,gemm,demo,model,attention OPS="rms_norm softmax" [TESTS="tests/test_x.py"] scripts/gpu_check.sh
# The test stage runs the whole suite on the GPU (the CPU suite's edge cases through the real compiler, plus
# the gpu-marked tests); TEST_MARK=gpu narrows it to the gpu-marked ones. The host stage compares host time
# per call with a baseline tree carried in .base/src (git worktree add .base <commit>), when present.
# Optional: TEST_TUNE=first (tests run the first config each pruner keeps instead of timing all),
# BENCH_SHAPES='[(4, 4096, 16, 128, True)]' (instead of the op's bench shapes), BENCH_FLAGS="--no-compile",
# PYTEST_WORKERS=N (pytest-xdist), SANITIZE_JOBS=N (ops under memcheck side by side, overlapping the tests),
# TEST_TIMEOUT / SANITIZE_TIMEOUT / BENCH_TIMEOUT in seconds per stage (per op for the last two).
set -uo pipefail
OUT=${OUT:-$PWD/.out}
STAGES=${STAGES:-doctor,test,sanitize,bench}
OPS=${OPS:-all}
RES=$OUT/results
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 KERNELKIT_CACHE=${KERNELKIT_CACHE:-/tmp/kernelkit-cache}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
log() { echo "== $(date +%T) $*" | tee -a "$RES/steps.log"; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then  # Liger-Kernel and friends, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$RES/install.log" 2>&1
# pip can report success while the image's interpreter still cannot import the package: check, else use the tree
python3 -c "import kernelkit" 2>/dev/null || { log "kernelkit not importable after install, using PYTHONPATH=src"
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}; }
KK="python3 -m kernelkit.commands.cli"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$RES/nvidia-smi.csv" 2>&1

if has doctor; then
  log doctor; $KK doctor --json "$RES/doctor.json" 2>&1 | tee "$RES/doctor.log"
fi
sanitize_one() {  # one op under memcheck; its log and one line in sanitize.txt
  op=$1
  KERNELKIT_TUNE=first timeout "${SANITIZE_TIMEOUT:-600}" compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 \
    python3 -m kernelkit.commands.cli check "$op" --small --trials 1 >"$RES/sanitize-$op.log" 2>&1
  echo "$op memcheck rc=$?" | tee -a "$RES/sanitize.txt"
}
export -f sanitize_one; export RES
sanitize_pid=
if has sanitize; then
  ops=$([ "$OPS" = all ] && python3 -c "from kernelkit.ops import registry; print(' '.join(sorted(registry.all_ops())))" || echo $OPS)
  log "compute-sanitizer memcheck (${SANITIZE_JOBS:-1} at a time): $ops"
  # SANITIZE_JOBS>1 runs the ops side by side (the sanitizer is host-bound); with the test stage it overlaps too
  echo $ops | tr ' ' '\n' | xargs -P "${SANITIZE_JOBS:-1}" -I{} bash -c 'sanitize_one {}' &
  sanitize_pid=$!
  [ "${SANITIZE_JOBS:-1}" = 1 ] && { wait $sanitize_pid; sanitize_pid=; }
  # `check --small` stays under the cooperative rows' widths: they get their own case (ops/_coop.py)
  timeout "${SANITIZE_TIMEOUT:-600}" compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 \
    python3 scripts/coop_sanitize.py >"$RES/sanitize-coop.log" 2>&1
  echo "cooperative rows memcheck rc=$?" | tee -a "$RES/sanitize.txt"
  # the Gluon attention backward's variants (Triton dQ, 64-query steps, d64), which `check attention` does not reach: its own case
  timeout "${SANITIZE_TIMEOUT:-600}" compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 \
    python3 scripts/memcheck_attention_bwd.py >"$RES/sanitize-attention-bwd.log" 2>&1
  echo "attention backward (Gluon) memcheck rc=$?" | tee -a "$RES/sanitize.txt"
fi
if has test; then
  sel=()
  if [ -n "${TESTS:-}" ]; then sel=($TESTS)
  elif [ "$OPS" != all ]; then for op in $OPS; do [ -f "tests/test_${op}.py" ] && sel+=("tests/test_${op}.py"); done
  else sel=(tests); fi
  mark=(); [ -n "${TEST_MARK:-}" ] && mark=(-m "$TEST_MARK")
  workers=(); [ -n "${PYTEST_WORKERS:-}" ] && workers=(-n "$PYTEST_WORKERS")
  log "pytest ${workers[*]} ${mark[*]} ${sel[*]}"
  if [ ${#workers[@]} -gt 0 ]; then  # in parallel, then the tests marked alone (timings, memory) by themselves
    KERNELKIT_TUNE=${TEST_TUNE:-} timeout "${TEST_TIMEOUT:-1800}" python3 -m pytest -q "${workers[@]}" \
      -m "${TEST_MARK:+$TEST_MARK and }not alone" -p no:cacheprovider --timeout=300 \
      --junitxml="$RES/pytest-gpu.xml" "${sel[@]}" 2>&1 | tee "$RES/pytest-gpu.log" | tail -25
    [ -n "${SKIP_ALONE:-}" ] || log "pytest -m alone ${sel[*]}"
    [ -n "${SKIP_ALONE:-}" ] || KERNELKIT_TUNE=${TEST_TUNE:-} timeout "${TEST_TIMEOUT:-1800}" python3 -m pytest -q -m "${TEST_MARK:+$TEST_MARK and }alone" \
      -p no:cacheprovider --timeout=300 --junitxml="$RES/pytest-gpu-alone.xml" "${sel[@]}" 2>&1 \
      | tee "$RES/pytest-gpu-alone.log" | tail -25
  else
    KERNELKIT_TUNE=${TEST_TUNE:-} timeout "${TEST_TIMEOUT:-1800}" python3 -m pytest -q "${mark[@]}" -p no:cacheprovider --timeout=300 \
      --junitxml="$RES/pytest-gpu.xml" "${sel[@]}" 2>&1 | tee "$RES/pytest-gpu.log" | tail -25
  fi
fi
if [ -n "$sanitize_pid" ]; then wait $sanitize_pid; log "memcheck done"; sort "$RES/sanitize.txt"; fi
if has bench; then
  for op in $([ "$OPS" = all ] && echo all || echo $OPS); do
    log "bench $op"
    timeout "${BENCH_TIMEOUT:-1800}" $KK bench "$op" --out "$RES/bench" ${BENCH_FLAGS:-} ${BENCH_SHAPES:+--shapes "$BENCH_SHAPES"} \
      2>&1 | tee -a "$RES/bench.log"
  done
  cp benchmarks/results/*.csv "$RES/" && log "packed the results tables: $(ls benchmarks/results/*.csv)"
fi
if has host && [ -d .base/src ]; then
  HOST_OPS=${HOST_OPS:-"rope layer_norm softmax rms_norm add_rms_norm swiglu cross_entropy"}
  for round in $(seq 1 ${HOST_ROUNDS:-2}); do  # interleaved, twice by default: drift of the host's speed shows up as disagreement between rounds
    for tree in .base/src src; do
      log "host time per call ($tree, round $round)"
      PYTHONPATH=$PWD/$tree KERNELKIT_TUNE=first timeout ${HOST_TIMEOUT:-150} python3 scripts/host_time.py $HOST_OPS 2>&1 | tee -a "$RES/host.log"
    done
  done
fi
if has flce && [ -f benchmarks/linear_cross_entropy.py ]; then
  log "fused linear cross-entropy"; timeout 420 python3 benchmarks/linear_cross_entropy.py --out "$RES/linear_cross_entropy.json" 2>&1 | tee "$RES/flce.log" | tail -30
fi
if has gemm && [ -f benchmarks/gemm.py ]; then
  log "GEMM vs cuBLAS"; timeout ${GEMM_TIMEOUT:-420} python3 benchmarks/gemm.py --out "$RES/gemm.json" ${GEMM_FLAGS:-} 2>&1 | tee "$RES/gemm.log" | tail -40
fi
if has demo; then  # `make demo` on a new machine: no tuning cache, no compiled kernels; the image's python as .venv
  log "make demo, cold caches"
  # a script, not a symlink: a link to the image's venv python would lose that venv's site-packages
  mkdir -p .venv/bin && printf '#!/bin/sh\nexec python3 "$@"\n' > .venv/bin/python && chmod +x .venv/bin/python
  printf '#!/bin/sh\nexec python3 -m kernelkit "$@"\n' > .venv/bin/kernelkit && chmod +x .venv/bin/kernelkit && touch .venv/.installed
  t0=$(date +%s)
  KERNELKIT_CACHE=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) timeout ${DEMO_TIMEOUT:-300} make demo 2>&1 | tee "$RES/demo.log" | tail -30
  echo "make demo, cold: rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s" | tee -a "$RES/demo.log" "$RES/steps.log"
fi
if has attention; then  # issue 28: the Gluon forward's GPU tests, memcheck, and the table against cuDNN / FA2 / FA4
  log "attention GPU tests"; timeout ${ATTN_TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu tests/test_attention_hopper.py \
    ${ATTN_TESTS:-tests/test_attention.py} 2>&1 | tee "$RES/attention-tests.log" | tail -15
  log "attention memcheck"; compute-sanitizer --tool memcheck --error-exitcode 3 python3 -c "
import torch; from kernelkit.ops.attention import attention, forward as f
for d, c in ((128, True), (64, False)):
    q, k, v = (torch.randn(2, 333, h, d, device='cuda', dtype=torch.bfloat16) for h in (4, 2, 2))
    attention(q, k, v, causal=c); torch.cuda.synchronize()
print('gluon memcheck ran')" >"$RES/attention-memcheck.log" 2>&1; echo "attention memcheck rc=$?" | tee -a "$RES/steps.log"
  tail -3 "$RES/attention-memcheck.log"
  log "attention vs cuDNN"; timeout ${ATTN_BENCH_TIMEOUT:-420} python3 benchmarks/attention_vs_cudnn.py \
    --out "$RES/attention_vs_cudnn.json" ${ATTN_FLAGS:-} 2>&1 | tee "$RES/attention-bench.log" | tail -20
fi
if has model; then
  log "bench model"; timeout ${MODEL_TIMEOUT:-590} $KK bench model --out "$RES/model" ${MODEL_FLAGS:-} 2>&1 | tee "$RES/model.log" | tail -40
fi
if has profile; then
  log "profile --example llama"; $KK profile --example llama --out "$RES/profile" 2>&1 | tee "$RES/profile.log" | tail -12
  python3 -c "import json,sys; rows=[r for r in json.load(open(sys.argv[1]))['rows'] if r.get('pct_roof')]; top=sorted(rows,key=lambda r:-r['pct_roof']); print('profile rows: %d, max %% of roof %.1f, rows over 102%%: %d' % (len(rows), top[0]['pct_roof'], sum(r['pct_roof']>102 for r in rows))); [print('  %.1f %s %s %s %s' % (r['pct_roof'], r['op'], r['module'], r['phase'], r['regime'])) for r in top[:6]]" "$RES/profile/profile.json" 2>&1 | tee -a "$RES/steps.log"
fi
tar -czf "$OUT/results.tar.gz" -C "$OUT" results && log "packed $OUT/results.tar.gz"
