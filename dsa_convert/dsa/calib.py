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
DEFAULT_TOKENS_CPU = 1 << 16
MEMORY_SHARE = 0.5          # of the device's free memory that the calibration activations may take

# the training recipe when --steps / --query-rows / --split-search / --placement-search are not given. A step's work is
# query rows x context (the dense target and the indexer's scores over every key), so on a CPU at long context the
# recipe keeps the rows x context product of a 256-row step at 8K and takes fewer steps, the split search is the coarse
# one (split.py: 3 sparse forwards of the held-out chunk instead of 9; at 32K on a 2-core CPU each takes ~1.5 min) and
# the layer placement of --index-share the one-shot one (placement.py: 6 layers to 3 in 4.5 forwards, not 8 to 9)
STEPS = 400
QUERY_ROWS = 256
CPU_LONG_STEPS = 300
CPU_ROW_KEYS = 256 * 8192   # query rows x context per step on a CPU beyond SHORT_CTX
MIN_QUERY_ROWS = 64


@dataclass
class CalibPlan:
    """How much calibration text the retrofit reads, how long it trains, and why (the report states it)."""

    ctx: int                # tokens per chunk: the calibration context
    n_train: int            # chunks the indexers are distilled on
    n_held: int             # held-out chunks (split and layer-placement scores)
    reason: str             # where ctx came from: "given", "model context", or the memory cap that lowered it
    bytes_per_token: int    # activation bytes the retrofit keeps per calibration token (estimate)
    steps: int = STEPS              # dense warm-up steps per layer
    sparse_steps: int = STEPS       # sparse-phase steps per layer
    query_rows: int = QUERY_ROWS    # query rows per step
    split_search: str = "full"      # full | coarse: the split candidates scored (split.py)
    placement_search: str = "greedy"    # greedy | oneshot: how --index-share's full layers are searched (placement.py)
    recipe: str = "default"         # which defaults applied: "default", "cpu long context", or "given"

    @property
    def train_tokens(self) -> int:
        return self.ctx * self.n_train

    def as_report(self) -> dict:
        return {"ctx": self.ctx, "ctx_source": self.reason, "train_chunks": self.n_train, "held_chunks": self.n_held,
                "train_tokens": self.train_tokens, "held_tokens": self.n_held * self.ctx,
                "activation_bytes_per_token": self.bytes_per_token, "steps": self.steps,
                "sparse_steps": self.sparse_steps, "query_rows": self.query_rows, "split_search": self.split_search,
                "placement_search": self.placement_search, "recipe": self.recipe}


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
                     model_ctx: int, bytes_per_token: int, device: str, free_bytes: int | None = None,
                     steps: int | None = None, sparse_steps: int | None = None, query_rows: int | None = None,
                     split_search: str = "auto", placement_search: str = "auto") -> CalibPlan:
    """The calibration context and chunk counts: the given values, else the model's trained context and a token budget,
    lowered (chunks first, then the context) until train + held-out activations fit MEMORY_SHARE of free memory; then
    the training recipe (given values, else the defaults above for the device and the context)."""
    reason = "given" if ctx is not None else "model context"
    ctx = ctx if ctx is not None else model_ctx
    on_gpu = str(device).startswith("cuda")
    if calib_tokens is None:
        calib_tokens = DEFAULT_TOKENS_SHORT if ctx <= SHORT_CTX else (DEFAULT_TOKENS_GPU if on_gpu else DEFAULT_TOKENS_CPU)
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
    cpu_long = not on_gpu and ctx > SHORT_CTX
    d_steps = CPU_LONG_STEPS if cpu_long else STEPS
    d_rows = max(MIN_QUERY_ROWS, min(QUERY_ROWS, CPU_ROW_KEYS // ctx)) if cpu_long else QUERY_ROWS
    d_split, d_place = ("coarse", "oneshot") if cpu_long else ("full", "greedy")
    given = (steps is not None or sparse_steps is not None or query_rows is not None or split_search != "auto"
             or placement_search != "auto")
    steps = d_steps if steps is None else steps
    recipe = "cpu long context" if cpu_long else "default"
    return CalibPlan(ctx=ctx, n_train=n_train, n_held=held(n_train), reason=reason, bytes_per_token=bytes_per_token,
                     steps=steps, sparse_steps=steps if sparse_steps is None else sparse_steps,
                     query_rows=d_rows if query_rows is None else query_rows,
                     split_search=d_split if split_search == "auto" else split_search,
                     placement_search=d_place if placement_search == "auto" else placement_search,
                     recipe=f"{recipe}, options given" if given else recipe)
