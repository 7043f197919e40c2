#!/usr/bin/env python3
"""Concurrent CUDA streams and the indexer key-store fold must not change a decode (issue 6; GPU builds).

The patch forks each sparse DSA layer's single-token graph at `attn_norm` into concurrent CUDA streams: Q, K, V and
the lightning indexer's branch (merged projection, key LayerNorm, RoPE, key store, indexer, top-k), joined at the
sparse attention op (`LLAMA_DSA_STREAMS`, default 1; upstream's `GGML_CUDA_GRAPH_OPT=1` adds its own 3-branch fork of
dense layers; docs/PATCH.md). The kernels and their inputs are the same as on one stream, so every decoded token's
logits must be bit-identical to a run without the fork. This runs the file several times, each in a process of its own
(the switches are read once per process) with the same random prompt and decode tokens: both forks off, the DSA fork
alone (the default), and both forks; it compares the logits of every decode step with the run without forks. With
LLAMA_DSA_STREAMS_LOG=1 the patch reports how many fork regions ran concurrently; that line is echoed, and a run with
a fork on but no valid region fails (a PASS would say nothing).
On a file with shared indexer layers (`{arch}.attention.indexer.types`, `dsa convert --index-share G`) the DSA fork
also forks each shared layer's Q, K, V (LLAMA_DSA_STREAMS_SHARED, default 1): a run with it off must report fewer
concurrent regions than the default, else the comparison says nothing about the shared layers' fork; and a run
with their L2 prefetch of the picks (opt-in LLAMA_DSA_SATTN_PREFETCH=1, a 4th branch of their fork that only warms L2)
must be bit-identical too.
A fourth run, with the DSA fork, folds the indexer key store into the decode indexer kernel (opt-in
LLAMA_DSA_LID_KFOLD=1; the others store the keys with their own kernel before the indexer): the same arithmetic,
so its logits must be bit-identical too; it must report the fold (LLAMA_DSA_LID_KFOLD_LOG=1), and the others must
not, else the comparison says nothing about it. A fifth, with the DSA fork, runs the indexer key's LayerNorm + RoPE in
its early form (opt-in LLAMA_DSA_NORM_ROPE_EARLY=1: weights, position and cell index read before the wait for the
projection, the same operations in the same order): bit-identical too, and it must report that form
(LLAMA_DSA_NORM_ROPE_EARLY_LOG=1). A sixth gives the greatest stream priority to the Q/K/V branches instead of the
indexer's (opt-in LLAMA_DSA_STREAM_PRIO=2): scheduling only, so bit-identical too, and its reported priority streams
must differ from the default run's.

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
import re  # noqa: E402
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

    from dsa_convert.formats.gguf_read import GgufFile
    g = GgufFile(Path(a.gguf))
    try:
        types = g.indexer_types()
    finally:
        g.close()
    shared = types is not None and not all(types)
    # name: (LLAMA_DSA_STREAMS, GGML_CUDA_GRAPH_OPT, LLAMA_DSA_LID_KFOLD, LLAMA_DSA_NORM_ROPE_EARLY,
    #        LLAMA_DSA_STREAMS_SHARED, LLAMA_DSA_SATTN_PREFETCH, LLAMA_DSA_STREAM_PRIO)
    configs = {
        "no fork": ("0", "0", "0", "0", "0", "0", "1"),
        "DSA fork (default)": ("1", "0", "0", "0", "1", "0", "1"),
        "DSA + upstream fork": ("1", "1", "0", "0", "1", "0", "1"),
        "DSA fork, key store folded": ("1", "0", "1", "0", "1", "0", "1"),
        "DSA fork, key norm early": ("1", "0", "0", "1", "1", "0", "1"),
        "DSA fork, Q/K/V priority": ("1", "0", "0", "0", "1", "0", "2"),
    }
    if shared:
        configs["DSA fork, shared layers unforked"] = ("1", "0", "0", "0", "0", "0", "1")
        # the shared layers' L2 prefetch of their picks (opt-in; a 4th branch beside Q, K, V): same arithmetic
        configs["DSA fork, prefetch"] = ("1", "0", "0", "0", "1", "1", "1")
    runs, n_regions, prio_streams = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="dsa-streams-") as td:
        for i, (name, (dsa, opt, kfold, early, share, pf, prio)) in enumerate(configs.items()):
            out = Path(td) / f"run{i}.npy"
            env = dict(os.environ, LLAMA_DSA_STREAMS=dsa, GGML_CUDA_GRAPH_OPT=opt, LLAMA_DSA_STREAMS_LOG="1",
                       LLAMA_DSA_LID_KFOLD=kfold, LLAMA_DSA_LID_KFOLD_LOG="1", LLAMA_DSA_NORM_ROPE_EARLY=early,
                       LLAMA_DSA_NORM_ROPE_EARLY_LOG="1", LLAMA_DSA_STREAMS_SHARED=share, LLAMA_DSA_SATTN_PREFETCH=pf,
                       LLAMA_DSA_STREAM_PRIO=prio)
            cmd = [sys.executable, __file__, a.gguf, "--prefill", str(a.prefill), "--decode", str(a.decode),
                   "--n-gpu-layers", str(a.n_gpu_layers), "--index-keys", a.index_keys, "--seed", str(a.seed),
                   "--kv", a.kv, "--child", str(out)]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            regions = [ln.strip() for ln in p.stderr.splitlines() if "concurrent regions" in ln]
            folded = any("key store folded" in ln for ln in p.stderr.splitlines())
            early_ran = any("in its early form" in ln for ln in p.stderr.splitlines())
            print(f"{name} (LLAMA_DSA_STREAMS={dsa} GGML_CUDA_GRAPH_OPT={opt} LLAMA_DSA_LID_KFOLD={kfold} "
                  f"LLAMA_DSA_NORM_ROPE_EARLY={early} LLAMA_DSA_STREAMS_SHARED={share} LLAMA_DSA_SATTN_PREFETCH={pf} "
                  f"LLAMA_DSA_STREAM_PRIO={prio}): "
                  f"{regions[0] if regions else 'no concurrent regions reported'}; "
                  f"key store {'folded into the indexer' if folded else 'its own kernel'}; "
                  f"key norm {'early form' if early_ran else 'plain form'}")
            if p.returncode != 0:
                print(f"[FAIL] the run '{name}' exited {p.returncode}:\n{p.stderr[-2000:]}")
                return 1
            m = re.search(r"concurrent regions: (\d+) of", regions[0]) if regions else None
            if dsa == "1" and (m is None or int(m.group(1)) == 0):
                print(f"[FAIL] the run '{name}' forked no region: it says nothing about concurrent streams")
                return 1
            n_regions[name] = int(m.group(1)) if m else 0
            pm = re.search(r"priority streams: (.*)$", regions[0]) if regions else None
            prio_streams[name] = pm.group(1) if pm else None
            if (kfold == "1") != folded:
                print(f"[FAIL] the run '{name}' {'did not fold' if kfold == '1' else 'folded'} the key store: "
                      "the comparison says nothing about the fold")
                return 1
            if (early == "1") != early_ran:
                print(f"[FAIL] the run '{name}' {'did not run' if early == '1' else 'ran'} the key norm's early form: "
                      "the comparison says nothing about it")
                return 1
            runs[name] = np.load(out)
    if shared and n_regions["DSA fork (default)"] <= n_regions["DSA fork, shared layers unforked"]:
        print(f"[FAIL] the shared layers' fork forked no region ({n_regions['DSA fork (default)']} regions with it, "
              f"{n_regions['DSA fork, shared layers unforked']} without): it says nothing about it")
        return 1
    if prio_streams["DSA fork, Q/K/V priority"] == prio_streams["DSA fork (default)"]:
        print(f"[FAIL] LLAMA_DSA_STREAM_PRIO=2 gave the same priority streams as the default "
              f"({prio_streams['DSA fork (default)']}): the comparison says nothing about it")
        return 1
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
