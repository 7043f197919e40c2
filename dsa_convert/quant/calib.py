"""Calibration samples for `dsa quantize`: text → token ids with the GGUF's own vocab → N × L blocks.

Like llm-awq / llama-imatrix: the text is tokenized once and cut into consecutive chunks of L tokens
(the first token of each chunk replaced by BOS when the vocab adds one, as llama-perplexity and
llama-imatrix do), so `--samples 128 --seq-len 512` sees the same tokens as
`llama-imatrix -c 512 --chunks 128`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import BadInputError
from ..formats.gguf_read import GgufFile


def tokenize_file(gguf_path: Path, text: str) -> list[int]:
    from ..backend.llama_runner import vocab_tokens_isolated

    return vocab_tokens_isolated(gguf_path, text, add_bos=False)[0]


def load_samples(gguf_path: Path, g: GgufFile, calib: Path, samples: int, seq_len: int) -> torch.Tensor:
    """[samples, seq_len] int64 token ids. BadInputError when the text holds fewer tokens."""
    calib = Path(calib)
    if samples < 1 or seq_len < 2:
        raise BadInputError(f"--samples must be ≥ 1 and --seq-len ≥ 2 (got {samples}, {seq_len})")
    if not calib.is_file():
        raise BadInputError(f"calibration file not found: {calib}")
    try:
        raw = calib.read_bytes()
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInputError(f"calibration file is not UTF-8 text: {calib}") from None
    need = samples * seq_len
    # tokenize only a generous prefix (≈ 8 bytes/token is far above any BPE vocab's average)
    prefix = text[: max(4096, need * 8)]
    toks = tokenize_file(gguf_path, prefix)
    if len(toks) < need and len(prefix) < len(text):
        toks = tokenize_file(gguf_path, text)
    if len(toks) < need:
        raise BadInputError(f"calibration text too short: {calib.name} has {len(toks)} tokens, "
                            f"--samples {samples} × --seq-len {seq_len} needs {need}")
    ids = torch.tensor(toks[:need], dtype=torch.long).view(samples, seq_len)
    bos = g.get("tokenizer.ggml.bos_token_id")
    add_bos = g.get("tokenizer.ggml.add_bos_token")
    if bos is not None and (add_bos is None or bool(add_bos)):
        ids[:, 0] = int(bos)
    return ids
