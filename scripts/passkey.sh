#!/usr/bin/env bash
# Passkey retrieval with llama.cpp's own client (examples/passkey, built by `dsa backend build`) on a GGUF.
#
#   scripts/passkey.sh FILE.gguf LENGTH [dense|sparse|local] [extra llama-passkey args ...]
#
# LENGTH is the prompt length in tokens: the script picks llama-passkey's --junk (how many filler sentences) so that
# the prompt, tokenized with the file's own vocab exactly as llama-passkey builds it, is the longest one of at most
# LENGTH tokens. The mode is set with kv overrides, as `dsa eval` runs it (default: sparse where the file has a DSA
# indexer, else dense):
#   dense   {arch}.attention.indexer.top_k = 0
#   sparse  the file's top-k, sinks and local window; indexer keys cached in F16
#   local   sinks + a window of top_k - sinks (no indexer picks): the equal-budget baseline
# The KV cache is F16 in every mode (the ASQ cache of a file with prototypes is switched off). Extra args go to the
# tool, e.g. `--pos 100` (where the key sits, in filler sentences; default: the tool's own pseudo-random choice),
# `-ngl 99`, `-fa on`. llama-passkey allocates n_ctx_train + 32 cells, so LENGTH must fit the trained context.
# Prints the tool's lines about the key (the passkey and where it was inserted, the prompt size) and its answer.
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }
[ $# -ge 2 ] || die "usage: scripts/passkey.sh FILE.gguf LENGTH [dense|sparse|local] [extra llama-passkey args]"
FILE=$1 LENGTH=$2
shift 2
MODE=auto
if [ $# -ge 1 ] && [[ $1 != -* ]]; then MODE=$1; shift; fi
case $MODE in auto|dense|sparse|local) ;; *) die "unknown mode '$MODE' (dense, sparse or local)";; esac
[[ $LENGTH =~ ^[0-9]+$ ]] || die "LENGTH must be a number of tokens (got '$LENGTH')"
[ -f "$FILE" ] || die "file not found: $FILE"

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# the plan, one item a line: tool path, library dir, --junk, the mode as run, then the --override-kv values
PLAN=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python3 - "$FILE" "$LENGTH" "$MODE" <<'EOF'
import sys
from dsa_convert.backend.runtime import import_llama_cpp
from dsa_convert.errors import DsaError

try:
    import_llama_cpp()              # before numpy (runtime.preload_llama_cpp)
    from dsa_convert.backend.llama_runner import open_vocab, tokenize
    from dsa_convert.backend.runtime import tool_path
    from dsa_convert.eval.perplexity_llamacpp import dsa_overrides
    from dsa_convert.formats.gguf_read import GgufFile

    path, length, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tool, env = tool_path("llama-passkey")
    g = GgufFile(path)
    try:
        n_train = int(g.require(f"{g.arch}.context_length"))
        ov, run = dsa_overrides(g, None if mode == "auto" else mode, None)
        if g.get(f"{g.arch}.attention.indexer.top_k") is not None:
            ov[f"{g.arch}.dsa.asq.cache"] = False       # F16 cache, as `dsa eval --kv f16`
    finally:
        g.close()
    if length > n_train:
        raise DsaError(f"LENGTH {length} exceeds the trained context {n_train} (llama-passkey would shift the cache)")

    # examples/passkey/passkey.cpp's prompt; the key sentence's length varies by a token or two with the key
    prefix = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
              "I will quiz you about the important information there.")
    key = " The pass key is 12345. Remember it. 12345 is the pass key."
    junk = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    llm = open_vocab(path)
    add_bos = bool(llm._model.add_bos_token())
    count = lambda n: len(tokenize(llm, prefix + key + junk * n + " What is the pass key? The pass key is", add_bos))
    budget = length - 2                                 # margin for the real key's digits
    a, b = count(10), count(20)
    n = max(1, int((budget - a) * 10 / (b - a)) + 10)
    while n > 1 and count(n) > budget:
        n -= 1
    if count(n) > budget:
        raise DsaError(f"LENGTH {length} is shorter than the smallest passkey prompt ({count(1) + 2} tokens)")
    print(tool)
    print(env["LD_LIBRARY_PATH"])
    print(n)
    print(run["attn"] + (f" (top-k {run['top_k']}, sinks {run['sink']}, local {run['local']})" if run["top_k"] else ""))
    for k, v in ov.items():
        kind = "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "str"
        print(f"{k}={kind}:{str(v).lower() if isinstance(v, bool) else v}")
except (DsaError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(3)
EOF
) || exit $?

mapfile -t P <<< "$PLAN"
TOOL=${P[0]} LIBDIR=${P[1]} JUNK=${P[2]} RUN=${P[3]}
ARGS=(-m "$FILE" --junk "$JUNK" -lv 4)     # log verbosity 4: llama.cpp's load lines, "sparse attention: ..." among them
for o in "${P[@]:4}"; do ARGS+=(--override-kv "$o"); done

OUT=$(mktemp) ERR=$(mktemp)
trap 'rm -f "$OUT" "$ERR"' EXIT
if ! LD_LIBRARY_PATH="$LIBDIR" "$TOOL" "${ARGS[@]}" "$@" >"$OUT" 2>"$ERR"; then
    tail -n 5 "$ERR" >&2
    echo "error: llama-passkey failed" >&2
    exit 1
fi
echo "attention: $RUN; --junk $JUNK"
# llama.cpp's log lines carry a time stamp and a level letter ("0.19.411.842 I main: ...")
grep -E "sparse attention: (top-k|off)|prompt tokens:|passkey = " "$ERR" | sed -E 's/^[0-9.]+ [A-Z] //; s/^[a-z_]+: //' || true
echo "answer:$(tr -s '\n' ' ' <"$OUT" | sed -E 's/ +$//')"
