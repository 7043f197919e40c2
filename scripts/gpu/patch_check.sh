#!/usr/bin/env bash
# Checks of the llama.cpp patch series on one GPU machine (docs/RESULTS.md §3): llama.cpp's test-backend-ops for the
# ops the patch adds or changes (the GPU backend against the CPU backend), and perplexity through this patch series
# beside a reference series built on the same machine (bit-identical, or the difference to explain).
#
# Prepare the folder a call carries (trimmed sdist with the test sources, wheels, data, the 32K reference checkpoint):
#   bash scripts/gpu/make_longctx_bundle.sh .devlc
# Optionally put a reference series in .devlc/ref-patches/*.patch (e.g. `git show REV:patches/llama.cpp/NAME`).
# Then on the GPU machine, from the repository root:
#   STEPS="bg:buildref build opstest retro:lc waitbg ppl" LIMIT=570 OUT=$OUT bash scripts/gpu/patch_check.sh .devlc
#
# Steps (space-separated, in order):
#   build        dsa backend build --cuda --op-tests (flash-attention kernels on) from the bundle's sdist, installed
#   buildref     the same build from BUNDLE/ref-patches/*.patch into WORK/refcache, not installed; its wheel unpacked
#                into WORK/refsite (run it as bg:buildref beside build: both share the machine's cores)
#   opstest      test-backend-ops (mode test, backend CUDA0) for each op of OPS; WORK/opstest-OP.txt per op and a
#                summary per op (cases passed / failed / not supported by the GPU backend) in WORK/opstest.md
#   retro:NAME   dsa convert of ref-llama-27m-32k with RETRO_ARGS (default --top-k 2048 --cluster-num 32) on the GPU
#                to WORK/NAME.gguf (skipped when it exists)
#   ppl          WikiText-2 at PPL_CTX (default 32768), PPL_CHUNKS chunks (default 2), flash attention, on
#                WORK/$PPL_FILE.gguf (default lc): dense, sparse, sparse with the ASQ cache, through this build and,
#                when buildref ran, through the reference build; WORK/ppl.md says which pairs are bit-identical
#   bg:STEP / waitbg   a step in the background / wait for those steps
# LIMIT: seconds for the whole call (default 570); the results are packed into OUT/patch_check.tgz in every case.
# WORK defaults to /tmp/pc (kept while the machine stays warm, so a later call can run the steps that remain).
set -uo pipefail
B=$(cd "${1:?usage: patch_check.sh BUNDLE}" && pwd)
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
. scripts/gpu/system_compilers.sh     # CC, CXX, CUDAHOSTCXX for the backend build
WORK=${WORK:-/tmp/pc}; OUT=${OUT:-$WORK/out}; LIMIT=${LIMIT:-570}
OPS=${OPS:-DSA_SPARSE_ATTN DSA_ASQ_SET_ROWS DSA_ASQ_GET_ROWS DSA_INDEXER_MASK LIGHTNING_INDEXER TOP_K DSA_LID_ROPE_TOP_K DSA_KEY_NORM_ROPE_SET_ROWS}
PPL_CTX=${PPL_CTX:-32768}; PPL_CHUNKS=${PPL_CHUNKS:-2}; PPL_FILE=${PPL_FILE:-lc}
mkdir -p "$WORK" "$OUT"
T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) - 20 )); }
for f in "$B"/shared/models/*/*.xz; do [ -f "$f" ] && { [ -f "${f%.xz}" ] || unxz -k "$f"; }; done
for f in "$B"/shared/*/*.gz "$B"/shared/*/*/*.gz; do [ -f "$f" ] && { [ -f "${f%.gz}" ] || gunzip -k "$f"; }; done
[ -d "$WORK/site" ] || python3 -m pip install -q --no-index --no-deps --target "$WORK/site" "$B"/whl/*.whl
export PYTHONPATH=$REPO:$WORK/site PYTHONUNBUFFERED=1 DSA_WIKITEXT2=$B/shared/data/wikitext-2-raw/wiki.test.raw
dsa() { python3 -m dsa_convert.cli "$@"; }
stamp() { echo "== $(date -u +%FT%TZ) (+$(( $(date +%s) - T0 )) s) $*"; }

run_step() {
  local step=$1 kind name
  IFS=: read -r kind name <<< "$step"
  case $kind in
  build)
    [ -x "$(dsa backend info --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin).get("build") or "")')/bin/test-backend-ops" ] \
      && return 0
    dsa backend build --cuda --op-tests --no-build-isolation --sdist "$B/llama-trim.tar.gz" \
      --cmake-arg=-DGGML_CUDA_FA=ON > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; return 1; }
    dsa backend info --json > "$WORK/backend-info.json" ;;
  buildref)
    [ -d "$WORK/refsite/llama_cpp" ] && return 0
    ls "$B"/ref-patches/*.patch > /dev/null || { echo "no $B/ref-patches/*.patch" >&2; return 1; }
    DSA_CACHE=$WORK/refcache python3 - "$B/ref-patches" "$B/llama-trim.tar.gz" > "$WORK/buildref.log" 2>&1 <<'EOF' || { tail -40 "$WORK/buildref.log"; return 1; }
import sys
from pathlib import Path
import dsa_convert.backend.build as b
b.PATCH_DIR = Path(sys.argv[1])
print(b.build(b.BuildConfig(cuda=True, sdist=Path(sys.argv[2]), build_isolation=False,
                            extra_cmake_args=["-DGGML_CUDA_FA=ON"]), install=False))
EOF
    python3 -m pip install -q --no-deps --target "$WORK/refsite" "$WORK"/refcache/backend/*/wheel/*.whl ;;
  opstest)
    local bin; bin=$(dsa backend info --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["build"])')/bin
    echo "| op | passed | failed | not supported on CUDA0 |" > "$WORK/opstest.md"; echo "|---|---:|---:|---:|" >> "$WORK/opstest.md"
    for op in $OPS; do
      # (colour codes stripped; a case line reads "  OP(params): OK | FAIL | not supported [CUDA0]")
      LD_LIBRARY_PATH=$bin timeout "$(left)" "$bin/test-backend-ops" test -b CUDA0 -o "$op" 2>&1 \
        | sed 's/\x1b\[[0-9;]*m//g' > "$WORK/opstest-$op.txt"
      echo "| $op | $(grep -cE '^ +[A-Z_]+\(.*\): OK' "$WORK/opstest-$op.txt") |" \
           "$(grep -cE '^ +[A-Z_]+\(.*\): FAIL' "$WORK/opstest-$op.txt") | $(grep -c 'not supported' "$WORK/opstest-$op.txt") |" \
           >> "$WORK/opstest.md"
    done
    cat "$WORK/opstest.md"; grep -h ': FAIL' "$WORK"/opstest-*.txt | head -20; true ;;
  retro)
    [ -f "$WORK/$name.gguf" ] && return 0
    dsa convert "$B/shared/models/ref-llama-27m-32k" "$WORK/$name.gguf" ${RETRO_ARGS:---top-k 2048 --cluster-num 32} \
      --calib "$B/shared/data/calib/books-calib.txt" --device cuda --json > "$WORK/$name.retrofit.json" 2> "$WORK/$name.retrofit.log" \
      || { tail -5 "$WORK/$name.retrofit.log"; return 1; } ;;
  ppl)
    local f=$WORK/$PPL_FILE.gguf site mode kv
    for site in new ref; do
      [ $site = ref ] && [ ! -d "$WORK/refsite/llama_cpp" ] && continue
      for mode in dense:f16 sparse:f16 sparse:asq; do
        IFS=: read -r attn kv <<< "$mode"
        local o=$WORK/ppl-$site-$attn-$kv.json
        [ -s "$o" ] && continue
        PYTHONPATH=$([ $site = ref ] && echo "$WORK/refsite:")$PYTHONPATH timeout "$(left)" python3 -m dsa_convert.cli eval "$f" \
          --ctx "$PPL_CTX" --chunks "$PPL_CHUNKS" --attn "$attn" --kv "$kv" --flash-attn --json > "$o" 2> "$o.log" \
          || { tail -3 "$o.log"; rm -f "$o"; }
      done
    done
    python3 - "$WORK" > "$WORK/ppl.md" <<'EOF'
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
print("| attn | kv | PPL, this series | PPL, reference series | bit-identical |\n|---|---|---:|---:|---|")
for mode in ("dense-f16", "sparse-f16", "sparse-asq"):
    new, ref = (w / f"ppl-{s}-{mode}.json" for s in ("new", "ref"))
    a = json.loads(new.read_text())["ppl"] if new.is_file() else None
    b = json.loads(ref.read_text())["ppl"] if ref.is_file() else None
    print(f"| {' | '.join(mode.split('-'))} | {a!r} | {b!r} | {'yes' if a is not None and a == b else 'no' if b is not None else '-'} |")
EOF
    cat "$WORK/ppl.md" ;;
  *) echo "unknown step $step" >&2; return 2 ;;
  esac
}

pids=()
for step in ${STEPS:?set STEPS}; do
  [ "$(left)" -gt 10 ] || { echo "out of time before $step"; break; }
  case $step in
  bg:*) stamp "background ${step#bg:}"; ( run_step "${step#bg:}" > "$WORK/bg-${step#bg:}.out" 2>&1 ) & pids+=($!) ;;
  waitbg) stamp waitbg; for p in "${pids[@]}"; do wait "$p"; done; pids=(); cat "$WORK"/bg-*.out 2>/dev/null | tail -20 ;;
  *) stamp "$step"; run_step "$step" || echo "step $step failed (rc $?)" ;;
  esac
done
stamp done
tar czf "$OUT/patch_check.tgz" -C "$WORK" $(cd "$WORK" && ls *.md *.json *.txt *.log 2>/dev/null) 2>/dev/null
