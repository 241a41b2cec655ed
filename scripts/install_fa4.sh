#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, CuTe DSL) on the GPU machine without network, in two calls to a machine kept warm
# (../shared/anchors/quack.md's recipe): `scripts/install_fa4.sh stage` with .fa4a/ carried (the first part of the
# repacked nvidia-cutlass-dsl-libs-cu13, kept in /tmp), then `scripts/install_fa4.sh install` with .fa4b/ (the second
# part and every other wheel). `install` prints the folders to put on PYTHONPATH as its last line:
#   export PYTHONPATH=$(scripts/install_fa4.sh install):$PWD/src
set -uo pipefail
SITE=/tmp/fa4site
case "${1:-}" in
  stage) cp .fa4a/part.aa /tmp/ && echo "staged $(du -h /tmp/part.aa | cut -f1)";;
  install)
    if [ ! -f "$SITE/.done" ]; then
      mkdir -p "$SITE" && cat /tmp/part.aa .fa4b/part.ab | xz -d | tar -xf - -C "$SITE" || { echo "fa4: unpack failed" >&2; exit 1; }
      for w in .fa4b/*.whl; do  # each into its own folder, then merged (pip --target skips a folder that exists)
        d=/tmp/fa4w-$(basename "$w" .whl)
        python3 -m pip install -q --no-deps --no-index --target "$d" "$w" >&2 && cp -r "$d"/. "$SITE"/
      done
      touch "$SITE/.done"
    fi
    P=$SITE/nvidia_cutlass_dsl/dsl_packages:$SITE
    PYTHONPATH=$P python3 -c "import flash_attn.cute; print('fa4: flash_attn.cute imports')" >&2
    echo "$P";;
  *) echo "usage: scripts/install_fa4.sh stage|install" >&2; exit 2;;
esac
