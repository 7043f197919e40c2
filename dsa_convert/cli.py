"""The `dsa` command line (Typer). Each command is a thin shell over a module that does the work.

Exit codes: 0 ok · 1 runtime failure · 2 usage error · 3 bad input · 130 interrupted.
Expected failures print one line `error: …` on stderr (a traceback only with --debug).
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_TERMINATED, DsaError, Terminated

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="HF checkpoint -> GGUF with sparse attention, compressed KV cache and AWQ INT4.")
backend_app = typer.Typer(no_args_is_help=True, help="Build and describe the patched llama.cpp backend.")
app.add_typer(backend_app, name="backend")

_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")):
    _state["debug"] = debug


def _fail(msg: str, code: int):
    print(f"error: {msg}", file=sys.stderr)
    raise typer.Exit(code)


def _lower(s: Optional[str]) -> Optional[str]:
    return None if s is None else s.lower()


_INDEX_KEYS_HELP = ("DSA indexer-key cache of llama.cpp: f16 (default; half the bytes of f32) | f32 (exact); "
                    "the patched llama.cpp's switch")

# the last SIGTERM / SIGINT received (set by main()'s handlers): a signal that arrives while numpy or torch
# probe an object can surface as some other exception (numpy turns errors inside __array__ probing into
# "could not determine the shape"), which must still end as "terminated" / "interrupted", not "internal error"
_signal = {"received": None}


def _exit_if_signalled() -> None:
    if _signal["received"] == "SIGTERM":
        _fail("terminated", EXIT_TERMINATED)
    if _signal["received"] == "SIGINT":
        _fail("interrupted", EXIT_INTERRUPTED)


def guarded(fn):
    """One-line errors and documented exit codes for every command."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except typer.Exit:
            raise
        except DsaError as e:
            _exit_if_signalled()
            if _state["debug"]:
                raise
            _fail(str(e).splitlines()[0] if str(e) else e.__class__.__name__, e.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted", EXIT_INTERRUPTED)
        except Terminated:
            _fail("terminated", EXIT_TERMINATED)
        except MemoryError:
            _exit_if_signalled()
            _fail("out of memory", EXIT_RUNTIME)
        except Exception as e:  # unexpected: still one line unless --debug
            _exit_if_signalled()
            if _state["debug"]:
                raise
            first = (str(e).splitlines() or [""])[0][:300]
            _fail(f"internal error: {e.__class__.__name__}: {first} (run with --debug for the traceback)", EXIT_RUNTIME)
    return wrapper


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


_RECIPE = "; default: the retrofit recipe for the device and context (docs/CLI.md)"


@app.command()
@guarded
def convert(
    model_dir: Path = typer.Argument(..., help="HuggingFace checkpoint directory"),
    out: Path = typer.Argument(..., help="output .gguf"),
    outtype: str = typer.Option("f16", help="f32 | f16 | bf16 | q8_0"),
    force: bool = typer.Option(False, "--force", help="overwrite OUT"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary on stdout"),
    no_dsa: bool = typer.Option(False, "--no-dsa", help="plain GGUF (no indexer, no ASQ)"),
    cluster_num: Optional[int] = typer.Option(None, help="ASQ prototypes per layer/KV head (enables DSA)"),
    top_k: Optional[int] = typer.Option(None, help="total keys per query (sinks + local + picks)"),
    index_heads: Optional[int] = typer.Option(None, help="indexer heads H"),
    index_dim: Optional[int] = typer.Option(None, help="indexer head dim D"),
    index_share: Optional[int] = typer.Option(None, help="an indexer every G layers; the layers between reuse its "
                                              "top-k (attention.indexer.types; default 1: every layer)"),
    index_place: Optional[str] = typer.Option(None, help="with --index-share G: search (default: train every layer's "
                                              "indexer, keep the n/G that held-out calibration NLL needs most) | "
                                              "every (layers 0, G, 2G, ...)"),
    sink: Optional[int] = typer.Option(None, help="always-attended first tokens"),
    local: Optional[int] = typer.Option(None, help="local window; omitted = chosen by calibration"),
    select: Optional[str] = typer.Option(None, help="token | block"),
    block_size: Optional[int] = typer.Option(None, help="block size for --select block"),
    residual_bits: Optional[int] = typer.Option(None, help="ASQ residual bits: 4 | 8"),
    calib: Optional[Path] = typer.Option(None, help="calibration text file"),
    calib_ctx: Optional[int] = typer.Option(None, "--calib-ctx", help="calibration context (tokens per chunk); default: "
                                            "the largest up to the model's that the time budget fits (the report says)"),
    calib_tokens: Optional[int] = typer.Option(None, "--calib-tokens", help="calibration tokens to train on" + _RECIPE),
    time_budget: Optional[float] = typer.Option(None, "--time-budget", help="seconds the retrofit may take: picks the "
                                                "calibration context and recipe (default 1800 on a CPU, 180 on a GPU; 0: none)"),
    memory_budget: Optional[float] = typer.Option(None, "--memory-budget", help="GiB the calibration activations may "
                                                  "take (default: half the free memory, on a CPU at most 1.5)"),
    steps: Optional[int] = typer.Option(None, help="indexer training steps per layer and phase" + _RECIPE),
    query_rows: Optional[int] = typer.Option(None, "--query-rows", help="query rows per training step" + _RECIPE),
    split_search: Optional[str] = typer.Option(None, "--split-search", help="full | coarse sink/local search" + _RECIPE),
    placement_search: Optional[str] = typer.Option(None, "--placement-search", help="greedy | oneshot search of "
                                                   "--index-share's full layers" + _RECIPE),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    seed: int = typer.Option(0, help="random seed"),
    allow_eval_calib: bool = typer.Option(False, "--allow-eval-calib",
                                          help="allow calibration text identical to the evaluation text"),
):
    """Convert a HuggingFace checkpoint to GGUF; any DSA option (--cluster-num, --top-k, ...) adds the sparse-attention retrofit."""
    from .convert import ConvertOptions, convert as run, dsa_config

    dsa_opts = dict(cluster_num=cluster_num, top_k=top_k, index_heads=index_heads, index_dim=index_dim,
                    index_share=index_share, index_place=index_place, sink=sink, local=local, select=select,
                    block_size=block_size, residual_bits=residual_bits, calib=calib, steps=steps, ctx=calib_ctx,
                    calib_tokens=calib_tokens, query_rows=query_rows, split_search=split_search,
                    placement_search=placement_search, time_budget=time_budget, memory_budget=memory_budget)
    wants_dsa = any(v is not None for v in dsa_opts.values())
    if no_dsa and wants_dsa:
        raise typer.BadParameter("--no-dsa cannot be combined with DSA options")
    dsa_cfg = dsa_config(dsa_opts, device, seed, allow_eval_calib) if wants_dsa else None
    res = run(ConvertOptions(model_dir, out, outtype=outtype, force=force, quiet=as_json, dsa=dsa_cfg))
    if as_json:
        emit_json(res)
    else:
        print(f"wrote {res['output']} ({res['bytes'] / 2**20:.1f} MiB, {res['tensors']} tensors, "
              f"{res['seconds']:.1f} s, peak RSS {res['peak_rss_mib']:.0f} MiB)", file=sys.stderr)


@app.command("eval")
@guarded
def eval_cmd(
    file: Path = typer.Argument(..., help="GGUF file (or, with --backend torch, a HF checkpoint dir)"),
    ppl: str = typer.Option("wikitext2", "--ppl", help="dataset name (wikitext2) or a text file"),
    needle: Optional[str] = typer.Option(None, "--needle", help="instead of perplexity, needle-in-a-haystack "
                                         "retrieval: passkey | niah | multikey (docs/CLI.md)"),
    backend: str = typer.Option("llama.cpp", help="llama.cpp | torch"),
    attn: Optional[str] = typer.Option(None, help="dense | sparse | local (| random | oracle with torch); with "
                                       "--needle a comma list, default dense,sparse"),
    kv: str = typer.Option("f16", help="KV cache: f16 | f32 | q8_0 | q4_0 (these two need --flash-attn) | asq "
                                      "(the file's ASQ prototypes, sparse runs; llama.cpp and torch)"),
    index_keys: Optional[str] = typer.Option(None, "--index-keys", help=_INDEX_KEYS_HELP),
    ctx: int = typer.Option(512, help="context length (chunk size)"),
    chunks: Optional[int] = typer.Option(None, help="evaluate only the first N chunks"),
    top_k: Optional[int] = typer.Option(None, help="override the file's top-k"),
    data: Optional[Path] = typer.Option(None, help="evaluation text file (else env DSA_WIKITEXT2 / cache)"),
    download: bool = typer.Option(False, "--download", help="download WikiText-2 if not found locally"),
    n_gpu_layers: Optional[int] = typer.Option(None, help="layers on the GPU (default: all when CUDA is present)"),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="llama.cpp CPU threads (default: the CPUs "
                                          "this process may run on, e.g. under taskset)"),
    flash_attn: Optional[bool] = typer.Option(None, "--flash-attn/--no-flash-attn",
                                              help="llama.cpp flash attention (default: off; on with --needle)"),
    tokenizer: Optional[Path] = typer.Option(None, help="HF tokenizer dir for --backend torch on a GGUF"),
    device: str = typer.Option("auto", help="torch backend device: auto | cpu | cuda"),
    seed: int = typer.Option(0, help="seed for --attn random; with --needle, the seed of the prompts"),
    kld: bool = typer.Option(False, "--kld", help="also the KL divergence from the same file run dense (perplexity)"),
    kld_base: Optional[Path] = typer.Option(None, "--kld-base", help="the KL divergence from another GGUF's logits "
                                            "instead (e.g. the F16 file a quantized one was made from; llama.cpp)"),
    lengths: Optional[str] = typer.Option(None, help="--needle: prompt lengths in tokens, answer included "
                                          "(default 4096,8192,16384,32768)"),
    depths: Optional[int] = typer.Option(None, help="--needle: needle depths, evenly spaced 0..100 % (default 10)"),
    trials: Optional[int] = typer.Option(None, help="--needle: prompts per length and depth (default 1)"),
    filler: Optional[str] = typer.Option(None, help="--needle: junk | book | PATH (default: junk for passkey, "
                                         "book otherwise)"),
    max_new: Optional[int] = typer.Option(None, "--max-new", help="--needle: answer tokens generated (default 16)"),
    plot: Optional[Path] = typer.Option(None, help="--needle: PNG heatmap (depth x length per attention mode)"),
    force: bool = typer.Option(False, "--force", help="--needle: allow lengths beyond the model's trained context"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Perplexity the way llama-perplexity computes it (chunks of --ctx, second half scored), or with --needle a
    needle-in-a-haystack retrieval grid (generated answers, exact match)."""
    from .errors import BadInputError

    if backend == "llama.cpp":
        from .backend.runtime import preload_llama_cpp
        preload_llama_cpp()     # before anything imports numpy (see preload_llama_cpp)
    from .resources import check_threads
    if backend == "torch":
        llama_only = {"--flash-attn / --no-flash-attn": flash_attn, "--n-gpu-layers": n_gpu_layers,
                      "--threads": threads, "--kld-base": kld_base}
        given = [k for k, v in llama_only.items() if v is not None]
        if given:
            raise BadInputError(f"{given[0]} is an option of --backend llama.cpp (the torch backend uses --device)")
    check_threads(threads)
    needle_only = {"--lengths": lengths, "--depths": depths, "--trials": trials, "--filler": filler,
                   "--max-new": max_new, "--plot": plot, "--force": force or None}
    if needle is not None:
        if kld or kld_base is not None:
            raise BadInputError("--kld / --kld-base are options of the perplexity mode, not of --needle")
        return _eval_needle(file, needle, backend=backend, attn=attn, kv=kv, index_keys=_lower(index_keys),
                            top_k=top_k, n_gpu_layers=n_gpu_layers, threads=threads, flash_attn=flash_attn,
                            tokenizer=tokenizer, device=device, seed=seed, as_json=as_json, lengths=lengths,
                            depths=depths, trials=trials, filler=filler, max_new=max_new, plot=plot, force=force)
    given = [k for k, v in needle_only.items() if v is not None]
    if given:
        raise BadInputError(f"{given[0]} is an option of --needle")
    flash_attn = bool(flash_attn)
    from .eval import data as evdata

    text_path = evdata.resolve(ppl, data, download)
    if backend == "llama.cpp":
        from .eval.perplexity_llamacpp import ATTN_MODES as LLAMA_ATTN
        if attn not in (None, *LLAMA_ATTN):
            raise BadInputError(f"--attn {attn} is a torch-backend baseline; llama.cpp runs {', '.join(LLAMA_ATTN)}")
        from .backend.runtime import import_llama_cpp
        from .eval.perplexity_llamacpp import LlamaPplOptions, run
        from .formats.gguf_read import GgufFile

        GgufFile(file).close()      # a bad file is bad input (exit 3) even where the backend is missing
        lc = import_llama_cpp()
        ngl = n_gpu_layers if n_gpu_layers is not None else (999 if lc.llama_supports_gpu_offload() else 0)
        res = run(file, evdata.read_eval_text(text_path),
                  LlamaPplOptions(ctx=ctx, chunks=chunks, attn=attn, top_k=top_k, kv=kv, index_keys=_lower(index_keys),
                                  n_gpu_layers=ngl, threads=threads, flash_attn=flash_attn, quiet=as_json,
                                  **({"kld": True} if kld else {}),
                                  **({"kld_base": kld_base} if kld_base is not None else {})))
    elif backend == "torch":
        from .eval.torch_backend import run_torch_eval

        if index_keys is not None and index_keys.lower() != "f32":
            raise BadInputError("--index-keys is a llama.cpp cache switch; the torch backend (kernels_ref) keeps F32 keys")
        res = run_torch_eval(file, text_path, ctx=ctx, chunks=chunks, attn=attn or "dense", kv=kv, top_k=top_k,
                             tokenizer=tokenizer, device=device, seed=seed, quiet=as_json,
                             **({"kld": True} if kld else {}))
    else:
        raise BadInputError(f"unknown --backend {backend!r} (llama.cpp or torch)")
    res["data"] = str(text_path)
    if as_json:
        res.pop("per_chunk_ppl", None)
        emit_json(res)
    else:
        from .eval.perplexity_common import summary_lines

        print("\n".join(summary_lines(res)))


def _eval_needle(file: Path, task: str, *, backend: str, as_json: bool, **kw) -> None:
    """`dsa eval --needle`: eval/needle_command.py does the work; this prints it."""
    from .eval.needle_command import NeedleCommand, render, run_command

    if kw["flash_attn"] is None:
        kw["flash_attn"] = True
    res = run_command(NeedleCommand(file, task, backend=backend, quiet=as_json, **kw))
    if as_json:
        emit_json(res)
    else:
        from rich.console import Console

        render(res, Console())


@app.command()
@guarded
def inspect(
    file: Path = typer.Argument(..., help="GGUF file"),
    as_json: bool = typer.Option(False, "--json"),
    heatmap: Optional[Path] = typer.Option(None, help="PNG: indexer selection vs dense attention"),
    text: Optional[Path] = typer.Option(None, help="text for --heatmap"),
    layer: int = typer.Option(0, help="layer for --heatmap"),
):
    """Show architecture, hyper-parameters, tokenizer, DSA keys and the tensor table."""
    from .inspect_gguf import render, summarize

    s = summarize(file)
    if heatmap is not None:
        from .dsa.heatmap import write_heatmap

        s["heatmap"] = write_heatmap(file, heatmap, text, layer)
    if as_json:
        emit_json(s)
    else:
        from rich.console import Console

        render(s, Console())


# ---- dsa quantize (dsa_convert/quant/) -------------------------------------------------------
@app.command()
@guarded
def quantize(
    inp: Path = typer.Argument(..., help="input GGUF (F16/F32/BF16 linear weights)"),
    out: Path = typer.Argument(..., help="output .gguf"),
    method: str = typer.Option("auto", help="auto | awq | rtn | gptq | search | mix. auto: gptq for q4_0, awq for "
                               "q4_1, mix for q4_k_m (RESULTS §4). gptq / search: the own writer (GPTQ / round to "
                               "nearest on its weighted grid); mix (q4_k_m): a type per tensor under --size-budget"),
    qtype: str = typer.Option("q4_0", "--type", help="q4_0 | q4_1 | q4_k_m (K-quants via llama.cpp's quantizer)"),
    group_size: Optional[int] = typer.Option(None, help="clipping groups (multiple of 32); default 32 for q4_0/q4_1 "
                                                        "(one ggml block, measured best), 128 for q4_k_m"),
    calib: Optional[Path] = typer.Option(None, help="calibration text (required for awq)"),
    samples: Optional[int] = typer.Option(None, help="calibration sequences; default 32 for awq and mix (RESULTS §4), "
                                                      "128 otherwise (rtn's imatrix, gptq, search)"),
    seq_len: int = typer.Option(512, help="tokens per calibration sequence"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    imatrix: Optional[str] = typer.Option(None, help="K-quants: 'auto' (from the calibration activations, "
                                          "AWQ-consistent), a llama-imatrix GGUF file (rescaled by the AWQ "
                                          "scales), or 'none'"),
    no_clip: bool = typer.Option(False, "--no-clip", help="AWQ scaling only, no clipping search"),
    damp: float = typer.Option(0.1, help="--method gptq: Hessian damping, a fraction of its mean diagonal"),
    no_sequential: bool = typer.Option(False, "--no-sequential", help="gptq / search: calibrate every block on "
                                       "the float model's activations (default: on the quantized model's)"),
    act_order: bool = typer.Option(False, "--act-order", help="gptq: columns by decreasing importance, grid fitted first"),
    gptq_types: str = typer.Option("all", "--gptq-types", help="gptq: all | k (the 32-weight fallbacks round to nearest)"),
    size_budget: Optional[str] = typer.Option(None, help="mix: BYTES (100MB, 96MiB) or BPW (4.9bpw) of tensor data; "
                                              "default: llama.cpp's Q4_K_M mix of the model"),
    threads: Optional[int] = typer.Option(None, help="llama-quantize threads"),
    seed: int = typer.Option(0, help="random seed (token subsets of the searches)"),
    force: bool = typer.Option(False, "--force", help="overwrite OUT"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary on stdout"),
):
    """4-bit quantization with AWQ calibration (or RTN): Q4_0/Q4_1 written here, Q4_K_M by llama.cpp."""
    from .quant.quantize import QuantOptions, quantize as run

    if group_size is None:
        group_size = 32 if qtype.lower() in ("q4_0", "q4_1") else 128
    res = run(QuantOptions(inp, out, method=method, qtype=qtype.lower(), group_size=group_size, calib=calib,
                           samples=samples, seq_len=seq_len, device=device, imatrix=imatrix, force=force,
                           quiet=as_json, clip=not no_clip, threads=threads, seed=seed, damp=damp,
                           sequential=not no_sequential, act_order=act_order, gptq_types=gptq_types,
                           size_budget=size_budget))
    if as_json:
        emit_json(res)
    else:
        print(f"wrote {res['output']} ({res['type']}, {res['method']}, {res['bytes'] / 2**20:.1f} MiB, "
              f"{res['bits_per_weight']:.2f} bpw, {res['seconds']:.1f} s, peak RSS {res['peak_rss_mib']:.0f} MiB)",
              file=sys.stderr)
# ---- end dsa quantize ------------------------------------------------------------------------


@app.command()
@guarded
def bench(
    file: Path = typer.Argument(..., help="GGUF file"),
    ctx: str = typer.Option("4096,16384,65536,131072", help="context lengths (comma-separated)"),
    gen: int = typer.Option(128, help="tokens decoded one at a time after the prefill"),
    attn: str = typer.Option("sparse,dense", help="sparse | dense | sparse,dense"),
    n_gpu_layers: int = typer.Option(999, help="layers offloaded to the GPU (CUDA builds)"),
    kv: str = typer.Option("f16", help="KV cache type of the sparse runs: f16 | q8_0 | q4_0 (need --flash-attn) | asq "
                                      "(the file's ASQ prototypes); dense runs use f16 with --kv asq"),
    index_keys: Optional[str] = typer.Option(None, "--index-keys", help=_INDEX_KEYS_HELP),
    batch: int = typer.Option(512, help="prefill batch (n_batch = n_ubatch)"),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: the CPUs this process may run on)"),
    flash_attn: bool = typer.Option(True, "--flash-attn/--no-flash-attn", help="llama.cpp flash attention"),
    dense_flash_attn: str = typer.Option("same", "--dense-flash-attn",
                                         help="flash attention of the dense runs: same (as --flash-attn) | on | off | "
                                              "both (two dense runs per ctx; sparse ÷ dense then uses the faster one "
                                              "per metric: on some CPUs the dense decode is faster without it)"),
    force: bool = typer.Option(False, "--force", help="allow --ctx beyond the model's trained context"),
    seed: int = typer.Option(0, help="seed of the random token ids"),
    plot: Optional[Path] = typer.Option(None, help="PNG: decode tok/s vs context, sparse and dense"),
    jsonl: Optional[Path] = typer.Option(None, help="append each run's JSON object to this file as it finishes"),
    variant: list[str] = typer.Option([], "--variant", help="LLAMA_DSA_NAME=VALUE: one more sparse run per ctx with "
                                                            "that patch switch set, in a process of its own: "
                                                            "LLAMA_DSA_FUSED=0, LLAMA_DSA_HOST_MASKS=1, "
                                                            "LLAMA_DSA_GATHER=never|always (repeatable; several "
                                                            "switches joined by '+', GGML_CUDA_* names too; "
                                                            "docs/PATCH.md)"),
    cpus: Optional[str] = typer.Option(None, "--cpus", help="pin the sweep to these host CPUs, e.g. 0-7 (on a GPU "
                                                            "machine its local cores: nvidia-smi topo -m); every row "
                                                            "records the CPU and NUMA node of its timed decode"),
    indexer_share: bool = typer.Option(True, "--indexer-share/--no-indexer-share",
                                       help="time the sparse runs' indexer in a second context (a second prefill)"),
    as_json: bool = typer.Option(False, "--json", help="print the list of runs as JSON"),
):
    """Prefill / decode speed and KV-cache bytes per context length, sparse vs dense (llama.cpp)."""
    from .backend.runtime import preload_llama_cpp
    preload_llama_cpp()     # before anything imports numpy (see preload_llama_cpp)
    from .eval.bench import BenchOptions, bench as run, parse_attn, parse_int_list
    from .eval.bench_summary import render, write_plot

    o = BenchOptions(ctx=parse_int_list(ctx, "--ctx"), gen=gen, attn=parse_attn(attn), n_gpu_layers=n_gpu_layers,
                     kv=kv.lower(), index_keys=_lower(index_keys), batch=batch, threads=threads,
                     flash_attn=flash_attn, dense_flash_attn=dense_flash_attn.lower(), force=force, seed=seed,
                     plot=plot, jsonl=jsonl, variants=list(variant),
                     quiet=as_json, cpus=cpus, indexer_share=indexer_share)
    rows = run(file, o)
    if plot is not None:
        write_plot(rows, plot, f"{file.name} ({rows[0].get('device', '?')}, kv {o.kv}, gen {o.gen})")
    if as_json:
        emit_json(rows)
    else:
        print(render(rows))
    failed = [r for r in rows if "error" in r]
    if failed:
        raise DsaError(f"{len(failed)} of {len(rows)} runs failed; first: ctx {failed[0]['ctx']} "
                       f"{failed[0]['attn']}: {failed[0]['error']}")


_SESSION_HELP = {
    "ctx": "context per sequence (default: the model's, at most 4096)",
    "attn": "sparse | dense | local (default: as the file says)",
    "kv": "KV cache: f16 | q8_0 | q4_0 | asq (default: asq where the file has ASQ prototypes and runs sparse, else f16)",
    "ngl": "layers offloaded to the GPU (default: all on a CUDA build)",
}


def _session(file: Path, ctx, attn, kv, top_k, n_gpu_layers, flash_attn):
    """The checked session plan; -ngl defaults to every layer where the built backend is a CUDA build (read from the
    build's record, so that `dsa serve` does not load llama.cpp itself)."""
    from .backend.runtime import build_record, current_build
    from .generate.session import SessionOptions, plan_session

    build = current_build()
    offload = build is not None and bool(build_record(build).get("cuda"))
    return plan_session(file, SessionOptions(ctx=ctx, attn=_lower(attn), kv=kv, top_k=top_k,
                                             n_gpu_layers=n_gpu_layers, flash_attn=flash_attn), offload)


@app.command("run")
@guarded
def run_cmd(
    file: Path = typer.Argument(..., help="GGUF file"),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="the prompt"),
    prompt_file: Optional[Path] = typer.Option(None, "-f", "--file", help="read the prompt from this file"),
    chat: bool = typer.Option(False, "--chat", help="the prompt is a user turn: format it with the file's chat template"),
    system: Optional[str] = typer.Option(None, "--system", help="with --chat: a system turn before the prompt"),
    n_predict: int = typer.Option(128, "-n", "--n-predict", help="tokens to generate at most"),
    ctx: Optional[int] = typer.Option(None, "--ctx", help=_SESSION_HELP["ctx"]),
    attn: Optional[str] = typer.Option(None, "--attn", help=_SESSION_HELP["attn"]),
    kv: Optional[str] = typer.Option(None, "--kv", help=_SESSION_HELP["kv"]),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="override the file's indexer top-k"),
    temp: float = typer.Option(0.8, "--temp", help="sampling temperature; 0 = greedy"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampling seed (default: random, reported)"),
    n_gpu_layers: Optional[int] = typer.Option(None, "--n-gpu-layers", "-ngl", help=_SESSION_HELP["ngl"]),
    flash_attn: bool = typer.Option(True, "--flash-attn/--no-flash-attn"),
    threads: Optional[int] = typer.Option(None, "--threads", "-t",
                                          help="CPU threads (default: the CPUs this process may run on)"),
    as_json: bool = typer.Option(False, "--json", help="print the whole result as JSON instead of streaming"),
):
    """Generate a completion: the text streams to stdout, a one-line stats footer goes to stderr."""
    from .backend.runtime import preload_llama_cpp
    preload_llama_cpp()     # before anything imports numpy (see preload_llama_cpp)
    from .generate.complete import RunOptions, check_run_options, complete, read_prompt, stats_line

    o = RunOptions(prompt=read_prompt(prompt, prompt_file), n_predict=n_predict, temp=temp, seed=seed, threads=threads,
                   chat=chat, system=system)
    check_run_options(o)
    plan = _session(file, ctx, attn, kv, top_k, n_gpu_layers, flash_attn)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    r = complete(plan, o, None if as_json else stream)
    if as_json:
        emit_json(r)
        return
    if sys.stdout.isatty():
        sys.stdout.write("\n")
    print(stats_line(r), file=sys.stderr)


@app.command("serve")
@guarded
def serve_cmd(
    file: Path = typer.Argument(..., help="GGUF file"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (default: loopback only)"),
    port: int = typer.Option(8080, "--port"),
    ctx: Optional[int] = typer.Option(None, "--ctx", help=_SESSION_HELP["ctx"] + ", for each slot"),
    parallel: int = typer.Option(1, "--parallel", "-np", help="server slots (concurrent requests)"),
    attn: Optional[str] = typer.Option(None, "--attn", help=_SESSION_HELP["attn"]),
    kv: Optional[str] = typer.Option(None, "--kv", help=_SESSION_HELP["kv"]),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="override the file's indexer top-k"),
    n_gpu_layers: Optional[int] = typer.Option(None, "--n-gpu-layers", "-ngl", help=_SESSION_HELP["ngl"]),
    flash_attn: bool = typer.Option(True, "--flash-attn/--no-flash-attn"),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="CPU threads (default: llama-server's)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="llama.cpp's load log too (the sparse attention "
                                 "and KV cache lines; -lv 4, which also logs every request in detail)"),
):
    """Serve the file with the patched llama-server (OpenAI-compatible API); prints the base URL when it is ready."""
    from .generate.server import ServeOptions, check_serve_options, serve

    o = ServeOptions(host=host, port=port, parallel=parallel, threads=threads, verbose=verbose)
    check_serve_options(o)
    plan = _session(file, ctx, attn, kv, top_k, n_gpu_layers, flash_attn)
    rc = serve(plan, o, lambda m: print(m, file=sys.stderr, flush=True))
    raise typer.Exit(rc)


@backend_app.command("build")
@guarded
def backend_build(cuda: bool = typer.Option(False, "--cuda", help="build with CUDA (sm_90 by default)"),
                  cuda_arch: str = typer.Option("90", help="CMAKE_CUDA_ARCHITECTURES"),
                  sdist: Optional[Path] = typer.Option(None, help="llama-cpp-python sdist (else cache or PyPI)"),
                  amx: bool = typer.Option(False, "--amx", help="keep ggml's AMX CPU weight buffers (off: they crash on some VMs)"),
                  cmake_arg: list[str] = typer.Option([], "--cmake-arg", help="extra CMake argument (repeatable)"),
                  no_build_isolation: bool = typer.Option(False, "--no-build-isolation",
                                                          help="offline: use the installed scikit-build-core"),
                  op_tests: bool = typer.Option(False, "--op-tests", help="also build llama.cpp's test-backend-ops "
                                                "into the build's bin/ (checks every backend's ops against the CPU)"),
                  as_json: bool = typer.Option(False, "--json", help="print the build's metadata as JSON")):
    """Build llama-cpp-python from its sdist with patches/llama.cpp/*.patch (cached by patch hash)."""
    from .backend.build import BuildConfig, BuildError, build
    from .backend.runtime import build_record

    try:
        cfg = BuildConfig(cuda=cuda, cuda_arch=cuda_arch, sdist=sdist, amx=amx, extra_cmake_args=list(cmake_arg),
                          build_isolation=not no_build_isolation, op_tests=op_tests)
        out = build(cfg, say=lambda m: print(m, file=sys.stderr))
    except BuildError as e:
        raise DsaError(str(e)) from None
    if as_json:
        emit_json({"build_dir": str(out), **build_record(out)})
    else:
        print(out)


@backend_app.command("info")
@guarded
def backend_info(as_json: bool = typer.Option(False, "--json")):
    """Version, patch hash, CPU/CUDA and whether sparse attention is compiled in."""
    from .backend.runtime import backend_info as info

    d = info()
    if as_json:
        emit_json(d)
    else:
        for k, v in d.items():
            print(f"{k}: {v}")
        if d.get("installed") and not d.get("patch_up_to_date", True):
            print("the installed backend is not this repository's patched build: run `dsa backend build` "
                  "(a cached build is reinstalled without recompiling)")


# ---- pipeline (CI batch runs) -------------------------------------------------------------------
pipeline_app = typer.Typer(no_args_is_help=True, help="Batch convert → quantize → eval from a TOML file.")
app.add_typer(pipeline_app, name="pipeline")


@pipeline_app.command("run")
@guarded
def pipeline_run(
    file: Path = typer.Argument(..., help="pipeline TOML (format: docs/CLI.md)"),
    as_json: bool = typer.Option(False, "--json", help="print summary.json on stdout"),
    keep_going: bool = typer.Option(False, "--keep-going", help="after a failure, continue with the other models"),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="outputs + summary (default: [pipeline] workdir)"),
):
    """Run every model's steps in order, skipping steps whose inputs and options are unchanged."""
    from .pipeline import run as run_pipeline

    summary = run_pipeline(file, workdir=workdir, keep_going=keep_going)
    if as_json:
        emit_json(summary)
    else:
        c = summary["counts"]
        print(f"pipeline {summary['name']}: {c['ok']} ok, {c['skipped']} skipped, {c['failed']} failed, "
              f"{c['not-run']} not run ({summary['seconds']:.1f} s) -> {summary['summary_md']}", file=sys.stderr)
    if not summary["ok"]:
        failed = next((s for s in summary["steps"] if s["status"] == "failed"), None)
        where = f"{failed['model']}/{failed['step']}: {failed['error']}" if failed else "see summary"
        print(f"error: pipeline failed at {where}", file=sys.stderr)
        raise typer.Exit(summary["exit_code"])
# ---- end pipeline ---------------------------------------------------------------------------------


def _on_sigterm(signum, frame):
    _signal["received"] = "SIGTERM"
    raise Terminated()


def _on_sigint(signum, frame):
    _signal["received"] = "SIGINT"
    raise KeyboardInterrupt()


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, _on_sigterm)   # batch schedulers stop jobs with SIGTERM: clean up like Ctrl-C
    # a job started in the background by a non-interactive shell inherits SIGINT as *ignored*;
    # an explicit SIGINT must still interrupt (and clean up) a conversion
    signal.signal(signal.SIGINT, _on_sigint)
    app()


if __name__ == "__main__":
    main()
