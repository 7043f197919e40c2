#!/usr/bin/env python3
"""Parity of `dsa convert` output with transformers: tiny random checkpoints of every supported
architecture/variant and the reference model; kernels_ref and llama.cpp (F32 KV cache), plus the
reference model in F16 through llama.cpp's default F16 cache. Prints a markdown table.

    python scripts/bench/parity_report.py [--tokens 1024]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))
import conftest  # noqa: E402
from dsa_convert.backend.llama_runner import RunnerOptions, eval_logits, open_model  # noqa: E402
from dsa_convert.convert import ConvertOptions, convert  # noqa: E402
from dsa_convert.kernels_ref.model import RefModel  # noqa: E402


def stats(ref: np.ndarray, got: np.ndarray) -> str:
    rel = np.abs(ref - got).max() / (ref.max() - ref.min())
    return f"{rel:.2e} | {100 * (ref.argmax(-1) == got.argmax(-1)).mean():.2f}%"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="parity-"))
    models = {v: conftest.make_tiny_model(work / v, v) for v in conftest.VARIANTS}
    if conftest.REF_MODEL.exists():
        models["ref-llama-27m"] = conftest.REF_MODEL
    print("| model | outtype | tokens | kernels_ref max\\|Δ\\|/range | argmax eq | llama.cpp max\\|Δ\\|/range | argmax eq |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, d in models.items():
        toks = conftest.hf_tokens(d, conftest.wiki_passage(12000))[: a.tokens]
        n_ctx = 512 if name != "ref-llama-27m" else a.tokens
        toks = toks[:n_ctx]
        ref = conftest.hf_logits(d, torch.tensor(toks)).numpy()
        for outtype, kv in (("f32", "f32"), ("f16", "f16")):
            if outtype == "f16" and name != "ref-llama-27m":
                continue
            p = work / f"{name}-{outtype}.gguf"
            convert(ConvertOptions(d, p, outtype=outtype, quiet=True))
            k = RefModel.from_gguf(p).forward(torch.tensor(toks)).numpy()
            l = eval_logits(open_model(p, RunnerOptions(n_ctx=len(toks), kv_type=kv)), toks)
            print(f"| {name} | {outtype} (KV {kv}) | {len(toks)} | {stats(ref, k)} | {stats(ref, l)} |")


if __name__ == "__main__":
    main()
