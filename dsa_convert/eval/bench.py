"""`dsa bench`: prefill and decode speed, and KV-cache size, per context length, sparse vs dense.

For every (ctx, attn) pair a fresh llama.cpp context of n_ctx = ctx + 2 gen + 3 is created (the file's top-k for
`sparse`, the run-time override top_k = 0 for `dense`; flash attention on by default for both; --dense-flash-attn
off | both runs dense without it, or once with and once without, the ratios then taking the faster), a warm-up
batch is decoded and cleared, then ctx random token ids are prefilled (batches of --batch, timed until
llama_synchronize), 3 tokens are decoded untimed at that depth (so the sparse decode graph is built and, on CUDA,
captured before the timing: the warm-up batch decoded at a depth below top-k, where every key is selected and the
dense kernels run) and --gen tokens are decoded one at a time (timed the same way). Tokens go straight to
llama_decode (llama_batch_get_one), so no Python per-token work is inside the timings. llama.cpp's own
counters (llama_perf_context: prompt-eval and eval ms) are reported beside the wall times.

kv_bytes is llama.cpp's own figure: the sum of the `llama_kv_cache: size = … MiB` lines it logs when it
allocates the caches (main K/V + the DSA indexer-key cache for sparse), captured through the log callback
(backend/llama_log.py). kv_bytes_per_token divides by the cells llama.cpp allocated (n_ctx rounded up).
Indexer time share: sparse runs repeat the same steps in a second context created with LLAMA_DSA_INDEXER_ONLY=1
(the patch reads its switches when a context is created; it then computes every sparse layer's selection, scores
and top-k, but attends densely): `indexer_decode_ms_per_tok` = that context's decode time - the dense run's at the
same ctx, `indexer_share_decode` = it / the sparse decode time. The rest of the sparse overhead is the selection
mask and the gather. `indexer_share_*_est` = 1 - t_dense / t_sparse is the whole sparse overhead's share (indexer,
top-k, mask, gather), prefill and decode.
`--no-indexer-share` skips that second context (no indexer_* fields). `process_peak_rss_mib`: the process's peak RSS
when the row finished (monotone over a sweep: run one attention mode and cache type per process to compare them).
Host time: the timed contexts are created with LLAMA_DSA_HOST_TIMING=1; the patch logs, per single-token decode, the
host µs of cache apply + graph build/reuse, of writing the inputs (masks, positions) and of launching the graph
(`host_us_per_decode_token`; on a GPU the launch is asynchronous, on the CPU it is the whole compute). The table's
`host µs/tok` is graph + inputs: the host work a GPU waits for before each token. With it each prefill ubatch first
waits for the previous one's GPU work (the patch's prefill record), so on a GPU the prefill loses the overlap of one
ubatch's graph build with the previous ubatch's kernels.
--variant LLAMA_DSA_NAME=VALUE (repeatable) adds, per ctx, one more sparse run with that patch switch set in the
environment (docs/PATCH.md: LLAMA_DSA_FUSED=0, LLAMA_DSA_HOST_MASKS=1, LLAMA_DSA_GATHER=never|always), so an A/B of
a switch is measured in the same sweep; its rows carry `variant`. Several switches join with '+'
(LLAMA_DSA_FUSED=0+LLAMA_DSA_HOST_MASKS=1), and upstream's GGML_CUDA_* switches are allowed too
(LLAMA_DSA_GATHER=never+GGML_CUDA_GRAPH_OPT=1). Each variant run happens in a Python process of its own
(eval/variant_proc.py, the switch set before llama.cpp loads): ggml's CUDA backend reads its switches once per
process, so in the sweep's own process a variant of those would silently run the default. Every row carries the
`pid` of the process that ran it, and `host_cpu`: the host CPU and NUMA node it last ran on after the timed decodes and its CPU
affinity (--cpus LIST pins the sweep and its variant processes; eval/host_cpu.py says why).
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..backend.llama_log import KvCacheInfo, capture_log, parse_kv_log
from ..backend.llama_runner import KV_TYPES, RunnerOptions, check_kv_flash_attn, default_threads, open_model
from ..errors import BadInputError, DsaError
from ..formats import indexer_layout
from ..formats.gguf_read import GgufFile
from ..resources import check_threads, peak_rss_mib
from ..progress import task
from . import host_cpu
from .bench_summary import ATTN_MODES, add_indexer_share, add_ratios, fa_label
from .perplexity_llamacpp import dsa_overrides
# environment switches recorded in each row: the patch's (docs/PATCH.md; e.g. LLAMA_DSA_FUSED=0, get_rows + flash
# attention over the picks) and ggml's CUDA ones (e.g. GGML_CUDA_GRAPH_OPT)
RECORDED_ENV = ("LLAMA_DSA_", "GGML_CUDA_")
# the patch's switches a --variant may set, with their values (the first: the default); LLAMA_DSA_HOST_TIMING and
# LLAMA_DSA_INDEXER_ONLY are the bench's own measurements
VARIANT_SWITCHES = {"LLAMA_DSA_FUSED": ("1", "0"), "LLAMA_DSA_HOST_MASKS": ("0", "1"),
                    "LLAMA_DSA_GATHER": ("auto", "never", "always")}
DEFAULT_CTX = (4096, 16384, 65536, 131072)
# flash attention of the dense runs: `same` as --flash-attn, or on / off, or both (two dense runs per ctx; the ratios
# then take, per metric, the faster one: on some CPUs llama.cpp's flash-attention decode is slower than without it)
DENSE_FLASH_ATTN = ("same", "on", "off", "both")


@dataclass
class BenchOptions:
    ctx: list[int] = field(default_factory=lambda: list(DEFAULT_CTX))
    gen: int = 128
    attn: list[str] = field(default_factory=lambda: list(ATTN_MODES))
    n_gpu_layers: int = 999
    kv: str = "f16"
    index_keys: str | None = None     # indexer-key cache of the sparse runs: f16 | f32 (None: INDEX_KEYS_DEFAULT)
    batch: int = 512                  # n_batch = n_ubatch of the context
    threads: int | None = None        # None: the CPUs this process may run on (default_threads)
    flash_attn: bool = True
    dense_flash_attn: str = "same"    # DENSE_FLASH_ATTN
    force: bool = False               # allow ctx > the model's trained context
    seed: int = 0
    plot: Path | None = None          # checked before the runs (the PNG is written by write_plot)
    jsonl: Path | None = None         # append each finished row here at once (partial results survive a kill)
    variants: list[str] = field(default_factory=list)   # LLAMA_DSA_NAME=VALUE: one more sparse run per ctx each
    quiet: bool = False
    cpus: str | None = None           # pin the sweep (and its variant processes) to these host CPUs (host_cpu.py)
    indexer_share: bool = True        # time the sparse runs' indexer in a second context (INDEXER_ONLY); on a CPU at
                                      # long context that context's prefill is most of the sweep


@dataclass
class FileInfo:
    arch: str
    n_ctx_train: int | None
    top_k: int | None                 # the file's indexer top-k (None: no DSA indexer)
    overrides: dict[str, dict]        # attn -> kv_overrides
    index_keys: dict[str, str | None]  # attn -> the indexer-key cache that run uses (None: dense, no indexer)
    indexer_layers: int | None = None  # layers that run their own indexer (FORMAT.md §4a; None: no indexer)


def parse_int_list(spec: str, what: str) -> list[int]:
    out = []
    for part in (p.strip() for p in str(spec).split(",")):
        try:
            out.append(int(part))
        except ValueError:
            raise BadInputError(f"{what}: {part!r} is not an integer") from None
    return out


def dense_flash_attn_settings(o: BenchOptions) -> list[bool]:
    """The flash-attention settings the dense runs of each ctx use, in run order."""
    return {"same": [o.flash_attn], "on": [True], "off": [False], "both": [True, False]}[o.dense_flash_attn]


def parse_attn(spec: str) -> list[str]:
    modes = [p.strip().lower() for p in str(spec).split(",") if p.strip()]
    bad = [m for m in modes if m not in ATTN_MODES]
    if not modes or bad:
        raise BadInputError(f"unknown --attn {bad[0] if bad else spec!r} (choose from sparse, dense)")
    return list(dict.fromkeys(modes))


_VARIANT_ITEM = re.compile(r"^((?:LLAMA_DSA|GGML_CUDA)_[A-Z0-9_]+)=([^+]*)$")


def parse_variant(variant: str) -> dict[str, str] | None:
    """`NAME=VALUE[+NAME=VALUE...]` (names GGML_CUDA_*, or a VARIANT_SWITCHES name with one of its values) as
    {name: value}; None if malformed."""
    items = [_VARIANT_ITEM.match(x) for x in variant.split("+")]
    if not all(items):
        return None
    env = {m.group(1): m.group(2) for m in items}
    for k, val in env.items():
        if k.startswith("LLAMA_DSA_") and val not in VARIANT_SWITCHES.get(k, ()):
            return None
    return env if len(env) == len(items) else None     # a name twice: malformed


@contextmanager
def _patch_switch(key: str, val: str):
    """A patch switch in the environment (read by llama.cpp when a context is created), restored afterwards."""
    old = os.environ.get(key)
    os.environ[key] = val
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _ignore_sigint() -> None:
    """In the variant's process from its start (Python then installs no KeyboardInterrupt handler): a terminal's
    Ctrl-C reaches the whole process group, and the sweep stops the variant itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_variant(path: Path, ctx_len: int, o: BenchOptions, fi: FileInfo, variant: str) -> dict:
    """One variant's sparse run in a new Python process (eval/variant_proc.py), the switch in its environment from
    the start; the child is stopped if this one is interrupted (Ctrl-C, SIGTERM). Not multiprocessing's spawn: its
    child imports the parent's modules (numpy) before llama.cpp, which segfaults with a CUDA library
    that carries its own libstdc++ (backend.runtime.preload_llama_cpp)."""
    from ..backend.runtime import child_python_env

    env = child_python_env(parse_variant(variant))
    with tempfile.TemporaryDirectory(prefix="dsa-variant-") as td:
        result = Path(td) / "result.pkl"
        child = subprocess.Popen([sys.executable, "-m", "dsa_convert.eval.variant_proc", str(result)],
                                 stdin=subprocess.PIPE, env=env, preexec_fn=_ignore_sigint)
        try:
            child.communicate(pickle.dumps((path, ctx_len, o, fi, variant)))
        finally:
            if child.poll() is None:
                child.terminate()
                child.wait()
        if not result.is_file():
            raise DsaError(f"the process of variant {variant} died (exit code {child.returncode})")
        kind, payload = pickle.loads(result.read_bytes())
    if kind == "error":
        raise DsaError(payload)
    return payload


