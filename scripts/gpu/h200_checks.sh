#!/usr/bin/env bash
# The GPU rows of docs/RESULTS.md, on one machine with an NVIDIA GPU (recorded on one H200):
#
#   build     dsa backend build --cuda from a llama-cpp-python sdist (a trimmed copy is fine)
#   retrofit  dsa convert with DSA (indexer training, split search, ASQ k-means) on the GPU:
#             wall time, peak RSS and peak GPU memory from its --json report
#   runtime   scripts/bench/bench_runtime.py with every layer on the GPU: stock file vs llama-perplexity,
#             sparse llama.cpp vs kernels_ref (torch on the GPU), dense override vs stripped file
#   quant     dsa quantize --device cuda, AWQ Q4_0, at 6 and 12 blocks (calibration cost vs depth)
#   decode    scripts/verify_dsa_patch.py with every layer on the GPU: the decode path (gather of the
#             selected K/V rows) vs masked dense vs kernels_ref
#   bench     dsa bench on a synthetic llama-3.2-1b-shape Q4_K_M file (scripts/make_synth_gguf.py),
#             contexts $BENCH_CTX (default 4096,16384,32768), sparse and dense, flash attention off
#             (the quick build has no FA kernels), results appended to $BENCH_JSONL as they finish
#   asq       scripts/bench/bench_kv.py on the reference DSA file ($DSA_FILE, default WORK/ref-dsa.gguf; tokenizer dir
#             $TOK, default the model dir), every layer on the GPU: KV bytes as allocated and PPL for
#             f16 / q8_0 / q4_0 / ASQ, llama.cpp's ASQ PPL vs kernels_ref (torch on the GPU)
#   asqspeed  decode speed with the ASQ cache vs a q4_0 cache at 64K on the synthetic 1B shape with random
#             ASQ prototypes (make_synth_gguf.py --asq 64), flash attention on; the ASQ row once more with
#             LLAMA_DSA_FUSED=0 (the picks decoded into F32 + flash attention)
#   streams   scripts/gpu/check_streams.py on the synthetic 1B shape: decode logits with the concurrent CUDA streams
#             (the indexer's branch forked at attn_norm; with GGML_CUDA_GRAPH_OPT=1 upstream's fork too) and without
#             them (CUDA graphs off) must be bit-identical
#   decodecheck  scripts/gpu/check_decode.py on $DSA_FILE (trained indexer) with every layer on the GPU, --kv asq and
#             --kv f16: the decode path's in-place op vs its older form vs the masked path vs kernels_ref;
#             $DC_PREFILL prefill tokens (default 600; > 1024 so that the decodes' rows take the radix top-k)
#   speed     the speed grid: dsa bench sparse vs dense (flash attention on) on the synthetic
#             1B (and, with SPEED_8B=1, 8B; SPEED_8B=only: just 8B) shape at $SPEED_CTX (default 16384,65536,131072)
#             (SPEED_VARIANT=LLAMA_DSA_NAME=VALUE: one more sparse run per ctx with that switch, e.g. the A/B
#             of LLAMA_DSA_FUSED=0, or LLAMA_DSA_HOST_MASKS=1: every mask written by the host; by default the
#             prefill indexer mask and the decode masks are built in the graph; SPEED_ARGS: more dsa bench
#             options for every run, e.g. "--index-keys f16")
#   asqenc    scripts/gpu/cuda/asq_encode_check.cu: the patch's ASQ encode kernel form vs the previous one vs a CPU
#             reference of FORMAT.md section 6, byte-exact (ties aside), with timing
#   licheck   scripts/gpu/cuda/li_check.cu: the lightning-indexer kernel's earlier form vs the staged decode and
#             tiled prefill kernels vs a CPU reference, timed for decode and prefill at 4K-128K keys
#   cudachecks  scripts/gpu/cuda/run_cuda_check.sh topk, sattn and lid: the patch's radix top-k, sparse-attention
#             decode and decode lightning-indexer kernels (headers taken from the patch) vs CPU references and
#             (lid) the earlier decode kernel, with timings
#   lidcheck / topkcheck / sattncheck  one of those checks alone (separate steps can run in parallel)
#   lipcheck  scripts/gpu/cuda/lip_check.cu: two tensor-core prefill indexers (tc = a prototype with relu and weight
#             through shared memory per head; mma = the patch's, mma.sync) vs the patch's FP32 prefill kernel: error
#             and top-2048 overlap against a CPU reference, timing hot and cold
#   profile   scripts/bench/profile_decode.py on the synthetic 1B shape at $PROF_CTX (default 32768): wall ms per
#             decoded token, then per-kernel GPU time of 2 decode steps under Nsight Compute (ncu), sparse
#             and dense (PROF_ATTN to choose; PROF_KV=asq|q4_0 for the cache type, PROF_FILE); PROF_PREFILL=1:
#             also one prefill ubatch's kernels (PROF_PREFILL_ATTN="sparse dense" for both modes)
#   trace     a kernel timeline of TRACE_GEN decode steps (default 8) without Nsight Systems: scripts/gpu/cuda/kernel_trace.c
#             (a CUPTI injection library, built here with nvcc) records every kernel's GPU start / end and stream
#             while scripts/bench/profile_decode.py --profile runs, sparse and dense (TRACE_ATTN), on PROF_FILE (default the
#             synthetic 1B) at each of TRACE_CTX (default 131072); scripts/bench/trace_summary.py: span, busy and idle per
#             token, per kernel its charged time and the idle gap before it, a layer's attention block and one layer's
#             chain
#   hostprof  scripts/bench/profile_decode.py --what prefill at each of $HOSTPROF_CTX (default "16384 65536"), no
#             profiler: host µs per prefill ubatch (wait / graph / inputs / launch), sparse and dense
#   decodeverify  scripts/verify_dsa_patch.py on a stock copy of $DSA_FILE (strip_dsa.py) with every layer on
#             the GPU: decode path vs masked path vs kernels_ref, f16 / q8_0 caches with flash attention
#             (DV_F32=1: the copy's weights widened to F32)
#   indexer   scripts/bench/bench_dsa_quality.py at ctx 1024 / K 256 and 2048 / K 256 with 8 and 16
#             indexer heads (the gap to the oracle)
#
#   bash scripts/gpu/h200_checks.sh SHARED SDIST WORK [STEP ...]      (default: build retrofit runtime quant)
#
# SHARED holds models/ref-llama-27m, data/calib/books-calib.txt, data/wikitext-2-raw/wiki.test.raw.
# Results land in WORK (*.json, *.md, *.log); a step whose result exists is skipped.
set -euo pipefail
SHARED=$(realpath "$1"); SDIST=$(realpath "$2"); mkdir -p "$3"; WORK=$(realpath "$3"); shift 3
STEPS=${*:-build retrofit runtime quant}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
. scripts/gpu/system_compilers.sh     # CC, CXX, CUDAHOSTCXX for the backend build
export PYTHONUNBUFFERED=1 PYTHONPATH=$REPO:${PYTHONPATH:-} DSA_SHARED=$SHARED \
       DSA_WIKITEXT2=${DSA_WIKITEXT2:-$SHARED/data/wikitext-2-raw/wiki.test.raw}
