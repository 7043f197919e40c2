"""Calibration text -> token chunks (tokenised with the model's own tokenizer.json), and how many chunks of which
length the retrofit reads (CalibPlan): the text's documents in file order, packed into chunks of the calibration context."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

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
# on a CPU the activations (the calibration passes' working set and the layers' data the sparse phase reuses) also
# stay within this many bytes unless --memory-budget says otherwise. The rest of the process is about 1.7 GiB for
# SmolLM2-135M at 2K (the model in float32, torch, the passes' transients: docs/data/smollm2/memory.md), so its
# default convert peaks near 3 GiB RSS (issue #69's target: 4 GiB), not at 13.5 GiB with all 30 layers' data kept
DEFAULT_CPU_MEMORY = 3 << 29

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
# the time budget picks among these, per calibration context from the model's own down (halving, while the context
# holds at least MIN_CTX_PER_TOP_K x top-k: a top-k trained at half its context picks little): "full" and then "light" at
# each context; light halves the steps and the calibration text, scores the split coarsely and fits the ASQ prototypes
# on a quarter of the vectors (SmolLM2: +0.7-2.0 % held-out reconstruction error, fits 1.2-5x faster;
# docs/data/smollm2/asq). Nothing lighter: a quarter of the steps and text ("minimal") cost SmolLM2-135M +11.3 % PPL at
# 2K against the full recipe's +1.4 % (docs/RESULTS.md §2.3), so over budget the plan runs light at the smallest
# context and says so
RECIPES = {"full": (1, 1, 1), "light": (2, 2, 4)}     # name -> (steps, tokens, ASQ vectors) divisors
MIN_TRAIN_CHUNKS = 2
MIN_CTX_PER_TOP_K = 4


@dataclass
class CalibPlan:
    """How much calibration text the retrofit reads, how long it trains, and why (the report states it)."""

    ctx: int                # tokens per chunk: the calibration context
    n_train: int            # chunks the indexers are distilled on
    n_held: int             # held-out chunks (split and layer-placement scores)
    reason: str             # where ctx came from: "given", "model context", or the budget that lowered it
    bytes_per_token: int    # activation bytes the retrofit keeps per calibration token (estimate)
    steps: int = STEPS              # dense warm-up steps per layer
    sparse_steps: int = STEPS       # sparse-phase steps per layer
    query_rows: int = QUERY_ROWS    # query rows per step
    split_search: str = "full"      # full | coarse: the split candidates scored (split.py)
    placement_search: str = "greedy"    # greedy | oneshot: how --index-share's full layers are searched (placement.py)
    recipe: str = "default"         # which defaults applied: "default", "cpu long context", or "given"
    level: str = "full"             # full | light (RECIPES): what the time budget allowed
    asq_div: int = 1                # the ASQ k-means fits on DsaConfig.asq_samples // asq_div vectors (RECIPES)
    memory_budget: int = 0          # bytes the calibration activations may take (0: not computed)
    time_budget: float | None = None    # seconds the plan was chosen for (None: no budget)
    estimate: dict = field(default_factory=dict)    # estimated seconds per stage of the chosen plan
    considered: list = field(default_factory=list)  # every (ctx, level) estimated, in the order tried

    @property
    def train_tokens(self) -> int:
        return self.ctx * self.n_train

    def as_report(self) -> dict:
        return {"ctx": self.ctx, "ctx_source": self.reason, "train_chunks": self.n_train, "held_chunks": self.n_held,
                "train_tokens": self.train_tokens, "held_tokens": self.n_held * self.ctx,
                "activation_bytes_per_token": self.bytes_per_token, "steps": self.steps,
                "sparse_steps": self.sparse_steps, "query_rows": self.query_rows, "split_search": self.split_search,
                "placement_search": self.placement_search, "recipe": self.recipe, "level": self.level,
                "asq_samples_divisor": self.asq_div,
                "memory_budget_mib": round(self.memory_budget / 2**20), "time_budget_s": self.time_budget,
                "estimate_s": self.estimate, "considered": self.considered}


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


def memory_budget(device: str, given: int | None = None, free_bytes: int | None = None) -> int:
    """Bytes the calibration activations may take: ``given`` (--memory-budget), else MEMORY_SHARE of the free memory,
    on a CPU at most DEFAULT_CPU_MEMORY."""
    if given is not None:
        return int(given)
    share = int(MEMORY_SHARE * (free_bytes if free_bytes is not None else free_memory_bytes(device)))
    return share if str(device).startswith("cuda") else min(share, DEFAULT_CPU_MEMORY)


def candidate_contexts(model_ctx: int, top_k: int | None, ctx: int | None) -> list[int]:
    """The calibration contexts the plan may choose: the given one, else the model's and its halvings while they hold
    at least MIN_CTX_PER_TOP_K x top-k (and 256 tokens); the model's own always."""
    if ctx is not None:
        return [ctx]
    out, c = [model_ctx], model_ctx // 2
    while c >= max(256, MIN_CTX_PER_TOP_K * (top_k or 0)):
        out.append(c)
        c //= 2
    return out


Estimator = Callable[["CalibPlan"], dict]


