#!/usr/bin/env bash
# The folder a GPU call carries for scripts/gpu/longctx.sh: make_device_bundle.sh's sdist, wheels and data (without the
# 2K checkpoint's weights), plus the 32K reference checkpoint (xz: the weights are bf16, xz takes 29 % off) and the
# needle eval's book filler (corpus/books_003.txt.xz).
#   bash scripts/gpu/make_longctx_bundle.sh [DIR]        (default .devlc; SHARED as make_device_bundle.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.devlc}
SHARED=${SHARED:-../shared}
mk=$(ls scripts/gpu/make_device_bundle.sh scripts/make_device_bundle.sh 2> /dev/null | head -1 || true)
NO_MODEL=1 SHARED=$SHARED bash "$mk" "$DIR" > /dev/null
m=$SHARED/models/ref-llama-27m-32k
mkdir -p "$DIR/shared/models/ref-llama-27m-32k" "$DIR/shared/corpus"
cp "$m"/*.json "$DIR/shared/models/ref-llama-27m-32k/"
for f in "$m"/*.safetensors; do xz -6 -T0 -c "$f" > "$DIR/shared/models/ref-llama-27m-32k/$(basename "$f").xz"; done
cp "$SHARED/corpus/books_003.txt.xz" "$DIR/shared/corpus/"
total=$(du -sb "$DIR" | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk 'END{print $1}' || true)   # files deleted but not yet committed: du fails on them
echo "wrote $DIR: $(( total / 1048576 )) MiB; with the working tree $(( (total + tree) / 1024 )) KiB of the 65536 KiB a call carries"
