#!/usr/bin/env bash
# Sparse against dense decode and prefill speed on one H200 (synthetic 1B / 8B shapes), llama-bench anchors, and
# `dsa run` beside `dsa bench`.
#
#   bash scripts/gpu/h200_speed.sh WORK OUT [STEP ...]
#
# WORK: scratch for the synthetic GGUFs (1B Q4_K_M ~0.9 GB, 8B ~4.9 GB, plus stripped stock copies) — never
#       under OUT. OUT: small results (*.json, *.jsonl, *.txt, the top-k test binary), e.g. the device's $OUT.
# A step whose result exists in OUT (or whose file exists in WORK) is skipped, so each step can be one device
# command (the device allows 10 minutes per command).
#
# Needs the patched CUDA backend installed WITH flash-attention kernels (`dsa backend build --cuda` without
# --cmake-arg=-DGGML_CUDA_FA=OFF, as scripts/gpu/h200_checks.sh's `build` step does unless CUDA_FA=OFF; the steps
# below refuse a backend without them). Step `build` does that build (SDIST=<llama-cpp-python sdist>).
# The `speed` step of h200_checks.sh (through gpu_batch.sh) runs the repeated sweeps of RESULTS §8; the anchor steps
# here are the only harness for llama-bench's dense anchors (tok/s of the stock file at depths 0-128K).
#
# Steps (default: topk synth1b bench1b anchor1b synth8b bench8b anchor8b); device-time estimates, H200:
#   build     dsa backend build --cuda (FA kernels on), in the background; waits up to BUILD_WAIT s (default
#             540), re-run the step to keep waiting. A full CUDA build with FA is ~10-20 min on 16 cores.
#   topk      scripts/gpu/cuda/run_cuda_check.sh topk: radix-select top-k vs CPU reference (set equality, ties,
#             CUDA-graph replay) + old full sort vs new timings, 4K..128K columns, 1 and 512 rows, k 2048
#             (~1.5-2.5 min: nvcc ~40 s, the rest is the CPU reference; TOPK_QUICK=1: ~40 s)
#   synth1b   make_synth_gguf.py llama-3.2-1b Q4_K_M, top-k 2048 (~30-60 s)
#   bench1b   dsa bench, ctx 16384,65536,131072, sparse and dense, flash attention on, all layers on the GPU,
#             --gen 32 (~1-2 min; the 131072 prefills dominate, sparse pays the host DSA mask: ~34 GB of F32
#             mask writes over a 128K prefill)
#   anchor1b  llama-bench -fa 1 -ngl 99 -n 32 -p $LB_PROMPT(0) -d 0,16384,65536,131072 -r $LB_REPS(2) on the
#             stripped (stock) file = dense anchor, and on the DSA file = sparse through llama.cpp's own
#             harness (tg after a prefill to each depth; the depth prefill is not timed) (~1 min)
#   synth8b   same for llama-3.1-8b (F16 write 16 GB + llama-quantize: ~3-5 min)
#   bench8b   dsa bench on the 8B file (~3-5 min; 131072 alone ~2-3 min: if the 10-minute limit is a risk,
#             run with BENCH8B_CTX=16384,65536 first, then BENCH8B_CTX=131072 into another OUT)
#   anchor8b  llama-bench on the 8B files (~2-4 min)
#   run8b     `dsa run` on the 8B file, sparse and dense, greedy, f16 cache, a RUN_PROMPT-token prompt (default
#             65280 of book text cut with the file's tokenizer; RUN_FILLER: the text) in a 65536 context, 128 new
#             tokens: the user-facing generation speed beside bench8b's decode (~1-2 min)
# Total without build: ~12-20 min of device time with 8B, ~4-5 min for topk + 1B only.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,34p' "$0"; exit 2; }
mkdir -p "$1" "$2"; WORK=$(realpath "$1"); OUT=$(realpath "$2"); shift 2
STEPS=${*:-topk synth1b bench1b anchor1b synth8b bench8b anchor8b}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
. scripts/gpu/system_compilers.sh     # CC, CXX, CUDAHOSTCXX for the backend build
export PYTHONUNBUFFERED=1 PYTHONPATH=$REPO:${PYTHONPATH:-}
CACHE=${DSA_CACHE:-$HOME/.cache/dsa}
CUR=$CACHE/backend/current
CTX=${BENCH_CTX:-16384,65536,131072}
dsa() { python3 -m dsa_convert.cli "$@"; }
stamp() { echo "== $(date -u +%FT%TZ) $*"; }

