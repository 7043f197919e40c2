#!/usr/bin/env python3
"""PPL and mean KL divergence to a base model, through kernels_ref (F32 activations, quantized weights
dequantized by gguf-py), llama-perplexity's chunking (chunks of --ctx, second half scored, no BOS).

    python scripts/kl_vs_f16.py ref-f16.gguf lc-q4_k_m.gguf awq-q4_k_m.gguf --chunks 60 [--ctx 512]

Prints, per file: PPL, mean KL(base ‖ file) over the scored positions, and the chunks where the first
two non-base files differ most in mean NLL. Used for RESULTS §4 ("AWQ and K-quants").
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_convert.backend.llama_runner import vocab_tokens_isolated  # noqa: E402
from dsa_convert.eval.data import resolve  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", type=Path)
    ap.add_argument("files", type=Path, nargs="+")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=60)
    ap.add_argument("--data", type=Path, default=None, help="text (default: the WikiText-2 test file)")
    a = ap.parse_args()

    import torch
    from dsa_convert.kernels_ref.model import RefModel

    text = Path(a.data or resolve("wikitext2")).read_text(encoding="utf-8")
    toks = vocab_tokens_isolated(a.base, text, add_bos=False)[0]
    n = min(a.chunks, len(toks) // a.ctx)
    T = torch.tensor(toks[: n * a.ctx]).view(n, a.ctx)
    paths = [a.base, *a.files]
    models = [RefModel.from_gguf(p) for p in paths]
    h = a.ctx // 2
    nll = [[0.0] * n for _ in paths]
    kl = [0.0] * len(paths)
    with torch.no_grad():
        for c in range(n):
            lps = [torch.log_softmax(m.forward(T[c]).double(), -1)[h:-1] for m in models]
            tgt = T[c, h + 1:]
            for i, lp in enumerate(lps):
                nll[i][c] = float(-lp.gather(-1, tgt[:, None]).sum())
                kl[i] += float((lps[0].exp() * (lps[0] - lp)).sum())
    cnt = n * (a.ctx - h - 1)
    for i, p in enumerate(paths):
        print(f"{p.name}: PPL {math.exp(sum(nll[i]) / cnt):.3f}  mean KL {kl[i] / cnt:.5f}")
    if len(paths) >= 3:
        d = sorted(((nll[2][c] - nll[1][c]) / (a.ctx - h - 1), c) for c in range(n))
        print(f"mean NLL per chunk, {paths[2].name} − {paths[1].name}: "
              f"min {[(round(x, 4), c) for x, c in d[:3]]}  max {[(round(x, 4), c) for x, c in d[-3:]]}")


if __name__ == "__main__":
    main()
