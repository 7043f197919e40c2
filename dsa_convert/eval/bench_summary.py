"""The summary side of `dsa bench`: sparse ÷ dense per ctx against the fastest dense row, the crossover context,
the indexer time share, the text table and the plot; also read back from saved `--jsonl` rows (scripts/plot_bench.py,
scripts/bench/sweep_ratios.py). Rows are the dicts bench.run_one returns (eval/bench.py)."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import BadInputError, DsaError

ATTN_MODES = ("sparse", "dense")


def add_indexer_share(rows: list[dict]) -> None:
    """Sparse rows get 1 - t_dense / t_sparse (prefill and decode) where dense ran at the same ctx, with the sparse
    row's flash attention (the INDEXER_ONLY context attends densely with it)."""
    dense = {(r["ctx"], r.get("flash_attn")): r for r in rows if r["attn"] == "dense" and "error" not in r}
    for r in rows:
        if r["attn"] != "sparse" or "error" in r:
            continue
        d = dense.get((r["ctx"], r.get("flash_attn")))
        for ph in ("prefill", "decode"):
            r[f"indexer_share_{ph}_est"] = (round(1.0 - d[f"{ph}_s"] / r[f"{ph}_s"], 4)
                                            if d and r[f"{ph}_s"] > 0 else None)
        r["indexer_share_method"] = ("indexer_*: decode with LLAMA_DSA_INDEXER_ONLY=1 (selection computed, dense "
                                     "attention) minus dense; *_est: 1 - t_dense/t_sparse (all sparse overhead)")
        io = r.get("indexer_only_decode_s")
        if d and io is not None and r["decode_s"] > 0:
            idx_s = max(0.0, io - d["decode_s"])
            r["indexer_decode_ms_per_tok"] = round(1000 * idx_s / r["decode_tokens"], 3)
            r["indexer_share_decode"] = round(idx_s / r["decode_s"], 4)


PLOT_METRICS = {"decode": ("decode_tok_s", "decode tokens / s"), "prefill": ("prefill_tok_s", "prefill tokens / s")}


