#!/usr/bin/env python3
"""DSA retrofit quality benchmark (torch backend): PPL of dense / sparse (trained indexer, calibrated
split) / oracle (same split) / local-only / random at several (ctx, budget) points, plus KV-cache
variants (f16, q8_0, q4_0, ASQ C x bits) with bytes per token. Writes JSON (--out) and prints markdown.

  python scripts/bench/bench_dsa_quality.py --model ../shared/models/ref-llama-27m \
      --calib ../shared/data/calib/books-calib.txt --text ../shared/data/wikitext-2-raw/wiki.test.raw \
      --points 2048:256,2048:512,2048:1024,1024:256 --chunks 4 --out dsa_bench.json
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from dsa_convert.dsa.config import DsaConfig  # noqa: E402
from dsa_convert.dsa.retrofit import run_retrofit  # noqa: E402
from dsa_convert.eval.perplexity_torch import load_model, perplexity_torch  # noqa: E402
from dsa_convert.kernels_ref.asq import kv_bytes_per_token  # noqa: E402


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--points", default="2048:256,2048:512,2048:1024,1024:256", help="ctx:budget,...")
    ap.add_argument("--modes", default="dense,sparse,oracle,local,random")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--calib-chunks", type=int, default=32)
    ap.add_argument("--split-chunks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sparse-steps", type=int, default=None)
    ap.add_argument("--query-rows", type=int, default=256)
    ap.add_argument("--rope-dim", type=int, default=32)
    ap.add_argument("--index-heads", type=int, default=4)
    ap.add_argument("--sparse-target", default="middle")
    ap.add_argument("--train-ctx", type=int, default=None,
                    help="calibration ctx of the retrofit (default: each point's ctx; `dsa convert` uses 2048)")
    ap.add_argument("--index-share", default="1", help="G values (comma list): an indexer every G layers, the layers "
                    "between reuse its top-k (FORMAT.md §4a); one retrofit per point and G")
    ap.add_argument("--index-place", default="search", choices=("search", "every"),
                    help="which layers keep an indexer when G > 1 (DsaConfig.index_place)")
    ap.add_argument("--sink", type=int, default=None)
    ap.add_argument("--local", type=int, default=None)
    ap.add_argument("--asq", default="16,32,64", help="cluster counts for the KV table ('' = skip)")
    ap.add_argument("--asq-bits", default="4,8")
    ap.add_argument("--asq-ctx", type=int, default=2048)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("dsa_bench.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = "cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device)
    model = load_model(a.model, dev)
    hp = model.hp
    out = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": dev,
           "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"
           + (f", {torch.cuda.get_device_name()}" if dev.startswith("cuda") else ""),
           "quality": [], "retrofits": [], "kv": []}

    def save():
        a.out.write_text(json.dumps(out, indent=1, default=str))

    def ppl(ctx, **kw):
        r = perplexity_torch(a.model, a.text, ctx=ctx, chunks=a.chunks, model=model, device=dev, seed=a.seed, **kw)
        r.pop("per_chunk_ppl", None)
        return r

    dense = {}
    for pt in [p for p in a.points.split(",") if p]:
        ctx, K = (int(v) for v in pt.split(":"))
        if ctx not in dense:
            dense[ctx] = ppl(ctx, attn="dense", kv="f16")
            out["quality"].append(dict(dense[ctx], budget=None))
            log(f"ctx {ctx} dense {dense[ctx]['ppl']:.3f}")
        for gi, G in enumerate(int(g) for g in a.index_share.split(",")):
            cfg = DsaConfig(top_k=K, sink=a.sink, local=a.local, calib=a.calib, ctx=a.train_ctx or ctx,
                            calib_chunks=a.calib_chunks, split_chunks=a.split_chunks, steps=a.steps,
                            sparse_steps=a.sparse_steps, query_rows=a.query_rows, rope_dim=a.rope_dim,
                            index_heads=a.index_heads, sparse_target=a.sparse_target, cluster_num=None, device=dev,
                            seed=a.seed, index_share=G, index_place=a.index_place)
            t0 = time.time()
            res = run_retrofit(a.model, cfg, progress=lambda d: log(d) if d["stage"] in ("split", "done") else None,
                               model=model)
            out["retrofits"].append({"ctx": ctx, "train_ctx": a.train_ctx or ctx, "budget": K, "index_share": G,
                                     "index_place": a.index_place if G > 1 else None,
                                     "seconds": time.time() - t0, "report": res.report})
            S, L = res.report["sink"], res.report["local"]
            log(f"ctx {ctx} K {K} G {G}: split S={S} L={L} in {time.time() - t0:.0f}s")
            for m in a.modes.split(","):
                if m == "dense" or (m != "sparse" and gi > 0):   # the baselines do not depend on G
                    continue
                r = ppl(ctx, attn=m, kv="f16", dsa=res)
                r.update(budget=K, index_share=G, index_place=a.index_place if G > 1 else None,
                         full_layers=res.report.get("placement", {}).get("full_layers"),
                         delta_pct=100 * (r["ppl"] / dense[ctx]["ppl"] - 1))
                out["quality"].append(r)
                log(f"  G {G} {m:7s} ppl {r['ppl']:.3f} ({r['delta_pct']:+.2f}%) sink {r['sink']} local {r['local']}")
                save()

    # ---- KV cache variants (dense attention)
    if a.asq:
        ctx = a.asq_ctx
        base = dense.get(ctx) or ppl(ctx, attn="dense", kv="f16")
        bpt = lambda kind, bits=4: kv_bytes_per_token(kind, hp.head_dim, hp.n_head_kv, hp.n_layer, bits)  # noqa: E731
        for kind in ("f16", "q8_0", "q4_0"):
            r = base if kind == "f16" else ppl(ctx, attn="dense", kv=kind)
            out["kv"].append({"kv": kind, "ppl": r["ppl"], "ppl_stderr": r["ppl_stderr"], "bytes_per_token": bpt(kind),
                              "delta_pct": 100 * (r["ppl"] / base["ppl"] - 1)})
            log(f"kv {kind}: {r['ppl']:.3f}")
        for C in [int(c) for c in a.asq.split(",")]:
            for space in ("pre_rope", "post_rope"):
                cfg = DsaConfig(top_k=min(512, ctx - 1), sink=4, local=64, calib=a.calib, ctx=ctx,
                                calib_chunks=a.calib_chunks, split_chunks=0, steps=0, sparse_steps=0,
                                cluster_num=C, residual_bits=4, key_space=space, device=dev, seed=a.seed)
                res = run_retrofit(a.model, cfg, model=model)
                for bits in [int(b) for b in a.asq_bits.split(",")]:
                    rb = copy.copy(res)
                    rb.kv = dict(res.kv)
                    rb.kv[f"{res.arch}.dsa.asq.residual_bits"] = (bits, rb.kv[f"{res.arch}.dsa.asq.residual_bits"][1])
                    r = ppl(ctx, attn="dense", kv="asq", dsa=rb)
                    row = {"kv": f"asq C={C} b={bits} {space}", "C": C, "bits": bits, "key_space": space,
                           "ppl": r["ppl"], "ppl_stderr": r["ppl_stderr"], "bytes_per_token": bpt("asq", bits),
                           "delta_pct": 100 * (r["ppl"] / base["ppl"] - 1),
                           "fit_errors": res.report["asq"]["layers"]}
                    out["kv"].append(row)
                    log(f"kv {row['kv']}: {r['ppl']:.3f} ({row['delta_pct']:+.2f}%)")
                    save()
    save()
    # ---- markdown
    print(f"\n{out['date']} on {out['machine']}; {a.chunks} chunks per point\n")
    print("| ctx | budget | attn | sink | local | PPL | ± | Δ vs dense |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in out["quality"]:
        d = "" if r["attn"] == "dense" else f"{r['delta_pct']:+.2f}%"
        print(f"| {r['ctx']} | {r.get('budget') or '—'} | {r['attn']} | {r.get('sink') if r.get('sink') is not None else ''} | "
              f"{r.get('local') if r.get('local') is not None else ''} | {r['ppl']:.3f} | {r['ppl_stderr']:.2f} | {d} |")
    if out["kv"]:
        print("\n| KV cache | bytes/token | × smaller than f16 | PPL | Δ vs f16 |")
        print("|---|---:|---:|---:|---:|")
        f16 = out["kv"][0]["bytes_per_token"]
        for r in out["kv"]:
            print(f"| {r['kv']} | {r['bytes_per_token']:.0f} | {f16 / r['bytes_per_token']:.2f} | {r['ppl']:.3f} | "
                  f"{r['delta_pct']:+.2f}% |")


if __name__ == "__main__":
    main()
