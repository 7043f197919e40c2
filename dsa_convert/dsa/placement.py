"""Choose which layers keep their own indexer when only n_full of them may (`--index-share G --index-place search`).

IndexCache's training-free greedy search (the layout GLM-5.2 writes as ``{arch}.attention.indexer.types``): start
with a trained indexer in every layer; at each step turn into a shared layer the one full layer (never layer 0) whose
loss of its own indexer raises the held-out calibration NLL the least, with the sparse model running in every layer
(a shared layer attends over the top-k of the last full layer before it, FORMAT §4a); stop at n_full full layers.
Every step's candidates and their NLL are recorded in the report. Cost: about n_layer² / 2 sparse forwards over the
held-out chunks (15 for 6 layers down to 2).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch

from ..kernels_ref.sparse_attention import DsaAttention
from .split import calib_nll


def n_full_layers(n_layer: int, share: int) -> int:
    """How many full layers `--index-share G` keeps: as many as the fixed pattern 0, G, 2G, ... has."""
    return math.ceil(n_layer / share)


def layout_nll(model, tokens: torch.Tensor, indexers: dict, full, *, top_k: int, sink: int, local: int,
               select: str = "token", block_size: int = 64) -> float:
    """Held-out NLL (split.calib_nll, positions >= top_k) with the indexers of the layers in ``full`` only, every
    other layer shared (FORMAT §4a)."""
    att = DsaAttention(scale=model.hp.kq_scale, attn="sparse", top_k=top_k, sink=sink, local=local, select=select,
                       block_size=block_size, indexers={il: indexers[il] for il in full},
                       indexer_types=[il in full for il in range(model.hp.n_layer)])
    return calib_nll(model, tokens, att, min(top_k, tokens.shape[1] - 2))


def choose_full_layers(model, tokens: torch.Tensor, indexers: dict, *, n_full: int, top_k: int, sink: int,
                       local: int, select: str = "token", block_size: int = 64,
                       progress: Optional[Callable[[dict], None]] = None) -> tuple[list[bool], dict]:
    """Return (types, report): types[il] True for the n_full layers kept full, chosen greedily (see the module
    docstring) among the layers in ``indexers`` (layer 0 must be one of them and always stays full)."""
    n = model.hp.n_layer
    if 0 not in indexers:
        raise ValueError("layer 0 needs an indexer: it is always a full layer")
    full = set(indexers)
    t0 = time.time()

    def nll(layers: set) -> float:
        return layout_nll(model, tokens, indexers, layers, top_k=top_k, sink=sink, local=local, select=select,
                          block_size=block_size)

    steps = []
    current = nll(full)
    while len(full) > max(1, n_full):
        cands = {il: nll(full - {il}) for il in sorted(full - {0})}
        il = min(cands, key=cands.get)
        full.discard(il)
        steps.append({"shared": il, "nll": cands[il], "ppl": math.exp(cands[il]),
                      "candidates": {str(j): v for j, v in cands.items()}})
        if progress is not None:
            progress({"stage": "placement", "shared": il, "nll": cands[il], "full": sorted(full)})
    types = [il in full for il in range(n)]
    report = {"method": "greedy", "n_full": len(full), "full_layers": sorted(full), "nll_all_full": current,
              "ppl_all_full": math.exp(current), "nll": steps[-1]["nll"] if steps else current,
              "steps": steps, "positions_from": min(top_k, tokens.shape[1] - 2), "chunks": int(tokens.shape[0]),
              "seconds": time.time() - t0}
    return types, report
