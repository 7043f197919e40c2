#!/usr/bin/env bash
# Chain scripts/gpu/h200_checks.sh steps (and a few helpers) in one call on a GPU machine that is lent for a limited
# time, keeping what finished. This is how the GPU figures of docs/RESULTS.md are taken.
#
#   STEPS="exp:TMAX=400 build exp:TMAX=150 exp:SHARE=2 synthsharebg synth8sharebg wait exp:BENCH_SHARE=2 \
#          bench1b=--ctx,65536:131072,--gen,34" LIMIT=585 \
#   SDIST=llama-trim.tar.gz SHARED=/path/to/shared OUT=/path/to/results bash scripts/gpu/gpu_batch.sh
#
# Run it from the repository root. On a machine without internet, `bash scripts/gpu/make_device_bundle.sh` writes the
# folder to carry (.devshare3: a trimmed sdist, the gguf and diskcache wheels (llama_cpp imports diskcache), the
# reference checkpoint, the data) and its runner .devshare3/run_d.sh, which sets SDIST / SHARED / WHEELS / WORK and
# calls this script:  STEPS="..." LIMIT=585 OUT=... bash .devshare3/run_d.sh
#
# Environment: STEPS (space-separated, run in order), LIMIT (seconds for the whole batch; each step gets what is
# left), SDIST (llama-cpp-python sdist, a trimmed copy is fine), SHARED (as h200_checks.sh: models/, data/), OUT
# (results: OUT/res.tgz with every *.txt / *.json* / *.md / *.csv / *.log of the work dir), WORK (default /tmp/w),
# WHEELS (optional dir of wheels installed with --no-index into WORK/site first, e.g. gguf on a machine without it).
# DSA_FILE / TOK / DSA_WIKITEXT2 pass through to h200_checks.sh.
#
# Steps:
#   any h200_checks.sh step    (build, retrofit, decodecheck, streams, asq, speed, profile, trace, cudachecks, ...)
#   bg:STEP                    that step in the background (e.g. a standalone CUDA check during the build)
#   waitbg                     wait for the bg: steps
#   synthbg / synth8bg         write the synthetic 1B (ASQ prototypes) / 8B Q4_K_M file in the background
#   synthsharebg / synth8sharebg  the same shapes with an indexer every SHARE layers (default 4; --index-share)
#   wait                       wait for the synth steps
#   packbackend                the built backend's cache entry into OUT/backend.txz.partNN (xz, else .tgz; 15 MiB
#                              parts), for a bundle that skips the build (make_device_bundle.sh BACKEND_PARTS=)
#   exp:VAR=VALUE              export a variable for the following steps (e.g. exp:PROF_CTX=131072); commas in
#                              VALUE become spaces (exp:SPEED_ARGS=--index-keys,f32)
#   speed1b=C1,C2 / speed8b=C  the speed step on the 1B / 8B file at those contexts
#   bench1b=ARGS / bench8b=ARGS  dsa bench on that file (sparse and dense, flash attention, every layer on the GPU)
#                              with extra comma-separated args; ':' inside an arg becomes ',' (bench1b=--ctx,16384:131072);
#                              BENCH_SHARE=G takes the G files of synthsharebg / synth8sharebg
#   TMAX (environment, default 400): the time limit of a plain h200_checks step
#
# What to plan for:
#   - A cold CUDA build takes 260-330 s on 16 cores and is lost with the machine; a lent machine is given back about
#     30 s after a call ends, so write the next call before the current one ends and send it at once.
#     The CUDA backend's cache entry (about 300 MiB with xz) cannot come back or be carried, so every cold machine
#     builds; `packbackend` and BACKEND_PARTS are for the CPU entry (10 MiB).
#   - Give `build` its own TMAX (exp:TMAX=400 build exp:TMAX=150) and do not run the retrofit beside a build with a
#     tight TMAX: together they can pass 400 s.
#   - The synth steps need the built llama-quantize (Q4_K_M): put them after `build`.
#   - A bench step appends to WORK/bench-<its arguments>.jsonl, which stays while the machine is warm: give each sweep a
#     distinct argument (e.g. --gen,34 / --gen,35; the step's --gen wins over the default 32) to keep sweeps apart.
#   - decodecheck / asq need WORK/ref-dsa.gguf from `retrofit` in the same warm session.
#   - Standalone CUDA checks need no backend build: `bash scripts/gpu/cuda/run_cuda_check.sh topk|sattn|lid|lip OUTDIR`
#     or, for the mat-vec check, `nvcc -O3 -std=c++17 -arch=sm_90 scripts/gpu/cuda/mmvq_check.cu -o m && ./m`.
#
# A typical round (one cold call, then warm calls of sweeps; the 8B sweep takes about 110 s, the 1B about 55 s):
#   1 STEPS="exp:TMAX=400 build exp:TMAX=150 exp:SHARE=2 synthsharebg synth8sharebg wait exp:BENCH_SHARE=2
#            bench8b=--ctx,65536:131072,--gen,33 bench1b=--ctx,65536:131072,--gen,34" LIMIT=588
#   2 STEPS="exp:BENCH_SHARE=2 bench1b=--ctx,65536:131072,--gen,35 bench8b=--ctx,65536:131072,--gen,36 ..." LIMIT=555
#   3 STEPS="exp:DC_PREFILL=1100 retrofit decodecheck exp:STREAMS_FILE=/tmp/w/synth-1b-share2.gguf streams" (checks)
# Judge the sweeps: tar xzf OUT/res.tgz; python3 scripts/bench/sweep_ratios.py r/bench-*.jsonl --markdown
set -uo pipefail
START=$(date +%s); LIMIT=${LIMIT:-580}
rem() { local r=$(( LIMIT - ($(date +%s) - START) )); [ $r -gt $1 ] && r=$1; [ $r -lt 1 ] && r=1; echo $r; }
: "${SDIST:?set SDIST}" "${SHARED:?set SHARED}" "${OUT:?set OUT}"
W=${WORK:-/tmp/w}; R=$OUT/r; mkdir -p "$W" "$R"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target "$W/site" "$WHEELS"/*.whl && export PYTHONPATH=$W/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
H="bash scripts/gpu/h200_checks.sh $SHARED $SDIST $W"
finish() { cp "$W"/*.txt "$W"/*.json* "$W"/*.md "$W"/*.csv "$W"/*.log "$R"/ 2>/dev/null; tar czf "$OUT/res.tgz" -C "$OUT" r; rm -rf "$R"; }
trap finish EXIT
synth() { python3 scripts/make_synth_gguf.py "$1" --shape "$2" --outtype q4_k_m --quiet ${3:-}; }
for s in ${STEPS:-}; do
  echo "== $s $(date -u +%T) (batch seconds left: $(rem 99999))"
  case $s in
  synthbg) (timeout "$(rem 300)" bash -c "$(declare -f synth); synth $W/synth-1b-asq.gguf llama-3.2-1b '--asq 64'" \
              > "$R/synth1b.out" 2>&1 &) ;;
  synth8bg) (timeout "$(rem 300)" bash -c "$(declare -f synth); synth $W/synth-8b.gguf llama-3.1-8b" \
              > "$R/synth8b.out" 2>&1 &) ;;
  # the same shapes with an indexer every SHARE layers (default 4), the others reusing its top-k (FORMAT.md §4a)
  # (every synth step needs the built llama-quantize for Q4_K_M: run it after `build`, never beside it)
  synthsharebg) (timeout "$(rem 300)" bash -c "$(declare -f synth); synth $W/synth-1b-share${SHARE:-4}.gguf llama-3.2-1b \
              '--asq 64 --index-share ${SHARE:-4}'" > "$R/synth1b-share.out" 2>&1 &) ;;
  synth8sharebg) (timeout "$(rem 300)" bash -c "$(declare -f synth); synth $W/synth-8b-share${SHARE:-4}.gguf llama-3.1-8b \
              '--index-share ${SHARE:-4}'" > "$R/synth8b-share.out" 2>&1 &) ;;
  wait) while pgrep -f make_synth_gguf > /dev/null; do sleep 2; done
        for o in "$R"/synth*.out; do [ -s "$o" ] && { echo "$(basename "$o"):"; tail -2 "$o"; }; done ;;
  bg:*) timeout "$(rem 300)" $H "${s#bg:}" > "$R/${s#bg:}.out" 2>&1 & ;;
  waitbg) wait ;;
  # the built backend's cache entry for the next calls (OUT/backend.txz.partNN, 15 MiB each; a bundle made with
  # BACKEND_PARTS=that folder installs it instead of building: scripts/gpu/make_device_bundle.sh; the CUDA entry, 303 MiB
  # with xz, is too large to come back or be carried)
  packbackend) b=$(python3 -m dsa_convert.cli backend info --json | python3 -c "import json,sys; print(json.load(sys.stdin).get('build') or '')")
     if [ -n "$b" ] && [ -f "$b/build.json" ]; then
       if command -v xz > /dev/null; then z="xz -T0 -6"; ext=txz; else z="gzip -6"; ext=tgz; fi  # xz: CPU entry 10 MiB, gzip 27
       tar cf - -C "$(dirname "$b")" "$(basename "$b")" | $z | split -b 15m -d - "$OUT/backend.$ext.part"
       du -b "$OUT"/backend.$ext.part* | awk '{s += $1} END {printf "backend parts: %d files, %.1f MiB\n", NR, s / 1048576}'
     else echo "packbackend: no built backend"; fi ;;
  exp:*) v=$(echo "${s#exp:}" | tr , ' '); export "$v" ;;
  speed1b=*) SPEED_CTX=${s#speed1b=} timeout "$(rem 400)" $H speed > "$R/$s.out" 2>&1; echo "rc $?"; tail -4 "$R/$s.out" | cut -c1-300 ;;
  speed8b=*) SPEED_8B=only SPEED_CTX=${s#speed8b=} timeout "$(rem 400)" $H speed > "$R/$s.out" 2>&1; echo "rc $?"; tail -4 "$R/$s.out" | cut -c1-300 ;;
  bench1b=*|bench8b=*)
    f=$W/synth-1b-asq.gguf; [ "${s%%=*}" = bench8b ] && f=$W/synth-8b.gguf
    if [ -n "${BENCH_SHARE:-}" ]; then f=${f%.gguf}; f=${f%-asq}-share$BENCH_SHARE.gguf; fi
    args=$(echo "${s#*=}" | tr , ' ' | tr : ,); tag=${s%%=*}-$(echo "${s#*=}" | tr -c 'a-zA-Z0-9\n' _ | cut -c1-60)
    timeout "$(rem 400)" python3 -m dsa_convert.cli bench "$f" --gen 32 $args --flash-attn --n-gpu-layers 999 --force \
      --jsonl "$W/bench-$tag.jsonl" > "$R/bench-$tag.out" 2>&1; echo "rc $?"; cut -c1-500 "$W/bench-$tag.jsonl" ;;
  *) n_plain=$(( ${n_plain:-0} + 1 )); o="$R/$s.$n_plain.out" # numbered: a step may run twice (other exp: values)
     timeout "$(rem "${TMAX:-400}")" $H "$s" > "$o" 2>&1; echo "rc $?"; tail -3 "$o" ;;
  esac
done
