"""Where evaluation text comes from: --data, env vars, the cache, the project's shared data, or
(only with --download) the standard WikiText-2 raw archive."""
from __future__ import annotations

import hashlib
import io
import os
import zipfile
from pathlib import Path

from ..errors import BadInputError

WIKITEXT2_URL = "https://huggingface.co/datasets/ggml-org/ci/resolve/main/wikitext-2-raw-v1.zip"
WIKITEXT2_MEMBER = "wikitext-2-raw/wiki.test.raw"
WIKITEXT2_SHA256 = "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"
DATASETS = {"wikitext2": WIKITEXT2_MEMBER}
_REPO = Path(__file__).resolve().parents[2]


def _cache_dir() -> Path:
    return Path(os.environ.get("DSA_CACHE", Path.home() / ".cache" / "dsa")) / "data"


def candidates(name: str) -> list[Path]:
    member = DATASETS[name]
    out = []
    if os.environ.get("DSA_WIKITEXT2"):
        out.append(Path(os.environ["DSA_WIKITEXT2"]))
    if os.environ.get("DSA_DATA_DIR"):
        out.append(Path(os.environ["DSA_DATA_DIR"]) / member)
    out.append(_cache_dir() / member)
    out.append(_REPO.parent / "shared" / "data" / member)   # the project's shared data, beside the checkout
    return out


def resolve(name_or_path: str, data: Path | None = None, download: bool = False) -> Path:
    """The evaluation text file for `--ppl NAME` (or a path given directly)."""
    if data is not None:
        if not Path(data).is_file():
            raise BadInputError(f"--data file not found: {data}")
        return Path(data)
    if name_or_path not in DATASETS:
        p = Path(name_or_path)
        if p.is_file():
            return p
        raise BadInputError(f"unknown dataset {name_or_path!r} (known: {', '.join(DATASETS)}; or pass a text file)")
    for c in candidates(name_or_path):
        if c.is_file():
            return c
    if download:
        return download_wikitext2()
    raise BadInputError(
        "WikiText-2 test file not found: pass --data PATH/wiki.test.raw or set DSA_WIKITEXT2; it is "
        f"{WIKITEXT2_MEMBER} in {WIKITEXT2_URL} (or the HF dataset wikitext/wikitext-2-raw-v1, split test); "
        "use --download to fetch it into the cache")


def download_wikitext2() -> Path:
    import urllib.request

    dest = _cache_dir() / WIKITEXT2_MEMBER
    try:
        with urllib.request.urlopen(WIKITEXT2_URL, timeout=60) as r:
            blob = r.read()
    except OSError as e:
        raise BadInputError(f"download of {WIKITEXT2_URL} failed: {e}") from None
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        raw = z.read(WIKITEXT2_MEMBER)
    if hashlib.sha256(raw).hexdigest() != WIKITEXT2_SHA256:
        raise BadInputError("downloaded wiki.test.raw has an unexpected sha256; refusing to use it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".partial")
    tmp.write_bytes(raw)
    os.replace(tmp, dest)
    return dest


def read_eval_text(path: Path) -> str:
    """Whole file; one trailing newline dropped (as llama.cpp's `-f` does)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInputError(f"{path}: not UTF-8 text") from None
    return text[:-1] if text.endswith("\n") else text
