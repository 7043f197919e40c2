"""Haystack text of the needle evaluation: llama.cpp's junk sentence repeated, or a contiguous slice of a book.

``junk``: JUNK repeated n times (llama.cpp examples/passkey); a needle goes before repeat i (0..n).
``book`` (the default filler of niah / multikey): books_003 of the models' training corpus, looked up as env
DSA_NEEDLE_FILLER, then <repo>/../shared/corpus/books_003.txt.xz. It is deliberately *not*
data/calib/books-calib.txt: the DSA retrofit calibrates on that file and evaluation text must be disjoint from
calibration text. A PATH is any UTF-8 text file (``.xz`` read with lzma). A text filler is n characters from the
start of a paragraph chosen by the trial's seed, cut back to a word boundary; a needle goes at a sentence end or a
paragraph end.
"""
from __future__ import annotations

import bisect
import lzma
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import BadInputError
from .data import _REPO

JUNK = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
BOOK_FILE = Path("corpus") / "books_003.txt.xz"
FILLER_ENV = "DSA_NEEDLE_FILLER"

_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)")
_PARAGRAPH_BREAK = re.compile(r"\n+")
_NEWLINE = re.compile("\n")


@dataclass(frozen=True)
class Haystack:
    text: str
    bounds: list[int]      # sorted character positions where a needle may go; 0 and len(text) included


class JunkFiller:
    """n units = JUNK repeated n times."""

    name = "junk"
    unit = "repeats"

    def start(self, fraction: float, need_units: int) -> int:
        return 0

    def max_units(self, start: int) -> int | None:
        return None

    def haystack(self, start: int, n: int) -> Haystack:
        return Haystack(JUNK * n, list(range(0, len(JUNK) * n + 1, len(JUNK))))

    def units_per_token(self, tokenize: Callable[[str], list[int]]) -> float:
        reps = 64
        return reps / max(1, len(tokenize(JUNK * reps)) - len(tokenize("")))


class TextFiller:
    """n units = n characters of `text` from a paragraph start."""

    unit = "characters"

    def __init__(self, name: str, text: str, source: str | None = None):
        self.name, self.text, self.source = name, text, source
        self.par_starts = [0] + [m.end() for m in _PARAGRAPH_BREAK.finditer(text) if m.end() < len(text)]

    def start(self, fraction: float, need_units: int) -> int:
        """The paragraph start picked by `fraction` (0..1) among those with `need_units` characters after them (the
        first paragraph where the text is shorter)."""
        last = len(self.text) - need_units
        eligible = self.par_starts[:bisect.bisect_right(self.par_starts, last)] or self.par_starts[:1]
        return eligible[min(len(eligible) - 1, int(fraction * len(eligible)))]

    def max_units(self, start: int) -> int:
        return len(self.text) - start

    def haystack(self, start: int, n: int) -> Haystack:
        end = start + n
        s = self.text[start:end]
        if end < len(self.text) and not self.text[end].isspace():   # do not end inside a word
            cut = max(s.rfind(" "), s.rfind("\n"))
            s = s[:cut] if cut > 0 else s
        s = s.rstrip()
        bounds = {0, len(s)}
        bounds.update(m.end() for m in _SENTENCE_END.finditer(s))
        bounds.update(m.start() for m in _NEWLINE.finditer(s))
        return Haystack(s, sorted(bounds))

    def units_per_token(self, tokenize: Callable[[str], list[int]]) -> float:
        sample = self.text[:65536]
        return len(sample) / max(1, len(tokenize(sample)) - len(tokenize("")))


def book_path() -> Path:
    env = os.environ.get(FILLER_ENV)
    if env:
        if not Path(env).is_file():
            raise BadInputError(f"{FILLER_ENV}={env}: file not found")
        return Path(env)
    p = _REPO.parent / "shared" / BOOK_FILE
    if not p.is_file():
        raise BadInputError(f"book filler not found ({FILLER_ENV} unset, no {p}); pass --filler PATH (a text file) "
                            "or --filler junk")
    return p


def read_text(path: Path) -> str:
    """A UTF-8 text file, `.xz` decompressed; CRLF as LF."""
    path = Path(path)
    try:
        raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
        text = raw.decode("utf-8")
    except lzma.LZMAError as e:
        raise BadInputError(f"filler {path}: not a valid .xz file ({e})") from None
    except UnicodeDecodeError:
        raise BadInputError(f"filler {path}: not UTF-8 text") from None
    except OSError as e:
        raise BadInputError(f"filler {path}: cannot read it ({e.strerror or e})") from None
    text = text.replace("\r\n", "\n").strip()
    if not text:
        raise BadInputError(f"filler {path}: no text in it")
    return text


def default_filler(task: str) -> str:
    """llama-passkey's junk for passkey; book text (RULER's haystack is essays) for niah and multikey."""
    return "junk" if task == "passkey" else "book"


def check_filler_spec(spec: str) -> None:
    """A one-line error, before any model load, for a filler that is neither junk, book nor a file."""
    if spec == "junk":
        return
    if spec == "book":
        book_path()
        return
    if not Path(spec).is_file():
        raise BadInputError(f"unknown --filler {spec!r}: not junk, book or an existing text file")


def load_filler(spec: str) -> JunkFiller | TextFiller:
    check_filler_spec(spec)
    if spec == "junk":
        return JunkFiller()
    path = book_path() if spec == "book" else Path(spec)
    return TextFiller(spec, read_text(path), str(path))