need_fa_backend() {
  [ -f "$CUR/build.json" ] || { echo "no backend build in $CUR: run the build step (or dsa backend build --cuda)" >&2; exit 3; }
  if ! grep -q '"cuda": true' "$CUR/build.json"; then echo "backend in $CUR is not a CUDA build" >&2; exit 3; fi
  if grep -q 'GGML_CUDA_FA=OFF' "$CUR/build.json"; then
    echo "backend in $CUR was built with -DGGML_CUDA_FA=OFF: flash attention would fall back to the CPU." \
         "Run: SDIST=<sdist> bash scripts/gpu/h200_speed.sh WORK OUT build" >&2
    exit 3
  fi
}

synth() { # shape file
  # written under another name and renamed when complete: a step cut short leaves no file that looks finished
  [ -f "$WORK/$2" ] || { s=$(date +%s); python3 scripts/make_synth_gguf.py "$WORK/part-$2" --shape "$1" --outtype q4_k_m \
      --top-k 2048 --force --quiet && mv "$WORK/part-$2" "$WORK/$2"; echo "$2: $(( $(date +%s) - s )) s"; }
  [ -f "$WORK/${2%.gguf}-stock.gguf" ] || python3 scripts/strip_dsa.py "$WORK/$2" "$WORK/${2%.gguf}-stock.gguf"
  ls -la "$WORK/$2" "$WORK/${2%.gguf}-stock.gguf"
}

bench() { # file tag ctx
  [ -s "$OUT/bench-$2.json" ] && { cat "$OUT/bench-$2.json"; return; }
  # fresh context per (ctx, attn); prefill ctx tokens in ubatches of 512, then 32 single-token decodes
  dsa bench "$WORK/$1" --ctx "$3" --gen "${GEN:-32}" --attn sparse,dense --flash-attn --n-gpu-layers 999 \
    --force --jsonl "$OUT/bench-$2.jsonl" --json > "$OUT/bench-$2.json" 2> "$OUT/bench-$2.log" || true
  python3 - "$OUT/bench-$2.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
by = {(r["ctx"], r["attn"]): r for r in rows}
print(f"{'ctx':>7} {'dense pp':>9} {'sparse pp':>9} {'ratio':>6} {'dense tg':>9} {'sparse tg':>9} {'ratio':>6}")
for c in sorted({r["ctx"] for r in rows}):
    d, s = by.get((c, "dense"), {}), by.get((c, "sparse"), {})
    if "error" in d or "error" in s or not d or not s:
        print(c, "error:", d.get("error"), s.get("error")); continue
    print(f"{c:>7} {d['prefill_tok_s']:>9.1f} {s['prefill_tok_s']:>9.1f} {s['prefill_tok_s']/d['prefill_tok_s']:>6.2f} "
          f"{d['decode_tok_s']:>9.1f} {s['decode_tok_s']:>9.1f} {s['decode_tok_s']/d['decode_tok_s']:>6.2f}")
EOF
}

anchor() { # file tag
  local lb=$CUR/bin/llama-bench
  [ -x "$lb" ] || { echo "no $lb: the backend build has no llama-bench (build.py TOOLS builds it; cmake target llama-bench)" >&2; return 3; }
  for kind in dense sparse; do
    local f=$WORK/${1%.gguf}-stock.gguf; [ $kind = sparse ] && f=$WORK/$1
    [ -s "$OUT/llama-bench-$2-$kind.json" ] || LD_LIBRARY_PATH=$CUR/bin:${LD_LIBRARY_PATH:-} "$lb" -m "$f" -fa 1 -ngl 99 \
      -n 32 -p "${LB_PROMPT:-0}" -d 0,16384,65536,131072 -r "${LB_REPS:-2}" -o json \
      > "$OUT/llama-bench-$2-$kind.json" 2> "$OUT/llama-bench-$2-$kind.log" || { tail -20 "$OUT/llama-bench-$2-$kind.log"; }
    python3 -c "
import json,sys
for r in json.load(open(sys.argv[1])):
    print(sys.argv[2], 'depth', r['n_depth'], 'pp', r['n_prompt'], 'tg', r['n_gen'], 'avg tok/s %.1f' % r['avg_ts'], '+-%.1f' % r['stddev_ts'])
" "$OUT/llama-bench-$2-$kind.json" "$kind" || true
  done
}