def plan_calibration(*, ctx: int | None, calib_tokens: int | None, calib_chunks: int | None, split_chunks: int | None,
                     model_ctx: int, bytes_per_token: int, device: str, free_bytes: int | None = None,
                     steps: int | None = None, sparse_steps: int | None = None, query_rows: int | None = None,
                     split_search: str = "auto", placement_search: str = "auto", top_k: int | None = None,
                     time_budget: float | None = None, estimator: Optional[Estimator] = None,
                     memory_bytes: int | None = None) -> CalibPlan:
    """The calibration context, chunk counts and training recipe. Without a time budget (or estimator): the given
    values, else the model's context and the full recipe, lowered until the activations fit the memory budget (chunks
    first, then the context). With one: the largest context (candidate_contexts) whose full, then light, recipe the
    estimator says fits ``time_budget`` seconds; else the light recipe at the smallest context (over budget: the
    reason says so). Given values (--calib-ctx, --steps, ...) hold in every recipe."""
    mem = memory_budget(device, memory_bytes, free_bytes)
    opts = dict(calib_tokens=calib_tokens, calib_chunks=calib_chunks, split_chunks=split_chunks,
                bytes_per_token=bytes_per_token, device=device, mem=mem, steps=steps, sparse_steps=sparse_steps,
                query_rows=query_rows, split_search=split_search, placement_search=placement_search)
    contexts = candidate_contexts(model_ctx, top_k, ctx)
    if time_budget is None or estimator is None:
        plan = _plan_at(contexts[0], "given" if ctx is not None else "model context", "full", model_ctx=model_ctx,
                        capped_ctx=ctx is None, **opts)
        if estimator is not None:       # no budget: the estimate is still stated
            plan.estimate = estimator(plan)
        return plan
    tried: list[dict] = []
    ladder = [(c, lv) for c in contexts for lv in ("full", "light")]
    best = None
    for c, lv in ladder:
        plan = _plan_at(c, "given" if ctx is not None else "model context", lv, model_ctx=model_ctx,
                        capped_ctx=False, **opts)
        if plan.ctx * (plan.n_train + plan.n_held) * bytes_per_token > mem and c != contexts[-1]:
            tried.append({"ctx": c, "level": lv, "fits_memory": False})
            continue
        est = estimator(plan)
        tried.append({"ctx": c, "level": lv, "estimate_s": est["total"], "fits": est["total"] <= time_budget})
        best = (plan, est)
        if est["total"] <= time_budget:
            break
    plan, est = best
    plan.time_budget, plan.estimate, plan.considered = time_budget, est, tried
    src = "given" if ctx is not None else ("model context" if plan.ctx == model_ctx else
                                           f"model context {model_ctx} lowered to {plan.ctx}")
    why = (f"fits the time budget ({est['total']:.0f} s estimated of {time_budget:.0f} s)"
           if est["total"] <= time_budget else
           f"over the time budget: the cheapest plan tried ({est['total']:.0f} s estimated > {time_budget:.0f} s)")
    plan.reason = f"{src}, {plan.level} recipe: {why}"
    return plan


def _plan_at(ctx: int, reason: str, level: str, *, model_ctx: int, capped_ctx: bool, calib_tokens, calib_chunks,
             split_chunks, bytes_per_token: int, device: str, mem: int, steps, sparse_steps, query_rows, split_search,
             placement_search) -> CalibPlan:
    """One plan at ``ctx`` and recipe ``level``; with ``capped_ctx`` the context halves until the memory fits."""
    on_gpu = str(device).startswith("cuda")
    steps_div, tok_div, asq_div = RECIPES[level]
    held = lambda n: split_chunks if split_chunks is not None else min(4, max(1, round(n / 8)))  # noqa: E731
    fits = lambda c, n: (n + held(n)) * c * bytes_per_token <= mem  # noqa: E731

    def chunks(c: int) -> int:
        if calib_chunks is not None:
            return calib_chunks
        tok = calib_tokens
        if tok is None:
            tok = DEFAULT_TOKENS_SHORT if c <= SHORT_CTX else (DEFAULT_TOKENS_GPU if on_gpu else DEFAULT_TOKENS_CPU)
            n = max(MIN_TRAIN_CHUNKS, tok // c // tok_div) if tok // c >= MIN_TRAIN_CHUNKS else max(1, tok // c)
        else:
            n = max(1, tok // c)
        while n > 1 and not fits(c, n):
            n -= 1
        return n

    n_train = chunks(ctx)
    if capped_ctx:
        while ctx > SHORT_CTX and not fits(ctx, n_train):
            ctx //= 2
            n_train = chunks(ctx)
            reason = f"model context {model_ctx} capped to {ctx} by memory ({mem / 2**30:.1f} GiB for activations)"
    cpu_long = not on_gpu and ctx > SHORT_CTX
    d_steps = max(1, (CPU_LONG_STEPS if cpu_long else STEPS) // steps_div)
    d_rows = max(MIN_QUERY_ROWS, min(QUERY_ROWS, CPU_ROW_KEYS // ctx)) if cpu_long else QUERY_ROWS
    d_split, d_place = ("coarse", "oneshot") if cpu_long or level != "full" else ("full", "greedy")
    given = (steps is not None or sparse_steps is not None or query_rows is not None or split_search != "auto"
             or placement_search != "auto")
    steps = d_steps if steps is None else steps
    recipe = "cpu long context" if cpu_long else "default"
    return CalibPlan(ctx=ctx, n_train=n_train, n_held=held(n_train), reason=reason, bytes_per_token=bytes_per_token,
                     steps=steps, sparse_steps=steps if sparse_steps is None else sparse_steps,
                     query_rows=d_rows if query_rows is None else query_rows,
                     split_search=d_split if split_search == "auto" else split_search,
                     placement_search=d_place if placement_search == "auto" else placement_search,
                     recipe=f"{recipe}, options given" if given else recipe, level=level, memory_budget=mem,
                     asq_div=asq_div)
