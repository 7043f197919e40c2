"""`dsa pipeline run`: convert → quantize → eval for many models from one TOML file, with skip-if-unchanged.

spec.py (TOML → dataclasses), state.py (hashing, skip logic), runner.py (child processes),
report.py (summary.json / summary.md). `run()` ties them together for the CLI.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

from .report import build_summary, write_reports
from .runner import FAILED, RunOptions, StepResult, check_options, run_pipeline
from .spec import parse


def _line(r: StepResult, i: int, n: int) -> str:
    bits = [f"[{i}/{n}] {r.model}/{r.step} ({r.kind}): {r.status}"]
    if r.status == "ok":
        extra = [f"{r.seconds or 0:.1f} s"]
        if r.peak_rss_mib is not None:
            extra.append(f"peak {r.peak_rss_mib:.0f} MiB")
        if r.ppl is not None:
            extra.append(f"PPL {r.ppl:.3f}")
        bits.append(f"({', '.join(extra)})")
    elif r.status == FAILED:
        bits.append(f"— {r.error}")
    elif r.reason:
        bits.append(f"({r.reason})")
    return " ".join(bits)


@contextmanager
def _display(total: int, quiet: bool):
    """One progress display for the whole pipeline: a rich bar on a terminal, a line per step otherwise."""
    done = [0]
    if quiet or not sys.stderr.isatty():
        def on_start(model, step, kind):
            pass

        def on_step(r):
            done[0] += 1
            if not quiet:
                print(_line(r, done[0], total), file=sys.stderr, flush=True)
        yield on_start, on_step
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..progress import console

    with Progress(TextColumn("[bold]pipeline"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), console=console) as prog:
        tid = prog.add_task("pipeline", total=total, info="")

        def on_start(model, step, kind):
            prog.update(tid, info=f"{model}/{step} ({kind}) …")

        def on_step(r):
            done[0] += 1
            prog.console.print(_line(r, done[0], total))
            prog.update(tid, advance=1, info="")
        yield on_start, on_step


def run(file: Path, workdir: Path | None = None, keep_going: bool = False, quiet: bool = False,
        ro: RunOptions | None = None) -> dict:
    """Parse, validate, run, write summary.json/summary.md; returns the summary dict."""
    spec = parse(file, workdir)
    ro = ro or RunOptions()
    ro.keep_going = keep_going or ro.keep_going
    if ro.introspect:
        check_options(spec)
    total = sum(len(m.steps) for m in spec.models)
    results: list[StepResult] = []
    t0 = time.perf_counter()
    with _display(total, quiet) as (on_start, on_step):
        ro.on_start, ro.on_step = on_start, on_step
        try:
            run_pipeline(spec, ro, results)
        except KeyboardInterrupt:
            write_reports(build_summary(spec, results, time.perf_counter() - t0, interrupted=True), spec.workdir)
            raise
    summary = build_summary(spec, results, time.perf_counter() - t0)
    js, md = write_reports(summary, spec.workdir)
    summary["summary_json"], summary["summary_md"] = str(js), str(md)
    return summary
