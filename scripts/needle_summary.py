#!/usr/bin/env python3
"""Needle grids side by side: `dsa eval --needle ... --json` files -> a markdown table per task and filler.

    python3 scripts/needle_summary.py needle-f16.json needle-asq.json [--against dense]

For each file's (task, filler) the table has one row per context length and one column per attention mode and KV
cache (hits / trials over all depths), then per mode the cells (length x depth) where it retrieves fewer than
`--against` (default dense), how many of them by more than one trial (the retrofit issue's "sparse hits = dense hits
in every cell, +- 1 trial"), in how many it retrieves more, and its lowest cell among those where the reference
retrieves >= 90 % ("none below 8/10 where dense is >= 9/10"); the first cells below are named.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def load(paths: list[Path]) -> dict:
    """(task, filler) -> {(attn label, length, depth_index): (hits, trials)} over all files."""
    out: dict = defaultdict(dict)
    for p in paths:
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"error: {p}: not a dsa eval --needle JSON file ({e.__class__.__name__})")
        if not isinstance(d, dict) or "rows" not in d:
            sys.exit(f"error: {p}: no 'rows' (not a dsa eval --needle JSON file)")
        for r in d["rows"]:
            label = r["attn"] if r["attn"] != "sparse" or d.get("kv", "f16") == "f16" else f"sparse/{d['kv']}"
            out[(d["task"], d["filler"])][(label, int(r["length"]), int(r["depth_index"]))] = (r["hits"], r["trials"])
    return out


def table(cells: dict, against: str) -> list[str]:
    labels = sorted({k[0] for k in cells}, key=lambda s: (s != "dense", s))
    lengths = sorted({k[1] for k in cells})
    lines = ["| length | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
    for L in lengths:
        row = []
        for a in labels:
            hs = [v for k, v in cells.items() if k[0] == a and k[1] == L]
            row.append(f"{sum(h for h, _ in hs)}/{sum(t for _, t in hs)}" if hs else "-")
        lines.append(f"| {L} | " + " | ".join(row) + " |")
    for a in labels:
        if a == against:
            continue
        # (length, depth, hits, reference hits) and the two (hits, trials)
        cmp = [(k[1], k[2], v, cells[(against, k[1], k[2])]) for k, v in cells.items()
               if k[0] == a and (against, k[1], k[2]) in cells]
        pairs = [(L, d, v[0], r[0]) for L, d, v, r in cmp]
        below = [p for p in pairs if p[2] < p[3]]
        worse = [p for p in below if p[2] < p[3] - 1]
        above = sum(1 for p in pairs if p[2] > p[3])
        # the lowest cell among those where the reference retrieves >= 90 % of its trials
        strong = [v for _, _, v, r in cmp if r[0] >= 0.9 * r[1]]
        low = min(strong, key=lambda ht: ht[0] / ht[1]) if strong else None
        lines.append(f"{a}: {len(below)} of {len(pairs)} cells below {against}, {len(worse)} by more than one trial, "
                     f"{above} above" + (f"; lowest where {against} >= 90 %: {low[0]}/{low[1]}" if low else "")
                     + ("" if not below else ": " + ", ".join(f"{L}@d{d} {h} vs {g}"
                                                                               for L, d, h, g in sorted(below)[:8])
                                            + (", ..." if len(below) > 8 else "")))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--against", default="dense", help="the mode the others are compared with (default dense)")
    a = ap.parse_args(argv)
    for (task, filler), cells in load(a.files).items():
        print(f"\n{task}, filler {filler}")
        print("\n".join(table(cells, a.against)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
