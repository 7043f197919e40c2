#!/usr/bin/env python3
"""Retrofit quality of a real model (issue 69, SmolLM2-135M-Instruct) with the torch reference: WikiText-2 PPL,
KLD and same-top-token of sparse variants against dense, the dense run's hidden states computed once per chunk.

A plan (JSON list, --plan FILE or inline) names the jobs, run in order on one loaded model:

    {"name": "oracle", "attn": "oracle", "top_k": 256, "sink": 4, "local": 32}
    {"name": "oracle-max", "attn": "oracle", "reduce": "max", ...}      # heads reduced by max instead of sum
    {"name": "oracle-group", "attn": "oracle_group", ...}  # one selection per KV head group (NOT the runtime's
                                                            # rule, FORMAT §5: a what-if ceiling)
    {"name": "local", "attn": "local", "top_k": 256, "sink": 4}
    {"name": "oracle-d", "attn": "oracle", ..., "dense_layers": [0, 1]}  # those layers keep dense attention
    {"name": "S", "attn": "sparse", "indexers": ["R1.npz"], "top_k": 256, "sink": 4, "local": 32}
    {"name": "sens", "sensitivity": {"attn": "oracle", "top_k": 256, ...}}   # one run per layer, sparse in that
        # layer only: its ΔPPL; later jobs' "dense_top": n keep the n layers with the largest ΔPPL dense
    {"name": "R1", "retrofit": {"top_k": 256, "steps": 400, ...}, "evals": [{"sink": 4, "local": 32}, ...]}
        -> run_retrofit (DsaConfig fields; cluster_num None: no ASQ), then the sparse model with the trained
           indexers at the retrofit's split and at each variant of "evals" (split, top_k, dense_top); "save": true
           keeps them in --save-dir as <name>.npz (float16, parts of <= 15 MiB; smol_write_gguf.py makes a GGUF);
           "eval": false trains (and saves) only

Every job prints one JSON line (stdout and --out, appended) with ppl, ppl_stderr, kld_mean, same_top_p, the ratio to
dense, seconds and the retrofit report's timings.

    python3 scripts/bench/smol_quality.py --model /tmp/smol --text ../shared/data/wikitext-2-raw/wiki.test.raw \
        --calib ../shared/data/calib/books-calib.txt --ctx 2048 --chunks 8 --plan plan.json --out res.jsonl
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dsa_convert.dsa.calib import load_tokenizer  # noqa: E402
from dsa_convert.eval.perplexity_common import (KldAccumulator, NllAccumulator, chunk_tokens, plan_chunks,  # noqa: E402
                                                tokenize_text, vocab_adds_bos)
from dsa_convert.eval.perplexity_torch import load_model, score_chunk  # noqa: E402
from dsa_convert.kernels_ref import blocked  # noqa: E402
from dsa_convert.kernels_ref import selection as sel  # noqa: E402
from dsa_convert.kernels_ref.indexer import IndexerWeights  # noqa: E402
from dsa_convert.kernels_ref.sparse_attention import DsaAttention  # noqa: E402


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


class DenseLayers:
    """Wraps an attention hook: the layers in ``dense`` attend densely (a layer without DSA tensors, FORMAT §3)."""

    def __init__(self, inner, dense, scale: float):
        self.inner, self.dense, self.scale = inner, set(dense), scale

    def __call__(self, layer, q, k, v, x, k_pre, positions):
        if layer in self.dense:
            return blocked.causal_attention(q, k, v, self.scale)
        return self.inner(layer, q, k, v, x, k_pre, positions)


class GroupOracle:
    """What-if ceiling: a separate oracle selection per KV head group (the group's query heads' probabilities summed).
    The runtime shares one selection by all heads of a layer (FORMAT §5), so this is not what a file can run."""

    def __init__(self, scale: float, top_k: int, sink: int, local: int):
        self.scale, self.top_k, self.sink, self.local = scale, top_k, sink, local

    def __call__(self, layer, q, k, v, x, k_pre, positions):
        n_head, T, _ = q.shape
        n_kv = k.shape[0]
        rep = n_head // n_kv
        if T <= self.top_k:
            return blocked.causal_attention(q, k, v, self.scale)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for a, b in blocked.row_blocks(T, T, 2 * n_head + 6, device=q.device):
            for g in range(n_kv):
                qg, kg, vg = q[g * rep:(g + 1) * rep, a:b], k[g:g + 1, :b], v[g:g + 1, :b]
                scores = sel.oracle_scores(qg, kg, self.scale)
                m = sel.select_tokens(scores, self.top_k, self.sink, self.local, row0=a)
                out[g * rep:(g + 1) * rep, a:b] = blocked.attend(qg, kg, vg, m, self.scale)
        return out.to(q.dtype)


class Evaluator:
    """WikiText-2 chunks as llama-perplexity takes them; the dense run's last hidden states are kept per chunk."""

    def __init__(self, model, text: Path, tok_dir: Path, ctx: int, chunks: int):
        self.model = model
        ab, bos = vocab_adds_bos(tok_dir)
        tokens = tokenize_text(text.read_text(encoding="utf-8", errors="replace"), load_tokenizer(tok_dir), ab, bos)
        self.plan = plan_chunks(len(tokens), ctx, chunks, ab, bos)
        self.chunks = [chunk_tokens(tokens, self.plan, i) for i in range(self.plan.n_chunk)]
        t0 = time.time()
        self.base = [model.forward(c, hidden=True) for c in self.chunks]
        acc = NllAccumulator()
        for c, h in zip(self.chunks, self.base):
            acc.add(score_chunk(model, h, None, c, self.plan.first, None))
        self.dense_ppl, self.dense_err = acc.result()
        self.dense_seconds = time.time() - t0

    def run(self, hook) -> dict:
        t0 = time.time()
        acc, kacc = NllAccumulator(), KldAccumulator()
        for c, bh in zip(self.chunks, self.base):
            h = self.model.forward(c, attention=hook, hidden=True)
            acc.add(score_chunk(self.model, h, bh, c, self.plan.first, kacc))
        ppl, err = acc.result()
        k = kacc.result()
        return {"ppl": ppl, "ppl_stderr": err, "vs_dense_pct": 100 * (ppl / self.dense_ppl - 1),
                "kld_mean": k["kld_mean"], "kld_stderr": k["kld_stderr"], "kld_p99": k["kld_p99"],
                "same_top_p": k["same_top_p"], "tokens": k["kld_tokens"], "seconds": time.time() - t0}


