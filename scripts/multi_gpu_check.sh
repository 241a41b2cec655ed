#!/usr/bin/env bash
# kernelkit under torch.distributed on one host with >= 2 GPUs (issue 31); parity ~1 min, bench ~8 min on 4 x H100:
#  1. parity: tests/test_distributed.py's checks on every GPU with NCCL (FSDP2 patched vs unpatched over 2 SGD
#     steps, with activation checkpointing, bf16 with the attention kernel; DCP save/load; tensor parallel on local
#     shards; SequenceParallel and DTensor arguments refused) -> $OUT/parity/parity-rank<r>.json
#  2. bench: Llama-3-8B shapes under FSDP2 (AdamW, bf16, full vocab), one training step per variant (eager, compile,
#     liger, kernelkit, kernelkit+compile, kernelkit-fp8, torchtitan's recipe): LAYERS=32 on NPROC GPUs with VARIANTS,
#     then the scaling runs, SCALE_LAYERS=8 on each of SCALE_NPROCS="1 2 NPROC" with SCALE_VARIANTS: step ms,
#     tokens/s per GPU and in total, MFU, peak GiB per rank, first/last loss, scaling efficiency
#     -> $OUT/fsdp_bench-<n>gpu-<layers>l.json, $OUT/fsdp_bench.json (every row), $OUT/bench-*.log
#     WHEELS: wheels (files or folders) installed first into /tmp/site, no index (torchtitan, liger; see docs)
#  3. doctor (not by default): this GPU's ceilings and the link sweep, all-gather and reduce-scatter 1 MiB..1 GiB on
#     every visible GPU (NCCL, spawned ranks), cached for the profile stage -> $OUT/doctor.json, $OUT/doctor.log
#  4. profile (not by default): `kernelkit profile --example hf-llama3-8b` (2 layers, seq 2048, batch 1 per GPU)
#     under torchrun with FSDP2: NCCL kernels, bus bandwidth vs the link, exposed communication, one report per
#     rank -> $OUT/profile/profile-rank<r>.json, trace-rank<r>.json, $OUT/profile.log (rank 0's summary)
#
#   export PYTHONPATH=$PWD/src; OUT=/tmp/out scripts/multi_gpu_check.sh
#   STAGES=doctor,profile OUT=/tmp/out scripts/multi_gpu_check.sh      # ~1.5 min on 4 GPUs
#   optional: NPROC (default: every GPU), SEQ=2048, BATCH=1 (per GPU), STEPS=5, WARMUP=3,
#             STAGES=parity,bench (also doctor, profile)
set -uo pipefail
OUT=${OUT:-$PWD/.out}
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
STAGES=${STAGES:-parity,bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KERNELKIT_CACHE=${KERNELKIT_CACHE:-/tmp/kernelkit-cache}
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}  # kernelkit from the tree, tests/ importable
has() { [[ ",$STAGES," == *",$1,"* ]]; }
log() { echo "== $(date +%T) $*" | tee -a "$OUT/steps.log"; }
if [ "$NPROC" -lt 2 ]; then log "needs >= 2 GPUs, found $NPROC"; exit 2; fi
RUN="python3 -m torch.distributed.run --standalone --nproc_per_node=$NPROC"
rc=0

if has parity; then
  log "parity checks, $NPROC ranks, NCCL"
  # KERNELKIT_TUNE=first: the tiny shapes launch the first config each pruner keeps instead of timing them all
  KERNELKIT_TUNE=first KERNELKIT_PATCH_CHOICE=kernelkit timeout "${PARITY_TIMEOUT:-150}" \
    $RUN -m tests.test_distributed "$OUT/parity" >"$OUT/parity.log" 2>&1
  prc=$?; log "parity rc=$prc (0: every check passed on every rank; 124: timed out)"; [ $prc = 0 ] || rc=1
  grep -E "^rank 0 " "$OUT/parity.log" | tee -a "$OUT/steps.log"
  rm -rf "$OUT/parity/dcp"  # the tiny checkpoints written by the state-dict check