def validate(path: Path, o: BenchOptions) -> FileInfo:
    """Every input check that needs no backend: one-line BadInputError (exit 3)."""
    for v in o.variants:
        if parse_variant(v) is None:
            names = ", ".join(f"{k}={'|'.join(vals[1:])}" for k, vals in VARIANT_SWITCHES.items())
            raise BadInputError(f"--variant: expected LLAMA_DSA_NAME=VALUE ({names}; several joined by '+'; "
                                f"GGML_CUDA_* names too), got {v!r}")
    if o.variants and "sparse" not in o.attn:
        raise BadInputError("--variant adds sparse runs: it needs --attn sparse (or sparse,dense)")
    if not o.ctx:
        raise BadInputError("--ctx: give at least one context length")
    for c in o.ctx:
        if c <= 0:
            raise BadInputError(f"--ctx must be > 0 (got {c})")
    if o.gen <= 0:
        raise BadInputError(f"--gen must be > 0 (got {o.gen})")
    if o.batch <= 0:
        raise BadInputError(f"--batch must be > 0 (got {o.batch})")
    if o.n_gpu_layers < 0:
        raise BadInputError(f"--n-gpu-layers must be >= 0 (got {o.n_gpu_layers})")
    check_threads(o.threads)
    if o.kv not in KV_TYPES:
        raise BadInputError(f"unknown --kv {o.kv!r} (choose from {', '.join(KV_TYPES)})")
    if o.dense_flash_attn not in DENSE_FLASH_ATTN:
        raise BadInputError(f"unknown --dense-flash-attn {o.dense_flash_attn!r} "
                            f"(choose from {', '.join(DENSE_FLASH_ATTN)})")
    check_kv_flash_attn(o.kv, o.flash_attn)    # before the sweep, not as a failed row per run
    if "dense" in o.attn:
        for fa in dense_flash_attn_settings(o):
            check_kv_flash_attn(o.kv, fa)
    for m in o.attn:
        if m not in ATTN_MODES:
            raise BadInputError(f"unknown --attn {m!r} (choose from sparse, dense)")
    if o.cpus is not None:
        host_cpu.check(o.cpus)
    for opt, p in (("--plot", o.plot), ("--jsonl", o.jsonl)):
        if p is not None and not Path(p).resolve().parent.is_dir():
            raise BadInputError(f"{opt}: directory does not exist: {Path(p).resolve().parent}")
    g = GgufFile(path)                     # missing / not a GGUF / corrupt -> BadInputError
    try:
        arch = g.arch
        n_train = g.get(f"{arch}.context_length")
        n_train = int(n_train) if n_train is not None else None
        resolved = {m: dsa_overrides(g, m, None, o.kv if m == "sparse" else "f16",
                                     o.index_keys if m == "sparse" else None) for m in o.attn}
        top_k = g.get(f"{arch}.attention.indexer.top_k")
        n_idx = sum(1 for il in range(g.layer_count()) if indexer_layout.has_indexer(g.has, il))
    finally:
        g.close()
    if n_train and not o.force:
        too_long = [c for c in o.ctx if c > n_train]
        if too_long:
            raise BadInputError(f"--ctx {too_long[0]} exceeds the model's trained context {n_train} "
                                "(use --force to run it anyway)")
    return FileInfo(arch, n_train, int(top_k) if top_k is not None else None,
                    {m: ov for m, (ov, _) in resolved.items()}, {m: mode["index_keys"] for m, (_, mode) in resolved.items()},
                    n_idx if top_k is not None else None)


