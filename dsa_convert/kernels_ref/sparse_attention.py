"""Masked (sparse) scaled-dot-product attention with GQA, shared mask across heads (FORMAT §5)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def _expand_kv(kv: Tensor, n_head: int) -> Tensor:
    """[n_kv, T, hd] -> [n_head, T, hd]; query head i uses KV head i // (n_head / n_kv)."""
    n_kv = kv.shape[0]
    if n_head % n_kv:
        raise ValueError(f"n_head {n_head} not a multiple of n_kv {n_kv}")
    return kv.repeat_interleave(n_head // n_kv, dim=0)


def attention_logits(q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
    """[n_head, Tq, Tk] un-masked logits."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.matmul(q, _expand_kv(k, q.shape[0]).transpose(-1, -2)) * scale


def causal_mask(T: int, device=None) -> Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def attention_probs(q: Tensor, k: Tensor, mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Softmax attention probabilities [n_head, T, T] over ``mask`` (default causal)."""
    T = q.shape[1]
    mask = causal_mask(T, q.device) if mask is None else mask
    lg = attention_logits(q.float(), k.float(), scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(lg, dim=-1)


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                     scale: float | None = None) -> Tensor:
    """Attention of q [n_head,T,hd] over k/v [n_kv,T,hd] restricted to bool mask [T,T] (None = causal).

    Computed in float32 and returned in q's dtype. Every row of ``mask`` must select >= 1 key.
    """
    p = attention_probs(q, k, mask, scale)
    out = torch.matmul(p, _expand_kv(v.float(), q.shape[0]))
    return out.to(q.dtype)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    return sparse_attention(q, k, v, None, scale)
