#!/usr/bin/env python3
"""Concurrent CUDA streams must not change a decode (issue 6; GPU builds of the backend).

With GGML_CUDA_GRAPH_OPT=1 llama.cpp's CUDA backend forks each layer's single-token attention at `attn_norm` into
concurrent streams (Q, K, V; with LLAMA_DSA_STREAMS=1 the patch adds the lightning indexer's branch: merged
projection, key LayerNorm, RoPE, key store, indexer, top-k) and joins them at the attention op (docs/PATCH.md). The kernels and their inputs are the same as on one
stream, so every decoded token's logits must be bit-identical to a run without the fork. This runs the file twice,
each in a process of its own (the switch is read once per process), with the same random prompt and decode tokens,
and compares the logits of every decode step. With LLAMA_DSA_STREAMS_LOG=1 the patch reports how many of the fork
regions it could run concurrently; that line is echoed, so a PASS with 0 valid regions is visible as such.

    python scripts/check_streams.py synth-1b.gguf --prefill 2600 --decode 24 --n-gpu-layers 999

Exit 0 when the logits are bit-identical, 1 otherwise.
"""
from __future__ import annotations

try:                      # before numpy: see dsa_convert.backend.runtime.preload_llama_cpp
    import llama_cpp  # noqa: F401
except (ImportError, OSError):
    pass

import argparse  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def decode_logits(a) -> np.ndarray:
    """Prefill a.prefill random tokens, then a.decode single-token evals: the logits of each decode step."""
    from dsa_convert.backend.llama_runner import RunnerOptions, open_model
    from dsa_convert.eval.perplexity_llamacpp import dsa_overrides
    from dsa_convert.formats.gguf_read import GgufFile
    g = GgufFile(Path(a.gguf))
    try:   # the sparse run's kv overrides as `dsa bench --kv f16 --index-keys K` builds them
        ov = dsa_overrides(g, "sparse", None, "f16", a.index_keys)[0]
    finally:
        g.close()
    n = a.prefill + a.decode
    llm = open_model(Path(a.gguf), RunnerOptions(n_ctx=256 * ((n + 255) // 256), n_batch=512, n_gpu_layers=a.n_gpu_layers,
                                                 flash_attn=True, kv_type="f16", kv_overrides=ov, logits_all=False))
    n_vocab = llm.n_vocab()
    toks = np.random.default_rng(a.seed).integers(3, n_vocab, n)
    ids = [int(t) for t in toks]
    llm.eval(ids[: a.prefill])
    out = np.empty((a.decode, n_vocab), dtype=np.float32)
    for i, t in enumerate(ids[a.prefill:]):
        llm.eval([t])
        out[i] = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
    llm.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--prefill", type=int, default=2600, help="prompt tokens (more than top_k: the decodes select)")
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--n-gpu-layers", type=int, default=999)
    ap.add_argument("--index-keys", choices=("f32", "f16"), default="f16")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        np.save(a.child, decode_logits(a))
        return 0

    runs = {}
    with tempfile.TemporaryDirectory(prefix="dsa-streams-") as td:
        for opt in ("0", "1"):
            out = Path(td) / f"opt{opt}.npy"
            env = dict(os.environ, GGML_CUDA_GRAPH_OPT=opt, LLAMA_DSA_STREAMS=opt, LLAMA_DSA_STREAMS_LOG="1")
            cmd = [sys.executable, __file__, a.gguf, "--prefill", str(a.prefill), "--decode", str(a.decode),
                   "--n-gpu-layers", str(a.n_gpu_layers), "--index-keys", a.index_keys, "--seed", str(a.seed),
                   "--child", str(out)]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            for line in p.stderr.splitlines():
                if "concurrent regions" in line:
                    print(f"GGML_CUDA_GRAPH_OPT={opt} LLAMA_DSA_STREAMS={opt}: {line.strip()}")
            if p.returncode != 0:
                print(f"[FAIL] the run with GGML_CUDA_GRAPH_OPT={opt} exited {p.returncode}:\n{p.stderr[-2000:]}")
                return 1
            runs[opt] = np.load(out)
    a0, a1 = runs["0"], runs["1"]
    same = np.array_equal(a0.view(np.uint32), a1.view(np.uint32))
    diff = float(np.max(np.abs(a0.astype(np.float64) - a1)))
    steps = int(np.sum(np.any(a0 != a1, axis=1)))
    print(f"[{'PASS' if same else 'FAIL'}] {a.decode} decode steps after {a.prefill} prompt tokens: logits "
          f"{'bit-identical' if same else f'differ in {steps} steps, max |diff| {diff:.3g}'} with and without "
          f"concurrent streams (index keys {a.index_keys})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
