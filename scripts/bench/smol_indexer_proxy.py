#!/usr/bin/env python3
"""Per-layer proxy of an indexer recipe's quality, cheap enough for a 2-core CPU: the attention mass its selection
keeps, against the oracle's.

Runs the frozen model over TRAIN + 1 calibration chunks of CTX tokens, collecting the listed layers' calibration data
(retrofit._group_pass), then for each recipe distils each layer's indexer (dense warm-up, then the sparse phase at the
given split) from the same initial weights and scores it on the held-out chunk, over ROWS query rows t >= top-k:

- kept: the mean over rows of the layer's head-averaged dense attention mass inside the indexer's selection (sinks,
  window and picks, FORMAT §5); oracle_kept: the same for the oracle's selection (the true top mass, the most any
  one-per-layer selection keeps of that average); missed_ratio = (1 − kept) / (1 − oracle_kept);
- heldout_kl: indexer_train.eval_kl (the dense-phase KL).

    python3 scripts/bench/smol_indexer_proxy.py --model /tmp/smol --calib ../shared/data/calib/books-calib.txt \
        --layers 3,15,25 --recipes 'h4d64s400,h16d64s400,h4d64s1600'
A recipe is h<heads>d<dim>s<steps>[r<query rows>][sel] (sel: the sparse phase over the selected keys).
With --indexers (smol_quality.py's saved .npz parts) nothing is trained: the given indexers are scored in every
listed layer (--layers all: every layer), beside the local-only selection of the same budget.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dsa_convert.dsa.calib import calib_chunks  # noqa: E402
from dsa_convert.dsa.indexer_train import _row_scores, dense_target, eval_kl, init_indexer, train_layer  # noqa: E402
from dsa_convert.dsa.retrofit import _group_pass  # noqa: E402
from dsa_convert.kernels_ref.model import RefModel  # noqa: E402
from dsa_convert.kernels_ref.selection import select_tokens  # noqa: E402


def parse_recipe(s: str) -> dict:
    m = re.fullmatch(r"h(\d+)d(\d+)s(\d+)(?:r(\d+))?(sel)?", s)
    if not m:
        raise SystemExit(f"bad recipe {s!r}")
    return {"heads": int(m[1]), "dim": int(m[2]), "steps": int(m[3]), "rows": int(m[4] or 256),
            "sparse_target": "selected" if m[5] else "middle"}


@torch.no_grad()
def kept_mass(data, w, top_k: int, sink: int, local: int, n_rows: int) -> tuple[float, float]:
    """(indexer kept mass, oracle kept mass) on chunk 0 of data, rows spread over [top_k, T)."""
    T = data.x.shape[1]
    rows = torch.linspace(top_k, T - 1, min(n_rows, T - top_k)).long()
    tgt = data.target(0, rows, torch.device("cpu"))                            # [R, T] head-averaged probs
    sc = _row_scores(w, data.x[0].float(), rows, torch.arange(T))
    m_idx = select_tokens(sc, top_k, sink, local, row0=rows)
    m_orc = select_tokens(tgt, top_k, sink, local, row0=rows)
    return float((tgt * m_idx).sum(-1).mean()), float((tgt * m_orc).sum(-1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--train-chunks", type=int, default=8)
    ap.add_argument("--layers", default="3,15,25")
    ap.add_argument("--top-k", type=int, default=256)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--local", type=int, default=32)
    ap.add_argument("--recipes", default="h4d64s400,h16d64s400,h4d64s1600")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--indexers", type=Path, nargs="*", default=None, help="score these trained indexers instead")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = RefModel.from_hf(a.model)
    layers = list(range(model.hp.n_layer)) if a.layers == "all" else sorted(int(x) for x in a.layers.split(","))
    trained = None
    if a.indexers:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from smol_quality import load_indexers
        trained = load_indexers(*a.indexers)[0]
    tokens = calib_chunks(a.calib, a.model, a.ctx, a.train_chunks + 1)
    pos = torch.arange(a.ctx)
    h = torch.stack([model.embed(t) for t in tokens])
    datas = {}
    for il in range(max(layers) + 1):
        if il in layers:
            train, held, h = _group_pass(model, il, il + 1, h, pos, a.train_chunks, {})
            datas[il] = (train, held)
        else:
            with torch.no_grad():
                h = torch.stack([model.layer(il, hh, pos) for hh in h])
    del h
    hp = model.hp
    if trained is not None:
        for il in layers:
            held = datas[il][1]
            kept, orc = kept_mass(held, trained[il], a.top_k, a.sink, a.local, a.rows)
            loc = kept_mass(held, trained[il], a.top_k, a.sink, a.top_k - a.sink, a.rows)[0]
            d = {"indexers": [str(p) for p in a.indexers], "layer": il, "kept": kept, "oracle_kept": orc,
                 "local_kept": loc, "missed_ratio": (1 - kept) / max(1e-9, 1 - orc), "ctx": a.ctx,
                 "top_k": a.top_k, "sink": a.sink, "local": a.local}
            print(json.dumps(d), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(d) + "\n")
        return
    for rs in a.recipes.split(","):
        r = parse_recipe(rs)
        for il in layers:
            train, held = datas[il]
            t0 = time.time()
            w = init_indexer(hp.n_embd, r["heads"], r["dim"], min(32, r["dim"]), 1e-6, hp.rope.base, il)
            kw = dict(top_k=a.top_k, lr=2e-3, query_rows=r["rows"], seed=0, layer=il)
            w = train_layer(train, w, steps=r["steps"], phase="dense", **kw)
            w = train_layer(train, w, steps=r["steps"], phase="sparse", sink=a.sink, local=a.local,
                            sparse_target=r["sparse_target"], **kw)
            kept, orc = kept_mass(held, w, a.top_k, a.sink, a.local, a.rows)
            d = {"recipe": rs, **r, "layer": il, "kept": kept, "oracle_kept": orc,
                 "missed_ratio": (1 - kept) / max(1e-9, 1 - orc), "heldout_kl": eval_kl(held, w, a.top_k),
                 "train_seconds": time.time() - t0, "ctx": a.ctx, "train_chunks": a.train_chunks,
                 "top_k": a.top_k, "sink": a.sink, "local": a.local}
            print(json.dumps(d), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(d) + "\n")


if __name__ == "__main__":
    main()