def write_plot(rows: list[dict], out: Path, title: str, metric: str = "decode") -> Path:
    """PNG of decode (or prefill) tok/s vs context length, one line per attention mode (and per flash-attention
    setting where the dense rows have both) and per variant."""
    if metric not in PLOT_METRICS:
        raise BadInputError(f"plot metric {metric!r}: expected one of {', '.join(PLOT_METRICS)}")
    key, ylabel = PLOT_METRICS[metric]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DsaError("--plot needs matplotlib (pip install matplotlib)") from None
    out = Path(out)
    if not out.resolve().parent.is_dir():
        raise BadInputError(f"--plot: directory does not exist: {out.resolve().parent}")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mixed = _mixed_dense_fa(rows)     # one dense line per flash-attention setting

    def fas(mode: str) -> list:
        return sorted({r.get("flash_attn") for r in rows if r["attn"] == mode}, key=str) if mixed else [None]
    lines = [(m, None, fa) for m in ATTN_MODES for fa in fas(m)] + \
        sorted({("sparse", r["variant"], None) for r in rows if r.get("variant")})
    for mode, variant, fa in lines:
        pts = sorted((r["ctx"], r[key]) for r in rows
                     if r["attn"] == mode and r.get("variant") == variant and "error" not in r and key in r
                     and (fa is None or r.get("flash_attn") == fa))
        if pts:
            label = mode + (f" (fa {fa_label(fa)})" if fa is not None else "") + (f" [{variant}]" if variant else "")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    except OSError as e:
        raise BadInputError(f"--plot: cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return out


def read_jsonl(path: Path, require_row: bool = False) -> list[dict]:
    """The rows of a `--jsonl` file (one JSON object per line, blank lines skipped), for the scripts that judge or plot
    saved sweeps; an unreadable file, a line that is not a JSON object or (require_row) an object without `ctx` and
    `attn` is a BadInputError naming the line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise BadInputError(f"cannot read {path}: {e.strerror or e}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInputError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(r, dict):
            raise BadInputError(f"{path}:{n}: not a JSON object")
        if require_row and not {"ctx", "attn"} <= r.keys():
            raise BadInputError(f"{path}:{n}: not a dsa bench row (no ctx / attn)")
        rows.append(r)
    return rows


def fastest_dense(rows: list[dict]) -> dict[int, dict[str, dict]]:
    """Per ctx, the dense row with the most tok/s for each metric (decode, prefill): with --dense-flash-attn both a ctx
    has a dense row with and one without flash attention, and sparse is held to the faster of the two."""
    best: dict[int, dict[str, dict]] = {}
    for r in rows:
        if r.get("attn") != "dense" or "error" in r:
            continue
        b = best.setdefault(r["ctx"], {})
        for m in ("decode", "prefill"):
            if m not in b or r[f"{m}_tok_s"] > b[m][f"{m}_tok_s"]:
                b[m] = r
    return best


def ratios(rows: list[dict]) -> list[dict]:
    """Sparse ÷ dense tok/s per ctx of one sweep (issue #6's measure): one entry per sparse row, plain or variant,
    whose ctx has a dense row; a variant is compared with the sweep's own dense row, and each metric with the
    fastest dense row of its ctx (`dense_flash_attn`: that row's flash attention, per metric)."""
    dense = fastest_dense(rows)
    out = []
    for r in rows:
        d = dense.get(r["ctx"])
        if r.get("attn") != "sparse" or "error" in r or d is None:
            continue
        out.append({"ctx": r["ctx"], "variant": r.get("variant"),
                    "decode": r["decode_tok_s"] / d["decode"]["decode_tok_s"],
                    "prefill": r["prefill_tok_s"] / d["prefill"]["prefill_tok_s"],
                    "dense_flash_attn": {m: d[m].get("flash_attn") for m in ("decode", "prefill")}, "row": r})
    return out


def crossover(rows: list[dict], metric: str = "decode") -> int | None:
    """The shortest context of the sweep from which on plain sparse runs are at least as fast as dense (`metric`:
    decode or prefill tok/s) at every measured context; None where sparse is slower at the longest one, or no context
    has both runs."""
    rs = sorted((x["ctx"], x[metric]) for x in ratios(rows) if x["variant"] is None)
    first = None
    for c, ratio in rs:
        if ratio < 1.0:
            first = None
        elif first is None:
            first = c
    return first


def add_ratios(rows: list[dict]) -> None:
    """`decode_vs_dense` / `prefill_vs_dense` on each sparse row that has a dense row of its ctx in the sweep, and the
    sweep's `decode_crossover_ctx` / `prefill_crossover_ctx` (crossover) on its plain ones (the returned / --json
    rows; --jsonl lines are written as each run finishes, before its dense run, so they lack them)."""
    xs = ratios(rows)
    cross = {m: crossover(rows, m) for m in ("decode", "prefill")}
    for x in xs:
        x["row"]["decode_vs_dense"] = round(x["decode"], 4)
        x["row"]["prefill_vs_dense"] = round(x["prefill"], 4)
        x["row"]["vs_dense_flash_attn"] = x["dense_flash_attn"]
        if x["variant"] is None:
            x["row"]["decode_crossover_ctx"] = cross["decode"]
            x["row"]["prefill_crossover_ctx"] = cross["prefill"]


def fa_label(flag) -> str:
    """A row's flash attention as the table prints it: on, off, or — where the row lacks the field."""
    return "—" if flag is None else "on" if flag else "off"


def _mixed_dense_fa(rows: list[dict]) -> bool:
    return len({r.get("flash_attn") for r in rows if r.get("attn") == "dense" and "error" not in r}) > 1


def render(rows: list[dict]) -> str:
    head = (f"{'ctx':>8} {'attn':>6} {'fa':>3} {'prefill tok/s':>14} {'decode tok/s':>13} {'KV MiB':>9} "
            f"{'KV B/tok':>9} {'indexer ms/tok':>15} {'host µs/tok':>11}  device")  # host µs/tok: graph + inputs
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['ctx']:>8} {r['attn']:>6} {fa_label(r.get('flash_attn')):>3}  error: {r['error']}")
            continue
        idx = r.get("indexer_decode_ms_per_tok")
        idx_s = f"{idx:.3f} ({100 * r['indexer_share_decode']:.0f} %)" if idx is not None else "—"
        host = r.get("host_us_per_decode_token")
        host_s = f"{host['graph'] + host['inputs']:.0f}" if host else "—"   # host work before the launch
        lines.append(f"{r['ctx']:>8} {r['attn']:>6} {fa_label(r.get('flash_attn')):>3} {r['prefill_tok_s']:>14.1f} "
                     f"{r['decode_tok_s']:>13.2f} {r['kv_bytes'] / 2**20:>9.2f} {r['kv_bytes_per_token']:>9.0f} "
                     f"{idx_s:>15} {host_s:>11}  {r['device']}" + (f"  [{r['variant']}]" if r.get("variant") else ""))
    rs = ratios(rows)
    if rs:
        mixed = _mixed_dense_fa(rows)
        lines.append("sparse ÷ dense, tok/s in the same sweep" + (" (against the faster dense row per metric)" if mixed
                                                                  else "") + ":")
        lines += [f"{x['ctx']:>8}  decode {x['decode']:.2f}×  prefill {x['prefill']:.2f}×"
                  + (f"  [{x['variant']}]" if x["variant"] else "")
                  + (f"  (dense fa: decode {fa_label(x['dense_flash_attn']['decode'])}, "
                     f"prefill {fa_label(x['dense_flash_attn']['prefill'])})" if mixed else "") for x in rs]
        longest = max(x["ctx"] for x in rs)
        for m in ("decode", "prefill"):
            c = crossover(rows, m)
            lines.append(f"crossover, {m}: " + (f"sparse ≥ dense from ctx {c} on (measured up to {longest})" if c
                                                else f"sparse slower than dense at ctx {longest}, the longest measured"))
    return "\n".join(lines)
