#!/usr/bin/env python3
"""Write patches/llama.cpp/ as an ordered series from a patched llama.cpp git tree.

    python3 scripts/write_patch_series.py TREE [--base REV] [--head REV] [--out patches/llama.cpp]

TREE is a llama.cpp checkout (git) whose BASE revision is the llama.cpp vendored in llama-cpp-python (see
dsa_convert/backend/build.py) and whose HEAD holds the project's changes. Each patch of the series is `git diff
BASE HEAD` over one group of paths, with a header saying what it does (patch(1) skips text before the first diff).
The groups are disjoint and every changed path must fall in one, so the series applies in order to a pristine tree
and gives HEAD exactly (`dsa backend build` applies them in name order). A changed path no group claims is an error.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

# (file name, paths (git pathspecs), header)
SERIES = [
    ("0001-ggml-dsa-ops.patch",
     ["ggml/include/ggml.h", "ggml/include/ggml-rpc.h", "ggml/src/ggml.c", "ggml/src/ggml-cpu", "tests/test-backend-ops.cpp"],
     "ggml: operators for DeepSeek-style sparse attention over a llama-family KV cache, CPU implementations\n"
     "and test-backend-ops cases.\n\n"
     "New ops, appended at the end of enum ggml_op (RPC_PROTO_PATCH_VERSION bumped):\n"
     "  GGML_OP_DSA_ASQ_SET_ROWS / GGML_OP_DSA_ASQ_GET_ROWS  encode / decode KV vectors of the ASQ compressed cache\n"
     "                                                       (prototype id, f16 residual scale, 4- or 8-bit levels)\n"
     "  GGML_OP_DSA_SPARSE_ATTN   attention over the top-k selected cells of an F16/F32 or ASQ cache, read in place\n"
     "  GGML_OP_DSA_INDEXER_MASK  the lightning indexer's mask (and a decode ubatch's visibility mask) from positions\n"
     "Changed: ggml_lightning_indexer takes an F32 mask; ggml_lightning_indexer_scaled folds the head-weight scale.\n"
     "CPU: ggml_top_k selects in O(n) per row (std::nth_element on a copy, then one scan) instead of a partial sort;\n"
     "the lightning indexer converts each key once per ubatch (blocks of keys scored against every token) and skips\n"
     "masked cells.\n"),
    ("0002-ggml-cuda-dsa-kernels.patch",
     ["ggml/src/ggml-cuda"],
     "ggml-cuda: kernels for the DSA ops of 0001 and the decode graph around them.\n\n"
     "Sparse attention (split-K online softmax; score-first and tensor-core forms), ASQ encode / decode, indexer mask,\n"
     "the decode / prefill lightning indexer (tensor cores on Ampere+), a radix-select top-k for rows longer than 1024\n"
     "(persistent cooperative kernel for decode, one block per row for prefill, clusters on Hopper), the indexer key's\n"
     "LayerNorm + RoPE + store fusion and concurrent streams for a DSA layer's decode branches. supports_op reports\n"
     "exactly the shapes the kernels take; the DSA kernels are compiled for NVIDIA CUDA only (HIP / MUSA report them\n"
     "unsupported).\n"),
    ("0003-ggml-backend-async-inputs.patch",
     ["ggml/src/ggml-backend.cpp"],
     "ggml-backend: the scheduler copies a split's host-memory user inputs asynchronously with one synchronization\n"
     "per split instead of a synchronous copy per input (not used with pipeline-parallel copy events).\n"),
    ("0004-llama-dsa-sparse-attention.patch",
     ["src"],
     "llama: DeepSeek-style sparse attention (lightning indexer + top-k) and the ASQ KV cache for llama / qwen2 / qwen3.\n\n"
     "GGUF keys {arch}.dsa.* and blk.N.indexer.* tensors (all optional: a file without them loads and runs as before),\n"
     "a llama_kv_cache_dsa with an indexer-key cache, the graph's indexer, selection and attention paths (decode over\n"
     "the picks, prefill masked or over the picks at long context), masks computed in the graph, and a GPU check of\n"
     "every DSA node (a standard-op form, or one error, where a fused kernel does not cover the shape).\n"
     "Environment (docs/PATCH.md in the dsa repository): LLAMA_DSA_FUSED, LLAMA_DSA_HOST_MASKS, LLAMA_DSA_GATHER\n"
     "(reference paths), LLAMA_DSA_HOST_TIMING, LLAMA_DSA_INDEXER_ONLY (measurements).\n"),
]


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", type=Path)
    ap.add_argument("--base", default="base")
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "patches" / "llama.cpp")
    a = ap.parse_args(argv)
    changed = set(git(a.tree, "diff", "--name-only", a.base, a.head).split())
    claimed: set[str] = set()
    for _, paths, _ in SERIES:
        claimed |= set(git(a.tree, "diff", "--name-only", a.base, a.head, "--", *paths).split())
    if changed - claimed:
        print(f"error: changed paths in no patch of the series: {', '.join(sorted(changed - claimed))}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    for old in a.out.glob("*.patch"):
        old.unlink()
    for name, paths, header in SERIES:
        diff = git(a.tree, "diff", "--no-color", "--no-ext-diff", a.base, a.head, "--", *paths)
        if not diff:
            print(f"error: {name}: no changes under {', '.join(paths)}", file=sys.stderr)
            return 2
        (a.out / name).write_text(header + "\n" + diff)
        print(f"{name}: {diff.count(chr(10))} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
