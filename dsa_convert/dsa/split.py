"""Choose the sink / local / indexer split of the top-k budget by measured calibration loss.

The loss is the mean next-token NLL over held-out calibration positions t >= top_k (earlier
positions attend densely and do not depend on the split), with the sparse model (trained indexers)
running in every layer. Search: local L over fractions of K at a starting sink, then the sink at the
best L. Every candidate and its loss is recorded in the report.

``search="coarse"`` (the CPU's default at long context, calib.py): local L over COARSE_LOCAL_FRACTIONS at the
starting sink, then only the sinks of COARSE_SINKS, and no dense reference NLL: at 32K on a 2-core CPU a sparse forward
of one held-out chunk takes 1.2-1.5 min, so the full search (9 forwards) alone would take about 13 min of a 30 min
budget.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch

from ..kernels_ref.sparse_attention import DsaAttention

LOCAL_FRACTIONS = (0.125, 0.25, 0.5, 0.75, 0.875)
SINK_CANDIDATES = (1, 4, 16, 64)
COARSE_LOCAL_FRACTIONS = (0.5, 0.875)
COARSE_SINKS = (1,)


NLL_ROWS = 256     # rows of logits at a time: SmolLM2's vocabulary 49,152 x 256 rows is 48 MiB in float32, 96 MiB in
                   # float64 (the whole [2K, vocab] chunk in float64 was 768 MiB, twice: the cast and the log-softmax)


@torch.no_grad()
def nll_sum(lg: torch.Tensor, row: torch.Tensor, start: int, rows: int | None = None) -> tuple[float, int]:
    """(summed next-token NLL in nats, positions) of one chunk's logits lg [T, vocab] over positions >= start."""
    return head_nll_sum(None, lg, row, start, rows)


@torch.no_grad()
def head_nll_sum(model, h: torch.Tensor, row: torch.Tensor, start: int,
                 rows: int | None = None) -> tuple[float, int]:
    """(summed next-token NLL in nats, positions) over positions >= start of one chunk whose last hidden states are
    h [T, n_embd], the LM head (model.head) applied ``rows`` (default NLL_ROWS) rows at a time; model None: h holds
    the logits already. Each row's log-softmax is its own, so blocks of given logits give the values of one
    [T, vocab] float64 log-softmax; only the sum's order differs (float64 rounding). The head's float32 matmul over a
    block equals the whole matrix's rows where the BLAS computes a row the same way at any row count (MKL on this
    project's CPU: blocks of 64 rows and more, bit for bit; 1 or 7 rows differ by float32 rounding)."""
    tgt = row[start + 1:].to(h.device)
    rows = rows or NLL_ROWS
    tot = 0.0
    for a in range(start, h.shape[0] - 1, rows):
        b = min(a + rows, h.shape[0] - 1)
        lg = h[a:b] if model is None else model.head(h[a:b])
        lp = torch.log_softmax(lg.double(), -1)
        tot += float(-lp.gather(1, tgt[a - start:b - start, None]).sum())
        del lg, lp
    return tot, tgt.numel()


@torch.no_grad()
def calib_nll(model, tokens: torch.Tensor, attention, start: int) -> float:
    """Mean next-token NLL (nats) over positions >= start of each chunk in tokens [N, T] (the LM head over row
    blocks: never a [T, vocab] logits matrix)."""
    tot, cnt = 0.0, 0
    for row in tokens:
        t, n = head_nll_sum(model, model.forward(row, attention=attention, hidden=True), row, start)
        tot, cnt = tot + t, cnt + n
    return tot / max(cnt, 1)


def _align(n: int, select: str, block_size: int) -> int:
    return n if select == "token" else max(block_size, (n // block_size) * block_size)


def local_candidates(top_k: int, sink: int, select: str = "token", block_size: int = 64,
                     fractions: tuple[float, ...] = LOCAL_FRACTIONS) -> list[int]:
    out = []
    for f in fractions:
        L = max(1, int(round(top_k * f)))
        L = min(L, top_k - sink)
        if select == "block":   # keep the indexer's share a whole number of blocks
            L = top_k - sink - _align(top_k - sink - L, select, block_size)
        if L >= 1 and L not in out:
            out.append(L)
    return out


def choose_split(model, tokens: torch.Tensor, indexers: dict, *, top_k: int, sink: Optional[int],
                 select: str = "token", block_size: int = 64,
                 progress: Optional[Callable[[dict], None]] = None,
                 indexer_types: Optional[list[bool]] = None, search: str = "full") -> tuple[int, int, dict]:
    """Return (sink, local, report) minimising held-out calibration NLL at budget top_k (search: full | coarse)."""
    if search not in ("full", "coarse"):
        raise ValueError(f"split search must be full or coarse (got {search!r})")
    coarse = search == "coarse"
    T = tokens.shape[1]
    start = min(top_k, T - 2)
    t0 = time.time()
    table: list[dict] = []
    cache: dict[tuple[int, int], float] = {}

    def score(S: int, L: int) -> float:
        if (S, L) not in cache:
            att = DsaAttention(scale=model.hp.kq_scale, attn="sparse", top_k=top_k, sink=S, local=L,
                               select=select, block_size=block_size, indexers=indexers,
                               indexer_types=indexer_types)
            nll = calib_nll(model, tokens, att, start)
            cache[(S, L)] = nll
            table.append({"sink": S, "local": L, "nll": nll, "ppl": math.exp(nll)})
            if progress is not None:
                progress({"stage": "split", "sink": S, "local": L, "nll": nll})
        return cache[(S, L)]

    S0 = sink if sink is not None else 4
    S0 = min(S0, top_k - 1)
    fractions = COARSE_LOCAL_FRACTIONS if coarse else LOCAL_FRACTIONS
    best_L = min(local_candidates(top_k, S0, select, block_size, fractions), key=lambda L: score(S0, L))
    best_S = S0
    if sink is None:
        for S in COARSE_SINKS if coarse else SINK_CANDIDATES:
            if S != S0 and S + best_L <= top_k:
                score(S, best_L)
        best_S = min((s for (s, L) in cache if L == best_L), key=lambda s: cache[(s, best_L)])
    dense_nll = None if coarse else calib_nll(model, tokens, None, start)
    report = {"search": search, "candidates": table, "sink": best_S, "local": best_L, "dense_nll": dense_nll,
              "dense_ppl": None if dense_nll is None else math.exp(dense_nll),
              "best_ppl": math.exp(cache[(best_S, best_L)]),
              "positions_from": start, "chunks": int(tokens.shape[0]), "seconds": time.time() - t0}
    return best_S, best_L, report
