"""Run a GGUF through llama-cpp-python (the patched llama.cpp): load, logits, tokenization."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import BadInputError, DsaError
from .runtime import import_llama_cpp

KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "asq": 1}
# "asq": the patched llama.cpp's compressed cache (docs/FORMAT.md section 6) for K and/or V, where the file has
# ASQ prototypes (the part without prototypes stays f16). Every other type switches that cache off with the
# kv override {arch}.dsa.asq.cache = false, so the requested type is what llama.cpp allocates.
QUANTIZED_V = ("q4_0", "q8_0")      # llama.cpp allocates a quantized V cache only with flash attention


def check_kv_flash_attn(kv_type: str, flash_attn: bool) -> None:
    """One-line refusal, before llama.cpp fails to create the context, of a quantized V cache without flash attention."""
    if kv_type in QUANTIZED_V and not flash_attn:
        raise BadInputError(f"KV type {kv_type} quantizes the V cache, which llama.cpp allocates only with flash "
                            "attention (--flash-attn)")


def asq_cache_override(path: Path) -> dict:
    """{"<arch>.dsa.asq.cache": False} for `path` (ignored by llama.cpp where the file has no DSA indexer)."""
    from ..formats.gguf_read import GgufFile

    g = GgufFile(path)
    try:
        return {f"{g.arch}.dsa.asq.cache": False}
    finally:
        g.close()


def default_threads() -> int:
    """llama.cpp threads when none are asked for: the CPUs this process may run on (`taskset`, a container's cpuset),
    not every CPU of the host, so that runs pinned side by side do not oversubscribe their cores."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:      # no affinity call on this OS
        return max(1, os.cpu_count() or 1)


@dataclass
class RunnerOptions:
    n_ctx: int = 512
    n_batch: int = 512
    n_gpu_layers: int = 0
    flash_attn: bool = False           # explicit: llama-cpp-python defaults off, llama.cpp tools default auto
    kv_type: str = "f16"
    kv_overrides: dict = field(default_factory=dict)
    n_threads: int | None = None
    logits_all: bool = True
    verbose: bool = False


@contextlib.contextmanager
def _quiet_stderr(enabled: bool):
    """llama.cpp logs to fd 2 from C; silence it unless verbose (errors are re-raised as one line)."""
    if not enabled:
        yield
        return
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as dn:
            os.dup2(dn.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def open_model(path: Path, opts: RunnerOptions):
    lc = import_llama_cpp()
    if not Path(path).is_file():
        raise BadInputError(f"file not found: {path}")
    if opts.kv_type not in KV_TYPES:
        raise BadInputError(f"llama.cpp backend: unsupported KV type {opts.kv_type!r} (choose from {', '.join(KV_TYPES)})")
    check_kv_flash_attn(opts.kv_type, opts.flash_attn)
    kvt = KV_TYPES[opts.kv_type]
    overrides = dict(opts.kv_overrides or {})
    if opts.kv_type != "asq":
        overrides = {**asq_cache_override(path), **overrides}
    threads = opts.n_threads or default_threads()
    try:
        with _quiet_stderr(not opts.verbose):
            return lc.Llama(
                model_path=str(path), n_ctx=opts.n_ctx, n_batch=opts.n_batch, n_ubatch=opts.n_batch,
                n_gpu_layers=opts.n_gpu_layers, flash_attn=opts.flash_attn, type_k=kvt, type_v=kvt,
                kv_overrides=overrides or None, logits_all=opts.logits_all,
                n_threads=threads, n_threads_batch=threads, verbose=opts.verbose)
    except ValueError as e:  # llama-cpp-python raises ValueError("Failed to load model from file: …")
        raise DsaError(f"llama.cpp could not load {Path(path).name}: {e}") from None


def close_model(llm, verbose: bool = False) -> None:
    """Free a model and its context now (llama.cpp's teardown log silenced unless verbose)."""
    with _quiet_stderr(not verbose):
        llm.close()


def eval_logits(llm, tokens: list[int]) -> np.ndarray:
    """Fresh sequence (cache cleared), returns float32 logits [len(tokens), n_vocab]."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(list(tokens))
    return np.array(llm.scores[: len(tokens)], dtype=np.float32, copy=True)


def decode_rows(llm, tokens: list[int], rows: range, *, n_past: int = 0) -> np.ndarray:
    """Decode `tokens` at positions n_past.. of sequence 0 in n_batch-sized pieces, asking llama.cpp for the logits of
    the token indices in `rows` only (a contiguous range of indices into `tokens`); returns them as float32
    [len(rows), n_vocab]. n_past 0 starts a fresh sequence (KV cache cleared). llama.cpp computes and copies out just
    those rows, so a context opened with logits_all=False holds no n_ctx x n_vocab buffer."""
    if rows.step != 1 or (len(rows) and (rows.start < 0 or rows.stop > len(tokens))):
        raise ValueError(f"rows {rows} is not a contiguous range inside {len(tokens)} tokens")
    if n_past == 0:
        llm.reset()
        llm._ctx.kv_cache_clear()
    n_vocab = llm.n_vocab()
    out = np.empty((len(rows), n_vocab), dtype=np.float32)
    b = llm._batch.batch
    done = 0
    for a in range(0, len(tokens), llm.n_batch):
        piece = tokens[a:a + llm.n_batch]
        n = len(piece)
        lo, hi = max(rows.start, a) - a, min(rows.stop, a + n) - a      # wanted indices inside this piece
        n_out = max(0, hi - lo)
        np.ctypeslib.as_array(b.token, shape=(n,))[:] = piece
        np.ctypeslib.as_array(b.pos, shape=(n,))[:] = np.arange(n_past + a, n_past + a + n)
        np.ctypeslib.as_array(b.n_seq_id, shape=(n,))[:] = 1
        flags = np.ctypeslib.as_array(b.logits, shape=(n,))
        flags[:] = 0
        flags[lo:lo + n_out] = 1
        for i in range(n):
            b.seq_id[i][0] = 0
        b.n_tokens = n
        rc = int(import_llama_cpp().llama_decode(llm._ctx.ctx, b))
        if rc != 0:
            raise DsaError(f"llama_decode failed (status {rc}) at positions {n_past + a}..{n_past + a + n - 1}")
        if n_out:
            out[done:done + n_out] = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_out, n_vocab))
            done += n_out
    return out


def tokenize(llm, text: str, add_bos: bool = False) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)


def open_vocab(path: Path):
    """A GGUF's vocab alone in llama.cpp (no weights, no context): for tokenize / detokenize."""
    lc = import_llama_cpp()
    try:
        with _quiet_stderr(True):
            return lc.Llama(model_path=str(path), vocab_only=True, verbose=False)
    except ValueError as e:
        raise BadInputError(f"{Path(path).name}: llama.cpp cannot read its vocab ({e})") from None


def vocab_tokens(path: Path, text: str, add_bos: bool | None = None) -> tuple[list[int], bool]:
    """Tokenise `text` with a GGUF's own vocab (llama.cpp, vocab only). add_bos None: as the vocab says.
    Returns (tokens, add_bos used)."""
    llm = open_vocab(path)
    try:
        ab = bool(llm._model.add_bos_token()) if add_bos is None else add_bos
        return list(tokenize(llm, text, add_bos=ab)), ab
    finally:
        llm.close()


_CHILD = """
import json, sys
from dsa_convert.backend.runtime import import_llama_cpp
import_llama_cpp()          # before numpy: see runtime.preload_llama_cpp
from dsa_convert.backend.llama_runner import vocab_tokens
from dsa_convert.errors import DsaError
path, text_file, add_bos = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
try:
    toks, ab = vocab_tokens(path, open(text_file, encoding="utf-8").read(), add_bos)
    print(json.dumps({"tokens": toks, "add_bos": ab}))
except DsaError as e:
    print(json.dumps({"error": str(e)}))
"""


def vocab_tokens_isolated(path: Path, text: str, add_bos: bool | None = None) -> tuple[list[int], bool]:
    """vocab_tokens in a fresh Python process, for callers that hold numpy/torch: llama.cpp loaded after
    them crashes on some CUDA images, and a CUDA torch beside llama.cpp's CUDA backend aborts."""
    import json
    import subprocess
    import sys
    import tempfile

    from .runtime import child_python_env

    env = child_python_env()
    with tempfile.TemporaryDirectory(prefix="dsa-tok-") as d:
        tf = Path(d) / "text.txt"
        tf.write_text(text, encoding="utf-8")
        r = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(tf), json.dumps(add_bos)],
                           capture_output=True, text=True, env=env)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise DsaError(f"tokenizing with {Path(path).name}'s vocab failed: {last}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "error" in out:
        raise BadInputError(out["error"])
    return out["tokens"], bool(out["add_bos"])