MODEL=$SHARED/models/ref-llama-27m
CALIB=$SHARED/data/calib/books-calib.txt
dsa() { python3 -m dsa_convert.cli "$@"; }
stamp() { echo "== $(date -u +%FT%TZ) $*"; }
# a synthetic Q4_K_M file of a model shape (scripts/make_synth_gguf.py) unless it exists: synth FILE SHAPE [OPTIONS]
# a name with -shareG (gpu_batch.sh's synthsharebg files) gets --index-share G, so a step that makes a missing file
# never writes a G = 1 file under a shared file's name (docs/history §4z's first call did)
synth() {
  local share=""; [[ $(basename "$1") =~ -share([0-9]+) ]] && share="--index-share ${BASH_REMATCH[1]}"
  [ -f "$1" ] || python3 scripts/make_synth_gguf.py "$1" --shape "$2" --outtype q4_k_m --quiet "${@:3}" $share
}
# one scripts/gpu/cuda/run_cuda_check.sh check: its log in $WORK/NAME_check.log, the last LINES lines shown, its status
cuda_check() {
  local rc=0
  bash scripts/gpu/cuda/run_cuda_check.sh "$1" "$WORK/$1" > "$WORK/$1_check.log" 2>&1 || rc=$?
  tail -n "$2" "$WORK/$1_check.log"
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
for step in $STEPS; do
  stamp "$step"
  case $step in
  build)
    if ! dsa backend info --json 2>/dev/null | grep -q '"cuda": true'; then
      s=$(date +%s)
      dsa backend build --cuda --no-build-isolation --sdist "$SDIST" --cmake-arg=-DGGML_CUDA_FA=${CUDA_FA:-ON} \
        > "$WORK/build.log" 2>&1 || { tail -50 "$WORK/build.log"; exit 1; }
      echo "build seconds: $(( $(date +%s) - s ))" | tee -a "$WORK/build.log"
    fi
    dsa backend info --json | tee "$WORK/backend-info.json" ;;
  retrofit)
    # RETRO_TAG / RETRO_ARGS: another retrofit beside the default one, e.g. RETRO_TAG=-share2 RETRO_ARGS="--index-share 2"
    # writes ref-dsa-share2.gguf and retrofit-share2.json
    t=${RETRO_TAG:-}
    [ -s "$WORK/retrofit$t.json" ] || dsa convert "$MODEL" "$WORK/ref-dsa$t.gguf" --cluster-num 64 --top-k 512 --calib "$CALIB" \
      --outtype f16 --device cuda ${RETRO_ARGS:-} --json > "$WORK/retrofit$t.json"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r.get(k) for k in ('seconds','peak_rss_mib','peak_gpu_mib')})" "$WORK/retrofit$t.json" ;;
  runtime)
    [ -f "$WORK/ref-f16.gguf" ] || dsa convert "$MODEL" "$WORK/ref-f16.gguf" --outtype f16 --json > /dev/null
    [ -s "$WORK/runtime.md" ] || python3 scripts/bench/bench_runtime.py --stock "$WORK/ref-f16.gguf" --dsa "$WORK/ref-dsa.gguf" \
      --ctx 2048 --chunks 4 --stock-ctx 512 --stock-chunks 60 --n-gpu-layers 99 > "$WORK/runtime.md"
    cat "$WORK/runtime.md" ;;
  quant)
    [ -f "$WORK/ref-f16.gguf" ] || dsa convert "$MODEL" "$WORK/ref-f16.gguf" --outtype f16 --json > /dev/null
    [ -f "$WORK/ref-f16-x2.gguf" ] || python3 -c "import sys; sys.path.insert(0, 'scripts/bench'); from bench_quant import deepen; \
from pathlib import Path; deepen(Path(sys.argv[1]), Path(sys.argv[2]))" "$WORK/ref-f16.gguf" "$WORK/ref-f16-x2.gguf"
    for src in ref-f16 ref-f16-x2; do
      [ -s "$WORK/quant-$src.json" ] || dsa quantize "$WORK/$src.gguf" "$WORK/q4_0-$src.gguf" --type q4_0 --calib "$CALIB" \
        --samples 8 --seq-len 512 --group-size 32 --device cuda --json > "$WORK/quant-$src.json"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1], {k: r.get(k) for k in ('calib_seconds','seconds','peak_rss_mib','peak_gpu_mib')})" "$WORK/quant-$src.json"
    done ;;
  decode)
    [ -f "$WORK/ref-f32.gguf" ] || dsa convert "$MODEL" "$WORK/ref-f32.gguf" --outtype f32 --json > /dev/null
    python3 scripts/verify_dsa_patch.py "$WORK/ref-f32.gguf" --n-gpu-layers 99 | tee "$WORK/decode.txt" ;;
  bench)
    synth "$WORK/synth-1b-q4_k_m.gguf" llama-3.2-1b
    dsa bench "$WORK/synth-1b-q4_k_m.gguf" --ctx "${BENCH_CTX:-4096,16384,32768}" --gen 32 --no-flash-attn \
      --n-gpu-layers 999 --jsonl "${BENCH_JSONL:-$WORK/bench.jsonl}" --json > "$WORK/bench.json" || true
    cat "${BENCH_JSONL:-$WORK/bench.jsonl}" ;;
  asq)
    # KV_TAG: another result file (kv$KV_TAG.md), e.g. for a second DSA_FILE in the same session
    [ -s "$WORK/kv${KV_TAG:-}.md" ] || python3 scripts/bench/bench_kv.py --dsa "${DSA_FILE:-$WORK/ref-dsa.gguf}" --tokenizer "${TOK:-$MODEL}" \
      --ctx 2048 --chunks 4 --n-gpu-layers 99 --ref-device cuda ${ASQ_ARGS:-} --json "$WORK/kv${KV_TAG:-}.json" > "$WORK/kv${KV_TAG:-}.md"
    cat "$WORK/kv${KV_TAG:-}.md" ;;
  asqspeed)
    synth "$WORK/synth-1b-asq.gguf" llama-3.2-1b --asq 64
    # asq also without the decode path's in-place attention op over the ASQ cache (LLAMA_DSA_FUSED=0: decode
    # the picks into F32 + flash attention), in the same sweep (--variant)
    for kv in q4_0 asq; do
      dsa bench "$WORK/synth-1b-asq.gguf" --ctx 65536 --gen 32 --attn sparse --kv $kv --flash-attn --n-gpu-layers 999 \
        --force --jsonl "$WORK/asqspeed.jsonl" $([ $kv = asq ] && echo --variant LLAMA_DSA_FUSED=0) > /dev/null || true
    done
    cat "$WORK/asqspeed.jsonl" ;;
  speed)
    synth "$WORK/synth-1b-asq.gguf" llama-3.2-1b --asq 64
    files=("$WORK/synth-1b-asq.gguf")
    [ "${SPEED_8B:-0}" = only ] && files=()
    if [ "${SPEED_8B:-0}" != 0 ]; then
      synth "$WORK/synth-8b.gguf" llama-3.1-8b
      files+=("$WORK/synth-8b.gguf")
    fi
    for f in "${files[@]}"; do
      for c in $(echo "${SPEED_CTX:-16384,65536,131072}" | tr , ' '); do
        dsa bench "$f" --ctx $c --gen 32 --attn sparse,dense --kv f16 --flash-attn --n-gpu-layers 999 --force \
          ${SPEED_VARIANT:+--variant $SPEED_VARIANT} ${SPEED_ARGS:-} --jsonl "$WORK/speed.jsonl" > /dev/null || true
      done
    done
    cat "$WORK/speed.jsonl" ;;
  asqenc)
    nvcc -O3 -std=c++17 -arch=sm_90 -use_fast_math scripts/gpu/cuda/asq_encode_check.cu -o "$WORK/asq_encode_check" \
      && "$WORK/asq_encode_check" | tee "$WORK/asq_encode_check.txt" ;;
  licheck)
    nvcc -O3 -std=c++17 -arch=sm_90 -use_fast_math scripts/gpu/cuda/li_check.cu -o "$WORK/li_check" \
      && "$WORK/li_check" | tee "$WORK/li_check.txt" ;;
  lipcheck) cuda_check lip 20 ;; # the tensor-core prefill indexers (a prototype, the patch's) vs the FP32 one
  lidcheck) cuda_check lid 30 ;; # the decode lightning indexer alone (also part of cudachecks)
  topkcheck) cuda_check topk 8 ;; # the top-k selects alone (also part of cudachecks; separate steps run in parallel)
  sattncheck) cuda_check sattn 12 ;; # the sparse attention kernels alone (also part of cudachecks)
  cudachecks)
    rc=0
    cuda_check topk 3 || rc=1; cuda_check sattn 3 || rc=1; cuda_check lid 30 || rc=1
    [ $rc -eq 0 ] || exit $rc ;;
  profile)
    f=${PROF_FILE:-$WORK/synth-1b-asq.gguf}
    synth "$f" llama-3.2-1b --asq 64
    c=${PROF_CTX:-32768}
    python3 scripts/bench/profile_decode.py "$f" --ctx $c --gen 16 --kv ${PROF_KV:-f16} | tee "$WORK/profile-wall-$c.json"
    if [ -n "${PROF_PREFILL:-}" ]; then   # one prefill ubatch (the last 512 tokens of the context), PROF_PREFILL_ATTN
      python3 scripts/bench/profile_decode.py "$f" --ctx $c --what prefill | tee "$WORK/profile-prefill-wall-$c.json"
      for m in ${PROF_PREFILL_ATTN:-sparse}; do   # e.g. "sparse dense": the two GPU-time tables side by side
        ncu --profile-from-start off --clock-control none --cache-control ${NCU_CACHE:-none} --metrics gpu__time_duration.sum --csv --print-units base \
          --log-file "$WORK/ncu-prefill-$m-$c.csv" python3 scripts/bench/profile_decode.py "$f" --ctx $c --what prefill --attn $m \
          --profile > "$WORK/ncu-prefill-$m-$c.log" 2>&1 || tail -5 "$WORK/ncu-prefill-$m-$c.log"
        python3 scripts/bench/profile_decode.py --summary "$WORK/ncu-prefill-$m-$c.csv" --gen 1 | tee "$WORK/profile-prefill-$m-$c.txt" | head -30
      done
    fi
    for m in ${PROF_ATTN:-sparse dense}; do
      [ "$m" = none ] && continue   # PROF_ATTN=none: the prefill profile alone
      ncu --profile-from-start off --clock-control none --cache-control ${NCU_CACHE:-none} --metrics gpu__time_duration.sum --csv --print-units base \
        --log-file "$WORK/ncu-$m-$c.csv" python3 scripts/bench/profile_decode.py "$f" --ctx $c --gen 2 --attn $m --kv ${PROF_KV:-f16} --profile \
        > "$WORK/ncu-$m-$c.log" 2>&1 || tail -5 "$WORK/ncu-$m-$c.log"
      python3 scripts/bench/profile_decode.py --summary "$WORK/ncu-$m-$c.csv" --gen 2 | tee "$WORK/profile-$m-$c.txt" | head -40
    done ;;
  trace)
    CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
    CUPTI_INC=$(dirname "$(find "$CUDA_HOME"/ -name cupti.h 2>/dev/null | head -1)")
    CUPTI_LIB=$(dirname "$(find "$CUDA_HOME"/ -name 'libcupti.so*' 2>/dev/null | head -1)")
    nvcc -shared -Xcompiler -fPIC -o "$WORK/libktrace.so" scripts/gpu/cuda/kernel_trace.c -I"$CUPTI_INC" -L"$CUPTI_LIB" -lcupti
    f=${PROF_FILE:-$WORK/synth-1b-asq.gguf}
    synth "$f" llama-3.2-1b --asq 64
    tag=$(basename "$f" .gguf)${TRACE_TAG:+-$TRACE_TAG}   # TRACE_TAG: a suffix, e.g. for a run with a switch set
    for c in ${TRACE_CTX:-131072}; do
      LD_LIBRARY_PATH=$CUPTI_LIB:${LD_LIBRARY_PATH:-} CUDA_INJECTION64_PATH=$WORK/libktrace.so \
        KTRACE_OUT=$WORK/ktrace-$tag-$c.csv python3 scripts/bench/profile_decode.py "$f" --ctx $c --gen ${TRACE_GEN:-8} \
        --attn ${TRACE_ATTN:-sparse,dense} --profile | tee "$WORK/trace-wall-$tag-$c.json"
      python3 scripts/bench/trace_summary.py "$WORK/ktrace-$tag-$c.csv" --names ${TRACE_ATTN:-sparse,dense} --chain rms_norm,combine \
        --follow dsa_lid_kernel,topk_radix_persist --beside topk_radix_persist \
        > "$WORK/trace-$tag-$c.txt"
      head -60 "$WORK/trace-$tag-$c.txt"
    done ;;
  hostprof)
    # where a prefill ubatch's time goes on the host (no profiler): scripts/bench/profile_decode.py --what prefill fills the
    # context with the patch's LLAMA_DSA_HOST_TIMING=1 (per fill ubatch: the wait for the previous ubatch's GPU work,
    # graph build, inputs, input copies + launches), sparse and dense, at each of HOSTPROF_CTX
    f=${PROF_FILE:-$WORK/synth-1b-asq.gguf}
    synth "$f" llama-3.2-1b --asq 64
    for c in ${HOSTPROF_CTX:-16384 65536}; do
      python3 scripts/bench/profile_decode.py "$f" --ctx $c --what prefill | tee "$WORK/hostprof-prefill-$c.json"
    done ;;
  decodeverify)
    # the decode path on the GPU vs the masked path vs kernels_ref (scripts/verify_dsa_patch.py) on a stock copy of
    # $DSA_FILE with a random indexer (H 4, D 64): sparse prefill, single-token decodes, ubatch 4, f16 / q8_0 + FA
    # DV_F32=1: the stock copy's F16 weights widened to F32 (the GPU then multiplies the same weights as the CPU
    # reference, so the absolute checks test the CUDA decode path rather than F16 rounding)
    sfx=${DV_F32:+-f32}
    python3 scripts/strip_dsa.py "${DSA_FILE:-$WORK/ref-dsa.gguf}" "$WORK/ref-stock$sfx.gguf" ${DV_F32:+--f32}
    python3 scripts/verify_dsa_patch.py "$WORK/ref-stock$sfx.gguf" --n-gpu-layers 99 | tee "$WORK/decodeverify$sfx.txt" ;;
  streams)
    # concurrent CUDA streams (the indexer's branch on its own stream; with GGML_CUDA_GRAPH_OPT=1 also upstream's
    # fork) leave every decode's logits bit-identical to CUDA graphs off, for the f16 and the ASQ cache; a failure ends
    # the script with its status, as decodecheck's does
    # STREAMS_FILE: another 1B-shaped file, e.g. $WORK/synth-1b-share4.gguf (made by gpu_batch.sh's synthsharebg first:
    # synth keeps an existing file), whose shared layers fork too
    f=${STREAMS_FILE:-$WORK/synth-1b-asq.gguf}
    synth "$f" llama-3.2-1b --asq 64
    st="$WORK/streams-$(basename "$f" .gguf).txt"; rc=0; : > "$st"
    for kv in f16 asq; do
      python3 scripts/gpu/check_streams.py "$f" --prefill 2600 --decode 24 --kv $kv | tee -a "$st"
      [ ${PIPESTATUS[0]} -eq 0 ] || rc=1
    done
    [ $rc -eq 0 ] || exit $rc ;;
  decodecheck)
    rc=0
    for kv in asq f16; do
      python3 scripts/gpu/check_decode.py "${DSA_FILE:-$WORK/ref-dsa.gguf}" --kv $kv --prefill ${DC_PREFILL:-600} --decode 48 \
        --n-gpu-layers 99 > "$WORK/decodecheck-$kv.txt" || rc=1
      cat "$WORK/decodecheck-$kv.txt"
    done
    [ $rc -eq 0 ] || exit $rc ;;
  indexer)
    for h in 8 16; do
      [ -s "$WORK/indexer-h$h.json" ] || python3 scripts/bench/bench_dsa_quality.py --model "$MODEL" --calib "$CALIB" \
        --text "$DSA_WIKITEXT2" --points 1024:256,2048:256 --modes dense,sparse,oracle,local --chunks 4 --asq "" \
        --index-heads $h --device cuda --out "$WORK/indexer-h$h.json" > "$WORK/indexer-h$h.md" 2> "$WORK/indexer-h$h.log"
      cat "$WORK/indexer-h$h.md"
    done ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
stamp done