def _device(lc, n_gpu_layers: int, kv: KvCacheInfo) -> str:
    if any(name.upper().startswith("CUDA") for name in kv.kv_buffers):
        return "cuda"
    return "cuda" if (n_gpu_layers > 0 and lc.llama_supports_gpu_offload()) else "cpu"


def _decode(lc, ctx, toks: np.ndarray) -> None:
    ptr = toks.ctypes.data_as(ctypes.POINTER(lc.llama_token))
    rc = lc.llama_decode(ctx, lc.llama_batch_get_one(ptr, int(toks.size)))
    if rc != 0:
        raise DsaError(f"llama_decode returned {rc} (n_tokens {toks.size})")


def _decode_steps(lc, ctx, toks: np.ndarray) -> float:
    """One token per llama_decode, synchronized per token as a generator reading logits would be; seconds."""
    t0 = time.perf_counter()
    for i in range(toks.size):
        _decode(lc, ctx, toks[i:i + 1])
        lc.llama_synchronize(ctx)
    return time.perf_counter() - t0


def _prefill(lc, ctx, toks: np.ndarray, batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, toks.size, batch):
        _decode(lc, ctx, toks[i:i + batch])
    lc.llama_synchronize(ctx)
    return time.perf_counter() - t0


WARM_DECODES = 3   # untimed single-token decodes between the prefill and the timed ones


