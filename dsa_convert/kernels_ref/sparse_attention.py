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


# ------------------------------------------------------------------ model attention hook
class DsaAttention:
    """``attention(layer, q, k, v, x, k_pre, positions)`` hook for ``RefModel.forward``.

    attn: dense | sparse (indexer, FORMAT §5) | local (sinks + window) | random | oracle (true
    head-summed dense attention ranks the middle picks, same split as sparse).
    kv:   f32 | f16 | q8_0 | q4_0 (K after RoPE, V; ggml block math) | asq (FORMAT §6; K in
          ``key_space``; pre_rope keys are decoded then RoPE'd with ``rope_keys(k_pre, positions)``).
    Layers without an indexer (``indexers`` lacks the layer) attend densely in ``sparse`` mode.
    ``indexer_types`` (FORMAT §4a, per layer: True = full, False = shared; None = all full): a shared layer attends
    over the selection of the last full layer before it in the same forward pass (layers are called in order).
    """

    def __init__(self, *, scale: float, attn: str = "dense", kv: str = "f32", top_k: int = 0, sink: int = 0,
                 local: int = 0, select: str = "token", block_size: int = 64, indexers: dict | None = None,
                 asq_protos: dict | None = None, residual_bits: int = 4, key_space: str = "pre_rope",
                 rope_keys=None, seed: int = 0, indexer_types: list[bool] | None = None):
        if attn not in ("dense", "sparse", "local", "random", "oracle"):
            raise ValueError(f"unknown attention mode {attn!r}")
        if attn != "dense" and top_k <= 0:
            raise ValueError("sparse attention modes need top_k > 0")
        self.scale, self.attn, self.kv = scale, attn, kv
        self.top_k, self.sink, self.local = top_k, sink, local
        self.select, self.block_size = select, block_size
        self.indexers = indexers or {}
        self.asq_protos = asq_protos or {}          # layer -> (k_proto [n_kv,C,hd], v_proto [n_kv,C,hd])
        self.bits, self.key_space, self.rope_keys, self.seed = residual_bits, key_space, rope_keys, seed
        self.selected_fraction: list[float] = []    # mean |mask row| / (t+1), for reports
        self.indexer_types = list(indexer_types) if indexer_types is not None else None
        if self.indexer_types and not self.indexer_types[0]:
            raise ValueError("attention.indexer.types[0] must be full: a shared layer reuses an earlier full layer")
        self._full_mask: Tensor | None = None       # the last full layer's selection (this forward pass)

    def _mask(self, layer: int, q: Tensor, k: Tensor, x: Tensor, positions: Tensor) -> Tensor | None:
        from . import selection as sel
        T = q.shape[1]
        if self.attn == "sparse" and self.indexer_types is not None and not self.indexer_types[layer]:
            return self._full_mask
        if self.attn == "sparse" and self.indexers.get(layer) is not None:
            self._full_mask = None                  # set below unless the whole context fits the budget
        if self.attn == "dense" or T <= self.top_k:
            return None
        if self.attn == "local":
            return sel.local_only(T, self.top_k, self.sink, q.device)
        if self.attn == "random":
            return sel.random_select(T, self.top_k, self.sink, self.local, self.seed + layer, q.device)
        if self.attn == "oracle":
            scores = sel.oracle_scores(q, k, self.scale)
        else:
            from .indexer import indexer_scores
            w = self.indexers.get(layer)
            if w is None:
                return None
            scores = indexer_scores(x, positions, w)
        mask = sel.select(scores, self.top_k, self.sink, self.local, self.select, self.block_size)
        if self.attn == "sparse":
            self._full_mask = mask
        return mask

    def _kv(self, layer: int, k: Tensor, v: Tensor, k_pre: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        if self.kv == "asq":
            from .asq import roundtrip_heads
            kp, vp = self.asq_protos[layer]
            if self.key_space == "pre_rope":
                k = self.rope_keys(roundtrip_heads(k_pre, kp.to(k.device), self.bits), positions)
            else:
                k = roundtrip_heads(k, kp.to(k.device), self.bits)
            return k, roundtrip_heads(v, vp.to(v.device), self.bits)
        from .kvquant import kv_roundtrip
        return kv_roundtrip(k, self.kv), kv_roundtrip(v, self.kv)

    def __call__(self, layer, q, k, v, x, k_pre, positions):
        mask = self._mask(layer, q, k, x, positions)
        k, v = self._kv(layer, k, v, k_pre, positions)
        if mask is not None:
            T = q.shape[1]
            self.selected_fraction.append(float(mask.sum()) / (T * (T + 1) / 2))
        return sparse_attention(q, k, v, mask, self.scale)
