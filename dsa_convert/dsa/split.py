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


@torch.no_grad()
def nll_sum(lg: torch.Tensor, row: torch.Tensor, start: int) -> tuple[float, int]:
    """(summed next-token NLL in nats, positions) of one chunk's logits lg [T, vocab] over positions >= start."""
    tgt = row[start + 1:].to(lg.device)
    tot = 0.0
    for a in range(start, lg.shape[0] - 1, 2048):           # float64 a block of rows at a time: [32K, vocab] is 4 GB
        lp = torch.log_softmax(lg[a:min(a + 2048, lg.shape[0] - 1)].double(), -1)
        tot += float(-lp.gather(1, tgt[a - start:a - start + lp.shape[0], None]).sum())
    return tot, tgt.numel()


@torch.no_grad()
def calib_nll(model, tokens: torch.Tensor, attention, start: int) -> float:
    """Mean next-token NLL (nats) over positions >= start of each chunk in tokens [N, T]."""
    tot, cnt = 0.0, 0
    for row in tokens:
        t, n = nll_sum(model.forward(row, attention=attention), row, start)
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
