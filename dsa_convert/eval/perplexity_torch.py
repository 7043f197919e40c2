"""Perplexity with the PyTorch reference forward (kernels_ref.model.RefModel), llama-perplexity's
method (see perplexity_common), with dense / sparse / baseline attention and KV-cache variants.

    perplexity_torch(Path("m.gguf"), Path("wiki.test.raw"), ctx=2048, chunks=4, attn="sparse", kv="asq",
                     tokenizer_dir=Path("hf_model_dir"))
    -> {"ppl", "ppl_stderr", "tokens", "ctx", "chunks", "attn", "kv", "top_k", "sink", "local",
        "backend": "torch", "device", "seconds", ...}

The DSA settings (indexers, top_k, sink, local, select, ASQ prototypes) come from the GGUF's keys and
tensors (FORMAT §2/§3) or, when ``dsa`` (a DsaResult) is given, from memory; ``top_k`` / ``sink`` /
``local`` arguments override them. ``local`` / ``random`` / ``oracle`` use the same budget (and, for
random/oracle, the same split) as ``sparse``.

Memory stays bounded at a 32K context: attention runs per block of query rows (kernels_ref.blocked) and the
output head is applied to SCORE_ROWS scored positions at a time. With ``kld`` each chunk is also run dense with
an F32 cache (the same run when attn is dense and kv f32) and the KL divergence of the scored half against it
is reported as `llama-perplexity --kl-divergence` does (perplexity_common.KldAccumulator).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..errors import BadInputError
from ..formats import indexer_layout
from ..kernels_ref.indexer import IndexerWeights
from ..kernels_ref.sparse_attention import DsaAttention
from .perplexity_common import (KldAccumulator, NllAccumulator, chunk_tokens, plan_chunks, tokenize_text,
                                vocab_adds_bos)

ATTN_MODES = ("dense", "sparse", "local", "random", "oracle")
KV_MODES = ("f32", "f16", "q8_0", "q4_0", "asq")
SCORE_ROWS = 1024     # scored positions per output-head block: [rows, vocab] logits, never [n_ctx, vocab]


def dsa_settings_from_gguf(model) -> dict:
    """Read FORMAT §2/§3 from a RefModel built with from_gguf (model.gguf, model.w)."""
    g = getattr(model, "gguf", None)
    if g is None:
        return {}
    a = lambda k, d=None: g.akey(k, d)  # noqa: E731
    s = {"top_k": a("attention.indexer.top_k"), "sink": a("dsa.sink", 0), "local": a("dsa.local", 1),
         "select": a("dsa.select", "token"), "block_size": a("dsa.block_size", 64),
         "cluster_num": a("dsa.asq.cluster_num"), "residual_bits": a("dsa.asq.residual_bits", 4),
         "key_space": a("dsa.asq.key_space", "pre_rope")}
    idx, protos = {}, {}
    R, eps = a("dsa.indexer.rope_dim", 0), a("dsa.indexer.norm_eps", 1e-6)
    for il in range(model.hp.n_layer):
        p = f"blk.{il}.indexer."
        if indexer_layout.has_indexer(model.has, il):
            W_q, W_k, W_w = indexer_layout.projections(model.has, model.w, il, int(a("attention.indexer.head_count")),
                                                       int(a("attention.indexer.key_length")))
            idx[il] = IndexerWeights(W_q, W_k, model.w(p + "k_norm.weight"), model.w(p + "k_norm.bias"), W_w,
                                     int(R), float(eps), float(model.hp.rope.base))
        if model.has(f"blk.{il}.dsa.asq_k_proto"):
            protos[il] = (model.w(f"blk.{il}.dsa.asq_k_proto"), model.w(f"blk.{il}.dsa.asq_v_proto"))
    s["indexers"], s["asq_protos"] = idx, protos
    s["indexer_types"] = g.indexer_types()
    return {k: v for k, v in s.items() if v is not None}


def dsa_settings_from_result(res) -> dict:
    return {"top_k": res.setting("attention.indexer.top_k"), "sink": res.setting("dsa.sink", 0),
            "local": res.setting("dsa.local", 1), "select": res.setting("dsa.select", "token"),
            "block_size": res.setting("dsa.block_size", 64), "residual_bits": res.setting("dsa.asq.residual_bits", 4),
            "key_space": res.setting("dsa.asq.key_space", "pre_rope"), "indexers": res.indexers(),
            "asq_protos": res.asq_protos(), "indexer_types": res.indexer_types()}


def fit_split(top_k: int, sink: int, local: int) -> tuple[int, int]:
    """(sink, local) that fit top_k: an overridden top_k smaller than the file's split scales the split down."""
    if sink + local <= top_k:
        return sink, local
    return min(sink, top_k), max(1, min(local, top_k - min(sink, top_k)))


