"""summary.json + summary.md for a pipeline run (written atomically into the workdir)."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from .runner import FAILED, NOT_RUN, OK, SKIPPED, StepResult
from .spec import PipelineSpec


def build_summary(spec: PipelineSpec, results: list[StepResult], seconds: float, interrupted: bool = False) -> dict:
    counts = {s: sum(r.status == s for r in results) for s in (OK, SKIPPED, FAILED, NOT_RUN)}
    ok = counts[FAILED] == 0 and counts[NOT_RUN] == 0 and not interrupted
    return {
        "pipeline": str(spec.file), "name": spec.name, "workdir": str(spec.workdir),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
        "seconds": round(seconds, 3), "ok": ok, "interrupted": interrupted,
        "exit_code": 130 if interrupted else (0 if ok else 1),
        "counts": counts, "steps": [r.as_dict() for r in results],
    }


def _fmt(v, spec: str, none: str = "—") -> str:
    return none if v is None else format(v, spec)


def render_md(summary: dict) -> str:
    c = summary["counts"]
    lines = [f"# Pipeline `{summary['name']}`", "",
             f"{summary['finished_at']} · {summary['seconds']:.1f} s · "
             f"{c['ok']} ok, {c['skipped']} skipped, {c['failed']} failed, {c['not-run']} not run"
             + (" · **interrupted**" if summary["interrupted"] else ""), "",
             "| model | step | kind | status | time (s) | peak RSS (MiB) | PPL | size (MiB) | note |",
             "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in summary["steps"]:
        note = r["error"] if r["status"] == FAILED else r["reason"]
        note = (note or "").replace("|", "\\|")
        size = None if r["bytes"] is None else r["bytes"] / 2**20
        lines.append(f"| {r['model']} | {r['step']} | {r['kind']} | {r['status']} | {_fmt(r['seconds'], '.1f')} | "
                     f"{_fmt(r['peak_rss_mib'], '.0f')} | {_fmt(r['ppl'], '.3f')} | {_fmt(size, '.2f')} | {note} |")
    return "\n".join(lines) + "\n"


def write_reports(summary: dict, workdir: Path) -> tuple[Path, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    out = []
    for name, text in (("summary.json", json.dumps(summary, indent=2, default=str) + "\n"),
                       ("summary.md", render_md(summary))):
        p = workdir / name
        tmp = p.with_name(f".{name}.partial-{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, p)
        out.append(p)
    return out[0], out[1]
