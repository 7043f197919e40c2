"""The lightning indexer's projections in a DSA GGUF (FORMAT.md §3).

`dsa convert` writes a layer's W_q, W_k and W_w stacked in one matrix, ``blk.N.indexer.attn_qkw.weight``
([H*D + D + H, n_embd] in numpy order), so that the runtime computes the three with one product. Files written before
2026-12-08 carry them apart, under upstream's names (``attn_q_b``, ``attn_k``, ``proj``); both layouts are read.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

QKW = "attn_qkw.weight"
SEPARATE = ("attn_q_b.weight", "attn_k.weight", "proj.weight")


def prefix(il: int) -> str:
    return f"blk.{il}.indexer."


def stack(W_q, W_k, W_w) -> np.ndarray:
    """[H*D + D + H, n_embd]: the rows of W_q, then W_k, then W_w."""
    return np.ascontiguousarray(np.concatenate([np.asarray(W_q), np.asarray(W_k), np.asarray(W_w)], axis=0))


def split(qkw, n_head: int, head_dim: int):
    """(W_q, W_k, W_w) of a stacked matrix (numpy array or torch tensor; views)."""
    hd = n_head * head_dim
    if qkw.shape[0] != hd + head_dim + n_head:
        raise ValueError(f"indexer attn_qkw has {qkw.shape[0]} rows, expected H*D + D + H = {hd + head_dim + n_head}")
    return qkw[:hd], qkw[hd:hd + head_dim], qkw[hd + head_dim:]


def has_indexer(has: Callable[[str], bool], il: int) -> bool:
    """Whether layer il carries its own indexer, in either layout."""
    p = prefix(il)
    return has(p + QKW) or has(p + SEPARATE[1])


def projections(has: Callable[[str], bool], get: Callable[[str], object], il: int, n_head: int, head_dim: int):
    """(W_q, W_k, W_w) of layer il from either layout; get(name) returns the array / tensor."""
    p = prefix(il)
    if has(p + QKW):
        return split(get(p + QKW), n_head, head_dim)
    return tuple(get(p + s) for s in SEPARATE)
