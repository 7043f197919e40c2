"""Choose which layers keep their own indexer when only n_full of them may (`--index-share G --index-place search`).

Start with a trained indexer in every layer and score, by held-out calibration NLL with the sparse model running in
every layer (a shared layer attends over the top-k of the last full layer before it, FORMAT §4a), what turning each
full layer but layer 0 into a shared one costs. Two searches (the layout GLM-5.2 writes as
``{arch}.attention.indexer.types``):

- ``greedy`` (IndexCache's training-free search): turn the cheapest layer into a shared one, score the remaining
  full layers again, repeat until n_full are left.
- ``oneshot`` (the CPU's default at long context, calib.py): score every layer once against the all-full layout and
  share the n_layer - n_full cheapest together, then score the chosen layout once.

Every candidate and its NLL are recorded in the report. A round scores a layout and each of its candidates with one
forward of the layout per held-out chunk, forked at each candidate layer: the layers before it are the same in both
layouts, so a candidate runs only the layers from its own on: a round of the all-full layout costs about
1 + (n_layer - 1) / 2 forwards. From 6 layers down to 3 the greedy search takes 3 rounds, 8 to 9 forwards (13 without
the forks); oneshot one round and the chosen layout, 4.5.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch

from ..kernels_ref.sparse_attention import DsaAttention
from .split import head_nll_sum

SEARCHES = ("greedy", "oneshot")


def n_full_layers(n_layer: int, share: int) -> int:
    """How many full layers `--index-share G` keeps: as many as the fixed pattern 0, G, 2G, ... has."""
    return math.ceil(n_layer / share)


def _attention(model, indexers: dict, full, *, top_k: int, sink: int, local: int, select: str,
               block_size: int) -> DsaAttention:
    """The sparse model with the indexers of the layers in ``full`` only, every other layer shared (FORMAT §4a)."""
    return DsaAttention(scale=model.hp.kq_scale, attn="sparse", top_k=top_k, sink=sink, local=local, select=select,
                        block_size=block_size, indexers={il: indexers[il] for il in full},
                        indexer_types=[il in full for il in range(model.hp.n_layer)])


@torch.no_grad()
def layout_nlls(model, tokens: torch.Tensor, indexers: dict, full, candidates=(), *, top_k: int, sink: int,
                local: int, select: str = "token", block_size: int = 64) -> tuple[float, dict[int, float]]:
    """Held-out NLL (positions >= top_k, split.head_nll_sum) of the layout ``full`` and, for each layer c of
    ``candidates`` (full layers other than 0), of ``full`` without c; see the module docstring."""
    full = set(full)
    if not set(candidates) <= full - {0}:
        raise ValueError("candidates must be full layers other than layer 0")
    kw = dict(top_k=top_k, sink=sink, local=local, select=select, block_size=block_size)
    start = min(top_k, tokens.shape[1] - 2)
    tot = {c: 0.0 for c in (None, *candidates)}
    cnt = 0
    for row in tokens:
        pos = torch.arange(row.shape[0])
        base = _attention(model, indexers, full, **kw)
        h = model.embed(row)
        for il in range(model.hp.n_layer):
            if il in tot:
                alt = _attention(model, indexers, full - {il}, **kw).resume(base)
                tot[il] += head_nll_sum(model, model.layers_from(il, h, pos, alt), row, start)[0]
            h = model.layer(il, h, pos, base)
        t, n = head_nll_sum(model, h, row, start)
        tot[None] += t
        cnt += n
    mean = {c: v / max(cnt, 1) for c, v in tot.items()}
    return mean.pop(None), mean


def layout_nll(model, tokens: torch.Tensor, indexers: dict, full, **kw) -> float:
    """Held-out NLL of the layout ``full`` alone (layout_nlls' keywords)."""
    return layout_nlls(model, tokens, indexers, full, **kw)[0]


def choose_full_layers(model, tokens: torch.Tensor, indexers: dict, *, n_full: int, top_k: int, sink: int,
                       local: int, select: str = "token", block_size: int = 64, search: str = "greedy",
                       progress: Optional[Callable[[dict], None]] = None) -> tuple[list[bool], dict]:
    """Return (types, report): types[il] True for the n_full layers kept full, chosen by ``search`` (see the module
    docstring) among the layers in ``indexers`` (layer 0 must be one of them and always stays full)."""
    if search not in SEARCHES:
        raise ValueError(f"placement search must be one of {', '.join(SEARCHES)} (got {search!r})")
    if 0 not in indexers:
        raise ValueError("layer 0 needs an indexer: it is always a full layer")
    n_full = max(1, n_full)
    full = set(indexers)
    t0 = time.time()
    kw = dict(top_k=top_k, sink=sink, local=local, select=select, block_size=block_size)
    steps = []
    nll_all, cands = layout_nlls(model, tokens, indexers, full, sorted(full - {0}), **kw)
    nll = nll_all
    while len(full) > n_full:
        if search == "greedy":
            shared = min(cands, key=cands.get)
            full.discard(shared)
            nll = cands[shared]
        else:
            shared = sorted(cands, key=cands.get)[:len(full) - n_full]
            full -= set(shared)
            nll = layout_nll(model, tokens, indexers, full, **kw)
        steps.append({"shared": shared, "nll": nll, "ppl": math.exp(nll),
                      "candidates": {str(j): v for j, v in cands.items()}})
        if progress is not None:
            progress({"stage": "placement", "shared": shared, "nll": nll, "full": sorted(full)})
        if len(full) > n_full:          # greedy: score the layers left
            _, cands = layout_nlls(model, tokens, indexers, full, sorted(full - {0}), **kw)
    types = [il in full for il in range(model.hp.n_layer)]
    report = {"method": search, "n_full": len(full), "full_layers": sorted(full), "nll_all_full": nll_all,
              "ppl_all_full": math.exp(nll_all), "nll": nll, "steps": steps,
              "positions_from": min(top_k, tokens.shape[1] - 2), "chunks": int(tokens.shape[0]),
              "seconds": time.time() - t0}
    return types, report
