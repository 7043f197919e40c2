#!/usr/bin/env python3
"""Check the patched llama.cpp sparse attention against the PyTorch reference (dsa_convert.kernels_ref).

    LLAMA_CPP_LIB_PATH=<dir with the patched libllama.so> \
    python scripts/verify_dsa_patch.py /tmp/ref-f32.gguf --tokens 200 --top-k 64 --sink 4 --local 16

Takes a stock llama / qwen2 / qwen3 GGUF (f32 recommended), writes a DSA copy with a random indexer
(scripts/make_test_dsa_gguf.py) and checks through llama-cpp-python, with an f32 KV cache:
  1. the DSA file with the kv override `{arch}.attention.indexer.top_k = 0` gives exactly the
     logits of the stock file (dense, indexer not run);
  2. an override top_k >= n_tokens gives exactly the stock logits (every key selected);
  3. the sparse run matches kernels_ref's FORMAT.md §4-5 math (indexer + token selection +
     masked attention) to fp tolerance and differs clearly from dense.
Check (a) "stock file: patched == unpatched" needs two libraries and is done by running this
script's stock-file logits once with each library (see docs/PATCH.md).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def ref_logits(path: str, toks: np.ndarray, sparse: bool) -> np.ndarray:
    import gguf
    import torch
    from dsa_convert.kernels_ref.indexer import IndexerWeights, indexer_scores
    from dsa_convert.kernels_ref.model import RefModel, masked_attention
    from dsa_convert.kernels_ref.selection import select_tokens

    m = RefModel.from_gguf(path)
    if not sparse:
        return m.forward(torch.tensor(toks)).double().numpy()
    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    a = kv["general.architecture"]
    K, S, L = kv[f"{a}.attention.indexer.top_k"], kv[f"{a}.dsa.sink"], kv[f"{a}.dsa.local"]
    R, eps = kv[f"{a}.dsa.indexer.rope_dim"], kv[f"{a}.dsa.indexer.norm_eps"]
    base = float(kv.get(f"{a}.rope.freq_base", 10000.0))
    T = lambda n: torch.tensor(np.asarray(m.gguf.tensor(n), dtype=np.float32))  # noqa: E731

    def attn(layer, q, k, v, x, k_pre, positions):
        p = f"blk.{layer}.indexer."
        if not m.has(p + "attn_k.weight"):
            return masked_attention(q, k, v, torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril(), m.hp.kq_scale)
        w = IndexerWeights(T(p + "attn_q_b.weight"), T(p + "attn_k.weight"), T(p + "k_norm.weight"),
                           T(p + "k_norm.bias"), T(p + "proj.weight"), R, eps, base)
        mask = select_tokens(indexer_scores(x, positions, w), K, S, L)
        return masked_attention(q, k, v, mask, m.hp.kq_scale)

    return m.forward(torch.tensor(toks), attention=attn).double().numpy()


def llama_logits(path: str, toks: np.ndarray, overrides=None, n_ctx: int = 1024) -> np.ndarray:
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, verbose=False,
                kv_overrides=overrides, type_k=0, type_v=0)  # 0 = GGML_TYPE_F32
    llm.eval([int(t) for t in toks])
    out = np.array(llm.scores[: len(toks)], dtype=np.float64)
    llm.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stock_gguf")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--local", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rope-dim", type=int, default=32)
    ap.add_argument("--tol", type=float, default=1e-3, help="max |logit| difference to the reference")
    args = ap.parse_args()

    import gguf
    arch = gguf.GGUFReader(args.stock_gguf).fields["general.architecture"].contents()
    dsa = str(Path(tempfile.mkdtemp()) / "dsa.gguf")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_test_dsa_gguf.py"), args.stock_gguf, dsa,
                    "--heads", str(args.heads), "--dim", str(args.dim), "--rope-dim", str(args.rope_dim),
                    "--top-k", str(args.top_k), "--sink", str(args.sink), "--local", str(args.local)], check=True)
    toks = np.random.default_rng(1).integers(3, 300, args.tokens)
    key = f"{arch}.attention.indexer.top_k"

    stock = llama_logits(args.stock_gguf, toks)
    dense0 = llama_logits(dsa, toks, {key: 0})
    full = llama_logits(dsa, toks, {key: max(args.tokens, args.top_k)})
    sparse = llama_logits(dsa, toks)
    ref = ref_logits(dsa, toks, sparse=True)

    ok = True
    def check(name, cond, detail=""):
        nonlocal ok
        ok &= bool(cond)
        print(f"[{'PASS' if cond else 'FAIL'}] {name} {detail}")

    check("top_k=0 override == stock file (bit-exact)", np.array_equal(dense0, stock))
    check("top_k>=n_tokens == stock file (bit-exact)", np.array_equal(full, stock))
    check(f"first {args.top_k} rows of the sparse run == stock (dense rows)", np.array_equal(sparse[:args.top_k], stock[:args.top_k]))
    d_ref = np.abs(sparse - ref).max()
    d_dense = np.abs(sparse - stock).max()
    check("sparse matches kernels_ref", d_ref < args.tol, f"(max |diff| {d_ref:.2e})")
    check("sparse differs from dense", d_dense > 10 * max(d_ref, 1e-6), f"(max |diff| {d_dense:.2e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
