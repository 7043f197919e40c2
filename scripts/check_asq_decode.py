#!/usr/bin/env python3
"""The ASQ decode path of the patched llama.cpp on a DSA file with ASQ prototypes (e.g. the reference DSA model),
CPU or GPU: prefill, then single-token evals (the decode path) with the in-place op over the ASQ cache (the
default, ggml_dsa_sparse_attn_asq) vs the decode-into-F32 + flash-attention form (LLAMA_DSA_FUSED_ASQ=0), both
vs kernels_ref's ASQ math (FORMAT.md section 6; torch on the CPU, in a separate process).

    python scripts/check_asq_decode.py ref-dsa.gguf --prefill 600 --decode 48 --n-gpu-layers 99

The prefill must pass the file's top_k so that the decodes select. Errors are relative to the reference's logit
range: op vs FA form is reported (see main() for why it has no float-noise bound on a trained model); per-row vs
kernels_ref: median below 1.5x that of the masked decode (LLAMA_DSA_GATHER_MAX_TOKENS=0) on the same rows, or 1e-3,
whichever is larger; and the op's median no more than 1.1x the FA form's.
Exit 0 when every check passes, 1 otherwise.
"""
from __future__ import annotations

import os
import sys

try:                      # before numpy: see dsa_convert.backend.runtime.preload_llama_cpp
    import llama_cpp  # noqa: F401
except (ImportError, OSError):
    pass

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verify_dsa_patch as v  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dsa_gguf")
    ap.add_argument("--prefill", type=int, default=600)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    v.N_GPU_LAYERS = args.n_gpu_layers
    n = args.prefill + args.decode
    n_ctx = 256 * ((n + 255) // 256)
    toks = np.random.default_rng(args.seed).integers(3, 4000, n)

    os.environ["LLAMA_DSA_FUSED_ASQ"] = "0"
    unfused = v.llama_logits(args.dsa_gguf, toks, n_ctx=n_ctx, prefill=args.prefill, flash_attn=True)
    del os.environ["LLAMA_DSA_FUSED_ASQ"]
    fused = v.llama_logits(args.dsa_gguf, toks, n_ctx=n_ctx, prefill=args.prefill, flash_attn=True)
    ref = v.ref_logits_isolated(args.dsa_gguf, toks, kv="asq")

    d = slice(args.prefill, n)
    scale = ref.max() - ref.min()
    ok = True

    def check(name: str, cond: bool, detail: str) -> None:
        nonlocal ok
        ok &= cond
        print(f"[{'PASS' if cond else 'FAIL'}] {name} ({detail})")

    check("prefill rows: op and FA form run the same masked path", np.array_equal(fused[: args.prefill],
          unfused[: args.prefill]), "bit-exact")
    check("decode rows differ (two different graphs ran)", not np.array_equal(fused[d], unfused[d]), "")
    e = np.abs(fused[d] - unfused[d]).max() / scale
    # Reported, not bounded: each decoded token's K/V is ASQ-encoded from its hidden state, and the nearest-prototype /
    # residual-rounding choice flips on rounding-level differences between the two forms (CUDA flash attention takes
    # the decoded rows as F16, the op keeps them F32; on the CPU their summation orders differ), so the two drift apart
    # over the decodes. Seen: H200 max 7.3e-3, this VM's CPU wheel 2.5e-3, a -march=native CPU build 1.5e-7 of the
    # logit range, each time with both forms at the same median error vs kernels_ref. The checks below hold each form
    # to the reference instead (the tiny random models of tests/test_runtime_asq.py keep a 2e-3 bound between them).
    print(f"       decode: in-place ASQ op vs decode + flash attention: max {e:.2e} of the logit range (reported)")
    # baseline: the same decode rows through the masked path (LLAMA_DSA_GATHER_MAX_TOKENS=0: the whole cache decoded,
    # masked flash attention), vs kernels_ref. With F16 weights the ASQ encode (nearest prototype, residual rounding)
    # flips on rounding-level differences, so the decode path is held to the masked path's error, not to float noise.
    masked = v.llama_logits(args.dsa_gguf, toks, n_ctx=n_ctx, prefill=args.prefill, flash_attn=True, gather=False)
    base = np.median(np.abs(masked[d] - ref[d]).max(axis=1) / scale)
    bound = max(1.5 * base, 1e-3)
    print(f"       masked decode vs kernels_ref ASQ: per-row max err median {base:.2e}")
    med = {}
    for name, got in (("in-place op", fused), ("decode + FA", unfused)):
        row = np.abs(got[d] - ref[d]).max(axis=1) / scale
        med[name] = np.median(row)
        check(f"decode: {name} vs kernels_ref ASQ", med[name] < bound,
              f"per-row max err median {med[name]:.2e} (bound {bound:.2e}), max {row.max():.2e}")
    check("decode: the in-place op is no further from kernels_ref than decode + FA",
          med["in-place op"] <= 1.1 * med["decode + FA"] + 1e-5,
          f"medians {med['in-place op']:.2e} vs {med['decode + FA']:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
