#!/usr/bin/env python3
"""Concurrent CUDA streams must not change a decode (issue 6; GPU builds).

The patch forks each sparse DSA layer's single-token graph at `attn_norm` into concurrent CUDA streams: Q, K, V and
the lightning indexer's branch (merged projection, key LayerNorm, RoPE, key store, indexer, top-k), joined at the
sparse attention op; a shared layer (`{arch}.attention.indexer.types`, `dsa convert --index-share G`) forks its Q, K,
V the same way (upstream's `GGML_CUDA_GRAPH_OPT=1` adds its own 3-branch fork of dense layers; docs/PATCH.md). The
forks are made only for CUDA graphs. The kernels and their inputs are the same as on one stream, so every decoded
token's logits must be bit-identical to a run without forks. This runs the file several times, each in a process of
its own (ggml's CUDA switches are read once per process) with the same random prompt and decode tokens: CUDA graphs
off (upstream's GGML_CUDA_DISABLE_GRAPHS=1: no fork, the reference), the DSA fork alone (the default), and both
forks; it compares the logits of every decode step with the run without forks. The patch logs no count of the
regions it forked, so this check does not show that the default run forked (a kernel timeline does, e.g. nsys).

    python scripts/gpu/check_streams.py synth-1b.gguf --prefill 2600 --decode 24 --n-gpu-layers 999 [--kv f16|asq]

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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def decode_logits(a) -> np.ndarray:
    """Prefill a.prefill random tokens, then a.decode single-token evals: the logits of each decode step."""
    from dsa_convert.backend.llama_runner import RunnerOptions, open_model
    from dsa_convert.eval.perplexity_llamacpp import dsa_overrides
    from dsa_convert.formats.gguf_read import GgufFile
    g = GgufFile(Path(a.gguf))
    try:   # the sparse run's kv overrides as `dsa bench --kv f16 --index-keys K` builds them
        ov = dsa_overrides(g, "sparse", None, a.kv, a.index_keys)[0]
    finally:
        g.close()
    n = a.prefill + a.decode
    llm = open_model(Path(a.gguf), RunnerOptions(n_ctx=256 * ((n + 255) // 256), n_batch=512, n_gpu_layers=a.n_gpu_layers,
                                                 flash_attn=True, kv_type=a.kv, kv_overrides=ov, logits_all=False))
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
    ap.add_argument("--kv", choices=("f16", "asq", "q8_0"), default="f16", help="KV cache of the sparse run")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        np.save(a.child, decode_logits(a))
        return 0

    # name: (GGML_CUDA_DISABLE_GRAPHS, GGML_CUDA_GRAPH_OPT); "" = unset
    configs = {
        "no fork": ("1", ""),
        "DSA fork (default)": ("", ""),
        "DSA + upstream fork": ("", "1"),
    }
    runs = {}
    with tempfile.TemporaryDirectory(prefix="dsa-streams-") as td:
        for i, (name, (no_graphs, opt)) in enumerate(configs.items()):
            out = Path(td) / f"run{i}.npy"
            env = {k: v for k, v in os.environ.items() if k not in ("GGML_CUDA_DISABLE_GRAPHS", "GGML_CUDA_GRAPH_OPT")}
            env.update({k: v for k, v in (("GGML_CUDA_DISABLE_GRAPHS", no_graphs), ("GGML_CUDA_GRAPH_OPT", opt)) if v})
            cmd = [sys.executable, __file__, a.gguf, "--prefill", str(a.prefill), "--decode", str(a.decode),
                   "--n-gpu-layers", str(a.n_gpu_layers), "--index-keys", a.index_keys, "--seed", str(a.seed),
                   "--kv", a.kv, "--child", str(out)]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            print(f"{name} (GGML_CUDA_DISABLE_GRAPHS={no_graphs or '-'} GGML_CUDA_GRAPH_OPT={opt or '-'})")
            if p.returncode != 0:
                print(f"[FAIL] the run '{name}' exited {p.returncode}:\n{p.stderr[-2000:]}")
                return 1
            runs[name] = np.load(out)
    ok = True
    base = runs["no fork"]
    for name, arr in runs.items():
        if name == "no fork":
            continue
        same = np.array_equal(base.view(np.uint32), arr.view(np.uint32))
        diff = float(np.max(np.abs(base.astype(np.float64) - arr)))
        steps = int(np.sum(np.any(base != arr, axis=1)))
        ok = ok and same
        print(f"[{'PASS' if same else 'FAIL'}] {name}: {a.decode} decode steps after {a.prefill} prompt tokens, logits "
              f"{'bit-identical' if same else f'differ in {steps} steps, max |diff| {diff:.3g}'} to the run without "
              f"forks ({a.kv} cache, index keys {a.index_keys})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
