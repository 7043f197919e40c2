"""Calibration text -> token chunks (tokenised with the model's own tokenizer.json), and how many chunks of which
length the retrofit reads (CalibPlan): the text's documents in file order, packed into chunks of the calibration context."""
from __future__ import annotations

from dataclasses import dataclass
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


# calibration tokens when --calib-tokens is not given: a short context keeps the 32 x 2K chunks that the short-context
# figures were measured with; a long one takes more text on a GPU than the CPU's time budget allows
SHORT_CTX = 2048
DEFAULT_TOKENS_SHORT = 32 * SHORT_CTX
DEFAULT_TOKENS_GPU = 1 << 19
DEFAULT_TOKENS_CPU = 1 << 17
MEMORY_SHARE = 0.5          # of the device's free memory that the calibration activations may take


@dataclass
class CalibPlan:
    """How much calibration text the retrofit reads, and why (the report states it)."""

    ctx: int                # tokens per chunk: the calibration context
    n_train: int            # chunks the indexers are distilled on
    n_held: int             # held-out chunks (split and layer-placement scores)
    reason: str             # where ctx came from: "given", "model context", or the memory cap that lowered it
    bytes_per_token: int    # activation bytes the retrofit keeps per calibration token (estimate)

    @property
    def train_tokens(self) -> int:
        return self.ctx * self.n_train


def activation_bytes_per_token(n_embd: int, n_head: int, n_head_kv: int, head_dim: int, members: int = 1) -> int:
    """float32 bytes per token held at once: the residual stream, and a layer group's attention input, queries and keys
    (``members``: layers in the largest group trained into one indexer)."""
    return 4 * (2 * n_embd + members * (n_head + n_head_kv) * head_dim)


def free_memory_bytes(device: str) -> int:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as f:
            info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f}
        return info.get("MemAvailable", info.get("MemFree", 8 << 30))
    except OSError:
        return 8 << 30


def plan_calibration(*, ctx: int | None, calib_tokens: int | None, calib_chunks: int | None, split_chunks: int | None,
                     model_ctx: int, bytes_per_token: int, device: str, free_bytes: int | None = None) -> CalibPlan:
    """The calibration context and chunk counts: the given values, else the model's trained context and a token budget,
    lowered (chunks first, then the context) until train + held-out activations fit MEMORY_SHARE of free memory."""
    reason = "given" if ctx is not None else "model context"
    ctx = ctx if ctx is not None else model_ctx
    if calib_tokens is None:
        calib_tokens = DEFAULT_TOKENS_SHORT if ctx <= SHORT_CTX else (
            DEFAULT_TOKENS_GPU if str(device).startswith("cuda") else DEFAULT_TOKENS_CPU)
    n_train = calib_chunks if calib_chunks is not None else max(1, calib_tokens // ctx)
    held = lambda n: split_chunks if split_chunks is not None else min(4, max(1, round(n / 8)))  # noqa: E731
    budget = MEMORY_SHARE * (free_bytes if free_bytes is not None else free_memory_bytes(device))
    fits = lambda c, n: (n + held(n)) * c * bytes_per_token <= budget  # noqa: E731
    while calib_chunks is None and n_train > 1 and not fits(ctx, n_train):
        n_train -= 1
    if reason != "given":
        while ctx > SHORT_CTX and not fits(ctx, n_train):
            ctx //= 2
            reason = f"model context {model_ctx} capped to {ctx} by memory ({budget / 2**30:.1f} GiB for activations)"
    return CalibPlan(ctx=ctx, n_train=n_train, n_held=held(n_train), reason=reason, bytes_per_token=bytes_per_token)
