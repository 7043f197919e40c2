#!/usr/bin/env bash
# Build and run scripts/cuda/topk_check.cu: the CUDA radix-select top-k of the patched ggml
# (ggml/src/ggml-cuda/top-k-radix.cuh) vs a CPU reference, and its speed vs the old full-sort path.
#
#   bash scripts/cuda/run_topk_check.sh [OUTDIR] [--quick] [--compile-only]
#
# The kernel header is taken from $TOPK_RADIX_HEADER if set, else extracted from the new-file hunk of
# patches/llama.cpp/*.patch (or from the diff/patch files in $TOPK_PATCHES). nvcc: $NVCC or the one on PATH
# or /usr/local/cuda/bin/nvcc; architecture $CUDA_ARCH (default sm_90).
# Writes OUTDIR/topk_check (binary) and OUTDIR/topk_check.txt; exit status of the check (0: all rows equal).
# Runtime on an H200: compile ~40 s (2 CPU cores; less on 16), full run ~1-2 min (the CPU reference of
# 512 x 128K rows dominates), --quick ~20 s.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUTDIR=${1:-/tmp/topk_check}; shift || true
QUICK=""; COMPILE_ONLY=0
for a in "$@"; do
  case $a in --quick) QUICK=--quick ;; --compile-only) COMPILE_ONLY=1 ;; *) echo "unknown arg $a" >&2; exit 2 ;; esac
done
mkdir -p "$OUTDIR"
HDIR=$(mktemp -d)
trap 'rm -rf "$HDIR"' EXIT
if [ -n "${TOPK_RADIX_HEADER:-}" ]; then
  cp "$TOPK_RADIX_HEADER" "$HDIR/top-k-radix.cuh"
else
  # shellcheck disable=SC2086
  for p in ${TOPK_PATCHES:-$REPO/patches/llama.cpp/*.patch}; do
    awk '/^\+\+\+ b\/ggml\/src\/ggml-cuda\/top-k-radix\.cuh/ {on=1; next}
         on && /^diff --git / {exit}
         on && /^\+/ {print substr($0, 2)}' "$p" > "$HDIR/top-k-radix.cuh"
    [ -s "$HDIR/top-k-radix.cuh" ] && break
  done
fi
if [ ! -s "$HDIR/top-k-radix.cuh" ]; then
  echo "top-k-radix.cuh not found: the llama.cpp patch has no ggml/src/ggml-cuda/top-k-radix.cuh (fold issue #6's" \
       "top-k diff into patches/llama.cpp first) and TOPK_RADIX_HEADER is not set" >&2
  exit 2
fi
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
echo "== nvcc: $NVCC ($("$NVCC" --version | tail -1)), arch ${CUDA_ARCH:-sm_90}"
s=$(date +%s)
"$NVCC" -O3 -std=c++17 -arch="${CUDA_ARCH:-sm_90}" -I"$HDIR" "$REPO/scripts/cuda/topk_check.cu" -o "$OUTDIR/topk_check"
echo "== compiled in $(( $(date +%s) - s )) s: $OUTDIR/topk_check"
[ "$COMPILE_ONLY" = 1 ] && exit 0
set +e
"$OUTDIR/topk_check" $QUICK 2>&1 | tee "$OUTDIR/topk_check.txt"
rc=${PIPESTATUS[0]}
echo "== topk_check exit $rc"
exit "$rc"
