#!/usr/bin/env python3
"""KV-cache table (RESULTS §7): bytes per token as llama.cpp allocates them and PPL, for the ordinary cache
types and the ASQ cache of a DSA GGUF with ASQ prototypes, plus llama.cpp's ASQ PPL against kernels_ref's.

    python3 scripts/bench/bench_kv.py --dsa ref-dsa.gguf --tokenizer ../shared/models/ref-llama-27m \
        --ctx 2048 --chunks 4 [--n-gpu-layers 99] [--kv f16,q8_0,q4_0,asq] [--json out.json]

All llama.cpp rows run sparse attention (the file's top-k) with flash attention on (llama.cpp needs it for
a quantized V cache; the ASQ cache is decoded to F32/F16 before attention either way). kernels_ref runs the
same chunks with the file's ASQ math (dsa eval --backend torch --kv asq). Bytes per token are llama.cpp's
own KV-cache size lines (MiB, two decimals) divided by its cells: main cache (K + V) and the DSA indexer-key
cache separately.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_runtime import dsa_eval   # scripts/bench/ is sys.path[0] when this script runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsa", type=Path, required=True, help="DSA GGUF with ASQ prototypes")
    ap.add_argument("--tokenizer", type=Path, required=True, help="HF tokenizer dir (kernels_ref on a GGUF)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--kv", default="f16,q8_0,q4_0,asq")
    ap.add_argument("--ref-device", default="cpu", help="torch device of the kernels_ref run")
    ap.add_argument("--index-keys", default=None, help="llama.cpp's indexer-key cache (f32 | f16; default: dsa eval's)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    common = ["--ctx", str(a.ctx), "--chunks", str(a.chunks), "--attn", "sparse"]
    rows = {}
    keys = ["--index-keys", a.index_keys] if a.index_keys else []
    for kv in a.kv.split(","):
        rows[kv] = dsa_eval(str(a.dsa), *common, "--kv", kv, "--flash-attn", "--n-gpu-layers", str(a.n_gpu_layers), *keys)
        print(f"# {kv}: ppl {rows[kv]['ppl']:.4f}, {rows[kv]['kv_main_bytes'] / rows[kv]['kv_cells']:.1f} B/token "
              f"(main), {rows[kv]['seconds']} s", file=sys.stderr, flush=True)
    ref = {}
    for kv in ("asq", "f16"):
        if kv in rows:
            ref[kv] = dsa_eval(str(a.dsa), *common, "--kv", kv, "--backend", "torch", "--tokenizer", str(a.tokenizer),
                               "--device", a.ref_device)
    base = rows.get("f16")
    dev = next(iter(rows.values()))["device"]
    print(f"device: {dev}; sparse attention (top-k {next(iter(rows.values()))['top_k']}), flash attention on, "
          f"ctx {a.ctx}, {a.chunks} chunks, llama.cpp index keys {next(iter(rows.values())).get('index_keys')}\n")
    print("| KV cache (llama.cpp) | K / V type as allocated | bytes/token main (K+V) | vs f16 | + indexer keys "
          "| PPL | Δ vs f16 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kv, r in rows.items():
        main_b = r["kv_main_bytes"] / r["kv_cells"]
        idx_b = r["kv_indexer_bytes"] / r["kv_cells"]
        ratio = f"{(base['kv_main_bytes'] / base['kv_cells']) / main_b:.2f}×" if base else ""
        d = f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f} %" if base else ""
        print(f"| {kv} | {r['kv_k_type']} / {r['kv_v_type']} | {main_b:.1f} | {ratio} | {idx_b:.1f} "
              f"| {r['ppl']:.4f} ± {r['ppl_stderr']:.4f} | {d} |")
    print("\n| check | PPL llama.cpp | PPL kernels_ref | llama.cpp / kernels_ref − 1 |")
    print("|---|---:|---:|---:|")
    for kv, r in ref.items():
        print(f"| sparse, KV {kv} | {rows[kv]['ppl']:.4f} | {r['ppl']:.4f} | {100 * (rows[kv]['ppl'] / r['ppl'] - 1):+.4f} % |")
    if a.json:
        a.json.write_text(json.dumps({"llama_cpp": rows, "kernels_ref": ref}, indent=1))


if __name__ == "__main__":
    main()
