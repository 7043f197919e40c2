"""Every layout of shared indexer layers from one G = 1 retrofit, without retraining (docs/history §4ab item 3).

Retrofit once with an indexer in every layer (split fixed by --sink / --local), then for each count of full layers
in --counts score every layout (layer 0 always full; the others reuse the top-k of the last full layer before them,
FORMAT.md §4a) by the retrofit's held-out calibration NLL, and the fixed patterns 0, G, 2G, ... with that count,
the best and the worst of each count also by kernels_ref sparse PPL on --text. Shows whether the calibration NLL
ranks layouts as the evaluation text does, which is what `--index-place search` (dsa_convert/dsa/placement.py)
relies on.

    python3 scripts/bench/bench_index_layouts.py --model ../shared/models/ref-llama-27m \
        --calib ../shared/data/calib/books-calib.txt --text ../shared/data/wikitext-2-raw/wiki.test.raw \
        --top-k 128 --sink 1 --local 112 --counts 3,2 --chunks 40 --out layouts.json
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gguf import GGUFValueType  # noqa: E402

from dsa_convert.dsa.calib import calib_chunks  # noqa: E402
from dsa_convert.dsa.config import DsaConfig  # noqa: E402
from dsa_convert.dsa.retrofit import run_retrofit  # noqa: E402
from dsa_convert.dsa.placement import layout_nll  # noqa: E402
from dsa_convert.eval.perplexity_torch import load_model, perplexity_torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=128)
    ap.add_argument("--sink", type=int, default=1)
    ap.add_argument("--local", type=int, default=112)
    ap.add_argument("--counts", default="3,2", help="numbers of full layers to try (comma list)")
    ap.add_argument("--chunks", type=int, default=40, help="evaluation chunks of --ctx tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("layouts.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(a.model, "cpu")
    n = model.hp.n_layer
    K, S, L = a.top_k, a.sink, a.local
    cfg = DsaConfig(top_k=K, sink=S, local=L, calib=a.calib, ctx=a.ctx, cluster_num=None, device="cpu")
    t0 = time.time()
    res = run_retrofit(a.model, cfg, model=model)
    idx = res.indexers()
    held = calib_chunks(a.calib, a.model, a.ctx, cfg.calib_chunks + cfg.split_chunks)[cfg.calib_chunks:]
    out = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "retrofit_seconds": time.time() - t0,
           "held_out_chunks": int(held.shape[0]), "calib_nll": {}, "ppl": {}}

    def types_of(full):
        return [il in full for il in range(n)]

    def nll(full) -> float:
        return layout_nll(model, held, idx, full, top_k=K, sink=S, local=L)

    def ppl(full) -> tuple[float, float]:
        r = copy.copy(res)
        r.kv = dict(res.kv)
        r.tensors = {k: v for k, v in res.tensors.items()
                     if not (k.startswith("blk.") and ".indexer." in k and int(k.split(".")[1]) not in full)}
        if len(full) < n:
            r.kv[f"{res.arch}.attention.indexer.types"] = (types_of(full), GGUFValueType.ARRAY)
        q = perplexity_torch(a.model, a.text, ctx=a.ctx, chunks=a.chunks, model=model, device="cpu", attn="sparse",
                             kv="f16", dsa=r)
        return q["ppl"], q["ppl_stderr"]

    def save():
        a.out.write_text(json.dumps(out, indent=1))

    allf = tuple(range(n))
    out["calib_nll"][str(allf)] = nll(allf)
    out["ppl"][str(allf)] = ppl(allf)
    counts = [int(c) for c in a.counts.split(",")]
    for nf in counts:
        for rest in itertools.combinations(range(1, n), nf - 1):
            full = (0,) + rest
            out["calib_nll"][str(full)] = nll(full)
            print(full, f"held-out PPL {math.exp(out['calib_nll'][str(full)]):.3f}", flush=True)
        save()
    for nf in counts:
        cands = {k: v for k, v in out["calib_nll"].items() if len(eval(k)) == nf}
        fixed = [str(tuple(range(0, n, G))) for G in range(2, n + 1) if len(range(0, n, G)) == nf]  # --index-share G
        for f in dict.fromkeys(fixed + [min(cands, key=cands.get), max(cands, key=cands.get)]):
            out["ppl"][f] = ppl(eval(f))
            print(f, "PPL", out["ppl"][f], flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
