#!/usr/bin/env python3
"""Plot saved `dsa bench` rows: decode tok/s vs context, one line per attention mode (the same PNG as `--plot`).

    python scripts/plot_bench.py ROWS.jsonl [--match SUBSTRING] [--first] [--label NAME=VARIANT ...] --out OUT.png
                                 [--title TITLE] [--metric decode|prefill]

ROWS.jsonl: rows as `dsa bench --jsonl` (or the h200 `speed` step) writes them, one JSON object per line. --match
keeps the rows whose `file` contains SUBSTRING (a sweep file often holds several models). docs/history §4i's plots
come from docs/data/speed-h200-2026-11-30.jsonl this way. --first keeps the first row of each (ctx, attn, variant)
in file order (a file that holds several sweeps of one model); --label NAME=VARIANT (repeatable) names a `--variant`
line NAME in the legend (everything after the first '=' is the variant, e.g. V1=LLAMA_DSA_FUSED=0+LLAMA_DSA_HOST_MASKS=1).
--metric prefill plots the rows' prefill tok/s instead of decode tok/s (docs/history §4s).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_convert.errors import BadInputError, DsaError  # noqa: E402
from dsa_convert.eval.bench_summary import PLOT_METRICS, read_jsonl, write_plot  # noqa: E402


def load_rows(path: Path, match: str | None) -> list[dict]:
    rows = [r for r in read_jsonl(path, require_row=True) if match is None or match in str(r.get("file", ""))]
    if not any("error" not in r and "decode_tok_s" in r for r in rows):
        raise BadInputError(f"{path}: no finished rows" + (f" whose file contains {match!r}" if match else ""))
    return rows


def first_rows(rows: list[dict]) -> list[dict]:
    """The first row of each (ctx, attn, variant), in order."""
    seen, out = set(), []
    for r in rows:
        key = (r["ctx"], r["attn"], r.get("variant"))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def relabel(rows: list[dict], labels: list[str]) -> list[dict]:
    """Rows whose variant is named by a NAME=VARIANT label carry NAME as their variant instead."""
    names = {}
    for lab in labels:
        name, sep, variant = lab.partition("=")
        if not sep or not name or not variant:
            raise BadInputError(f"--label {lab!r}: expected NAME=VARIANT")
        names[variant] = name
    unused = set(names) - {r.get("variant") for r in rows}
    if unused:
        raise BadInputError(f"--label: no row has variant {sorted(unused)[0]!r}")
    return [dict(r, variant=names.get(r.get("variant"), r.get("variant"))) for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=Path)
    ap.add_argument("--match", default=None, help="keep rows whose `file` contains this")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default=None, help="default: dsa bench: <metric> speed")
    ap.add_argument("--metric", choices=list(PLOT_METRICS), default="decode", help="which tok/s to plot")
    ap.add_argument("--first", action="store_true", help="keep the first row of each (ctx, attn, variant)")
    ap.add_argument("--label", action="append", default=[], metavar="NAME=VARIANT", help="legend name of a variant")
    a = ap.parse_args(argv)
    try:
        rows = load_rows(a.rows, a.match)
        if a.first:
            rows = first_rows(rows)
        out = write_plot(relabel(rows, a.label), a.out, a.title or f"dsa bench: {a.metric} speed", a.metric)
    except DsaError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
