#!/usr/bin/env bash
# Fresh machine, one command: install dsa + the patched llama.cpp backend, then the main job end to
# end: convert with the DSA retrofit -> AWQ INT4 quantize -> perplexity through llama.cpp (sparse and dense).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
work=${DSA_DEMO_DIR:-out/demo}
mkdir -p "$work"
model=../shared/models/ref-llama-27m
steps=${DSA_DEMO_STEPS:-200}
topk=512; ctx=2048
if [[ ! -f "$model/config.json" ]]; then
  echo "reference model not found; generating a small checkpoint in $work/tiny-model"
  "$PY" scripts/make_tiny_checkpoint.py "$work/tiny-model"
  model="$work/tiny-model"; topk=64; ctx=256
fi
calib=../shared/data/calib/books-calib.txt
[[ -f "$calib" ]] || calib=$("$PY" scripts/make_tiny_checkpoint.py --calib-text "$work/calib.txt")
evaldata=()
[[ -f ../shared/data/wikitext-2-raw/wiki.test.raw ]] || evaldata=(--data "$("$PY" scripts/make_tiny_checkpoint.py --eval-text "$work/eval.txt")")
set -x
"$PY" -m dsa_convert.cli convert "$model" "$work/model-dsa.gguf" --cluster-num 32 --top-k "$topk" \
      --calib "$calib" --steps "$steps" --force
"$PY" -m dsa_convert.cli inspect "$work/model-dsa.gguf" | tail -n 5
"$PY" -m dsa_convert.cli quantize "$work/model-dsa.gguf" "$work/model-dsa-q4.gguf" --calib "$calib" --force
"$PY" -m dsa_convert.cli eval "$work/model-dsa-q4.gguf" --ppl wikitext2 --ctx "$ctx" --chunks 4 --attn sparse "${evaldata[@]}"
"$PY" -m dsa_convert.cli eval "$work/model-dsa-q4.gguf" --ppl wikitext2 --ctx "$ctx" --chunks 4 --attn dense "${evaldata[@]}"
