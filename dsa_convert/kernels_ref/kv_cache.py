"""Per-layer cache of what attention reads for earlier tokens, for incremental decoding with DsaAttention.

Each entry grows along its token axis with doubling capacity, so appending one token is O(1) amortised and
``view()`` returns the first n tokens without a copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


class GrowingTensor:
    """A tensor that grows along ``dim``; ``view()`` is the filled part."""

    def __init__(self, dim: int):
        self.dim, self.n = dim, 0
        self._buf: Tensor | None = None

    def append(self, x: Tensor) -> Tensor:
        add = x.shape[self.dim]
        if self._buf is None or self.n + add > self._buf.shape[self.dim]:
            cap = max(self.n + add, 2 * (self._buf.shape[self.dim] if self._buf is not None else 0), 16)
            shape = list(x.shape)
            shape[self.dim] = cap
            buf = torch.empty(shape, dtype=x.dtype, device=x.device)
            if self._buf is not None:
                buf.narrow(self.dim, 0, self.n).copy_(self.view())
            self._buf = buf
        self._buf.narrow(self.dim, self.n, add).copy_(x)
        self.n += add
        return self.view()

    def view(self) -> Tensor:
        return self._buf.narrow(self.dim, 0, self.n)


@dataclass
class LayerCache:
    """One layer: K / V as attention reads them (after the KV-cache round trip), the keys before that round trip
    (only when the oracle ranks by them and the cache is lossy) and the indexer keys [S, D] (full sparse layers)."""

    k: GrowingTensor = field(default_factory=lambda: GrowingTensor(1))
    v: GrowingTensor = field(default_factory=lambda: GrowingTensor(1))
    k_raw: GrowingTensor = field(default_factory=lambda: GrowingTensor(1))
    index_k: GrowingTensor = field(default_factory=lambda: GrowingTensor(0))

    @property
    def n_tokens(self) -> int:
        return self.k.n


class KvCache(dict):
    """layer -> LayerCache, created on first use."""

    def layer(self, il: int) -> LayerCache:
        if il not in self:
            self[il] = LayerCache()
        return self[il]

    @property
    def n_tokens(self) -> int:
        return self[min(self)].n_tokens if self else 0
