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
# The kernel headers include ggml-cuda/common.cuh (they launch through ggml's ggml_cuda_kernel_launch and its PDL
# helpers), so a check compiles against a whole patched llama.cpp source tree: $CHECK_LLAMA_DIR if set (e.g. a git
# tree with the series applied), else the llama-cpp-python sdist's vendor/llama.cpp ($DSA_SDIST, else the backend
# cache's or PyPI's: dsa_convert.backend.build.find_sdist) patched with patches/llama.cpp/*.patch (or the diff/patch
# files in $CHECK_PATCHES) in a temporary directory. check_common.cuh defines the two host helpers of ggml-cuda.cu
# that the launch helper calls. nvcc: $NVCC or the one on PATH or /usr/local/cuda/bin/nvcc (its toolkit must have
# cuBLAS's headers, which common.cuh includes); architecture $CUDA_ARCH (default sm_90).
# Writes OUTDIR/CHECK_check (binary) and OUTDIR/CHECK_check.txt; exit status of the check (0: all cases pass).
# Runtime on an H200: topk compiles in ~40 s and runs 1-2 min (--quick ~20 s); sattn ~10 s + a few seconds; lid
# ~10 s + a few seconds.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
CHECK=${1:?usage: run_cuda_check.sh topk|sattn|lid|lip|latency [OUTDIR] [--quick] [--compile-only]}; shift
case $CHECK in
  topk|sattn|lid|lip|latency) ;;
  *) echo "unknown check $CHECK (topk, sattn, lid, lip or latency)" >&2; exit 2 ;;
esac
OUTDIR=${1:-/tmp/${CHECK}_check}; shift || true
QUICK=""; COMPILE_ONLY=0
for a in "$@"; do
  case $a in --quick) QUICK=--quick ;; --compile-only) COMPILE_ONLY=1 ;; *) echo "unknown arg $a" >&2; exit 2 ;; esac
done
[ "$CHECK" = sattn ] || [ "$CHECK" = lip ] && QUICK=""   # one size only
mkdir -p "$OUTDIR"
if [ -n "${CHECK_LLAMA_DIR:-}" ]; then
  LDIR=$CHECK_LLAMA_DIR
else
  TDIR=$(mktemp -d)
  trap 'rm -rf "$TDIR"' EXIT
  SDIST=${DSA_SDIST:-$(cd "$REPO" && python3 -c "from dsa_convert.backend.build import BuildConfig, find_sdist; print(find_sdist(BuildConfig()))")}
  tar xzf "$SDIST" -C "$TDIR"
  LDIR=$(echo "$TDIR"/llama_cpp_python-*/vendor/llama.cpp)
  # shellcheck disable=SC2086
  for p in ${CHECK_PATCHES:-$REPO/patches/llama.cpp/*.patch}; do
    patch -d "$LDIR" -p1 --forward --batch --quiet -i "$p"
  done
fi
if [ ! -f "$LDIR/ggml/src/ggml-cuda/top-k-radix.cuh" ]; then
  echo "$LDIR is not a patched llama.cpp tree (no ggml/src/ggml-cuda/top-k-radix.cuh)" >&2
  exit 2
fi
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
echo "== nvcc: $NVCC ($("$NVCC" --version | tail -1)), arch ${CUDA_ARCH:-sm_90}"
s=$(date +%s)
"$NVCC" -O3 -std=c++17 -arch="${CUDA_ARCH:-sm_90}" -I"$LDIR/ggml/src/ggml-cuda" -I"$LDIR/ggml/src" -I"$LDIR/ggml/include" \
  "$REPO/scripts/gpu/cuda/${CHECK}_check.cu" -o "$OUTDIR/${CHECK}_check"
echo "== compiled in $(( $(date +%s) - s )) s: $OUTDIR/${CHECK}_check"
[ "$COMPILE_ONLY" = 1 ] && exit 0
set +e
"$OUTDIR/${CHECK}_check" $QUICK 2>&1 | tee "$OUTDIR/${CHECK}_check.txt"
rc=${PIPESTATUS[0]}
echo "== ${CHECK}_check exit $rc"
exit "$rc"