run_file() { # file tag
  local prompt=$WORK/prompt-$2.txt
  [ -s "$prompt" ] || python3 - "$WORK/$1" "${RUN_FILLER:?set RUN_FILLER=<a text file, .xz allowed>}" \
      "${RUN_PROMPT:-65280}" "$prompt" <<'EOF'
import lzma, sys
import llama_cpp
path, filler, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
text = (lzma.open(filler, "rt") if filler.endswith(".xz") else open(filler)).read()
llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
toks = llm.tokenize(text.encode(), add_bos=False)
while len(toks) < n:
    toks += toks
open(out, "wb").write(llm.detokenize(toks[:n]))
EOF
  for attn in sparse dense; do
    [ -s "$OUT/run-$2-$attn.json" ] || dsa run "$WORK/$1" -f "$prompt" --ctx 65536 -n 128 --temp 0 --seed 0 \
        --attn $attn --kv f16 --json > "$OUT/run-$2-$attn.json" 2> "$OUT/run-$2-$attn.log" \
      || { tail -5 "$OUT/run-$2-$attn.log"; continue; }
    python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], r['attention'], 'prompt', r['prompt_tokens'], 'tok %.1f tok/s' % r['prompt_tps'],
      '| generated', r['generated_tokens'], 'tok %.1f tok/s' % r['gen_tps'], '|', r['finish_reason'])
" "$OUT/run-$2-$attn.json" $attn
  done
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
for step in $STEPS; do
  stamp "$step"
  case $step in
  build)
    if [ -f "$CUR/build.json" ] && grep -q '"cuda": true' "$CUR/build.json" && ! grep -q 'GGML_CUDA_FA=OFF' "$CUR/build.json"; then
      echo "FA-enabled CUDA backend already installed: $(readlink -f "$CUR")"
    else
      if ! { [ -f "$WORK/build-fa.pid" ] && kill -0 "$(cat "$WORK/build-fa.pid")" 2>/dev/null; }; then
        [ -n "${SDIST:-}" ] || { echo "build: set SDIST=<llama-cpp-python-0.3.36 sdist>" >&2; exit 2; }
        setsid nohup python3 -m dsa_convert.cli backend build --cuda --no-build-isolation --sdist "$SDIST" \
          > "$WORK/build-fa.log" 2>&1 < /dev/null &
        echo $! > "$WORK/build-fa.pid"
        echo "started FA build, pid $(cat "$WORK/build-fa.pid"), log $WORK/build-fa.log"
      fi
      s=$(date +%s)
      while kill -0 "$(cat "$WORK/build-fa.pid")" 2>/dev/null && [ $(( $(date +%s) - s )) -lt "${BUILD_WAIT:-540}" ]; do sleep 10; done
      if kill -0 "$(cat "$WORK/build-fa.pid")" 2>/dev/null; then
        echo "still building after ${BUILD_WAIT:-540} s (log tail below); re-run the build step to keep waiting"
      else
        echo "build process ended"
      fi
      tail -5 "$WORK/build-fa.log"
    fi ;;
  topk)
    [ -s "$OUT/topk/topk_check.txt" ] && grep -q "ALL OK" "$OUT/topk/topk_check.txt" && { cat "$OUT/topk/topk_check.txt"; continue; }
    bash scripts/gpu/cuda/run_cuda_check.sh topk "$OUT/topk" ${TOPK_QUICK:+--quick} || echo "topk check FAILED (exit $?)" ;;
  synth1b)  need_fa_backend; synth llama-3.2-1b synth-1b-q4_k_m.gguf ;;
  bench1b)  need_fa_backend; bench synth-1b-q4_k_m.gguf 1b "$CTX" ;;
  anchor1b) need_fa_backend; anchor synth-1b-q4_k_m.gguf 1b ;;
  synth8b)  need_fa_backend; synth llama-3.1-8b synth-8b-q4_k_m.gguf ;;
  bench8b)  need_fa_backend; bench synth-8b-q4_k_m.gguf "8b${BENCH8B_CTX:+-${BENCH8B_CTX//,/-}}" "${BENCH8B_CTX:-$CTX}" ;;
  anchor8b) need_fa_backend; anchor synth-8b-q4_k_m.gguf 8b ;;
  run8b)    need_fa_backend; run_file synth-8b-q4_k_m.gguf 8b ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
stamp done
