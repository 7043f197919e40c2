"""Progress display on stderr: a rich bar on a terminal, plain periodic lines otherwise (logs, CI, and `--json`, whose
JSON alone goes to stdout). A plain line names the stage, the step (done/total), the elapsed time and an ETA: from the
rate so far when the total is known, else from an event's own ``eta_s`` (the retrofit's plan estimate)."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)
PLAIN_EVERY_S = 5.0         # at most one plain line per this many seconds (and always the last step's)


def clock(seconds: float) -> str:
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class _Plain:
    def __init__(self, description: str, total: float | None, quiet: bool = False):
        self.description, self.total, self.done, self.quiet = description, total, 0.0, quiet
        self.last, self.extra, self.eta = float("-inf"), "", None
        self.t0 = time.monotonic()

    def advance(self, n: float = 1, info: str | None = None, eta_s: float | None = None) -> None:
        self.done += n
        if info is not None:
            self.extra = info
        if eta_s is not None:
            self.eta = eta_s
        now = time.monotonic()
        last_step = bool(self.total) and self.done >= self.total
        if self.quiet or not (now - self.last >= PLAIN_EVERY_S or last_step):
            return
        self.last = now
        el = now - self.t0
        head = f"{self.description}:"
        if self.total:
            head += f" {100 * self.done / self.total:5.1f}% {self.done:g}/{self.total:g}"
        eta = self.eta
        if self.total and self.done > 0 and eta is None:
            eta = el * (self.total - self.done) / self.done
        times = f"[{clock(el)} elapsed" + (f", ETA {clock(eta)}]" if eta is not None else "]")
        print(f"{head} {times} {self.extra}".rstrip(), file=sys.stderr, flush=True)


class _Rich:
    def __init__(self, prog: Progress, task):
        self.prog, self.task = prog, task

    def advance(self, n: float = 1, info: str | None = None, eta_s: float | None = None) -> None:
        if eta_s is not None:
            info = f"{info or ''} ETA {clock(eta_s)}".strip()
        self.prog.update(self.task, advance=n, **({"info": info} if info is not None else {}))


@contextmanager
def task(description: str, total: float | None, quiet: bool = False, silent: bool = False):
    """`with task("convert", n) as t: t.advance(1, info="loss 0.3")`. ``quiet`` (the commands' --json): plain lines on
    stderr instead of a bar, so that stdout holds the JSON only; ``silent``: nothing at all (library calls)."""
    if silent or quiet or not sys.stderr.isatty():
        yield _Plain(description, total, quiet=silent)
        return
    cols = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}")]
    with Progress(*cols, console=console, transient=False) as prog:
        yield _Rich(prog, prog.add_task(description, total=total, info=""))
