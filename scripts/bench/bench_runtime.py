#!/usr/bin/env python3
"""Runtime checks of the patched llama.cpp against its own tool and against kernels_ref:

1. a stock GGUF: `dsa eval` (llama-cpp-python) vs the same tree's `llama-perplexity -b CTX`;
2. a DSA GGUF: llama.cpp sparse vs kernels_ref sparse, and llama.cpp dense override vs the same
   file with the DSA parts stripped (scripts/strip_dsa.py), at the same ctx / chunks / KV type.

    python scripts/bench/bench_runtime.py --stock ref-f16.gguf --dsa ref-dsa.gguf [--ctx 2048 --chunks 4]
        [--stock-ctx 512 --stock-chunks 60] [--n-gpu-layers 0]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from dsa_convert.backend.runtime import tool_path  # noqa: E402
from dsa_convert.eval.data import resolve  # noqa: E402


def dsa_eval(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "dsa_convert.cli", "eval", *args, "--json"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"dsa eval {' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def tool_ppl(gguf: Path, ctx: int, chunks: int, ngl: int) -> float:
    exe, env = tool_path("llama-perplexity")
    cmd = [str(exe), "-m", str(gguf), "-f", str(resolve("wikitext2")), "-c", str(ctx), "-b", str(ctx),
           "--chunks", str(chunks), "-fa", "off", "-ngl", str(ngl)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
    if not m:
        raise SystemExit(f"llama-perplexity failed: {(r.stderr or r.stdout)[-800:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stock", type=Path, required=True)
    ap.add_argument("--dsa", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--stock-ctx", type=int, default=512)
    ap.add_argument("--stock-chunks", type=int, default=60)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--kv", default="f16")
    a = ap.parse_args()
    ngl = ["--n-gpu-layers", str(a.n_gpu_layers)]
    rows = []
    ours = dsa_eval(str(a.stock), "--ctx", str(a.stock_ctx), "--chunks", str(a.stock_chunks), *ngl)
    tool = tool_ppl(a.stock, a.stock_ctx, a.stock_chunks, a.n_gpu_layers)
    rows.append(("stock file: `dsa eval` vs `llama-perplexity`", ours["ppl"], tool, a.stock_ctx, a.stock_chunks))
    common = ["--ctx", str(a.ctx), "--chunks", str(a.chunks), "--kv", a.kv]
    sp = dsa_eval(str(a.dsa), *common, "--attn", "sparse", *ngl)
    ref = dsa_eval(str(a.dsa), *common, "--attn", "sparse", "--backend", "torch")
    rows.append((f"DSA file, sparse (top-k {sp['top_k']}): llama.cpp vs kernels_ref", sp["ppl"], ref["ppl"], a.ctx, a.chunks))
    stripped = Path(tempfile.mkdtemp()) / "stripped.gguf"
    subprocess.run([sys.executable, str(REPO / "scripts" / "strip_dsa.py"), str(a.dsa), str(stripped)], check=True,
                   capture_output=True)
    dn = dsa_eval(str(a.dsa), *common, "--attn", "dense", *ngl)
    st = dsa_eval(str(stripped), *common, *ngl)
    rows.append(("DSA file, dense override vs the stripped (stock) file, llama.cpp", dn["ppl"], st["ppl"], a.ctx, a.chunks))
    device = sp["device"]
    print(f"device: {device}; KV {a.kv}; flash attention off\n")
    print("| check | ctx | chunks | PPL (a) | PPL (b) | (a)/(b) − 1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, x, y, ctx, ch in rows:
        print(f"| {name} | {ctx} | {ch} | {x:.4f} | {y:.4f} | {100 * (x / y - 1):+.4f}% |")
    print(f"\nsparse vs dense on the DSA file (llama.cpp): {sp['ppl']:.4f} vs {dn['ppl']:.4f} "
          f"({100 * (sp['ppl'] / dn['ppl'] - 1):+.3f}%)")


if __name__ == "__main__":
    main()