def load_model(model_path: Path, device: str = "cpu"):
    from ..kernels_ref.model import RefModel
    model_path = Path(model_path)
    if model_path.is_file() and model_path.suffix == ".gguf":
        return RefModel.from_gguf(model_path, device=device)
    if model_path.is_dir():
        return RefModel.from_hf(model_path, device=device)
    raise BadInputError(f"not a GGUF file or HF model directory: {model_path}")


def score_chunk(model, h: torch.Tensor, base_h: Optional[torch.Tensor], chunk, first: int,
                kacc: Optional[KldAccumulator]) -> np.ndarray:
    """Per-token NLL (float64 log-softmax, on the model's device) of a chunk's scored half from the last hidden
    states h [n_ctx, n_embd]: positions first .. n_ctx-2 predict the next token. The head runs SCORE_ROWS rows at a
    time. With ``kacc`` the same rows are compared against ``base_h``'s logits (None: against themselves)."""
    n_ctx = h.shape[0]
    targets = np.asarray(chunk, dtype=np.int64)
    nll = []
    for a in range(first, n_ctx - 1, SCORE_ROWS):
        b = min(n_ctx - 1, a + SCORE_ROWS)
        lg = model.head(h[a:b])
        tgt = targets[a + 1:b + 1]
        lg64 = lg.double()
        rows, cols = torch.arange(b - a, device=lg.device), torch.as_tensor(tgt, device=lg.device)
        nll.append((torch.logsumexp(lg64, dim=-1) - lg64[rows, cols]).cpu().numpy())
        if kacc is not None:
            kacc.add(lg if base_h is None else model.head(base_h[a:b]), lg, tgt)
    return np.concatenate(nll)


