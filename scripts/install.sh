#!/usr/bin/env bash
# Install dsa and its llama.cpp backend on a fresh machine (idempotent; the backend wheel is cached
# in ~/.cache/dsa keyed by llama-cpp-python version + patch hash + build flags, so a second run is instant).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q -e ".[test]"
if [[ "${DSA_SKIP_BACKEND:-0}" != "1" ]]; then
  "$PY" -m dsa_convert.cli backend build ${DSA_BACKEND_FLAGS:-}
fi
