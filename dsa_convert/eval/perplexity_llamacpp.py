"""Perplexity through llama.cpp (llama-cpp-python on the patched tree), llama-perplexity's method:
llama.cpp's own tokenizer on the whole text (BOS prepended when the vocab adds it), chunks of
n_ctx with BOS replacing the first token, KV cache cleared per chunk, second half scored,
log-softmax in double."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..backend.llama_log import capture_log, parse_kv_log
from ..backend.llama_runner import RunnerOptions, eval_logits, open_model, tokenize
from ..backend.runtime import import_llama_cpp
from ..errors import BadInputError
from ..formats.gguf_read import GgufFile
from ..progress import task
from .perplexity_common import NllAccumulator, chunk_nll, chunk_tokens, plan_chunks


@dataclass
class LlamaPplOptions:
    ctx: int = 512
    chunks: int | None = None
    attn: str | None = None            # None = as the file says; "dense" or "sparse"
    top_k: int | None = None
    kv: str = "f16"
    index_keys: str | None = None      # the indexer-key cache: f16 (None: the default) or f32 (exact)
    n_gpu_layers: int = 0
    flash_attn: bool = False
    batch: int | None = None
    quiet: bool = False


INDEX_KEY_TYPES = ("f32", "f16")
# the default indexer-key cache of llama.cpp runs: F16 halves the bytes the decode's indexer reads (RESULTS §4k: 1B
# Q4_K_M at 64K on an H200, 1.845 / 1.845 ms per token vs 1.958 / 1.874 with F32 keys, alternating processes) and
# moved the reference model's sparse PPL from +0.0165 % to +0.0178 % of kernels_ref
INDEX_KEYS_DEFAULT = "f16"


def dsa_overrides(g: GgufFile, attn: str | None, top_k: int | None, kv: str = "f16",
                  index_keys: str | None = None) -> tuple[dict, dict]:
    """kv_overrides for the per-run switch, and what the run will use. index_keys None: INDEX_KEYS_DEFAULT where the
    file has an indexer (a stock file has no indexer-key cache; an explicit f16 on one is refused)."""
    arch = g.arch
    key = f"{arch}.attention.indexer.top_k"
    file_k = g.get(key)
    has_indexer = file_k is not None
    if index_keys is not None and index_keys not in INDEX_KEY_TYPES:
        raise BadInputError(f"unknown --index-keys {index_keys!r} (choose from {', '.join(INDEX_KEY_TYPES)})")
    if index_keys not in (None, "f32") and not has_indexer:
        raise BadInputError(f"--index-keys {index_keys}: {g.path.name} has no DSA indexer (no indexer-key cache)")
    if kv == "asq":
        if g.get(f"{arch}.dsa.asq.residual_bits") is None:
            raise BadInputError(f"--kv asq: {g.path.name} has no ASQ prototypes (convert with `dsa convert --cluster-num C`)")
        if attn == "dense" or (top_k is None and not file_k):
            raise BadInputError("--kv asq runs with sparse attention only (the compressed cache is part of llama.cpp's "
                                "DSA cache); use --top-k >= --ctx for attention over every key")
    if attn == "sparse" and not has_indexer:
        raise BadInputError(f"{g.path.name} has no DSA indexer; --attn sparse needs a file from `dsa convert` with DSA")
    if top_k is not None and not has_indexer:
        raise BadInputError("--top-k needs a file with a DSA indexer")
    ov: dict = {}
    if has_indexer and attn == "dense":
        ov[key] = 0
    elif has_indexer and top_k is not None:
        if top_k <= 0:
            raise BadInputError(f"--top-k must be > 0 (got {top_k})")
        ov[key] = int(top_k)
    mode = "dense" if (not has_indexer or attn == "dense") else "sparse"
    if mode == "sparse":
        g.indexer_types()   # a clear one-line error here rather than llama.cpp's generic load failure
    keys = (index_keys or INDEX_KEYS_DEFAULT) if mode == "sparse" else None
    if keys == "f16":
        ov[f"{arch}.dsa.indexer.key_f16"] = True     # the patched llama.cpp's runtime switch (FORMAT.md §5b)
    eff_k = None if mode == "dense" else int(ov.get(key, file_k))
    return ov, {"attn": mode, "top_k": eff_k, "index_keys": keys}


def run(path: Path, text: str, o: LlamaPplOptions) -> dict:
    g = GgufFile(path)
    try:
        ov, mode = dsa_overrides(g, o.attn, o.top_k, o.kv, o.index_keys)
    finally:
        g.close()
    lc = import_llama_cpp()
    with capture_log(lc) as log:
        llm = open_model(path, RunnerOptions(n_ctx=o.ctx, n_batch=o.batch or o.ctx, n_gpu_layers=o.n_gpu_layers,
                                             flash_attn=o.flash_attn, kv_type=o.kv, kv_overrides=ov))
    kvlog = parse_kv_log("".join(log))
    add_bos = bool(llm._model.add_bos_token()) if hasattr(llm, "_model") else False
    bos = llm.token_bos()
    tokens = tokenize(llm, text, add_bos=add_bos)
    plan = plan_chunks(len(tokens), o.ctx, o.chunks, add_bos, bos)
    acc = NllAccumulator()
    t0 = time.perf_counter()
    with task("perplexity (llama.cpp)", plan.n_chunk, quiet=o.quiet) as bar:
        for i in range(plan.n_chunk):
            chunk = chunk_tokens(tokens, plan, i)
            acc.add(chunk_nll(eval_logits(llm, chunk.tolist()), chunk, plan))
            bar.advance(1, info=f"ppl {acc.per_chunk[-1]:.4f}")
    ppl, err = acc.result()
    import llama_cpp

    return {"ppl": ppl, "ppl_stderr": err, "tokens": acc.count, "chunks": plan.n_chunk, "ctx": o.ctx,
            "attn": mode["attn"], "kv": o.kv, "index_keys": mode["index_keys"], "top_k": mode["top_k"],
            "backend": "llama.cpp",
            "device": "cuda" if (o.n_gpu_layers and llama_cpp.llama_supports_gpu_offload()) else "cpu",
            "flash_attn": o.flash_attn, "n_gpu_layers": o.n_gpu_layers, "file": str(path),
            "seconds": round(time.perf_counter() - t0, 2), "per_chunk_ppl": acc.per_chunk, **kvlog.report()}