SENSITIVE: list[int] = []      # layers by falling ΔPPL of a "sensitivity" job


def attention_hook(model, job: dict, indexers: dict | None = None):
    scale = model.hp.kq_scale
    K, S, L = job["top_k"], job.get("sink", 0), job.get("local", 1)
    attn = job["attn"]
    if attn == "oracle_group":
        hook = GroupOracle(scale, K, S, L)
    else:
        hook = DsaAttention(scale=scale, attn=attn, top_k=K, sink=S, local=L if attn != "local" else K - S,
                            indexers=indexers, oracle_reduce=job.get("reduce", "sum"))
    dense = list(job.get("dense_layers") or []) + SENSITIVE[:job.get("dense_top", 0)]
    return DenseLayers(hook, dense, scale) if dense else hook


MAX_FILE_BYTES = 15 << 20   # the device tool brings back files of at most 16 MiB


def save_indexers(path: Path, indexers: dict[int, IndexerWeights], meta: dict) -> list[Path]:
    """The indexers as float16 .npz files (the GGUF stores them as F16 too) of at most MAX_FILE_BYTES each:
    path, or path's stem + .partN.npz when they need more than one."""
    names = ("W_q", "W_k", "gamma", "beta", "W_w")
    w0 = next(iter(indexers.values()))
    meta = {**meta, "rope_dim": w0.rope_dim, "eps": w0.eps, "freq_base": w0.freq_base}
    per_layer = sum(getattr(w0, n).numel() for n in names) * 2
    per_file = max(1, MAX_FILE_BYTES // per_layer)
    layers = sorted(indexers)
    groups = [layers[i:i + per_file] for i in range(0, len(layers), per_file)]
    out = []
    for gi, group in enumerate(groups):
        p = path if len(groups) == 1 else path.with_name(f"{path.stem}.part{gi}.npz")
        arrs = {f"{il}.{n}": getattr(indexers[il], n).to(torch.float16).numpy() for il in group for n in names}
        np.savez(p, meta=json.dumps(meta), **arrs)
        out.append(p)
    return out


def load_indexers(*paths: Path) -> tuple[dict[int, IndexerWeights], dict]:
    """save_indexers' files (all parts) back as float32 IndexerWeights."""
    out, meta = {}, {}
    for path in paths:
        z = np.load(path)
        meta = json.loads(str(z["meta"]))
        t = lambda il, n: torch.from_numpy(z[f"{il}.{n}"].astype(np.float32))  # noqa: E731
        for il in sorted({int(k.split(".")[0]) for k in z.files if k != "meta"}):
            out[il] = IndexerWeights(t(il, "W_q"), t(il, "W_k"), t(il, "gamma"), t(il, "beta"), t(il, "W_w"),
                                     int(meta["rope_dim"]), float(meta["eps"]), float(meta["freq_base"]))
    return out, meta


def retrofit_job(model, model_dir: Path, ev: Evaluator, job: dict, calib: Path, device: str, out_dir: Path,
                 emit) -> None:
    from dsa_convert.dsa.config import DsaConfig
    from dsa_convert.dsa.retrofit import run_retrofit
    kw = dict(job["retrofit"])
    kw.setdefault("cluster_num", None)
    cfg = DsaConfig(calib=calib, device=device, **kw)
    res = run_retrofit(model_dir, cfg, model=model,
                       progress=lambda d: log(json.dumps(d)) if d.get("step", 1) % 200 == 1 or "step" not in d
                       else None)
    rep = res.report
    idx = res.indexers()
    sink, local = rep["sink"], rep["local"]
    info = {"retrofit_seconds": rep["seconds"], "stage_seconds": rep["stage_seconds"],
            "calibration": rep["calibration"], "split": rep.get("split"),
            "heldout_kl_mean": float(np.mean([v.get("heldout_kl_dense_phase", v.get("train_kl_dense_phase", 0))
                                              for v in rep["layers"].values()
                                              if isinstance(v, dict) and ("heldout_kl_dense_phase" in v
                                                                          or "train_kl_dense_phase" in v)]))}
    if job.get("save"):
        save_indexers(out_dir / f"{job['name']}.npz", idx, {"sink": sink, "local": local, "top_k": cfg.top_k,
                                                            "index_heads": cfg.index_heads, "index_dim": cfg.index_dim})
    if not job.get("eval", True):   # train (and save) only: e.g. to evaluate the GGUF through llama.cpp instead
        emit({"name": job["name"], "attn": "sparse", "top_k": cfg.top_k, "sink": sink, "local": local, **info,
              "recipe": job["retrofit"]})
        return
    for e in [{"sink": sink, "local": local}] + list(job.get("evals", [])):
        sub = {"attn": "sparse", "top_k": cfg.top_k, "sink": sink, "local": local, **e}
        r = ev.run(attention_hook(model, sub, idx))
        emit({"name": job["name"], **sub, **r, **info, "recipe": job["retrofit"]})
        info = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--calib", type=Path, default=None)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--plan", required=True, help="JSON list of jobs, or a file holding it")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSON lines appended here")
    ap.add_argument("--save-dir", type=Path, default=Path("."))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    plan = json.loads(a.plan if a.plan.lstrip().startswith("[") else Path(a.plan).read_text())
    t0 = time.time()
    model = load_model(a.model, dev)
    ev = Evaluator(model, a.text, a.model, a.ctx, a.chunks)
    host = torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"

    def emit(d: dict) -> None:
        d = {"ctx": a.ctx, "chunks": ev.plan.n_chunk, "dense_ppl": ev.dense_ppl, "device": host, **d}
        line = json.dumps(d)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")

    emit({"name": "dense", "attn": "dense", "ppl": ev.dense_ppl, "ppl_stderr": ev.dense_err,
          "seconds": ev.dense_seconds, "load_seconds": time.time() - t0})
    for job in plan:
        if "sensitivity" in job:
            base = job["sensitivity"]
            all_layers = range(model.hp.n_layer)
            delta = {}
            for il in all_layers:
                r = ev.run(attention_hook(model, {**base, "dense_layers": [j for j in all_layers if j != il]}))
                delta[il] = r["vs_dense_pct"]
                emit({"name": job["name"], "sparse_layer": il, **base, **r})
            SENSITIVE[:] = sorted(delta, key=delta.get, reverse=True)
            emit({"name": job["name"] + "-ranking", "layers_by_delta": SENSITIVE, "delta_pct": delta})
            continue
        if "retrofit" in job:
            retrofit_job(model, a.model, ev, job, a.calib, dev, a.save_dir, emit)
            continue
        idx = load_indexers(*map(Path, job["indexers"]))[0] if job.get("indexers") else None
        emit({**job, **ev.run(attention_hook(model, job, idx))})


if __name__ == "__main__":
    main()
