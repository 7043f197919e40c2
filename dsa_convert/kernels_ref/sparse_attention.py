"""Masked (sparse) scaled-dot-product attention with GQA, shared mask across heads (FORMAT §5), and the
``DsaAttention`` hook that runs it inside ``RefModel.forward``, one block of query rows at a time (blocked.py: only
[rows, keys] scores / masks / probabilities exist, so a 32K context fits in a few GB), optionally over a KV cache
for incremental decoding (generate.py).

The plain functions (``attention_probs``, ``sparse_attention``) take q [n_head, Tq, hd] as the last Tq rows of
k / v [n_kv, S, hd] and a bool mask [Tq, S] (None: causal).
"""
from __future__ import annotations

import copy
import math

import torch
from torch import Tensor

from . import blocked
from . import selection as sel
from .asq import roundtrip_heads
from .indexer import block_scores, indexer_keys, indexer_queries
from .kv_cache import KvCache, LayerCache

ASQ_CHUNK_TOKENS = 2048   # tokens per ASQ round trip (its nearest-prototype search holds [tokens, C, hd])


def _scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def attention_logits(q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
    """[n_head, Tq, S] un-masked logits."""
    return blocked.logits(q, k, _scale(q, scale))


def attention_probs(q: Tensor, k: Tensor, mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Softmax attention probabilities [n_head, Tq, S] over ``mask`` (default causal), float32."""
    mask = blocked.causal_rows_mask(q.shape[1], k.shape[1], q.device) if mask is None else mask
    return blocked.probs(q, k, mask, _scale(q, scale))


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                     scale: float | None = None, rows: int | None = None) -> Tensor:
    """Attention of q [n_head,Tq,hd] over k/v [n_kv,S,hd] restricted to bool mask [Tq,S] (None = causal).

    Computed in float32 per block of ``rows`` query rows (None: by memory budget) and returned in q's dtype. Every
    row of ``mask`` must select >= 1 key.
    """
    return blocked.masked_attention(q, k, v, mask, _scale(q, scale), rows)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    return sparse_attention(q, k, v, None, scale)


def _asq_roundtrip(x: Tensor, protos: Tensor, bits: int) -> Tensor:
    """ASQ round trip of x [n_kv, T, hd] (per-head prototypes), ASQ_CHUNK_TOKENS tokens at a time (per token, so
    the result does not depend on the chunking)."""
    return torch.cat([roundtrip_heads(x[:, a:a + ASQ_CHUNK_TOKENS], protos, bits)
                      for a in range(0, x.shape[1], ASQ_CHUNK_TOKENS)], dim=1)


# ------------------------------------------------------------------ model attention hook
class DsaAttention:
    """``attention(layer, q, k, v, x, k_pre, positions)`` hook for ``RefModel.forward``.

    attn: dense | sparse (indexer, FORMAT §5) | local (sinks + window) | random | oracle (true
    head-summed dense attention ranks the middle picks, same split as sparse).
    kv:   f32 | f16 | q8_0 | q4_0 (K after RoPE, V; ggml block math) | asq (FORMAT §6; K in
          ``key_space``; pre_rope keys are decoded then RoPE'd with ``rope_keys(k_pre, positions)``).
    Layers without an indexer (``indexers`` lacks the layer) attend densely in ``sparse`` mode.
    ``indexer_types`` (FORMAT §4a, per layer: True = full, False = shared; None = all full): a shared layer attends
    over the selection of the last full layer before it in the same forward pass (layers are called in order); that
    selection is kept as its middle picks ([T, K − S − L] int32), not as a mask.
    ``random`` ranks the middle by ``selection.random_scores`` (a hash of seed + layer, query and key position).
    ``oracle_reduce``: how the oracle reduces the heads' dense probabilities to one ranking (selection.oracle_scores).

    Work is done per block of ``block_rows`` query rows (None: by a memory budget, blocked.py). With ``cache`` (or
    ``with_cache()``) every call appends its tokens' K / V (after the KV round trip), indexer keys and, for the
    oracle over a lossy cache, the raw keys, and its queries attend over everything cached: the queries of a call
    are the last rows of the cache, and positions equal cache indices (the token's index in the sequence).
    """

    def __init__(self, *, scale: float, attn: str = "dense", kv: str = "f32", top_k: int = 0, sink: int = 0,
                 local: int = 0, select: str = "token", block_size: int = 64, indexers: dict | None = None,
                 asq_protos: dict | None = None, residual_bits: int = 4, key_space: str = "pre_rope",
                 rope_keys=None, seed: int = 0, indexer_types: list[bool] | None = None,
                 block_rows: int | None = None, cache: bool = False, oracle_reduce: str = "sum"):
        if attn not in ("dense", "sparse", "local", "random", "oracle"):
            raise ValueError(f"unknown attention mode {attn!r}")
        if attn != "dense" and top_k <= 0:
            raise ValueError("sparse attention modes need top_k > 0")
        if oracle_reduce not in sel.ORACLE_REDUCE:
            raise ValueError(f"unknown oracle reduce {oracle_reduce!r}")
        self.oracle_reduce = oracle_reduce
        if block_rows is not None and block_rows <= 0:
            raise ValueError(f"block_rows must be > 0 (got {block_rows})")
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
        self.block_rows = block_rows
        self.cache: KvCache | None = KvCache() if cache else None
        self._shared: sel.Selection | None = None   # the last full layer's selection (this forward pass)

    def with_cache(self) -> "DsaAttention":
        """A copy of this hook with an empty KV cache (and fresh statistics) for one generated sequence."""
        c = copy.copy(self)
        c.cache, c.selected_fraction, c._shared = KvCache(), [], None
        return c

    def resume(self, other: "DsaAttention") -> "DsaAttention":
        """Continue, from its next layer, the forward pass ``other`` has run so far (RefModel.layers_from): take the
        selection a shared layer would reuse. Returns self."""
        self._shared = other._shared
        return self

    # ---- selection
    def _uses_indexer(self, layer: int) -> bool:
        return self.attn == "sparse" and self._is_full(layer) and self.indexers.get(layer) is not None

    def _is_full(self, layer: int) -> bool:
        return self.indexer_types is None or bool(self.indexer_types[layer])

    def _index_keys(self, layer: int, x: Tensor, positions: Tensor, lc: LayerCache | None) -> Tensor | None:
        """Indexer keys [S, D] of every key this call sees (cached ones + the new tokens'), or None."""
        if not self._uses_indexer(layer):
            return None
        kx = indexer_keys(x, positions, self.indexers[layer])
        return lc.index_k.append(kx) if lc is not None else kx

    def _selection(self, layer: int, q: Tensor, k_rank: Tensor | None, x: Tensor, positions: Tensor,
                   index_k: Tensor | None, n_keys: int) -> sel.Selection | None:
        """The selection of this call's query rows (the last q.shape[1] of n_keys keys); None = dense rows."""
        if layer == 0:
            self._shared = None                     # a new forward pass: no earlier full layer yet
        if self.attn == "sparse" and not self._is_full(layer):
            return self._shared
        if self.attn == "sparse" and index_k is None:
            return None                             # a layer without an indexer is dense and no source
        Tq = q.shape[1]
        row0 = n_keys - Tq
        out = None
        if self.attn != "dense" and n_keys > self.top_k:   # else every row has t + 1 <= K: dense
            if self.attn == "local":
                out = sel.Selection(torch.zeros(Tq, 0, dtype=torch.int32, device=q.device), row0, self.top_k,
                                    self.sink, self.top_k - self.sink)
            else:
                mode = "token" if self.attn == "random" else self.select
                picks = self._picks(layer, q, k_rank, x, positions, index_k, n_keys, mode)
                out = sel.Selection(picks, row0, self.top_k, self.sink, self.local, mode, self.block_size)
        if self.attn == "sparse":
            self._shared = out
        return out

    def _picks(self, layer: int, q: Tensor, k_rank: Tensor | None, x: Tensor, positions: Tensor,
               index_k: Tensor | None, n_keys: int, mode: str) -> Tensor:
        """int32 [Tq, n] middle picks (selection.pick_middle), scored one block of rows at a time; the rows that
        attend densely (t + 1 <= K) are not scored and keep zeros."""
        Tq = q.shape[1]
        row0 = n_keys - Tq
        budget = self.top_k - self.sink - self.local
        n = budget if mode == "token" else budget // self.block_size
        picks = torch.zeros(Tq, n, dtype=torch.int32, device=q.device)
        if self.attn == "sparse":
            qi, wt = indexer_queries(x, positions, self.indexers[layer])
            planes = qi.shape[0] + 6
        else:
            planes = 2 * q.shape[0] + 6 if self.attn == "oracle" else 8
        first = min(Tq, max(0, self.top_k - row0))  # rows before it attend densely
        for a, b in blocked.row_blocks(Tq - first, n_keys, planes, self.block_rows, q.device):
            a, b = a + first, b + first
            S = row0 + b
            if self.attn == "sparse":
                scores = block_scores(qi[:, a:b], index_k[:S], wt[a:b])
            elif self.attn == "oracle":
                scores = sel.oracle_scores(q[:, a:b], k_rank[:, :S], self.scale, self.oracle_reduce)
            else:
                rows = torch.arange(row0 + a, row0 + b, device=q.device)
                scores = sel.random_scores(rows, S, self.seed + layer)
            p = sel.pick_middle(scores, self.top_k, self.sink, self.local, mode, self.block_size)
            picks[a:b, :p.shape[1]] = p
        return picks

    def _mask(self, layer: int, q: Tensor, k: Tensor, x: Tensor, positions: Tensor) -> Tensor | None:
        """The full [T, T] mask of a forward call without cache (None = dense); for inspection at short T."""
        T = q.shape[1]
        sl = self._selection(layer, q, k, x, positions, self._index_keys(layer, x, positions, None), T)
        return None if sl is None else sl.mask(0, T, T)

    # ---- KV cache round trip
    def _kv(self, layer: int, k: Tensor, v: Tensor, k_pre: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        if self.kv == "asq":
            kp, vp = self.asq_protos[layer]
            if self.key_space == "pre_rope":
                k = self.rope_keys(_asq_roundtrip(k_pre, kp.to(k.device), self.bits), positions)
            else:
                k = _asq_roundtrip(k, kp.to(k.device), self.bits)
            return k, _asq_roundtrip(v, vp.to(v.device), self.bits)
        from .kvquant import kv_roundtrip
        return kv_roundtrip(k, self.kv), kv_roundtrip(v, self.kv)

    def __call__(self, layer, q, k, v, x, k_pre, positions):
        lc = self.cache.layer(layer) if self.cache is not None else None
        k_att, v_att = self._kv(layer, k, v, k_pre, positions)
        k_rank = None
        if lc is not None:
            k_att, v_att = lc.k.append(k_att), lc.v.append(v_att)
            if self.attn == "oracle":
                k_rank = k_att if self.kv == "f32" else lc.k_raw.append(k)
        elif self.attn == "oracle":
            k_rank = k
        Tq, S = q.shape[1], k_att.shape[1]
        index_k = self._index_keys(layer, x, positions, lc)
        sl = self._selection(layer, q, k_rank, x, positions, index_k, S)
        if sl is None:
            return blocked.masked_attention(q, k_att, v_att, None, self.scale, self.block_rows)
        row0 = S - Tq
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        selected = torch.zeros((), dtype=torch.int64, device=q.device)
        for a, b in blocked.row_blocks(Tq, S, 2, self.block_rows, q.device):
            n = row0 + b
            m = sl.mask(a, b, n)
            selected += torch.count_nonzero(m)
            out[:, a:b] = blocked.attend(q[:, a:b], k_att[:, :n], v_att[:, :n], m, self.scale)
        causal_cells = (S * (S + 1) - row0 * (row0 + 1)) / 2
        self.selected_fraction.append(float(selected) / causal_cells)
        return out.to(q.dtype)