def perplexity_torch(model_path: Path | None, text_path: Path, *, ctx: int = 2048, chunks: Optional[int] = None,
                     attn: str = "dense", kv: str = "f16", top_k: Optional[int] = None, sink: Optional[int] = None,
                     local: Optional[int] = None, dsa=None, tokenizer_dir: Optional[Path] = None,
                     tokens: Optional[list[int]] = None, add_bos: Optional[bool] = None, device: str = "cpu",
                     seed: int = 0, model=None, progress: Optional[Callable[[dict], None]] = None,
                     kld: bool = False) -> dict:
    """See the module docstring. ``model`` reuses a loaded RefModel; ``tokens`` skips tokenisation."""
    if attn not in ATTN_MODES:
        raise BadInputError(f"--attn must be one of {', '.join(ATTN_MODES)} (got {attn!r})")
    if kv not in KV_MODES:
        raise BadInputError(f"--kv must be one of {', '.join(KV_MODES)} (got {kv!r})")
    if top_k is not None and top_k <= 0:
        raise BadInputError(f"--top-k must be > 0 (got {top_k})")
    t0 = time.time()
    model = model or load_model(Path(model_path), device)
    st = dsa_settings_from_result(dsa) if dsa is not None else dsa_settings_from_gguf(model)
    K = top_k if top_k is not None else st.get("top_k")
    S = sink if sink is not None else st.get("sink", 0)
    L = local if local is not None else st.get("local", 1)
    if attn != "dense":
        if not K:
            raise BadInputError(f"--attn {attn} needs a top-k (none in the model; pass --top-k)")
        if attn == "sparse" and not st.get("indexers"):
            raise BadInputError("--attn sparse needs indexer tensors (a dsa GGUF or a retrofit result)")
        S, L = fit_split(K, S, L)
    if kv in ("q8_0", "q4_0") and model.hp.head_dim % 32:
        raise BadInputError(f"--kv {kv} needs head_dim divisible by 32 (model has {model.hp.head_dim})")
    if kv == "asq" and not st.get("asq_protos"):
        raise BadInputError("--kv asq needs ASQ prototypes (a dsa GGUF with asq tensors or a retrofit result)")
    # ---- tokens
    tdir = Path(tokenizer_dir) if tokenizer_dir else (Path(model_path) if model_path and Path(model_path).is_dir() else None)
    if tokens is None:
        if tdir is None:
            raise BadInputError("the torch backend needs the HF tokenizer directory (tokenizer_dir) for a GGUF")
        from ..dsa.calib import load_tokenizer
        text_path = Path(text_path)
        if not text_path.is_file():
            raise BadInputError(f"evaluation text not found: {text_path}")
        ab, bos_id = vocab_adds_bos(tdir)
        ab = ab if add_bos is None else add_bos
        tokens = tokenize_text(text_path.read_text(encoding="utf-8", errors="replace"), load_tokenizer(tdir), ab, bos_id)
    else:
        ab, bos_id = (vocab_adds_bos(tdir) if tdir else (False, None))
        ab = ab if add_bos is None else add_bos
        if bos_id is None and getattr(model, "gguf", None) is not None:
            b = model.gguf.get("tokenizer.ggml.bos_token_id")
            bos_id = None if b is None else int(b)
    plan = plan_chunks(len(tokens), ctx, chunks, ab, bos_id)
    hook = None
    if attn != "dense" or kv != "f32":
        hook = DsaAttention(scale=model.hp.kq_scale, attn=attn, kv=kv, top_k=K or 0, sink=S, local=L,
                            select=st.get("select", "token"), block_size=st.get("block_size", 64),
                            indexers=st.get("indexers"), asq_protos=st.get("asq_protos"),
                            residual_bits=st.get("residual_bits", 4), key_space=st.get("key_space", "pre_rope"),
                            rope_keys=model.rope_keys, seed=seed, indexer_types=st.get("indexer_types"))
    acc = NllAccumulator()
    kacc = KldAccumulator() if kld else None
    chunk_seconds = []
    for i in range(plan.n_chunk):
        tc = time.time()
        chunk = chunk_tokens(tokens, plan, i)
        h = model.forward(chunk, attention=hook, hidden=True)
        base_h = model.forward(chunk, hidden=True) if kacc is not None and hook is not None else None
        acc.add(score_chunk(model, h, base_h, chunk, plan.first, kacc))
        chunk_seconds.append(time.time() - tc)
        if progress is not None:
            progress({"stage": "perplexity", "chunk": i + 1, "chunks": plan.n_chunk, "ppl": acc.per_chunk[-1]})
    ppl, err = acc.result()
    out = {"ppl": ppl, "ppl_stderr": err, "tokens": acc.count, "ctx": ctx, "chunks": plan.n_chunk, "attn": attn,
           "kv": kv, "top_k": K if attn != "dense" else None, "sink": S if attn != "dense" else None,
           "local": (L if attn != "local" else (K - S)) if attn != "dense" else None,
           "backend": "torch", "device": str(model.device), "add_bos": ab, "seconds": time.time() - t0,
           "per_chunk_ppl": acc.per_chunk, "chunk_seconds": chunk_seconds}
    if kacc is not None:
        out.update(kacc.result())
        out["kld_base"] = "dense, kv f32"
    if hook is not None and hook.selected_fraction:
        out["selected_fraction"] = sum(hook.selected_fraction) / len(hook.selected_fraction)
    return out
