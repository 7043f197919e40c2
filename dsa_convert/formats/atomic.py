"""Atomic output files: write to a hidden temp file beside OUT, rename at the end.

A failure, Ctrl-C or SIGKILL never leaves a partial OUT: at worst a `.NAME.partial-PID` file,
which the next run removes when its process is gone.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from ..errors import BadInputError


def check_output(out: Path, force: bool) -> None:
    """Refuse early: OUT exists without --force, or its directory is missing / not writable."""
    out = Path(out)
    if out.is_dir():
        raise BadInputError(f"output path is a directory: {out}")
    if out.exists() and not force:
        raise BadInputError(f"output file exists: {out} (use --force to overwrite)")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise BadInputError(f"output directory does not exist: {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInputError(f"output directory is not writable: {parent}")


def _clean_stale(out: Path) -> None:
    for p in out.parent.glob(f".{out.name}.partial-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            p.unlink(missing_ok=True)
        except PermissionError:
            pass


def _disk_full(directory: Path, e: OSError) -> bool:
    """numpy's short writes raise OSError without errno ("N requested and M written")."""
    if e.errno is not None or "written" not in str(e):
        return False
    try:
        return shutil.disk_usage(directory).free < 1 << 20
    except OSError:
        return False


@contextlib.contextmanager
def atomic_output(out: Path):
    """Yields a temp path; on success it is renamed onto `out`, on any exit otherwise removed."""
    out = Path(out).resolve()
    _clean_stale(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC or _disk_full(out.parent, e):
            raise BadInputError(f"no space left on device while writing {out}") from None
        raise BadInputError(f"cannot write {out}: {e.strerror or e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
