"""Progress display: a rich bar on a terminal, plain periodic lines otherwise (logs, CI)."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


class _Plain:
    def __init__(self, description: str, total: float | None, quiet: bool):
        self.description, self.total, self.done, self.quiet = description, total, 0.0, quiet
        self.last, self.extra = 0.0, ""

    def advance(self, n: float = 1, info: str | None = None) -> None:
        self.done += n
        if info is not None:
            self.extra = info
        now = time.monotonic()
        if not self.quiet and (now - self.last > 5 or (self.total and self.done >= self.total)):
            self.last = now
            pct = f" {100 * self.done / self.total:5.1f}%" if self.total else ""
            print(f"{self.description}:{pct} {self.done:g}/{self.total or '?'} {self.extra}".rstrip(),
                  file=sys.stderr, flush=True)


class _Rich:
    def __init__(self, prog: Progress, task):
        self.prog, self.task = prog, task

    def advance(self, n: float = 1, info: str | None = None) -> None:
        self.prog.update(self.task, advance=n, **({"info": info} if info is not None else {}))


@contextmanager
def task(description: str, total: float | None, quiet: bool = False):
    """`with task("convert", n) as t: t.advance(1, info="loss 0.3")`."""
    if quiet or not sys.stderr.isatty():
        yield _Plain(description, total, quiet)
        return
    cols = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}")]
    with Progress(*cols, console=console, transient=False) as prog:
        yield _Rich(prog, prog.add_task(description, total=total, info=""))
