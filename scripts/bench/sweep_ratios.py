#!/usr/bin/env python3
"""Same-run sparse ÷ dense decode ratios across many `dsa bench` sweeps, and their median per file and context.

Issue 6 judges speed by the decode tok/s ratio of a sparse row to the dense row of the same context in the same
sweep; one sweep moves by a few per cent with the dense row's host time, so a goal is judged over several sweeps.
This reads `dsa bench --jsonl` files (or docs/data/speed-*.jsonl, whose rows carry a `source` tag), pairs the rows
and prints each sweep's ratios, then per (model file, ctx): the count, the median, the range and how many sweeps meet
the goal.

    python3 scripts/bench/sweep_ratios.py docs/data/speed-h200-2026-12-0[23]-r*.jsonl --match share2 [--sweeps]
        [--goal 65536=1.7 --goal 131072=2.5] [--source 'r29|r30'] [--markdown]

Pairing, in each file's order, within one group (the row's `source` tag and model file; a file without tags is one
group per model file): plain sparse rows wait for the next dense row of their ctx (a bench runs sparse, then dense,
per ctx); a variant row (`--variant`, written after the dense row) pairs with the last dense row of its ctx. Rows
with an `error` and sparse rows that never meet a dense row are left out (counted in the footer).
GPU-side ratio: the same with each row's host µs per decoded token (graph + inputs + launch) taken off its ms/token.

--floor CTX (a short context run in the same sweeps, e.g. `dsa bench --ctx 1024,65536,131072`): the dense row at CTX
is the shape's attention-free token (weights, norms, launches; its cache is negligible). Per longer ctx it adds the
bound, floor tok/s ÷ dense tok/s (the ratio a sparse path whose attention cost nothing would reach), and sparse tok/s ÷
floor tok/s (how close the sparse token comes to that).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dsa_convert.errors import DsaError  # noqa: E402
from dsa_convert.eval.bench_summary import read_jsonl  # noqa: E402

DEFAULT_GOALS = {65536: 1.7, 131072: 2.5}   # issue 6's decode goals


@dataclass
class Pair:
    group: str
    model: str
    ctx: int
    variant: str | None
    sparse: dict
    dense: dict
    floor: dict | None = None         # the dense row at --floor CTX of the same group and model

    @property
    def bound(self) -> float | None:
        return None if self.floor is None else self.floor["decode_tok_s"] / self.dense["decode_tok_s"]

    @property
    def of_floor(self) -> float | None:
        return None if self.floor is None else self.sparse["decode_tok_s"] / self.floor["decode_tok_s"]

    @property
    def decode(self) -> float:
        return self.sparse["decode_tok_s"] / self.dense["decode_tok_s"]

    @property
    def prefill(self) -> float:
        return self.sparse["prefill_tok_s"] / self.dense["prefill_tok_s"]

    @property
    def gpu_side(self) -> float | None:
        s, d = gpu_ms(self.sparse), gpu_ms(self.dense)
        return None if s is None or d is None or s <= 0 else d / s


def gpu_ms(row: dict) -> float | None:
    h = row.get("host_us_per_decode_token")
    ms = row.get("decode_ms_per_tok")
    if not h or ms is None:
        return None
    return ms - sum(h.get(k, 0.0) for k in ("graph", "inputs", "launch")) / 1000


def pair_rows(rows: list[dict], where: str = "") -> tuple[list[Pair], int]:
    """(pairs, rows left unpaired) for the rows of one file, in order."""
    pairs: list[Pair] = []
    pending: dict[tuple, list[dict]] = {}
    last_dense: dict[tuple, dict] = {}
    orphan_variants = 0
    for r in rows:
        if "error" in r or "ctx" not in r or r.get("attn") not in ("sparse", "dense"):
            continue
        model = Path(str(r.get("file", "?"))).stem
        group = r.get("source") or where
        key = (group, model, r["ctx"])
        if r["attn"] == "dense":
            for s in pending.pop(key, []):
                pairs.append(Pair(group, model, r["ctx"], None, s, r))
            last_dense[key] = r
        elif r.get("variant"):
            d = last_dense.get(key)
            if d is not None:
                pairs.append(Pair(group, model, r["ctx"], r["variant"], r, d))
            else:
                orphan_variants += 1
        else:
            pending.setdefault(key, []).append(r)
    return pairs, orphan_variants + sum(len(v) for v in pending.values())


def attach_floor(pairs: list[Pair], floor_ctx: int) -> list[Pair]:
    """The pairs of the other contexts, each given the dense row at floor_ctx of its sweep (group and model); pairs
    whose sweep has no floor row keep floor None."""
    floors = {(p.group, p.model): p.dense for p in pairs if p.ctx == floor_ctx and p.variant is None}
    out = [p for p in pairs if p.ctx != floor_ctx]
    for p in out:
        p.floor = floors.get((p.group, p.model))
    return out


def _median(xs: list) -> float | None:
    """The median of the values that are not None; None when there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def summarize(pairs: list[Pair], goals: dict[int, float]) -> list[dict]:
    out = []
    for model, ctx in sorted({(p.model, p.ctx) for p in pairs if p.variant is None}):
        ps = [p for p in pairs if p.model == model and p.ctx == ctx and p.variant is None]
        dec = [p.decode for p in ps]
        goal = goals.get(ctx)
        out.append({"model": model, "ctx": ctx, "n": len(ps), "decode": dec, "median": statistics.median(dec),
                    "gpu_median": _median([p.gpu_side for p in ps]),
                    "prefill_median": statistics.median(p.prefill for p in ps), "goal": goal,
                    "bound_median": _median([p.bound for p in ps]), "of_floor": [p.of_floor for p in ps],
                    "meets": None if goal is None else sum(d >= goal for d in dec)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="dsa bench --jsonl files")
    ap.add_argument("--match", help="only rows whose model file name contains this")
    ap.add_argument("--source", help="only rows whose source tag matches this regular expression")
    ap.add_argument("--goal", action="append", default=[], metavar="CTX=RATIO",
                    help="decode goal per ctx (default 65536=1.7 and 131072=2.5, issue 6)")
    ap.add_argument("--floor", type=int, metavar="CTX",
                    help="the short context whose dense row is the attention-free token (adds the bound and "
                         "sparse ÷ floor per longer ctx)")
    ap.add_argument("--sweeps", action="store_true", help="print every pair too")
    ap.add_argument("--markdown", action="store_true", help="the summary as a markdown table")
    a = ap.parse_args(argv)
    goals = dict(DEFAULT_GOALS) if not a.goal else {}
    for g in a.goal:
        m = re.fullmatch(r"(\d+)=([0-9.]+)", g)
        if not m:
            ap.error(f"--goal {g!r}: expected CTX=RATIO, e.g. 131072=2.5")
        goals[int(m[1])] = float(m[2])
    try:
        src = re.compile(a.source) if a.source else None
    except re.error as e:
        ap.error(f"--source: {e}")
    pairs, unpaired = [], 0
    for f in a.files:
        if not f.is_file():
            ap.error(f"no such file: {f}")
        try:
            rows = [r for r in read_jsonl(f)
                    if (a.match is None or a.match in str(r.get("file", "")))
                    and (src is None or src.search(str(r.get("source", ""))))]
        except DsaError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        p, u = pair_rows(rows, where=f.name)
        pairs += p
        unpaired += u
    if a.floor is not None:
        pairs = attach_floor(pairs, a.floor)
        if not any(p.floor for p in pairs):
            print(f"--floor {a.floor}: no sweep has a dense row at that ctx beside a longer one", file=sys.stderr)
            return 1
    if not pairs:
        print("no sparse row with a dense row of its ctx in the same sweep", file=sys.stderr)
        return 1
    if a.sweeps:
        for p in pairs:
            g = p.gpu_side
            print(f"{p.group[:60]:<60} {p.model:<22} {p.ctx:>7} {p.sparse['decode_tok_s']:>8.2f} "
                  f"{p.dense['decode_tok_s']:>8.2f}  decode {p.decode:.2f}×  GPU-side "
                  f"{'—' if g is None else f'{g:.2f}×'}  prefill {p.prefill:.2f}×"
                  + (f"  bound {p.bound:.2f}×  sparse ÷ floor {p.of_floor:.2f}" if p.floor else "")
                  + (f"  [{p.variant}]" if p.variant else ""))
        print()
    rows = summarize(pairs, goals)
    fl = a.floor is not None
    if a.markdown:
        print("| model, ctx | sweeps | decode ratios (sorted) | **median** | GPU-side median | prefill median | ≥ goal |"
              + (" bound median | sparse ÷ floor |" if fl else ""))
        print("|---|---:|---|---:|---:|---:|---|" + ("---:|---|" if fl else ""))
    for s in rows:
        vals = " ".join(f"{d:.2f}" for d in sorted(s["decode"]))
        gm = _fmt(s["gpu_median"])
        meets = "—" if s["goal"] is None else f"{s['meets']} of {s['n']} (goal {s['goal']})"
        bm = _fmt(s["bound_median"])
        of = " ".join(f"{x:.2f}" for x in sorted(x for x in s["of_floor"] if x is not None)) or "—"
        if a.markdown:
            print(f"| {s['model']}, {s['ctx'] // 1024}K | {s['n']} | {vals} | **{s['median']:.2f}** | {gm} | "
                  f"{s['prefill_median']:.2f} | {meets} |" + (f" {bm} | {of} |" if fl else ""))
        else:
            print(f"{s['model']:<22} {s['ctx']:>7}  n {s['n']:>2}  median {s['median']:.2f}  GPU-side {gm}  "
                  f"prefill {s['prefill_median']:.2f}  meets {meets}  [{vals}]"
                  + (f"  bound {bm}  sparse ÷ floor [{of}]" if fl else ""))
    if unpaired:
        print(f"({unpaired} sparse rows without a dense row of their ctx in their sweep left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
