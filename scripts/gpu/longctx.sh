#!/usr/bin/env bash
# Long-context quality on a GPU machine (docs/RESULTS.md, "Retrofit quality at long context"): retrofit the 32K
# reference model on the GPU, then needle grids, WikiText-2 PPL / KLD by context length and llama-passkey through the
# CUDA build of the patched llama.cpp. Every step keeps its results in WORK; a step whose result exists is skipped, so
# a warm machine can take the steps in several calls.
#
# Prepare the folder a call carries (the 32K checkpoint xz-compressed, the eval filler, the trimmed sdist, wheels):
#   bash scripts/gpu/make_longctx_bundle.sh .devlc
# then on the GPU machine, from the repository root:
#   STEPS="bg:build retro:lc:--top-k,2048,--cluster-num,32 waitbg needle:lc:passkey:junk" LIMIT=570 OUT=$OUT \
#     bash scripts/gpu/longctx.sh .devlc
#
# Steps (space-separated, in order; ARGS: commas become spaces):
#   build                       dsa backend build --cuda from the bundle's sdist
#   retro:NAME:ARGS             dsa convert of ref-llama-27m-32k to WORK/NAME.gguf with ARGS on the GPU, its --json
#                               report in WORK/NAME.retrofit.json
#   bg:STEP / waitbg            a step in the background (a retrofit during the build) / wait for them
#   needle:NAME:TASK:FILLER[:ARGS]  dsa eval --needle TASK --filler FILLER (junk | book | a path) at 4K-32K x 10 depths,
#                               one process per mode of NEEDLE_MODES, side by side (dense / sparse / local with the
#                               F16 cache, sparse-asq: sparse with the file's ASQ cache); ARGS e.g. --trials,10;
#                               WORK/needle-NAME-TASK-FILLER-MODE.{json,png}
#   ppl:NAME:CTX                WikiText-2 at CTX (flash attention): dense; sparse and local with --kld (against dense
#                               F16 on the same tokens); sparse with the ASQ cache and --kld
#   passkey:NAME                llama-passkey (upstream's client) dense and sparse at 16K and 32K, 3 depths
#   split:NAME                  WORK/NAME.gguf into OUT/NAME.gguf.partNN (15 MiB each; `cat` joins them)
# NEEDLE_LENGTHS / NEEDLE_DEPTHS / NEEDLE_MODES / NGL / PPL_CHUNKS / PPL_MODES: the grid, its runs, the layers
# offloaded, the WikiText-2 chunks of a ppl step, its runs (defaults 4096,...,32768 / 10 / dense,sparse,local,sparse-asq
# / 999 / 4 / dense,sparse,local,sparse-asq).
# LIMIT: seconds for the whole call (default 570); a step gets what is left, and the results are packed into
# OUT/longctx.tgz at the end in every case. WORK defaults to /tmp/lc (kept while the machine stays warm).
set -uo pipefail
B=$(cd "${1:?usage: longctx.sh BUNDLE}" && pwd)
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
. scripts/gpu/system_compilers.sh     # CC, CXX, CUDAHOSTCXX for the backend build
WORK=${WORK:-/tmp/lc}; OUT=${OUT:-$WORK/out}; LIMIT=${LIMIT:-570}
NEEDLE_LENGTHS=${NEEDLE_LENGTHS:-4096,8192,16384,32768}; NEEDLE_DEPTHS=${NEEDLE_DEPTHS:-10}
NEEDLE_MODES=${NEEDLE_MODES:-dense,sparse,local,sparse-asq}; NGL=${NGL:-999}; PPL_CHUNKS=${PPL_CHUNKS:-4}
PPL_MODES=${PPL_MODES:-dense,sparse,local,sparse-asq}
mkdir -p "$WORK" "$OUT"
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) - 20 )); }
for f in "$B"/shared/*/*.gz "$B"/shared/*/*/*.gz; do [ -f "$f" ] && { [ -f "${f%.gz}" ] || gunzip -k "$f"; }; done
for f in "$B"/shared/models/*/*.xz; do [ -f "$f" ] && { [ -f "${f%.xz}" ] || unxz -k "$f"; }; done
if [ ! -d "$WORK/site" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$WORK/site" "$B"/whl/*.whl
fi
export PYTHONPATH=$REPO:$WORK/site PYTHONUNBUFFERED=1 DSA_WIKITEXT2=$B/shared/data/wikitext-2-raw/wiki.test.raw \
       DSA_NEEDLE_FILLER=$B/shared/corpus/books_003.txt.xz
MODEL=$B/shared/models/ref-llama-27m-32k
CALIB=$B/shared/data/calib/books-calib.txt
dsa() { python3 -m dsa_convert.cli "$@"; }
stamp() { echo "== $(date -u +%FT%TZ) (+$(( $(date +%s) - T0 )) s) $*"; }
args() { echo "${1//,/ }"; }

run_step() {
  local step=$1 name kind x
  IFS=: read -r kind name x <<< "$step"
  case $kind in
  build)
    dsa backend info --json 2>/dev/null | grep -q '"cuda": true' && return 0
    dsa backend build --cuda --no-build-isolation --sdist "$B/llama-trim.tar.gz" > "$WORK/build.log" 2>&1 \
      || { tail -30 "$WORK/build.log"; return 1; }
    dsa backend info --json > "$WORK/backend-info.json" ;;
  retro)
    [ -s "$WORK/$name.retrofit.json" ] && return 0
    # shellcheck disable=SC2046
    dsa convert "$MODEL" "$WORK/$name.gguf" --calib "$CALIB" --device "${RETRO_DEVICE:-cuda}" --outtype f16 $(args "${step#retro:"$name":}") \
      --json > "$WORK/$name.retrofit.json" 2> "$WORK/$name.retrofit.log" || { tail -5 "$WORK/$name.retrofit.log"; return 1; }
    python3 - "$WORK/$name.retrofit.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); d = r.get("dsa", {})