def _timed_context(lc, path: Path, ctx_len: int, attn: str, o: BenchOptions, fi: FileInfo, flash_attn: bool) -> dict:
    """One context: warm-up, the timed prefill of ctx_len random tokens, WARM_DECODES untimed and --gen timed
    single-token decodes; the context is freed before returning (the patch logs its host timing then). The patch's
    switches in the environment apply: llama.cpp reads them when the context is created."""
    threads = o.threads or default_threads()
    ropts = RunnerOptions(n_ctx=ctx_len + 2 * o.gen + WARM_DECODES, n_batch=o.batch, n_gpu_layers=o.n_gpu_layers,
                          flash_attn=flash_attn, kv_type=o.kv, kv_overrides=fi.overrides[attn],
                          n_threads=threads, logits_all=False)
    t0 = time.perf_counter()
    with capture_log(lc) as log:
        llm = open_model(path, ropts)
    load_s = time.perf_counter() - t0
    kv = parse_kv_log("".join(log))
    try:
        ctx = llm.ctx
        mem = lc.llama_get_memory(ctx)
        rng = np.random.default_rng(o.seed + ctx_len)       # same tokens for sparse and dense
        n_vocab = llm.n_vocab()
        lo = 3 if n_vocab > 3 else 0
        prompt = rng.integers(lo, n_vocab, size=ctx_len, dtype=np.int32)
        gen = rng.integers(lo, n_vocab, size=o.gen, dtype=np.int32)
        _prefill(lc, ctx, prompt[: min(o.batch, ctx_len)], o.batch)   # warm-up (allocations, kernels)
        _decode(lc, ctx, gen[:1])
        lc.llama_synchronize(ctx)
        lc.llama_memory_clear(mem, True)
        lc.llama_perf_context_reset(ctx)
        prefill_s = _prefill(lc, ctx, prompt, o.batch)
        # untimed decodes at the full depth: the warm-up above decoded at depth < top_k (all keys selected, the dense
        # kernels), so the sparse decode's first steps would load its kernels and capture its CUDA graph in the timing
        _decode_steps(lc, ctx, gen[:WARM_DECODES])
        prefill_perf = lc.llama_perf_context(ctx)
        # llama.cpp's counters, and the patch's host timing with them: the timed decode steps only
        lc.llama_perf_context_reset(ctx)
        decode_s = _decode_steps(lc, ctx, gen)
        cpu_at_decode = host_cpu.where()                   # the host CPU (and NUMA node) of the timed decode
        perf = lc.llama_perf_context(ctx)
    finally:
        with capture_log(lc) as close_log:   # the host timing is logged when the context is freed
            llm.close()
            del llm
            gc.collect()
    return {"threads": threads, "load_s": load_s, "kv": kv, "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_perf": prefill_perf, "perf": perf, "host_cpu": cpu_at_decode, "close_log": "".join(close_log)}


