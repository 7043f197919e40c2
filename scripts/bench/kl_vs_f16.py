#!/usr/bin/env python3
"""PPL and mean KL divergence to a base model, through kernels_ref (F32 activations, quantized weights
dequantized by gguf-py), with llama-perplexity's chunking (dsa_convert.eval.perplexity_common: chunks
of --ctx, BOS as the vocab says, second half scored).

    python scripts/bench/kl_vs_f16.py ref-f16.gguf lc-q4_k_m.gguf awq-q4_k_m.gguf --chunks 60 [--ctx 512]

Prints, per file: PPL, mean KL(base ‖ file) over the scored positions, and the chunks where the first
two non-base files differ most in mean NLL. Used for docs/history §4 ("AWQ and K-quants").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dsa_convert.backend.llama_runner import vocab_tokens_isolated  # noqa: E402
from dsa_convert.eval.data import resolve  # noqa: E402
from dsa_convert.eval.perplexity_common import NllAccumulator, chunk_nll, chunk_tokens, plan_chunks  # noqa: E402


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
    toks, add_bos = vocab_tokens_isolated(a.base, text)
    paths = [a.base, *a.files]
    models = [RefModel.from_gguf(p) for p in paths]
    bos = models[0].gguf.get("tokenizer.ggml.bos_token_id")
    plan = plan_chunks(len(toks), a.ctx, a.chunks, add_bos, None if bos is None else int(bos))
    accs = [NllAccumulator() for _ in paths]
    chunk_mean = [[] for _ in paths]
    kl = [0.0] * len(paths)
    with torch.no_grad():
        for c in range(plan.n_chunk):
            chunk = chunk_tokens(toks, plan, c)
            logits = [m.forward(torch.from_numpy(chunk)) for m in models]
            lps = [torch.log_softmax(lg[plan.first: plan.n_ctx - 1].double(), -1) for lg in logits]
            for i, lg in enumerate(logits):
                nll = chunk_nll(lg, chunk, plan)
                accs[i].add(nll)
                chunk_mean[i].append(float(nll.mean()))
                kl[i] += float((lps[0].exp() * (lps[0] - lps[i])).sum())
    for i, p in enumerate(paths):
        print(f"{p.name}: PPL {accs[i].result()[0]:.3f}  mean KL {kl[i] / plan.tokens_scored:.5f}")
    if len(paths) >= 3:
        d = sorted((chunk_mean[2][c] - chunk_mean[1][c], c) for c in range(plan.n_chunk))
        print(f"mean NLL per chunk, {paths[2].name} − {paths[1].name}: "
              f"min {[(round(x, 4), c) for x, c in d[:3]]}  max {[(round(x, 4), c) for x, c in d[-3:]]}")


if __name__ == "__main__":
    main()
