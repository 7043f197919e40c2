#!/usr/bin/env python3
"""Write a dsa GGUF from a HF checkpoint and indexers trained elsewhere (smol_quality.py's saved .npz parts, e.g.
trained on a GPU machine), through `dsa convert`'s own writer: the retrofit step is replaced by those weights, so the
file is what `dsa convert` with that recipe writes, without ASQ prototypes.

    python3 scripts/bench/smol_write_gguf.py --model /tmp/smol --indexers R1.part0.npz R1.part1.npz --out r1.gguf
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import dsa_convert.dsa.retrofit as retrofit  # noqa: E402
from dsa_convert.convert import ConvertOptions, convert  # noqa: E402
from dsa_convert.dsa.config import DsaConfig  # noqa: E402
from dsa_convert.formats.hf_config import load_config  # noqa: E402
from smol_quality import load_indexers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--indexers", type=Path, nargs="+", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--outtype", default="f16")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--top-k", type=int, default=None, help="the file's top-k (default: the one trained at)")
    ap.add_argument("--dense-layers", default="", help="comma-separated layers written without an indexer: they "
                    "attend densely (FORMAT §3)")
    a = ap.parse_args()
    idx, meta = load_indexers(*a.indexers)
    dense = {int(x) for x in a.dense_layers.split(",") if x.strip()}
    if 0 in dense:
        raise SystemExit("layer 0 keeps its indexer in this script (FORMAT §4a needs a full first layer)")
    idx = {il: w for il, w in idx.items() if il not in dense}
    w0 = next(iter(idx.values()))
    cfg = DsaConfig(top_k=a.top_k or int(meta["top_k"]), sink=int(meta["sink"]), local=int(meta["local"]),
                    index_heads=w0.n_head, index_dim=w0.head_dim, rope_dim=w0.rope_dim, norm_eps=w0.eps,
                    cluster_num=None)
    arch = load_config(a.model).arch_name
    tensors = {}
    for il, w in sorted(idx.items()):
        tensors.update(retrofit.indexer_tensors(il, w))
    res = retrofit.DsaResult(arch=arch, kv=retrofit.dsa_kv(arch, cfg, cfg.sink, cfg.local, "calibrated", None),
                             tensors=tensors, report={"indexers_from": [str(p) for p in a.indexers], "dense_layers": sorted(dense), **meta})
    retrofit.run_retrofit = lambda *args, **kw: res      # convert() imports it from the module when it runs
    print(json.dumps(convert(ConvertOptions(a.model, a.out, a.outtype, a.force, quiet=True, dsa=cfg))))


if __name__ == "__main__":
    main()
