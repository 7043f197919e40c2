"""Content hashing and skip logic for pipeline steps.

A step is skipped when its *fingerprint* — sha256 over the step kind, its options (as passed to the
command, with resolved paths), the dsa-convert version and the content hash of every input file —
equals the one recorded in `OUTPUT.dsa-step.json` by its last successful run, and OUTPUT still has
the size and mtime recorded then.

File hashes (`[pipeline] hash = …`):
* ``full``  — sha256 of the whole file.
* ``quick`` — sha256 of (size, mtime_ns, first MiB, last MiB). Cheap for multi-GB checkpoints;
  misses an in-place edit in the middle of a file that keeps size and mtime (practically: none).
* ``auto`` (default) — ``full`` for files up to 256 MiB, ``quick`` above.
A directory input (the HF checkpoint) hashes every regular file directly inside it, by name.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

STATE_SUFFIX = ".dsa-step.json"
STATE_VERSION = 1
QUICK_ABOVE = 256 * 2**20
_MIB = 2**20


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("dsa-convert")
    except Exception:
        return "0+unknown"


class Hasher:
    """File/directory content hashes, memoized per (path, size, mtime) within one run."""

    def __init__(self, mode: str = "auto"):
        self.mode = mode
        self._memo: dict[tuple, str] = {}

    def file(self, p: Path) -> str:
        st = p.stat()
        key = (str(p), st.st_size, st.st_mtime_ns)
        if key in self._memo:
            return self._memo[key]
        quick = self.mode == "quick" or (self.mode == "auto" and st.st_size > QUICK_ABOVE)
        h = hashlib.sha256()
        with open(p, "rb") as f:
            if quick:
                h.update(f"quick:{st.st_size}:{st.st_mtime_ns}:".encode())
                h.update(f.read(_MIB))
                if st.st_size > _MIB:
                    f.seek(max(_MIB, st.st_size - _MIB))
                    h.update(f.read(_MIB))
                digest = "quick:" + h.hexdigest()
            else:
                for chunk in iter(lambda: f.read(4 * _MIB), b""):
                    h.update(chunk)
                digest = "sha256:" + h.hexdigest()
        self._memo[key] = digest
        return digest

    def path(self, p: Path) -> str:
        """Hash of a file or a directory (its direct regular files); 'missing' when absent."""
        p = Path(p)
        if p.is_file():
            return self.file(p)
        if p.is_dir():
            h = hashlib.sha256()
            for child in sorted(p.iterdir()):
                if child.is_file() and not child.name.startswith("."):
                    h.update(child.name.encode() + b"\0" + self.file(child).encode() + b"\n")
            return "dir:" + h.hexdigest()
        return "missing"


def fingerprint(kind: str, argv_options: list[str], inputs: dict[str, str]) -> str:
    blob = json.dumps({"v": STATE_VERSION, "dsa": _version(), "kind": kind, "options": argv_options,
                       "inputs": dict(sorted(inputs.items()))}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def state_path(output: Path) -> Path:
    return output.with_name(output.name + STATE_SUFFIX)


def load_state(output: Path) -> dict | None:
    p = state_path(output)
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("state_version") == STATE_VERSION else None


def output_stat(output: Path) -> dict | None:
    try:
        st = output.stat()
    except OSError:
        return None
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_fresh(output: Path, fp: str) -> tuple[bool, str]:
    """(skip?, reason)."""
    st = load_state(output)
    if st is None:
        return False, "never ran" if not output.exists() else "no state record"
    if st.get("fingerprint") != fp:
        return False, "inputs or options changed"
    cur = output_stat(output)
    if cur is None:
        return False, "output missing"
    if cur != st.get("output_stat"):
        return False, "output modified since last run"
    return True, "unchanged"


def save_state(output: Path, fp: str, record: dict[str, Any]) -> None:
    """Atomically write the state record (only after the step succeeded)."""
    p = state_path(output)
    tmp = p.with_name(f".{p.name}.partial-{os.getpid()}")
    data = {"state_version": STATE_VERSION, "fingerprint": fp, "output_stat": output_stat(output), **record}
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, p)


def drop_state(output: Path) -> None:
    state_path(output).unlink(missing_ok=True)