def run_one(lc, path: Path, ctx_len: int, attn: str, o: BenchOptions, fi: FileInfo, variant: str | None = None,
            flash_attn: bool | None = None) -> dict:
    """One (ctx, attn) run; flash_attn None: --flash-attn's setting."""
    fa = o.flash_attn if flash_attn is None else flash_attn
    with _patch_switch("LLAMA_DSA_HOST_TIMING", "1"):   # the patch times the host part of every ubatch
        m = _timed_context(lc, path, ctx_len, attn, o, fi, fa)
    indexer_only_s = None
    if attn == "sparse" and o.indexer_share:   # a second context: the same steps, the selection computed, dense attention
        with _patch_switch("LLAMA_DSA_INDEXER_ONLY", "1"):
            indexer_only_s = _timed_context(lc, path, ctx_len, attn, o, fi, fa)["decode_s"]
    kv, perf, pre = m["kv"], m["perf"], m["prefill_perf"]
    prefill_s, decode_s = m["prefill_s"], m["decode_s"]
    host_us = parse_host_timing(m["close_log"])
    if not kv.found:
        raise DsaError("llama.cpp logged no KV-cache size (log format changed?)")
    eff_k = None if attn == "dense" else fi.top_k
    return {
        "ctx": ctx_len, "gen": o.gen, "attn": attn, "top_k": eff_k,
        "indexer_layers": None if attn == "dense" else fi.indexer_layers,
        "sparse_active": bool(eff_k is not None and ctx_len + o.gen > eff_k),
        "mode_log": kv.sparse_line,
        "prefill_tokens": ctx_len, "prefill_s": round(prefill_s, 4),
        "prefill_tok_s": round(ctx_len / prefill_s, 2),
        "decode_tokens": o.gen, "decode_s": round(decode_s, 4),
        "indexer_only_decode_s": None if indexer_only_s is None else round(indexer_only_s, 4),
        "decode_tok_s": round(o.gen / decode_s, 2), "decode_ms_per_tok": round(1000 * decode_s / o.gen, 3),
        "host_us_per_decode_token": host_us,
        "llama_perf_ms": {"prefill": round(pre.t_p_eval_ms, 2), "decode": round(perf.t_eval_ms, 2),
                          "n_prefill": pre.n_p_eval, "n_decode": perf.n_eval, "n_graphs_reused": perf.n_reused},
        **kv.report(),
        "kv_type": o.kv, "index_keys": fi.index_keys[attn],
        "kv_buffers": kv.kv_buffers, "compute_buffers": kv.compute_buffers,
        "device": _device(lc, o.n_gpu_layers, kv), "n_gpu_layers": o.n_gpu_layers,
        "flash_attn": fa, "batch": o.batch, "threads": m["threads"], "load_s": round(m["load_s"], 3),
        "process_peak_rss_mib": round(peak_rss_mib(), 1),
        "variant": variant, "pid": os.getpid(), "host_cpu": m["host_cpu"],
        "llama_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_ENV)},
        "file": str(path),
    }


