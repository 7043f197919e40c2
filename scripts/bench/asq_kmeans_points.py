#!/usr/bin/env python3
"""ASQ k-means: training points per fit against held-out reconstruction error and fit time, on SmolLM2's pre-RoPE
keys and values (layers 3 / 15 / 27, 20 chunks of 2,048 calibration tokens, 64 prototypes, 4-bit residuals, 8,192
held-out vectors per layer and kind). dsa convert's default (DsaConfig.asq_samples 32768) gives 26,214 training points.

    python3 scripts/bench/asq_kmeans_points.py F16.gguf OUT.json   (F16.gguf: dsa convert SMOL F16.gguf --outtype f16 --no-dsa)
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dsa_convert.dsa.asq_fit import kmeans, rel_err  # noqa: E402
from dsa_convert.formats.gguf_read import GgufFile  # noqa: E402
from dsa_convert.kernels_ref import asq  # noqa: E402
from dsa_convert.kernels_ref.model import RefModel  # noqa: E402
from dsa_convert.quant.calib import load_samples  # noqa: E402

CALIB = Path(__file__).resolve().parents[3] / "shared" / "data" / "calib" / "books-calib.txt"
LAYERS = (3, 15, 27)
POINTS = (26214, 8192, 4096, 2048)


def main() -> None:
    f16, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(2)
    m, g = RefModel.from_gguf(f16), GgufFile(f16)
    toks = load_samples(f16, g, CALIB, 20, 2048)
    pos = torch.arange(2048)
    col = {il: {"k_pre": [], "v": []} for il in LAYERS}
    with torch.no_grad():
        for t in toks:
            h = m.embed(t)
            for il in range(max(LAYERS) + 1):
                if il in LAYERS:
                    _q, _k, v, kp = m.qkv(il, m.attn_input(il, h), pos)
                    col[il]["k_pre"].append(kp.float())
                    col[il]["v"].append(v.float())
                h = m.layer(il, h, pos)
    gen = torch.Generator().manual_seed(0)
    res = []
    for il in LAYERS:
        for kind in ("k_pre", "v"):
            X = torch.cat(col[il][kind], 1)          # [n_kv, N, head_dim]
            perm = torch.randperm(X.shape[1], generator=gen)
            ho, pool = perm[:8192], perm[8192:]
            for n in POINTS:
                t0 = time.perf_counter()
                P = torch.stack([kmeans(X[h, pool[:n]], 64, h) for h in range(X.shape[0])])
                r = {"layer": il, "kind": kind, "train_points": n,
                     "s_per_fit": round((time.perf_counter() - t0) / X.shape[0], 3),
                     "heldout_rel_err": rel_err(asq.roundtrip_heads(X[:, ho], P, 4), X[:, ho])}
                print(r, flush=True)
                res.append(r)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
