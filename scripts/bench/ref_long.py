#!/usr/bin/env python3
"""Time and peak memory of the PyTorch reference (kernels_ref) at long context: one perplexity chunk, or a prompt
plus greedy generation, with any attention / KV-cache mode. One configuration per process, so the peak RSS
(ru_maxrss) belongs to it; on CUDA the peak allocated GPU memory is reported too.

    python scripts/bench/ref_long.py ppl ref32k.gguf --tokenizer ../shared/models/ref-llama-27m-32k \
        --text ../shared/data/wikitext-2-raw/wiki.test.raw --ctx 16384 --attn sparse [--kv f16 --kld]
    python scripts/bench/ref_long.py gen --synthetic --ctx 32768 --attn sparse --top-k 1024 --new 8 --device cuda

``--synthetic`` builds random weights of ref-llama-27m-32k's shapes (6 layers, d 512, 8/2 heads, head_dim 64,
ffn 1536, vocab 16384) with random 4-head indexers and 32-prototype ASQ tables in every layer: timings and memory
only (no file needed, e.g. on a GPU machine), perplexities are meaningless. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dsa_convert.kernels_ref.indexer import IndexerWeights  # noqa: E402
from dsa_convert.kernels_ref.model import RefHParams, RefModel  # noqa: E402
from dsa_convert.kernels_ref.rope import RopeParams  # noqa: E402


class SyntheticDsa:
    """What perplexity_torch reads from a retrofit result (``dsa=``), with random indexers and ASQ tables."""

    def __init__(self, hp: RefHParams, top_k: int, device: str, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        H, D, E = 4, 64, hp.n_embd
        self._idx = {il: IndexerWeights(r(H * D, E) / E ** 0.5, r(D, E) / E ** 0.5, torch.ones(D), torch.zeros(D),
                                        r(H, E) / E ** 0.5, 32).to(device=device) for il in range(hp.n_layer)}
        self._protos = {il: (r(hp.n_head_kv, 32, hp.head_dim).to(device), r(hp.n_head_kv, 32, hp.head_dim).to(device))
                        for il in range(hp.n_layer)}
        self._settings = {"attention.indexer.top_k": top_k, "dsa.sink": 4, "dsa.local": 128}

    def setting(self, key, default=None):
        return self._settings.get(key, default)

    def indexers(self):
        return self._idx

    def asq_protos(self):
        return self._protos

    def indexer_types(self):
        return None


def synthetic_model(device: str, seed: int = 0) -> RefModel:
    hp = RefHParams("llama", 6, 512, 8, 2, 64, 1e-5, RopeParams(n_rot=64, base=500000.0), 16384)
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (16384, 512), "output_norm.weight": (512,)}
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        shapes |= {p + "attn_norm.weight": (512,), p + "ffn_norm.weight": (512,), p + "attn_q.weight": (512, 512),
                   p + "attn_k.weight": (128, 512), p + "attn_v.weight": (128, 512), p + "attn_output.weight": (512, 512),
                   p + "ffn_gate.weight": (1536, 512), p + "ffn_up.weight": (1536, 512),
                   p + "ffn_down.weight": (512, 1536)}

    def load(name):
        s = shapes[name]
        return np.ones(s, np.float32) if len(s) == 1 else (rng.standard_normal(s) / s[-1] ** 0.5).astype(np.float32)
    return RefModel(hp, load, lambda n: n in shapes, device=device)


def peak_memory(device: str) -> dict:
    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.startswith("cuda"):
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["ppl", "gen"])
    ap.add_argument("model", type=Path, nargs="?", help="a GGUF or HF model directory (or --synthetic)")
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--tokenizer", type=Path, default=None, help="HF tokenizer directory (GGUF + text)")
    ap.add_argument("--text", type=Path, default=None, help="evaluation text (default: random tokens)")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--attn", default="dense")
    ap.add_argument("--kv", default="f32")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--kld", action="store_true")
    ap.add_argument("--new", type=int, default=8, help="tokens to generate (gen)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from dsa_convert.eval.perplexity_torch import load_model, perplexity_torch

    t0 = time.time()
    if a.synthetic:
        model = synthetic_model(a.device)
        dsa = SyntheticDsa(model.hp, a.top_k or 1024, a.device)
    else:
        model, dsa = load_model(a.model, a.device), None
    rng = np.random.default_rng(0)
    tokens = None if a.text else rng.integers(1, model.hp.vocab_size, size=2 * a.ctx).tolist()
    rec = {"what": a.what, "model": "synthetic" if a.synthetic else str(a.model), "ctx": a.ctx, "attn": a.attn,
           "kv": a.kv, "device": a.device, "threads": torch.get_num_threads(), "load_seconds": time.time() - t0}
    if a.what == "ppl":
        res = perplexity_torch(a.model, a.text, ctx=a.ctx, chunks=1, attn=a.attn, kv=a.kv, top_k=a.top_k, dsa=dsa,
                               tokenizer_dir=a.tokenizer, tokens=tokens, device=a.device, model=model, kld=a.kld)
        rec |= {k: res[k] for k in ("ppl", "chunk_seconds", "selected_fraction", "kld_mean", "same_top_p")
                if k in res}
    else:
        from dsa_convert.eval.perplexity_torch import dsa_settings_from_gguf, dsa_settings_from_result
        from dsa_convert.kernels_ref.generate import Decoder
        from dsa_convert.kernels_ref.sparse_attention import DsaAttention

        st = dsa_settings_from_result(dsa) if dsa is not None else dsa_settings_from_gguf(model)
        K = a.top_k or st.get("top_k") or 0
        hook = DsaAttention(scale=model.hp.kq_scale, attn=a.attn, kv=a.kv, top_k=K, sink=st.get("sink", 0),
                            local=st.get("local", 1), indexers=st.get("indexers"), asq_protos=st.get("asq_protos"),
                            residual_bits=st.get("residual_bits", 4), key_space=st.get("key_space", "pre_rope"),
                            rope_keys=model.rope_keys, indexer_types=st.get("indexer_types"))
        prompt = (tokens or rng.integers(1, model.hp.vocab_size, size=a.ctx).tolist())[:a.ctx - a.new]
        Decoder(model, hook).feed(prompt[:256])                      # warm-up (CUDA kernels, weights)
        dec = Decoder(model, hook)
        t1 = time.time()
        logits = dec.feed(prompt)
        t_prefill = time.time() - t1
        out = []
        t1 = time.time()
        for _ in range(a.new):                                        # greedy_generate's loop, timed per step
            out.append(int(torch.argmax(logits)))
            logits = dec.feed([out[-1]])
        rec |= {"prefill_seconds": t_prefill, "decode_seconds_per_token": (time.time() - t1) / max(1, a.new),
                "new": len(out), "ids": out}
    print(json.dumps(rec | peak_memory(a.device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
