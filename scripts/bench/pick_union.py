#!/usr/bin/env python3
"""How much do neighbouring queries' picks overlap? (issue 6: the design of a sparse prefill attention)

A prefill ubatch can only skip attention work for the cells that none of a tile's queries picked. This runs the
kernels_ref model of a DSA GGUF over one chunk of text, keeps every sparse layer's selection (FORMAT §5: sinks,
local window, top-k of the indexer's scores) and reports, for tiles of Q consecutive queries that all select
sparsely (t + 1 > top_k), the size of the union of their picks: in units of top_k (1 = every query of the tile
picked the same cells, Q = disjoint picks) and as a share of the cells the tile's last query can see. The same for
random picks with the same sinks and window (kernels_ref.selection.random_select: what the synthetic speed files'
random-weight indexers give, whose scores do not depend on content).

    python scripts/bench/pick_union.py ref-dsa.gguf --tokenizer ../shared/models/ref-llama-27m \
        --text ../shared/data/wikitext-2-raw/wiki.test.raw --ctx 2048 --tiles 16,64 [--top-k K --sink S --local L]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def unions(mask: torch.Tensor, q: int, t_min: int) -> tuple[float, float]:
    """Mean union size of the picks of tiles of q consecutive rows (rows >= t_min), and mean share of the causal
    cells of the tile's last row."""
    T = mask.shape[0]
    sizes, shares = [], []
    for t0 in range(t_min, T - q + 1, q):
        u = mask[t0:t0 + q].any(dim=0)
        n = int(u.sum())
        sizes.append(n)
        shares.append(n / (t0 + q))
    return sum(sizes) / len(sizes), sum(shares) / len(shares)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="HF tokenizer directory of the model")
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--offset", type=int, default=0, help="first token of the chunk")
    ap.add_argument("--tiles", default="16,64", help="query tile sizes")
    ap.add_argument("--top-k", type=int, default=None, help="override the file's top_k")
    ap.add_argument("--sink", type=int, default=None, help="override the file's sinks")
    ap.add_argument("--local", type=int, default=None, help="override the file's local window")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    from dsa_convert.dsa.calib import load_tokenizer
    from dsa_convert.eval.perplexity_torch import dsa_settings_from_gguf, fit_split, load_model
    from dsa_convert.kernels_ref import selection as sel
    from dsa_convert.kernels_ref.sparse_attention import DsaAttention

    model = load_model(a.gguf)
    st = dsa_settings_from_gguf(model)
    K = a.top_k or st["top_k"]
    S = a.sink if a.sink is not None else st.get("sink", 0)
    L = a.local if a.local is not None else st.get("local", 1)
    S, L = fit_split(K, S, L)
    tok = load_tokenizer(a.tokenizer)
    ids = tok.encode(a.text.read_text(encoding="utf-8", errors="replace")[: 40 * a.ctx]).ids
    ids = ids[a.offset: a.offset + a.ctx]
    if len(ids) < a.ctx:
        raise SystemExit(f"the text gives {len(ids)} tokens, fewer than --ctx {a.ctx}")
    tiles = [int(x) for x in a.tiles.split(",")]

    masks: dict[int, torch.Tensor] = {}

    class Capture(DsaAttention):
        def _selection(self, layer, *args):
            s = super()._selection(layer, *args)
            if s is not None:
                n = s.picks.shape[0]
                masks[layer] = s.mask(0, n, s.row0 + n).cpu()
            return s

    hook = Capture(scale=model.hp.kq_scale, attn="sparse", top_k=K, sink=S, local=L, indexers=st["indexers"],
                   rope_keys=model.rope_keys)
    with torch.no_grad():
        model.forward(torch.tensor(ids), attention=hook)
    T = a.ctx
    t_min = K   # rows t >= K select sparsely (t + 1 > K)
    rows = []
    for q in tiles:
        for layer in sorted(masks):
            size, share = unions(masks[layer], q, t_min)
            rows.append({"picks": "indexer", "layer": layer, "tile": q, "union_over_k": size / K, "share": share})
        rnd = sel.random_select(T, K, S, L, seed=0)
        size, share = unions(rnd, q, t_min)
        rows.append({"picks": "random", "layer": None, "tile": q, "union_over_k": size / K, "share": share})
    print(f"{a.gguf.name}: ctx {T}, top_k {K} (sinks {S}, local {L}), {len(masks)} sparse layers, rows t >= {t_min}")
    print("| picks | tile Q | union of the tile's picks ÷ top_k: mean over layers (min – max) | share of visible cells |")
    print("|---|---:|---|---:|")
    for q in tiles:
        ind = [r for r in rows if r["tile"] == q and r["picks"] == "indexer"]
        u = [r["union_over_k"] for r in ind]
        sh = sum(r["share"] for r in ind) / len(ind)
        print(f"| trained indexer | {q} | {sum(u) / len(u):.2f} ({min(u):.2f} – {max(u):.2f}) | {sh:.2f} |")
        r = [r for r in rows if r["tile"] == q and r["picks"] == "random"][0]
        print(f"| random | {q} | {r['union_over_k']:.2f} | {r['share']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"ctx": T, "top_k": K, "sink": S, "local": L, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