def _parse_timing_line(log: str, name: str, fields: tuple[str, ...]) -> dict | None:
    """The patch's `NAME: n=N F_us=V ...` line (the fields in that order) as {"n": N, F: V, ...}; None if absent."""
    m = re.search(rf"{name}: n=(\d+) " + " ".join(rf"{f}_us=([\d.]+)" for f in fields), log)
    if not m:
        return None
    return {"n": int(m.group(1)), **{f: float(v) for f, v in zip(fields, m.groups()[1:])}}


def parse_host_timing(log: str) -> dict | None:
    """The patch's LLAMA_DSA_HOST_TIMING line: mean host µs per single-token decode spent in cache apply + graph
    build/reuse (`graph`), writing the inputs (`inputs`: masks, positions, indices) and launching the graph (`launch`,
    asynchronous); None if the runtime did not log it (a stock build)."""
    return _parse_timing_line(log, "dsa_host_timing", ("graph", "inputs", "launch"))


def parse_host_timing_prefill(log: str) -> dict | None:
    """The patch's LLAMA_DSA_HOST_TIMING line for multi-token ubatches: mean µs per ubatch waiting for the previous
    ubatch's GPU work (`wait`), in cache apply + graph build (`graph`), writing the inputs (`inputs`) and in the input
    copies + kernel launches (`launch`); None if the runtime did not log it."""
    return _parse_timing_line(log, "dsa_host_timing_prefill", ("wait", "graph", "inputs", "launch"))


def bench(path: Path, o: BenchOptions) -> list[dict]:
    """Runs every ctx x attn pair; a failed run becomes a row with `error` (the sweep goes on)."""
    from ..backend.runtime import import_llama_cpp

    fi = validate(Path(path), o)
    if o.cpus is not None:
        host_cpu.pin(o.cpus)                  # before any run: variant processes inherit it
    lc = import_llama_cpp()
    rows: list[dict] = []
    dense_fa = dense_flash_attn_settings(o)
    runs = []
    for c in o.ctx:                        # each ctx's variant runs right after its plain ones
        for a in o.attn:
            runs += [(c, a, None, fa) for fa in (dense_fa if a == "dense" else [o.flash_attn])]
        runs += [(c, "sparse", v, o.flash_attn) for v in o.variants]
    mixed_fa = len({fa for *_, fa in runs}) > 1
    with task("bench", len(runs), quiet=o.quiet) as bar:
        for c, a, v, fa in runs:
            label = f"ctx {c} {a}" + (f" fa {fa_label(fa)}" if mixed_fa else "") + (f" [{v}]" if v else "")
            try:
                rows.append(_run_variant(Path(path), c, o, fi, v) if v else
                            run_one(lc, Path(path), c, a, o, fi, flash_attn=fa))
                info = f"{label}: {rows[-1]['decode_tok_s']:.1f} tok/s decode"
            except (DsaError, RuntimeError, MemoryError) as e:
                rows.append({"ctx": c, "attn": a, "variant": v, "flash_attn": fa,
                             "error": str(e).splitlines()[0] if str(e) else repr(e)})
                info = f"{label}: failed"
            if o.jsonl is not None:
                with open(o.jsonl, "a", encoding="utf-8") as f:
                    f.write(json.dumps(rows[-1], default=str) + "\n")
            bar.advance(1, info=info)
    add_indexer_share(rows)
    add_ratios(rows)
    return rows
