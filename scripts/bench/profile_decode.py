#!/usr/bin/env python3
"""Where a decoded token's time goes on CUDA: per-kernel GPU time of a few decode steps at a given context.

    # wall time per decoded token (no profiler), sparse and dense:
    python scripts/bench/profile_decode.py FILE.gguf --ctx 32768 --gen 16
    # the same decode steps under Nsight Compute, one metric (gpu__time_duration), profiling only the decode:
    # (--cache-control none: without it ncu flushes the caches before every kernel, which inflates the small ones)
    ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
        --print-units base --log-file k.csv python scripts/bench/profile_decode.py FILE.gguf --ctx 32768 --gen 2 --attn sparse --profile
    python scripts/bench/profile_decode.py --summary k.csv --gen 2          # per-kernel table, µs per token
    # the same for one prefill ubatch (the last --batch tokens of the context), --gen 1 in the summary:
    ... profile_decode.py FILE.gguf --ctx 32768 --what prefill --attn sparse --profile

The context is filled the way `dsa bench` fills it (random token ids in batches of --batch, flash attention
on, all layers on the GPU), then --gen single-token decodes run, each followed by llama_synchronize. With
--profile the decode steps are bracketed by cuProfilerStart/Stop (libcuda), so a profiler started with
`--profile-from-start off` sees only them. The summary groups kernels by name and divides by --gen; the
difference between the wall time per token and the GPU-time sum is host work plus launch gaps.
In --what prefill without --profile the context is created with the patch's LLAMA_DSA_HOST_TIMING=1 and the row gets
`host_us_per_fill_ubatch`: per prefill ubatch (the fill's and the measured one), the wait for the previous ubatch's
GPU work, the graph build, the inputs written and the input copies + kernel launches (docs/PATCH.md).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import gc
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _cuda_profiler():
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
            return lib.cuProfilerStart, lib.cuProfilerStop
        except OSError:
            continue
    raise SystemExit("error: libcuda not found (--profile needs the CUDA driver)")


@contextlib.contextmanager
def _profiled(on: bool):
    """cuProfilerStart/Stop around the block (a profiler started with --profile-from-start off sees only it)."""
    if not on:
        yield
        return
    start, stop = _cuda_profiler()
    start()
    try:
        yield
    finally:
        stop()


def run(a) -> None:
    import llama_cpp as lc                                           # before numpy / torch (CUDA init order)
    import numpy as np
    from dsa_convert.backend.llama_log import capture_log
    from dsa_convert.backend.llama_runner import RunnerOptions, open_model
    from dsa_convert.eval import bench

    o = bench.BenchOptions(ctx=[a.ctx], gen=a.gen, attn=a.attn.split(","), kv=a.kv, batch=a.batch, force=True)
    fi = bench.validate(Path(a.file), o)
    rows = []
    for attn in o.attn:
        ropts = RunnerOptions(n_ctx=a.ctx + 2 * a.gen + 8, n_batch=a.batch, n_gpu_layers=999, flash_attn=True,
                              kv_type=a.kv, kv_overrides=fi.overrides[attn], logits_all=False)
        # prefill without the profiler: the patch's host timing (read when the context is created; each prefill
        # ubatch then waits for the previous one's GPU work first, so the fill is slower than a plain one)
        timing = a.what == "prefill" and not a.profile
        with bench._patch_switch("LLAMA_DSA_HOST_TIMING", "1") if timing else contextlib.nullcontext():
            llm = open_model(Path(a.file), ropts)
        try:
            ctx = llm.ctx
            rng = np.random.default_rng(a.ctx)
            prompt = rng.integers(3, llm.n_vocab(), size=a.ctx, dtype=np.int32)
            gen = rng.integers(3, llm.n_vocab(), size=2 * a.gen, dtype=np.int32)
            if a.what == "prefill":      # the last ubatch of the prefill is the measured (profiled) step
                t_fill = bench._prefill(lc, ctx, prompt[:-a.batch], a.batch)
                with _profiled(a.profile):
                    dt = bench._prefill(lc, ctx, prompt[-a.batch:], a.batch)
                rows.append({"attn": attn, "ctx": a.ctx, "what": "prefill", "prefill_s": round(t_fill, 3),
                             "last_ubatch_ms": round(1000 * dt, 3), "ubatch": a.batch})
                continue
            t_fill = bench._prefill(lc, ctx, prompt, a.batch)
            bench._decode_steps(lc, ctx, gen[:a.gen])                  # warm-up: graph reuse, CUDA graphs
            with _profiled(a.profile):
                dt = bench._decode_steps(lc, ctx, gen[a.gen:])
            rows.append({"attn": attn, "ctx": a.ctx, "what": "decode", "gen": a.gen, "prefill_s": round(t_fill, 3),
                         "decode_ms_per_tok": round(1000 * dt / a.gen, 3),
                         "n_graphs_reused": lc.llama_perf_context(ctx).n_reused})
        finally:   # (also after the prefill branch's `continue`)
            with capture_log(lc) as close_log:   # the patch logs its host timing when the context is freed
                llm.close()
                del llm, ctx
                gc.collect()
            host = bench.parse_host_timing_prefill("".join(close_log))
            if a.what == "prefill" and host and rows:   # µs per fill ubatch: GPU wait, graph, inputs, copies + launches
                rows[-1]["host_us_per_fill_ubatch"] = host
    print(json.dumps(rows))


def _short(name: str) -> str:
    name = re.sub(r"\(.*", "", name)                 # drop the argument list
    name = re.sub(r"^void ", "", name)
    return name[:90]


def summary(path: Path, gen: int) -> None:
    text = path.read_text(errors="replace")
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit(f"error: {path}: no ncu CSV header found")
    per = defaultdict(lambda: [0, 0.0])
    for r in csv.DictReader(text[start:].splitlines()):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "ns")
        us = v / 1000.0 if unit in ("ns", "nsecond") else v * 1000.0 if unit in ("ms", "msecond") else v
        k = _short(r["Kernel Name"])
        per[k][0] += 1
        per[k][1] += us
    total = sum(t for _, t in per.values())
    print(f"{'kernel':90s} {'n/tok':>7s} {'us/tok':>9s} {'share':>6s}")
    for k, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"{k:90s} {n / gen:7.1f} {t / gen:9.1f} {100 * t / total:5.1f}%")
    print(f"{'TOTAL GPU time per token':90s} {sum(n for n, _ in per.values()) / gen:7.1f} {total / gen:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", nargs="?")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--attn", default="sparse,dense")
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--what", choices=("decode", "prefill"), default="decode",
                    help="prefill: measure (profile) the last --batch-token ubatch of the context fill instead")
    ap.add_argument("--profile", action="store_true", help="bracket the measured decode with cuProfilerStart/Stop")
    ap.add_argument("--summary", type=Path, help="summarize an ncu --csv log instead of running")
    a = ap.parse_args()
    if a.summary:
        summary(a.summary, a.gen)
    elif a.file:
        run(a)
    else:
        ap.error("give FILE or --summary")


if __name__ == "__main__":
    main()
