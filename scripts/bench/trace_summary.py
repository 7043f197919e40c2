#!/usr/bin/env python3
"""Summarise a kernel timeline written by scripts/gpu/cuda/kernel_trace.c (a CUPTI injection library).

    python3 scripts/bench/trace_summary.py trace.csv [--names sparse,dense] [--layer-rows 60] [--chain A,B] [--follow A,B]
                                     [--beside NAME]

Per window (one `cuProfilerStart/Stop` bracket of scripts/bench/profile_decode.py --profile: one per --attn mode) the
kernels are grouped into graph launches (the correlation id all kernels of one launch share); the launches of
the most common size are the decoded tokens. Per token: span (first kernel start to last kernel end), busy (time
with at least one kernel running), idle = span - busy (launch gaps, waits between streams), kernels and the sum
of their durations (above busy where streams overlap). Per kernel name, µs per token: the summed duration, the
*charged* time and the idle gap just before it starts; charged + gap over all names = span. Then the first --layer-rows kernels of the middle token in
start order (offset from the token's start, duration, stream), which show one layer's chain.
A kernel launched with programmatic dependent launch starts (and is timed) while its predecessor still runs, so
its duration includes that wait; the *charged* time gives each instant to the running kernel that ends first.
"""
from __future__ import annotations

import argparse
import csv
import re
import shutil
import statistics
import subprocess
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Rec:
    kind: str
    start: int
    end: int
    stream: int
    corr: int
    node: int
    grid: int
    block: int
    name: str


def _demangle(names: list[str]) -> dict[str, str]:
    out = {n: n for n in names}
    mangled = [n for n in names if n.startswith("_Z")]
    if mangled and shutil.which("c++filt"):
        res = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True)
        for m, d in zip(mangled, res.stdout.splitlines()):
            out[m] = d
    return out


def short_name(full: str) -> str:
    """The function name with its leading template arguments kept short (kernel<16, 24> -> kernel<16,24>)."""
    s = re.sub(r"\(.*$", "", full)                    # parameter list
    s = re.sub(r"^(void|static|__global__)\s+", "", s)
    m = re.match(r"([\w:~]+)(<.*>)?", s)
    if not m:
        return full[:60]
    base = m.group(1).split("::")[-1]
    targs = m.group(2) or ""
    targs = re.sub(r"\(\w+\)", "", targs)            # (ggml_type)1 -> 1
    targs = re.sub(r"\s+", "", targs)
    if len(targs) > 40:
        targs = targs[:37] + "..>"
    return base + targs