fi

if has bench; then
  for w in ${WHEELS:-}; do  # the image has no network: wheels travel in the git-ignored .whl/
    if [ -d "$w" ]; then set -- "$w"/*.whl; else set -- $w; fi
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$@" || rc=1
  done
  [ -n "${WHEELS:-}" ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
  # kernelkit.patch as users call it: each switch keeps kernelkit only where it measured faster (the default)
  bench_run() {  # nproc layers variants timeout
    log "FSDP2 bench: $2 layers on $1 GPU(s), seq ${SEQ:-2048}, batch ${BATCH:-1} per GPU, variants $3"
    timeout "$4" python3 -m torch.distributed.run --standalone --nproc_per_node="$1" -m kernelkit.testing.fsdp_bench \
      --layers "$2" --seq "${SEQ:-2048}" --batch "${BATCH:-1}" --steps "${STEPS:-5}" --warmup "${WARMUP:-3}" \
      --variants "$3" --out "$OUT/fsdp_bench-$1gpu-$2l.json" >"$OUT/bench-$1gpu-$2l.log" 2>&1
    brc=$?; log "bench $1 GPU(s) $2 layers rc=$brc (124: timed out)"; [ $brc = 0 ] || rc=1
    grep -E '^\{"variant"' "$OUT/bench-$1gpu-$2l.log" | tee -a "$OUT/steps.log"
  }
  # LAYERS=0 or SCALE_LAYERS=0 leaves that part out (the two parts as two device calls)
  [ "${LAYERS:-32}" = 0 ] || bench_run "$NPROC" "${LAYERS:-32}" "${VARIANTS:-all}" "${BENCH_TIMEOUT:-420}"
  if [ "${SCALE_LAYERS:-8}" != 0 ]; then
    for n in ${SCALE_NPROCS:-1 2 $NPROC}; do
      bench_run "$n" "${SCALE_LAYERS:-8}" "${SCALE_VARIANTS:-eager,kernelkit,torchtitan}" "${SCALE_TIMEOUT:-150}"
    done
  fi
  # every row in one file, the scaling efficiency set against the fewest GPUs that ran the same config
  python3 -c "import glob, json, sys; from kernelkit.testing.fsdp_bench import add_scaling
docs = [json.load(open(p)) for p in sorted(glob.glob(sys.argv[1] + '/fsdp_bench-*gpu-*l.json'))]
rows = add_scaling([r for d in docs for r in d['rows']])
json.dump({'environment': docs[0]['environment'] if docs else {}, 'rows': rows}, open(sys.argv[1] + '/fsdp_bench.json', 'w'), indent=1)" "$OUT" || rc=1
fi

if has doctor; then
  log "doctor: ceilings of one GPU, then the link sweep on $NPROC GPUs (NCCL)"
  # every visible GPU (keep NPROC at their count, or profile finds no link ceiling for its ranks)
  timeout "${DOCTOR_TIMEOUT:-150}" python3 -m kernelkit.commands.cli doctor --json "$OUT/doctor.json" \
    >"$OUT/doctor.log" 2>&1
  drc=$?; log "doctor rc=$drc"; [ $drc = 0 ] || rc=1
  grep -E "link ceiling|skipped" "$OUT/doctor.log" | tee -a "$OUT/steps.log"
fi

if has profile; then
  log "profile under torchrun, FSDP2, Llama-3-8B shapes, 2 layers, seq 2048, batch 1 per GPU"
  # the projections' kernel timing and the graph timing are single-GPU questions: left out here
  timeout "${PROFILE_TIMEOUT:-150}" $RUN -m kernelkit.commands.cli profile --example hf-llama3-8b --fsdp \
    --steps 3 --no-time-kernels --no-measure-overhead --top 15 --out "$OUT/profile" >"$OUT/profile.log" 2>&1
  frc=$?; log "profile rc=$frc"; [ $frc = 0 ] || rc=1
  grep -E "^- communication|^communication" "$OUT/profile.log" | tee -a "$OUT/steps.log"
fi
exit $rc
