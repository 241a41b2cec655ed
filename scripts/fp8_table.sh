#!/usr/bin/env bash
# Issue 30's step table on the GPU machine, one variant per process (kernelkit.testing.model_bench), each with
# its own time limit so one slow variant cannot take the others with it. Writes $OUT/r.tgz.
#   SHAPE=1b|8b VARIANTS="eager kernelkit-fp8+compile ..." [TAG=-forced] [NO_TAR=1] scripts/fp8_table.sh
# TAG suffixes the files' names (a second run with other switches, e.g. KERNELKIT_PATCH_CHOICE=kernelkit); NO_TAR=1
# leaves $OUT/r as it is for a later run to add to.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELKIT_CACHE=${KERNELKIT_CACHE:-/tmp/kkc}
if ls .whl/liger/*.whl .whl/torchao/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/liger/*.whl .whl/torchao/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
O=$OUT/r; mkdir -p "$O"
case ${SHAPE:-1b} in
  1b) args=(--example llama-1b --layers 4 --batch 8 --seq 2048);;
  8b) args=(--example llama --layers 2 --batch 4 --seq 2048);;
esac
nvidia-smi --query-gpu=name,driver_version --format=csv > "$O/gpu.csv"
for v in ${VARIANTS:-eager torch.compile kernelkit+compile kernelkit-fp8 kernelkit-fp8+compile torchao-fp8+compile}; do
  t0=$(date +%s)
  timeout "${VARIANT_TIMEOUT:-150}" python3 -m kernelkit.testing.model_bench --variant "$v" "${args[@]}" --steps 5 \
    --json "$O/${SHAPE:-1b}-$v${TAG:-}.json" > "$O/${SHAPE:-1b}-$v${TAG:-}.log" 2>&1
  echo "$v${TAG:-} rc=$? $(( $(date +%s) - t0 ))s $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"{d.get('step_ms',0):.1f} ms peak {d.get('peak_gib',0):.2f} GiB loss {d.get('loss',0):.4f}\")" "$O/${SHAPE:-1b}-$v${TAG:-}.json" 2>/dev/null)"
done
[ -n "${NO_TAR:-}" ] || { cd "$OUT" && tar czf r.tgz r && rm -rf r; }