def load(path: Path) -> tuple[list[tuple[int, int]], list[Rec]]:
    windows: list[tuple[int, int]] = []
    recs: list[Rec] = []
    with path.open(newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "window":
                windows.append((int(row[2]), int(row[3])))
                continue
            kind, start, end, stream, corr, node, grid, block = row[:8]
            name = ",".join(row[8:])
            recs.append(Rec(kind, int(start), int(end), int(stream), int(corr), int(node), int(grid), int(block),
                            name))
    names = _demangle(sorted({r.name for r in recs if r.kind == "K"}))
    for r in recs:
        if r.kind == "K":
            r.name = short_name(names.get(r.name, r.name))
        elif r.kind == "S":
            r.name = f"[memset {r.name} B]"
        else:
            r.name = f"[memcpy {r.name} B]"
    windows.sort()
    recs.sort(key=lambda r: r.start)
    return windows, recs


def attribute(tok: list[Rec]) -> tuple[dict[str, float], dict[str, float]]:
    """Per name: the ns it is charged (each instant goes to the running record that ends first: with programmatic
    dependent launch a kernel starts early and waits for its predecessor, which is what the GPU runs meanwhile) and
    the idle ns just before it starts. The two sum to the token's span."""
    events = sorted({r.start for r in tok} | {r.end for r in tok})
    charged: dict[str, float] = defaultdict(float)
    gap_before: dict[str, float] = defaultdict(float)
    for a, b in zip(events, events[1:]):
        running = [r for r in tok if r.start <= a and r.end >= b]
        if running:
            charged[min(running, key=lambda r: (r.end, r.start)).name] += b - a
        else:
            nxt = min((r for r in tok if r.start >= b), key=lambda r: r.start, default=None)
            if nxt is not None:
                gap_before[nxt.name] += b - a
    return charged, gap_before


@dataclass
class Summary:
    label: str
    n_tokens: int
    kernels_per_token: int
    others: int
    streams: list[int]
    span_us: float           # per token, means
    busy_us: float
    kernel_sum_us: float
    between_us: float        # from the end of one token's kernels to the start of the next
    rows: list[tuple[str, float, float, float, float]]   # name, n/token, duration, charged, gap before (µs/token)
    tokens: list[list[Rec]]  # each token's records in start order

    @property
    def middle(self) -> list[Rec]:
        return self.tokens[self.n_tokens // 2]


def summarise(label: str, recs: list[Rec]) -> Summary | None:
    by_corr: dict[int, list[Rec]] = defaultdict(list)
    for r in recs:
        if r.kind == "K":
            by_corr[r.corr].append(r)
    sizes: dict[int, int] = defaultdict(int)
    for g in by_corr.values():
        sizes[len(g)] += 1
    big = {s: c for s, c in sizes.items() if s >= 8}
    if not big:
        return None
    tok_size = max(big, key=lambda s: (big[s], s))   # the decode graph: the most common launch size
    toks = sorted((g for g in by_corr.values() if len(g) == tok_size), key=lambda g: g[0].start)
    extra = [r for r in recs if r.kind != "K"]       # graph memset nodes have their own correlation ids
    for g in toks:
        lo, hi = min(r.start for r in g), max(r.end for r in g)
        g.extend(r for r in extra if lo <= r.start <= hi)
        g.sort(key=lambda r: r.start)
    n = len(toks)
    spans = [max(r.end for r in g) - g[0].start for g in toks]
    between = [toks[i + 1][0].start - max(r.end for r in toks[i]) for i in range(n - 1)]
    cnt: dict[str, int] = defaultdict(int)
    dur: dict[str, float] = defaultdict(float)
    chg: dict[str, float] = defaultdict(float)
    gap: dict[str, float] = defaultdict(float)
    for g in toks:
        c, gb = attribute(g)
        for r in g:
            cnt[r.name] += 1
            dur[r.name] += r.end - r.start
        for k, v in c.items():
            chg[k] += v
        for k, v in gb.items():
            gap[k] += v
    rows = [(k, cnt[k] / n, dur[k] / n / 1e3, chg[k] / n / 1e3, gap[k] / n / 1e3) for k in cnt]
    rows.sort(key=lambda x: -(x[3] + x[4]))
    return Summary(label, n, tok_size, len(recs) - sum(len(g) for g in toks), sorted({r.stream for g in toks for r in g}),
                   sum(spans) / n / 1e3, sum(chg.values()) / n / 1e3,   # busy: every busy instant is charged once
                   sum(dur.values()) / n / 1e3,
                   sum(between) / len(between) / 1e3 if between else 0.0, rows, toks)


def pairs(s: Summary, a: str, b: str) -> list[tuple[int, Rec]]:
    """In every token, each kernel whose name contains `a` with the next kernel (in start order) whose name contains
    `b`: (the a kernel's end, the b kernel). A b kernel launched early (PDL) may start before that end."""
    out = []
    for tok in s.tokens:
        last_a = None
        for r in tok:                       # start order
            if b in r.name and last_a is not None:
                out.append((last_a, r))
                last_a = None
            if a in r.name:
                last_a = r.end
    return out


def chain(s: Summary, a: str, b: str) -> tuple[float, float] | None:
    """From the end of each kernel named *a* to the end of the next one named *b* (e.g. a layer's attention norm to its
    attention output: `rms_norm`, `combine`): (occurrences per token, mean µs per occurrence), None where b never
    follows a."""
    spans = [r.end - a_end for a_end, r in pairs(s, a, b)]
    return (len(spans) / s.n_tokens, sum(spans) / len(spans) / 1e3) if spans else None


def follow(s: Summary, a: str, b: str) -> tuple[float, float, float, float] | None:
    """The kernel named *b* after each one named *a* (e.g. the decode indexer and its top-k: `dsa_lid`, `topk`), medians
    in µs: (a's end to b's start, negative where b started early; b's duration; a's end to b's end; occurrences per
    token), None where b never follows a."""
    p = pairs(s, a, b)
    if not p:
        return None
    return (statistics.median(r.start - a_end for a_end, r in p) / 1e3, statistics.median(r.end - r.start for _, r in p) / 1e3,
            statistics.median(r.end - a_end for a_end, r in p) / 1e3, len(p) / s.n_tokens)


@dataclass
class Beside:
    """The kernels named *name*, split by whether a kernel of another stream ran during them (counts per token,
    median durations in µs; with others: the median number of such kernels and of the µs they overlap)."""
    alone: float
    alone_us: float | None
    shared: float
    shared_us: float | None
    others: float | None
    overlap_us: float | None


def beside(s: Summary, name: str) -> Beside | None:
    """Each kernel whose name contains *name* against the other streams' kernels overlapping it in time (e.g. the
    persistent top-k, whose blocks wait for each other: `topk`), None where no kernel has that name."""
    alone: list[int] = []
    shared: list[tuple[int, int, int]] = []   # duration, other kernels, overlapped ns
    for tok in s.tokens:
        for r in tok:
            if name not in r.name:
                continue
            ov = [o for o in tok if o.stream != r.stream and o.kind == "K" and o.start < r.end and o.end > r.start]
            if ov:
                shared.append((r.end - r.start, len(ov), sum(min(o.end, r.end) - max(o.start, r.start) for o in ov)))
            else:
                alone.append(r.end - r.start)
    if not alone and not shared:
        return None
    med = lambda xs: statistics.median(xs) / 1e3 if xs else None  # noqa: E731
    return Beside(len(alone) / s.n_tokens, med(alone), len(shared) / s.n_tokens, med([d for d, _, _ in shared]),
                  statistics.median(n for _, n, _ in shared) if shared else None, med([o for _, _, o in shared]))


def report(s: Summary | None, label: str, layer_rows: int, chains: list[tuple[str, str]] = (),
           follows: list[tuple[str, str]] = (), besides: list[str] = ()) -> None:
    if s is None:
        print(f"== {label}: no graph launch of 8 or more kernels")
        return
    print(f"== {s.label}: {s.n_tokens} tokens of {s.kernels_per_token} kernels each (+{s.others} other records), "
          f"streams {s.streams}")
    print(f"   span {s.span_us:8.1f} µs/token   busy {s.busy_us:8.1f}   idle {s.span_us - s.busy_us:8.1f}"
          f"   kernel sum {s.kernel_sum_us:8.1f}   between tokens {s.between_us:.1f}")
    print(f"   {'kernel':<52} {'n/tok':>6} {'dur µs':>8} {'charged':>8} {'gap bef':>8} {'sum':>8}")
    for name, n, d, c, g in s.rows:
        print(f"   {name[:52]:<52} {n:6.1f} {d:8.1f} {c:8.1f} {g:8.1f} {c + g:8.1f}")
    tc, tg = sum(r[3] for r in s.rows), sum(r[4] for r in s.rows)
    print(f"   {'total':<52} {s.kernels_per_token:6d} {s.kernel_sum_us:8.1f} {tc:8.1f} {tg:8.1f} {tc + tg:8.1f}")
    for a, b in chains:
        c = chain(s, a, b)
        print(f"   chain {a} -> {b}: " + (f"{c[1]:.2f} µs, {c[0]:.1f} times per token" if c else "never"))
    for a, b in follows:
        f = follow(s, a, b)
        print(f"   follow {a} -> {b}: " + (f"median {f[0]:.2f} µs from {a}'s end to {b}'s start, {b} {f[1]:.2f} µs, "
                                           f"{f[2]:.2f} µs end to end, {f[3]:.1f} times per token" if f else "never"))
    for name in besides:
        b = beside(s, name)
        if b is None:
            print(f"   beside {name}: never")
            continue
        line = f"   beside {name}: alone {b.alone:.1f} per token" + (f" (median {b.alone_us:.2f} µs)" if b.alone else "")
        line += f", with other streams' kernels {b.shared:.1f}"
        if b.shared:
            line += f" (median {b.shared_us:.2f} µs, {b.others:g} kernels overlapping it for {b.overlap_us:.2f} µs)"
        print(line)
    t0 = s.middle[0].start
    print(f"   -- the middle token: first {layer_rows} records (offset µs, duration µs, stream, grid x block, name)")
    for r in s.middle[:layer_rows]:
        print(f"   {(r.start - t0)/1e3:9.2f} {(r.end - r.start)/1e3:8.2f}  s{r.stream:<4d} {r.grid:>6d}x{r.block:<5d} {r.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--names", default="", help="comma-separated labels of the windows, in order (e.g. sparse,dense)")
    ap.add_argument("--layer-rows", type=int, default=60)
    ap.add_argument("--chain", action="append", default=[], metavar="A,B",
                    help="from the end of a kernel named *A* to the end of the next one named *B* (repeatable), "
                         "e.g. rms_norm,combine: a layer's attention norm to its attention output")
    ap.add_argument("--follow", action="append", default=[], metavar="A,B",
                    help="medians for the kernel named *B* after each one named *A* (repeatable): the gap from A's "
                         "end to B's start, B's duration, A's end to B's end; e.g. dsa_lid,topk")
    ap.add_argument("--beside", action="append", default=[], metavar="NAME",
                    help="the kernels named NAME alone and with other streams' kernels running during them "
                         "(repeatable; counts and median durations), e.g. topk_radix_persist")
    a = ap.parse_args()
    windows, recs = load(a.trace)
    labels = [s for s in a.names.split(",") if s]
    chains, follows = [], []
    for opt, given, into in (("--chain", a.chain, chains), ("--follow", a.follow, follows)):
        for c in given:
            if c.count(",") != 1 or "" in c.split(","):
                raise SystemExit(f"error: {opt} {c!r}: give two name parts, A,B")
            into.append(tuple(c.split(",")))
    if not windows:
        raise SystemExit(f"error: {a.trace}: no profiler window recorded (run the program with --profile)")
    for i, (ws, we) in enumerate(windows):
        inside = [r for r in recs if r.start >= ws and (we == 0 or r.start <= we)]
        label = labels[i] if i < len(labels) else f"window {i}"
        report(summarise(label, inside), label, a.layer_rows, chains, follows, a.beside)


if __name__ == "__main__":
    main()
