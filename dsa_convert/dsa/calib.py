"""Calibration text -> token chunks (tokenised with the model's own tokenizer.json)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import BadInputError


def load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer
    p = Path(model_dir) / "tokenizer.json"
    if not p.is_file():
        raise BadInputError(f"no tokenizer.json in {model_dir}")
    return Tokenizer.from_file(str(p))


def tokenize_file(path: Path, tokenizer, max_tokens: int | None = None) -> list[int]:
    """Tokenise a text file in paragraph batches (no special tokens); stop once max_tokens are had."""
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"calibration file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    ids: list[int] = []
    # encode ~64 KiB pieces cut at paragraph boundaries: linear time, same tokens up to the cuts
    pos, step = 0, 1 << 16
    while pos < len(text) and (max_tokens is None or len(ids) < max_tokens):
        end = min(len(text), pos + step)
        if end < len(text):
            cut = text.rfind("\n", pos, end)
            end = cut + 1 if cut > pos else end
        ids.extend(tokenizer.encode(text[pos:end], add_special_tokens=False).ids)
        pos = end
    return ids


def calib_chunks(path: Path, model_dir: Path, ctx: int, n_chunks: int, bos_id: int | None = None) -> torch.Tensor:
    """LongTensor [n_chunks, ctx] of consecutive calibration tokens (first token BOS if bos_id given).

    Raises BadInputError when the text is shorter than n_chunks * ctx tokens.
    """
    tok = load_tokenizer(model_dir)
    ids = tokenize_file(path, tok, max_tokens=n_chunks * ctx)
    if len(ids) < n_chunks * ctx:
        have = len(ids) // ctx
        raise BadInputError(
            f"calibration text {path} is too short: {len(ids)} tokens, need {n_chunks} chunks x {ctx} "
            f"= {n_chunks * ctx} (fits {have} chunks)")
    out = torch.tensor(ids[: n_chunks * ctx], dtype=torch.long).view(n_chunks, ctx).clone()
    if bos_id is not None:
        out[:, 0] = bos_id
    return out
