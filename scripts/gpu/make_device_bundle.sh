#!/usr/bin/env bash
# Build the folder that a GPU machine without internet needs to run scripts/gpu/gpu_batch.sh (the GPU rows of
# docs/RESULTS.md): a trimmed llama-cpp-python sdist (< the 64 MiB a call carries), the wheels of the Python packages
# that such a machine lacks (gguf; diskcache, which llama_cpp imports), the reference checkpoint and the data files
# (text gzipped), and a runner.
#
#   bash scripts/gpu/make_device_bundle.sh [DIR]          (default DIR: .devshare3, added to .git/info/exclude)
#
# then, on the GPU machine, from the repository root (DIR carried there):
#   STEPS="bg:retrofit exp:TMAX=540 build ..." LIMIT=585 OUT=/path/to/results bash DIR/run_d.sh
#
# SHARED (default ../shared) holds models/ref-llama-27m and data/{wikitext-2-raw,calib}; the sdist comes from
# DSA_SDIST if set, else from PyPI (pip download). Every file is rebuilt, so the script can run again.
# A prebuilt backend: BACKEND_PARTS=DIR (the backend.txz.partNN files a call's `packbackend` step returned) puts them
# in the bundle and run_d.sh unpacks them into the device's backend cache, so `build` is a cache hit (pip install
# only) as long as the patch, the sdist and the flags are the same. With NO_MODEL=1 the checkpoint's weights stay
# out (its config and tokenizer stay): room for the parts, for speed-only calls (no retrofit / decodecheck / asq).
# This works for a CPU entry (10 MiB); the CUDA entry is 303 MiB with xz (the wheel alone 287 MB), past what a call
# returns or carries, so a GPU machine builds each time (docs/history §4ae).
# The trimmed sdist is written byte-for-byte the same each time (sorted, fixed times, gzip -n): the backend's cache
# key hashes it.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.devshare3}
SHARED=${SHARED:-../shared}
VER=$(python3 -c "import sys; sys.path.insert(0, '.'); from dsa_convert.backend.build import LLAMA_CPP_PYTHON_VERSION as v; print(v)")
PY=${DEVICE_PYTHON:-3.12}
[ -d "$SHARED/models/ref-llama-27m" ] || { echo "error: $SHARED/models/ref-llama-27m not found (set SHARED)" >&2; exit 2; }
if [ -e "$DIR" ] && [ ! -f "$DIR/run_d.sh" ] && [ -n "$(ls -A "$DIR" 2>/dev/null)" ]; then
  echo "error: $DIR exists and is not a bundle this script wrote (no run_d.sh); not replacing it" >&2; exit 2
fi
case "$DIR" in /*|..*) ;; *) grep -qxF "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude ;; esac
rm -rf "$DIR"
mkdir -p "$DIR/whl" "$DIR/shared/models/ref-llama-27m" "$DIR/shared/data/wikitext-2-raw" "$DIR/shared/data/calib"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# the sdist, trimmed: no git history, no model vocab files, docs, test data, benches or web UI sources (the build needs
# none: llama-server is built without its UI, but tools/ui/CMakeLists.txt must stay; the test sources stay for
# `dsa backend build --op-tests`, which builds test-backend-ops)
sdist=${DSA_SDIST:-}
if [ -z "$sdist" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$tmp"
  sdist=$tmp/llama_cpp_python-$VER.tar.gz
fi
tar xzf "$sdist" -C "$tmp"
v=$tmp/llama_cpp_python-$VER/vendor/llama.cpp
rm -rf "$tmp/llama_cpp_python-$VER/.git" "$v/.git" "$v/models" "$v/docs" "$v/tests/snapshots" "$v/benches" "$v/media" \
       "$v/tools/ui/src" "$v/tools/ui/tests" "$v/tools/ui/static" "$v/tools/ui/package-lock.json" \
       "$v"/tools/mtmd/*.mp4 "$v/AUTHORS" "$v/grammars" "$v/examples/llama.android" "$v/examples/llama.swiftui"
mkdir -p "$v/models"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - -C "$tmp" "llama_cpp_python-$VER" | gzip -n -6 \
  > "$DIR/llama-trim.tar.gz"

# wheels for the device's Python (pure Python: any platform)
gguf_ver=$(python3 -c "import importlib.metadata as m; print(m.version('gguf'))")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" -d "$DIR/whl" \
  "gguf==$gguf_ver" diskcache

m=$SHARED/models/ref-llama-27m
# the checkpoint's files gzipped (F16 shards: -21 %; the bundle plus the working tree must stay under 64 MiB),
# unpacked by run_d.sh on the device
files=("$m"/*.json)
[ -n "${NO_MODEL:-}" ] || files+=("$m"/*.safetensors)
for f in "${files[@]}"; do
  gzip -6c "$f" > "$DIR/shared/models/ref-llama-27m/$(basename "$f").gz"
done
if [ -n "${BACKEND_PARTS:-}" ]; then
  ls "$BACKEND_PARTS"/backend.t?z.part* > /dev/null || { echo "error: no backend.t?z.part* in $BACKEND_PARTS" >&2; exit 2; }
  mkdir -p "$DIR/backend" && cp "$BACKEND_PARTS"/backend.t?z.part* "$DIR/backend/"
fi
gzip -9c "$SHARED/data/wikitext-2-raw/wiki.test.raw" > "$DIR/shared/data/wikitext-2-raw/wiki.test.raw.gz"
gzip -9c "$SHARED/data/calib/books-calib.txt" > "$DIR/shared/data/calib/books-calib.txt.gz"

cat > "$DIR/run_d.sh" <<'RUN'
#!/usr/bin/env bash
# Device-side runner (written by scripts/gpu/make_device_bundle.sh): scripts/gpu/gpu_batch.sh with this folder's
# sdist, wheels and shared files. The work dir /tmp/w persists while the machine stays warm (backend, synthetic files,
# ref-dsa.gguf).
D=$(cd "$(dirname "$0")" && pwd)
for f in "$D"/shared/data/*/*.gz "$D"/shared/models/*/*.gz; do [ -f "${f%.gz}" ] || gunzip -k "$f"; done
p=$(ls "$D"/backend/backend.t?z.part* 2> /dev/null | head -1)   # a prebuilt backend (make_device_bundle.sh BACKEND_PARTS)
if [ -n "$p" ]; then
  case $p in *.txz.part*) x=J ;; *) x=z ;; esac
  c=${DSA_CACHE:-$HOME/.cache/dsa}/backend; mkdir -p "$c" && cat "${p%.part*}".part* | tar x${x}f - -C "$c" \
    && echo "prebuilt backend: $(ls "$c" | grep -v '\.log$' | tr '\n' ' ')"
fi
export SDIST=$D/llama-trim.tar.gz SHARED=$D/shared WHEELS=$D/whl WORK=${WORK:-/tmp/w}
export TOK=${TOK:-$D/shared/models/ref-llama-27m}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
exec bash scripts/gpu/gpu_batch.sh
RUN
total=$(du -sb "$DIR" | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk 'END{print $1}' || true)   # files deleted but not yet committed: du fails on them
echo "wrote $DIR: $(( total / 1048576 )) MiB; with the working tree $(( (total + tree) / 1024 )) KiB of the 65536 KiB a call carries"
