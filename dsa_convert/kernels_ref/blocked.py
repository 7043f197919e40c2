"""Attention computed per block of query rows, so that only [rows, keys] score / mask / probability tensors exist.

Convention shared by kernels_ref: the queries of a call are the *last* rows of its keys. A call with Tq queries over
S keys holds the query rows at absolute positions S − Tq .. S − 1 (a prefill has S = Tq; a decode step over a cache
has Tq = 1). A block of rows [a, b) of those queries only needs the keys [0, S − Tq + b) (causality), so every
per-block tensor is [b − a, S − Tq + b].

The number of rows per block follows a float32 element budget (``planes`` tensors of [rows, keys] at once), larger on
CUDA than on the CPU; pass ``rows`` to fix it (tests use small blocks to exercise the blocking).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CPU_BLOCK_ELEMENTS = 1 << 25     # 128 MiB of float32 per [rows, keys] plane group on the CPU
CUDA_BLOCK_ELEMENTS = 1 << 28    # 1 GiB on a GPU
MAX_BLOCK_ROWS = 4096


def block_rows(n_keys: int, planes: int = 1, device=None) -> int:
    """Rows per block such that ``planes`` float32 tensors of [rows, n_keys] stay within the device's budget."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    budget = CUDA_BLOCK_ELEMENTS if dev.type == "cuda" else CPU_BLOCK_ELEMENTS
    return max(16, min(MAX_BLOCK_ROWS, budget // max(1, planes * n_keys)))


def row_blocks(n_rows: int, n_keys: int, planes: int = 1, rows: int | None = None, device=None) -> list[tuple[int, int]]:
    """[a, b) ranges covering the n_rows query rows of a call over n_keys keys."""
    step = rows if rows is not None else block_rows(n_keys, planes, device)
    if step <= 0:
        raise ValueError(f"block rows must be > 0 (got {step})")
    return [(a, min(n_rows, a + step)) for a in range(0, n_rows, step)]


def causal_rows_mask(n_rows: int, n_keys: int, device=None) -> Tensor:
    """bool [n_rows, n_keys]: the rows are the last n_rows positions of the keys; row i sees s <= n_keys − n_rows + i."""
    t = torch.arange(n_keys - n_rows, n_keys, device=device)[:, None]
    return torch.arange(n_keys, device=device)[None, :] <= t


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Softmax attention of q [n_head, B, hd] over k / v [n_kv, S, hd] restricted to bool mask [B, S] (shared by the
    heads; GQA: query head i reads KV head i // (n_head / n_kv)). float32 math; [n_head, B, hd] float32 back.
    Every row of ``mask`` must select at least one key."""
    n_head, n_kv = q.shape[0], k.shape[0]
    if n_head % n_kv:
        raise ValueError(f"n_head {n_head} not a multiple of n_kv {n_kv}")
    k, v = k.float(), v.float()
    gqa = n_head != n_kv
    if gqa and q.is_cuda:
        # CUDA's memory-efficient kernel takes a mask but not GQA; its fallback would hold [n_head, B, S] scores
        k, v, gqa = k.repeat_interleave(n_head // n_kv, 0), v.repeat_interleave(n_head // n_kv, 0), False
    return F.scaled_dot_product_attention(q.float()[None], k[None], v[None], attn_mask=mask, scale=scale,
                                          enable_gqa=gqa)[0]


def logits(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Un-masked logits [n_head, B, S] of q [n_head, B, hd] against k [n_kv, S, hd] (GQA without copying k)."""
    n_head, B, hd = q.shape
    n_kv, S = k.shape[0], k.shape[1]
    if n_head % n_kv:
        raise ValueError(f"n_head {n_head} not a multiple of n_kv {n_kv}")
    qg = q.reshape(n_kv, (n_head // n_kv) * B, hd)
    return torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).view(n_head, B, S)


def probs(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Softmax probabilities [n_head, B, S] over bool mask [B, S] (float32)."""
    lg = logits(q.float(), k.float(), scale).masked_fill_(~mask, float("-inf"))
    return torch.softmax(lg, dim=-1)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, rows: int | None = None) -> Tensor:
    """Dense causal attention, blocked: q [n_head, Tq, hd] are the last Tq rows of k / v [n_kv, S, hd]."""
    return masked_attention(q, k, v, None, scale, rows)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                     rows: int | None = None) -> Tensor:
    """Attention of q [n_head, Tq, hd] (the last Tq rows) over k / v [n_kv, S, hd] within bool mask [Tq, S]
    (None: causal), one block of rows at a time; result in q's dtype."""
    Tq, S = q.shape[1], k.shape[1]
    row0 = S - Tq
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for a, b in row_blocks(Tq, S, planes=2, rows=rows, device=q.device):
        n = row0 + b
        m = causal_rows_mask(b - a, n, q.device) if mask is None else mask[a:b, :n]
        out[:, a:b] = attend(q[:, a:b], k[:, :n], v[:, :n], m, scale)
    return out.to(q.dtype)
