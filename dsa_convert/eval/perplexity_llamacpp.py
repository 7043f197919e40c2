"""Perplexity through llama.cpp (llama-cpp-python on the patched tree), llama-perplexity's method:
llama.cpp's own tokenizer on the whole text (BOS prepended when the vocab adds it), chunks of
n_ctx with BOS replacing the first token, KV cache cleared per chunk, second half scored,
log-softmax in double. With `kld`, a second context runs the same file dense with an F16 cache on the same chunks and
the run's KL divergence from it is reported as `llama-perplexity --kl-divergence` does. llama.cpp is asked for the
logits of the scored half only (decode_rows), so a chunk holds n_ctx / 2 x n_vocab floats per context, not n_ctx."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backend.llama_log import capture_log, parse_kv_log
from ..backend.llama_runner import RunnerOptions, close_model, decode_rows, default_threads, open_model, tokenize
from ..backend.runtime import import_llama_cpp
from ..errors import BadInputError
from ..formats.gguf_read import GgufFile
from ..progress import task
from .perplexity_common import KldAccumulator, NllAccumulator, chunk_tokens, log_softmax64, plan_chunks


@dataclass
class LlamaPplOptions:
    ctx: int = 512
    chunks: int | None = None
    attn: str | None = None            # None = as the file says; "dense", "sparse" or "local" (ATTN_MODES)
    top_k: int | None = None
    kv: str = "f16"
    index_keys: str | None = None      # the indexer-key cache: f16 (None: the default) or f32 (exact)
    n_gpu_layers: int = 0
    threads: int | None = None         # None: default_threads()
    flash_attn: bool = False
    batch: int | None = None           # tokens per llama_decode (and ubatch); None: min(ctx, BATCH_DEFAULT_MAX)
    quiet: bool = False
    kld: bool = False                  # also report the KL divergence from the same file run dense with an F16 cache
    kld_base: Path | None = None       # ... or from another GGUF (e.g. the F16 file a quantized one was made from)


ATTN_MODES = ("dense", "sparse", "local")
# local: sinks + the most recent top_k - sink positions, the sparse run's budget without indexer picks (the baseline an
# indexer must beat; kernels_ref's `--attn local`). llama.cpp runs it as a sparse run whose window fills the budget:
# the kv overrides {arch}.dsa.local = top_k - sink leave no picks, so the forced keys are the whole selection.
KLD_BASE = "dense f16"
BATCH_DEFAULT_MAX = 2048
# llama-perplexity's default n_batch. llama.cpp's compute buffer grows with the ubatch: without flash attention a
# 16K-token ubatch of the 27M reference model needs 9.4 GB (dense) / 12.9 GB (sparse) on the CPU, a 2048-token one
# 1.6 GB at 16K and 3.2 GB at 32K (sparse); `kld` holds two contexts.


INDEX_KEY_TYPES = ("f32", "f16")
# the default indexer-key cache of llama.cpp runs: F16 halves the bytes the decode's indexer reads (RESULTS §4k: 1B
# Q4_K_M at 64K on an H200, 1.845 / 1.845 ms per token vs 1.958 / 1.874 with F32 keys, alternating processes) and
# moved the reference model's sparse PPL from +0.0165 % to +0.0178 % of kernels_ref
INDEX_KEYS_DEFAULT = "f16"


def dsa_overrides(g: GgufFile, attn: str | None, top_k: int | None, kv: str = "f16",
                  index_keys: str | None = None) -> tuple[dict, dict]:
    """kv_overrides for the per-run switch, and what the run will use: {"attn", "top_k", "index_keys", "sink",
    "local"}.
    attn: dense | sparse | local | None (as the file says). index_keys None: INDEX_KEYS_DEFAULT where the file has an
    indexer (a stock file has no indexer-key cache; an explicit f16 on one is refused)."""
    arch = g.arch
    key = f"{arch}.attention.indexer.top_k"
    file_k = g.get(key)
    has_indexer = file_k is not None
    if attn is not None and attn not in ATTN_MODES:
        raise BadInputError(f"--attn {attn}: llama.cpp runs {', '.join(ATTN_MODES)}")
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
    if attn in ("sparse", "local") and not has_indexer:
        raise BadInputError(f"{g.path.name} has no DSA indexer; --attn {attn} needs a file from `dsa convert` with DSA")
    if top_k is not None and not has_indexer:
        raise BadInputError("--top-k needs a file with a DSA indexer")
    ov: dict = {}
    if has_indexer and attn == "dense":
        ov[key] = 0
    elif has_indexer and top_k is not None:
        if top_k <= 0:
            raise BadInputError(f"--top-k must be > 0 (got {top_k})")
        ov[key] = int(top_k)
    mode = "dense" if (not has_indexer or attn == "dense") else (attn or "sparse")
    if mode != "dense":
        g.indexer_types()   # a clear one-line error here rather than llama.cpp's generic load failure
    eff_k = None if mode == "dense" else int(ov.get(key, file_k))
    sink = local = None
    if mode == "sparse":
        sink, local = int(g.get(f"{arch}.dsa.sink", 0)), int(g.get(f"{arch}.dsa.local", 0))
        if eff_k and sink + local > eff_k:
            # a per-run top-k below the file's split scales the split down, as kernels_ref's fit_split does
            sink = min(sink, eff_k)
            local = max(1, min(local, eff_k - sink))
            if sink + local > eff_k:
                raise BadInputError(f"--top-k {eff_k} leaves no local window after the file's {sink} sink tokens")
            ov.update({f"{arch}.dsa.sink": sink, f"{arch}.dsa.local": local})
    elif mode == "local":
        if not eff_k:
            raise BadInputError(f"--attn local: {g.path.name} has top-k 0 (dense); pass --top-k")
        sink = min(int(g.get(f"{arch}.dsa.sink", 0)), eff_k)     # as kernels_ref's fit_split
        local = eff_k - sink
        if local < 1:
            raise BadInputError(f"--attn local: top-k {eff_k} leaves no local window after {sink} sink tokens")
        ov.update({key: eff_k, f"{arch}.dsa.sink": sink, f"{arch}.dsa.local": local})
        if g.get(f"{arch}.dsa.select", "token") != "token":
            # with no picks `block` and `token` select the same keys; the runtime runs only `token` (FORMAT.md §5b)
            ov[f"{arch}.dsa.select"] = "token"
    keys = (index_keys or INDEX_KEYS_DEFAULT) if mode != "dense" else None
    if keys == "f16":
        ov[f"{arch}.dsa.indexer.key_f16"] = True     # the patched llama.cpp's runtime switch (FORMAT.md §5b)
    return ov, {"attn": mode, "top_k": eff_k, "index_keys": keys, "sink": sink, "local": local}


ROWS_PER_BLOCK = 256     # rows of float64 softmax work at a time: 32 MB per temporary at a 16K vocab


def scored_nll(logits: np.ndarray, targets: np.ndarray, rows_per_block: int = ROWS_PER_BLOCK) -> np.ndarray:
    """Per-token NLL (float64) of logits [n, n_vocab] for targets [n], in blocks of rows (float64 work stays small)."""
    out = np.empty(len(targets), dtype=np.float64)
    for a in range(0, len(targets), rows_per_block):
        b = min(len(targets), a + rows_per_block)
        out[a:b] = -log_softmax64(logits[a:b])[np.arange(b - a), targets[a:b]]
    return out


def run(path: Path, text: str, o: LlamaPplOptions) -> dict:
    g = GgufFile(path)
    try:
        ov, mode = dsa_overrides(g, o.attn, o.top_k, o.kv, o.index_keys)
        base_ov = dsa_overrides(g, "dense", None)[0] if o.kld and o.kld_base is None else None
    finally:
        g.close()
    if mode["attn"] == "sparse" and mode["top_k"] and mode["sink"] + mode["local"] >= mode["top_k"]:
        print(f"warning: --top-k {mode['top_k']} is within the file's sink + local window ({mode['sink']} + "
              f"{mode['local']}): no key is picked by the indexer, so this sparse run is local attention", file=sys.stderr,
              flush=True)
    base_path = path
    if o.kld_base is not None:
        base_path, base_ov = Path(o.kld_base), _base_overrides(Path(o.kld_base), path)
    lc = import_llama_cpp()
    threads = o.threads or default_threads()
    ropts = dict(n_ctx=o.ctx, n_batch=o.batch or min(o.ctx, BATCH_DEFAULT_MAX), n_gpu_layers=o.n_gpu_layers,
                 n_threads=threads, flash_attn=o.flash_attn, logits_all=False)
    with capture_log(lc) as log:
        llm = open_model(path, RunnerOptions(**ropts, kv_type=o.kv, kv_overrides=ov))
    base = None
    try:
        if o.kld or o.kld_base is not None:
            base = open_model(base_path, RunnerOptions(**ropts, kv_type="f16", kv_overrides=base_ov))
            if base.n_vocab() != llm.n_vocab():
                raise BadInputError(f"--kld-base {base_path.name}: vocabulary of {base.n_vocab()} tokens, "
                                    f"{path.name} has {llm.n_vocab()}")
        res = _score(llm, base, text, o)
    finally:
        close_model(llm)
        if base is not None:
            close_model(base)
    import llama_cpp

    return {**res, "ctx": o.ctx, "attn": mode["attn"], "kv": o.kv, "index_keys": mode["index_keys"],
            "top_k": mode["top_k"], "sink": mode["sink"], "local": mode["local"], "backend": "llama.cpp",
            "device": "cuda" if (o.n_gpu_layers and llama_cpp.llama_supports_gpu_offload()) else "cpu",
            "flash_attn": o.flash_attn, "n_gpu_layers": o.n_gpu_layers, "threads": threads, "file": str(path),
            **parse_kv_log("".join(log)).report()}


def _score(llm, base, text: str, o: LlamaPplOptions) -> dict:
    """NLL of every chunk's scored half (and its KLD from `base`, when given): the result fields of run()."""
    add_bos = bool(llm._model.add_bos_token()) if hasattr(llm, "_model") else False
    tokens = tokenize(llm, text, add_bos=add_bos)
    plan = plan_chunks(len(tokens), o.ctx, o.chunks, add_bos, llm.token_bos())
    rows = range(plan.first, plan.n_ctx - 1)
    acc, kld, base_acc = NllAccumulator(), KldAccumulator(), NllAccumulator()
    t0 = time.perf_counter()
    with task("perplexity (llama.cpp)", plan.n_chunk, quiet=o.quiet) as bar:
        for i in range(plan.n_chunk):
            chunk = chunk_tokens(tokens, plan, i)
            targets = chunk[plan.first + 1: plan.n_ctx]
            logits = decode_rows(llm, chunk.tolist(), rows)
            if base is None:
                acc.add(scored_nll(logits, targets))
            else:       # the KLD pass has both runs' log-softmax: their NLLs come from it
                nll, nll_base = kld.add(decode_rows(base, chunk.tolist(), rows), logits, targets,
                                        rows_per_block=ROWS_PER_BLOCK)
                acc.add(nll)
                base_acc.add(nll_base)
            del logits
            bar.advance(1, info=f"ppl {acc.per_chunk[-1]:.4f}")
    ppl, err = acc.result()
    out = {"ppl": ppl, "ppl_stderr": err, "tokens": acc.count, "chunks": plan.n_chunk,
           "seconds": round(time.perf_counter() - t0, 2), "per_chunk_ppl": acc.per_chunk}
    if base is not None:
        base_ppl, base_err = base_acc.result()
        out.update(kld.result(), kld_base=KLD_BASE if o.kld_base is None else str(o.kld_base), ppl_base=base_ppl,
                   ppl_base_stderr=base_err, ppl_vs_base_pct=100.0 * (ppl / base_ppl - 1.0))
    return out


def _base_overrides(base: Path, path: Path) -> dict:
    """kv_overrides of a --kld-base file: dense, as the reference run of `--kld` is."""
    if not base.is_file():
        raise BadInputError(f"--kld-base: file not found: {base}")
    if base.resolve() == Path(path).resolve():
        raise BadInputError("--kld-base is the evaluated file itself; use --kld for its own dense run")
    gb = GgufFile(base)
    try:
        return dsa_overrides(gb, "dense", None)[0]
    finally:
        gb.close()
