"""Held-out KL of one layer's indexer against the training recipe (query rows per step x steps), at the calibration
context: what `plan_calibration`'s CPU recipe at long context rests on (dsa_convert/dsa/calib.py).

Runs the frozen model over TRAIN + 1 calibration chunks of CTX tokens up to --layer, then distils that layer's indexer
(dense warm-up phase) once per recipe from the same initial weights and scores each on the held-out chunk
(indexer_train.eval_kl: KL of the layer's dense attention to the indexer's distribution, 256 query rows spread over
[top-k, CTX)). Wall seconds of each training are on this machine, so run it alone.

    python3 scripts/bench/bench_indexer_recipe.py --model ../shared/models/ref-llama-27m-32k \
        --calib ../shared/data/calib/books-calib.txt --ctx 32768 --layer 3 --recipes 64x150,128x150,64x300,256x150
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dsa_convert.dsa.calib import calib_chunks  # noqa: E402
from dsa_convert.dsa.indexer_train import eval_kl, init_indexer, train_layer  # noqa: E402
from dsa_convert.dsa.retrofit import _group_pass  # noqa: E402
from dsa_convert.kernels_ref.model import RefModel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--train-chunks", type=int, default=2)
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--recipes", default="64x150,128x150,64x300,256x150", help="ROWSxSTEPS,...")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rope-dim", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model = RefModel.from_hf(a.model)
    hp = model.hp
    if not 0 <= a.layer < hp.n_layer:
        sys.exit(f"--layer must be in [0, {hp.n_layer})")
    tokens = calib_chunks(a.calib, a.model, a.ctx, a.train_chunks + 1)
    pos = torch.arange(a.ctx)
    t0 = time.time()
    h = torch.stack([model.embed(t) for t in tokens])
    for il in range(a.layer + 1):
        data, held, h = _group_pass(model, il, il + 1, h, pos, a.train_chunks, {})
    out = {"model": str(a.model), "ctx": a.ctx, "train_chunks": a.train_chunks, "layer": a.layer, "top_k": a.top_k,
           "forward_seconds": round(time.time() - t0, 1), "recipes": []}
    print(f"frozen model to layer {a.layer}: {out['forward_seconds']} s", flush=True)
    for spec in a.recipes.split(","):
        rows, steps = (int(v) for v in spec.split("x"))
        w = init_indexer(hp.n_embd, a.heads, a.dim, a.rope_dim, 1e-6, hp.rope.base, a.seed + a.layer)
        t = time.time()
        w = train_layer(data, w, steps=steps, top_k=a.top_k, lr=2e-3, query_rows=rows, seed=a.seed, phase="dense",
                        layer=a.layer)
        r = {"query_rows": rows, "steps": steps, "train_seconds": round(time.time() - t, 1),
             "heldout_kl": round(eval_kl(held, w, a.top_k), 4)}
        out["recipes"].append(r)
        print(r, flush=True)
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
