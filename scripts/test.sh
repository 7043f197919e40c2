#!/usr/bin/env bash
# The test command (README; .ci/run calls exactly this). Installs what is missing, builds the patched
# llama.cpp backend in the background while the pure-Python tests run, then runs the backend tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q -e ".[test]"
log=$(mktemp -t dsa-backend-build.XXXXXX.log)
"$PY" -m dsa_convert.cli backend build >"$log" 2>&1 &
build_pid=$!
echo "backend build running in the background (pid $build_pid, log $log)"
set +e
"$PY" -m pytest -q -m "not backend" -p no:cacheprovider
rc1=$?
wait "$build_pid"; brc=$?
set -e
if [[ $brc -ne 0 ]]; then
  echo "backend build failed (exit $brc):"; tail -n 40 "$log"; exit 1
fi
tail -n 3 "$log"
set +e
DSA_REQUIRE_BACKEND=1 "$PY" -m pytest -q -m backend -p no:cacheprovider
rc2=$?
set -e
echo "non-backend tests exit $rc1, backend tests exit $rc2"
[[ $rc1 -eq 0 && $rc2 -eq 0 ]]
