#!/usr/bin/env python3
"""Check --method mix's error proxy against real KL divergence, tensor by tensor (cf. llama.cpp PR #15550, which
measured the KLD each tensor's quantization costs).

    python scripts/bench/check_sensitivity.py --f16 F16.gguf [--types Q4_K,Q6_K] [--samples 16] [--kld-seqs 4]
        [--layers 0,2,5] [--json OUT.json]

For each linear of the chosen blocks (and the output head) and each type: the tensor alone is quantized (the
importance-weighted search, round to nearest, kq_writer.encode), and
  * proxy = tr(ΔW H ΔWᵀ) / N with H = Σ xxᵀ of the tensor's input over --samples calibration sequences of 512
    (the float model's activations), as kq_alloc scores candidates;
  * kld   = mean KL(float ‖ quantized) of the next-token distributions over --kld-seqs other calibration sequences.
Prints kld / proxy per tensor: if the proxy ranked tensors as the KLD does, that ratio would be constant.
Calibration text only (books-calib.txt); never evaluation text.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
CALIB = REPO.parent / "shared" / "data" / "calib" / "books-calib.txt"

from dsa_convert.formats.gguf_read import GgufFile  # noqa: E402
from dsa_convert.kernels_ref.model import RefModel, rms_norm  # noqa: E402
from dsa_convert.quant import kq_alloc, kq_writer  # noqa: E402
from dsa_convert.quant.block import LINEAR_INPUT, LINEARS, Block  # noqa: E402
from dsa_convert.quant.calib import load_samples  # noqa: E402

QT = gguf.GGMLQuantizationType


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--f16", type=Path, required=True)
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--kld-seqs", type=int, default=4)
    ap.add_argument("--gain-seqs", type=int, default=4, help="sequences of the block-gain measurement")
    ap.add_argument("--layers", default=None, help="comma list (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    g = GgufFile(a.f16)
    m = RefModel.from_gguf(a.f16)
    n_layer = m.hp.n_layer
    layers = range(n_layer) if a.layers is None else [int(x) for x in a.layers.split(",")]
    toks = load_samples(a.f16, g, CALIB, a.samples + a.kld_seqs, 512)
    cal, ev = toks[:a.samples], toks[a.samples:]

    # float Hessians of every linear input, block by block; the block gains at the first type (kq_alloc)
    H: dict[str, torch.Tensor] = {}
    gain: dict[str, float] = {}
    h = m.embed(cal)
    t0 = QT[a.types.split(",")[0]]
    for il in range(n_layer):
        blk = Block(m.hp, il, g.tensor, g.has, torch.device("cpu"), 512)
        h_next, caps = blk.forward_capture(h)
        if il in layers:
            hs = kq_writer.hessians(caps)
            fw, deq, px = dict(blk.w), {}, {}
            for n in LINEARS:
                H[f"blk.{il}.{n}.weight"] = hs[LINEAR_INPUT[n]]
                w = blk.w[n].numpy()
                deq[n] = kq_writer.dequantize(kq_writer.encode(w, t0, "search", hs[LINEAR_INPUT[n]], cal.numel()),
                                              t0, w.shape)
                px[n] = kq_alloc.output_error(w, deq[n], hs[LINEAR_INPUT[n]], cal.numel())
            for n, v in kq_alloc.block_gains(blk, h[:a.gain_seqs], fw, deq, px).items():
                gain[f"blk.{il}.{n}.weight"] = v
        h = h_next
        del caps
    head = "output.weight" if g.has("output.weight") else "token_embd.weight"
    H[head] = kq_writer.hessians({"x": rms_norm(h, m.w("output_norm.weight"), m.hp.rms_eps)})["x"]
    n_tok = cal.numel()

    def logp():
        return torch.cat([torch.log_softmax(m.forward(s), -1) for s in ev])
    base = logp()
    rows = []
    for name, Hn in H.items():
        w = np.asarray(g.tensor(name), np.float32)
        for tn in a.types.split(","):
            qt = QT[tn]
            if qt not in kq_alloc.candidates(w.shape[1]):
                continue
            t1 = time.perf_counter()
            d = kq_writer.dequantize(kq_writer.encode(w, qt, "search", Hn, n_tok), qt, w.shape)
            proxy = kq_alloc.output_error(w, d, Hn, n_tok)
            keep = m._cache.get(name)
            m._cache[name] = torch.from_numpy(d)
            lq = logp()
            m._cache[name] = keep if keep is not None else torch.from_numpy(w)
            kld = float((base.exp() * (base - lq)).sum(-1).mean())
            gp = gain.get(name, float("nan")) * proxy
            rows.append({"tensor": name, "type": tn, "proxy": proxy, "kld": kld, "ratio": kld / max(proxy, 1e-30),
                         "gain_proxy": gp, "ratio_gain": kld / gp})
            print(f"{name:28s} {tn:5s} proxy {proxy:10.4g}  kld {kld:10.4g}  kld/proxy {kld / max(proxy, 1e-30):9.3g}"
                  f"  kld/(gain·proxy) {kld / gp:9.3g}  ({time.perf_counter() - t1:.1f} s)", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"f16": str(a.f16), "samples": a.samples, "kld_seqs": a.kld_seqs,
                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
