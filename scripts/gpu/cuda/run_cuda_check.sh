#!/usr/bin/env bash
# Build and run one of the standalone CUDA checks that include a kernel header of the patched ggml:
#   topk   scripts/gpu/cuda/topk_check.cu:  the radix-select top-k (ggml/src/ggml-cuda/top-k-radix.cuh) vs a CPU
#          reference, and its speed vs the old full-sort path
#   sattn  scripts/gpu/cuda/sattn_check.cu: the sparse-attention decode kernel (ggml/src/ggml-cuda/
#          dsa-sparse-attn-kernels.cuh) vs a double-precision CPU reference, and its time on the 1B / 8B shapes
#   lid    scripts/gpu/cuda/lid_check.cu: the decode lightning indexer (ggml/src/ggml-cuda/dsa-lightning-indexer-decode.cuh)
#          bit-equal to the earlier decode kernel and vs a double-precision CPU reference, both timed back to back and
#          with a cold L2 (sattn likewise)
#   lip    scripts/gpu/cuda/lip_check.cu: the patch's two tensor-core prefill indexers (dsa-lightning-indexer-tc.cuh,
#          dsa-lightning-indexer-mma.cuh) and a first tensor-core prototype against the patch's FP32 prefill kernel
#          (dsa-lightning-indexer-prefill.cuh) and a CPU reference, all timed
#   latency scripts/gpu/cuda/latency_check.cu: what one more dependent kernel costs in a CUDA graph (plain, with
#          programmatic dependent launch, with a memset node between) against one more grid barrier inside a
#          persistent kernel (the patch's topk_radix_row_barrier); a measurement
#
#   bash scripts/gpu/cuda/run_cuda_check.sh CHECK [OUTDIR] [--quick] [--compile-only]
#
# The kernel headers are taken from $CHECK_HEADER_DIR (a ggml-cuda source dir) or $CHECK_HEADER (a file of that
# name) if set, else extracted from the new-file hunks of patches/llama.cpp/*.patch (or of the diff/patch files in
# $CHECK_PATCHES). nvcc: $NVCC or the one on PATH
# or /usr/local/cuda/bin/nvcc; architecture $CUDA_ARCH (default sm_90).
# Writes OUTDIR/CHECK_check (binary) and OUTDIR/CHECK_check.txt; exit status of the check (0: all cases pass).
# Runtime on an H200: topk compiles in ~40 s and runs 1-2 min (--quick ~20 s); sattn ~10 s + a few seconds; lid
# ~10 s + a few seconds.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
CHECK=${1:?usage: run_cuda_check.sh topk|sattn|lid|lip|latency [OUTDIR] [--quick] [--compile-only]}; shift
case $CHECK in
  topk)  HEADERS="top-k-key.cuh top-k-radix.cuh top-k-radix-persist.cuh top-k-radix-cluster.cuh top-k-radix-rows.cuh" ;;
  sattn) HEADERS="top-k-key.cuh dsa-lid-rope.cuh dsa-lightning-indexer-decode.cuh dsa-sparse-attn-kernels.cuh dsa-sparse-attn-tc.cuh" ;;
  lid)   HEADERS="top-k-key.cuh dsa-lid-rope.cuh dsa-lightning-indexer-decode.cuh" ;;
  lip)   HEADERS="top-k-key.cuh dsa-lid-rope.cuh dsa-lightning-indexer-decode.cuh dsa-lightning-indexer-prefill.cuh dsa-lightning-indexer-tc.cuh dsa-lightning-indexer-mma.cuh" ;;
  latency) HEADERS="top-k-key.cuh top-k-radix.cuh top-k-radix-persist.cuh" ;;
  *) echo "unknown check $CHECK (topk, sattn, lid, lip or latency)" >&2; exit 2 ;;
esac
OUTDIR=${1:-/tmp/${CHECK}_check}; shift || true
QUICK=""; COMPILE_ONLY=0
for a in "$@"; do
  case $a in --quick) QUICK=--quick ;; --compile-only) COMPILE_ONLY=1 ;; *) echo "unknown arg $a" >&2; exit 2 ;; esac
done
[ "$CHECK" = sattn ] || [ "$CHECK" = lip ] && QUICK=""   # one size only
mkdir -p "$OUTDIR"
HDIR=$(mktemp -d)
trap 'rm -rf "$HDIR"' EXIT
for HEADER in $HEADERS; do
  if [ -n "${CHECK_HEADER_DIR:-}" ]; then
    cp "$CHECK_HEADER_DIR/$HEADER" "$HDIR/$HEADER"
  elif [ -n "${CHECK_HEADER:-}" ] && [ "$(basename "$CHECK_HEADER")" = "$HEADER" ]; then
    cp "$CHECK_HEADER" "$HDIR/$HEADER"
  else
    # shellcheck disable=SC2086
    for p in ${CHECK_PATCHES:-$REPO/patches/llama.cpp/*.patch}; do
      awk -v h="+++ b/ggml/src/ggml-cuda/$HEADER" '$0 == h {on=1; next}
           on && /^diff --git / {exit}
           on && /^\+/ {print substr($0, 2)}' "$p" > "$HDIR/$HEADER"
      [ -s "$HDIR/$HEADER" ] && break
    done
  fi
  if [ ! -s "$HDIR/$HEADER" ]; then
    echo "$HEADER not found: the llama.cpp patch has no ggml/src/ggml-cuda/$HEADER and neither CHECK_HEADER_DIR nor CHECK_HEADER provides it" >&2
    exit 2
  fi
done
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
echo "== nvcc: $NVCC ($("$NVCC" --version | tail -1)), arch ${CUDA_ARCH:-sm_90}"
s=$(date +%s)
"$NVCC" -O3 -std=c++17 -arch="${CUDA_ARCH:-sm_90}" -I"$HDIR" "$REPO/scripts/gpu/cuda/${CHECK}_check.cu" -o "$OUTDIR/${CHECK}_check"
echo "== compiled in $(( $(date +%s) - s )) s: $OUTDIR/${CHECK}_check"
[ "$COMPILE_ONLY" = 1 ] && exit 0
set +e
"$OUTDIR/${CHECK}_check" $QUICK 2>&1 | tee "$OUTDIR/${CHECK}_check.txt"
rc=${PIPESTATUS[0]}
echo "== ${CHECK}_check exit $rc"
exit "$rc"