print({k: d.get(k) for k in ("calibration", "sink", "local", "seconds", "peak_rss_mib", "peak_gpu_mib")})
PY
    ;;
  needle)
    # one process per mode of NEEDLE_MODES, all at once (a 27M model leaves the GPU mostly idle per process)
    local task filler extra tag mode pids=() files=()
    IFS=: read -r kind name task filler extra <<< "$step"
    tag=$(basename "$filler" | cut -d. -f1)
    for mode in ${NEEDLE_MODES//,/ }; do
      local f="$WORK/needle-$name-$task-$tag-$mode.json" kv=f16
      files+=("$f")
      [ -s "$f" ] && continue
      [ "$mode" = sparse-asq ] && kv=asq
      # shellcheck disable=SC2046
      { dsa eval "$WORK/$name.gguf" --needle "$task" --filler "$filler" --lengths "$NEEDLE_LENGTHS" \
          --depths "$NEEDLE_DEPTHS" --attn "${mode%-asq}" --kv "$kv" --n-gpu-layers "$NGL" \
          --plot "${f%.json}.png" $(args "${extra:-}") --json > "$f.part" && mv "$f.part" "$f"; } &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    python3 scripts/needle_summary.py $(ls "${files[@]}" 2> /dev/null) ;;
  ppl)
    local ctx=$x
    local v
    for v in "dense f16" "sparse f16 --kld" "local f16 --kld" "sparse asq --kld"; do
      set -- $v
      [[ ",$PPL_MODES," == *",$1$([ "$2" = asq ] && echo -asq),"* ]] || continue
      local f="$WORK/ppl-$name-$ctx-$1-$2.json"
      [ -s "$f" ] || dsa eval "$WORK/$name.gguf" --ppl wikitext2 --ctx "$ctx" --chunks "$PPL_CHUNKS" --attn "$1" --kv "$2" "${@:3}" \
        --flash-attn --n-gpu-layers "$NGL" --json > "$f" || { rm -f "$f"; continue; }
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], \
{k: r.get(k) for k in ('ppl','ppl_stderr','chunks','kld_mean','same_top_p','top_k')})" "$f"
    done ;;
  passkey)
    for len in 16384 32768; do
      for mode in dense sparse; do
        [ -s "$WORK/passkey-$name-$len-$mode.txt" ] || bash scripts/passkey.sh "$WORK/$name.gguf" "$len" "$mode" -ngl "$NGL" \
          > "$WORK/passkey-$name-$len-$mode.txt" 2>&1
        tail -n 4 "$WORK/passkey-$name-$len-$mode.txt"
      done
    done ;;
  split)
    split -b 15M -d "$WORK/$name.gguf" "$OUT/$name.gguf.part" && ls -la "$OUT"/"$name".gguf.part* ;;
  *) echo "unknown step $step"; return 2 ;;
  esac
}

export -f run_step args dsa stamp
export B WORK OUT MODEL CALIB T0 NEEDLE_LENGTHS NEEDLE_DEPTHS NEEDLE_MODES NGL PPL_CHUNKS PPL_MODES
bgpids=()
for step in ${STEPS:?set STEPS}; do
  t=$(left)
  if [ "$t" -lt 10 ]; then stamp "no time left for $step"; break; fi
  case $step in
  bg:*) stamp "background ${step#bg:}"
        (timeout "$t" bash -c "run_step '${step#bg:}'" > "$WORK/bg-${step//[:\/,]/_}.log" 2>&1) &
        bgpids+=($!) ;;
  waitbg) stamp waitbg; for p in "${bgpids[@]}"; do wait "$p"; done; bgpids=(); tail -n 5 "$WORK"/bg-*.log ;;
  *) stamp "$step"; timeout "$t" bash -c "run_step '$step'" || echo "step $step: exit $?" ;;
  esac
done
stamp pack
tar czf "$OUT/longctx.tgz" -C "$WORK" $(cd "$WORK" && ls *.json *.png *.txt *.log 2> /dev/null) 2> /dev/null
ls -la "$OUT"
