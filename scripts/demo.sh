#!/usr/bin/env bash
# Fresh machine, one command: install dsa + the patched llama.cpp backend, then the main job end to
# end: convert with the DSA retrofit -> 4-bit quantize (Q4_0, GPTQ) -> perplexity through llama.cpp (sparse and dense).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
work=${DSA_DEMO_DIR:-out/demo}
mkdir -p "$work"
model=../shared/models/ref-llama-27m
# the retrofit's time budget (seconds): the plan picks the recipe that fits it on this machine (docs/CLI.md); the
# calibration context is the reference model's trained one (its config claims 8,192; it was trained at 2,048)
budget=${DSA_DEMO_BUDGET:-300}
steps=(); [[ -n "${DSA_DEMO_STEPS:-}" ]] && steps=(--steps "$DSA_DEMO_STEPS")
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
      --calib "$calib" --calib-ctx "$ctx" --time-budget "$budget" "${steps[@]}" --force --json > "$work/convert.json"
"$PY" -c 'import json, sys; c = json.load(open(sys.argv[1]))["dsa"]["calibration"]; print("retrofit plan:", c["ctx_source"],
      "| measured", c["measured_s"], "s of a", c["time_budget_s"], "s budget | steps", c["steps"], "x", c["train_chunks"], "chunks")' \
      "$work/convert.json"
"$PY" -m dsa_convert.cli inspect "$work/model-dsa.gguf" | tail -n 5
"$PY" -m dsa_convert.cli quantize "$work/model-dsa.gguf" "$work/model-dsa-q4.gguf" --calib "$calib" --force
"$PY" -m dsa_convert.cli eval "$work/model-dsa-q4.gguf" --ppl wikitext2 --ctx "$ctx" --chunks 4 --attn sparse "${evaldata[@]}"
"$PY" -m dsa_convert.cli eval "$work/model-dsa-q4.gguf" --ppl wikitext2 --ctx "$ctx" --chunks 4 --attn dense "${evaldata[@]}"
