"""Lightning-indexer reference math (docs/FORMAT.md §4).

Pure PyTorch, float32 by default. ``indexer_scores`` is the exact spec; ``indexer_qkw`` exposes
the intermediate q / k / w (differentiable) for training; ``indexer_keys`` / ``indexer_queries`` split them so that
long inputs are scored one block of query rows at a time (``block_scores``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class IndexerWeights:
    """One layer's indexer, numpy/gguf-py orientation ([rows, cols] = [out, in])."""

    W_q: Tensor        # [H*D, n_embd]; head j = rows j*D .. j*D+D-1
    W_k: Tensor        # [D, n_embd]
    gamma: Tensor      # [D]  LayerNorm weight
    beta: Tensor       # [D]  LayerNorm bias
    W_w: Tensor        # [H, n_embd]
    rope_dim: int      # R: leading dims that get NEOX RoPE (even, <= D)
    eps: float = 1e-6
    freq_base: float = 10000.0

    @property
    def n_head(self) -> int:
        return int(self.W_w.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.W_k.shape[0])

    def __post_init__(self) -> None:
        H, D = self.n_head, self.head_dim
        if tuple(self.W_q.shape) != (H * D, self.W_k.shape[1]):
            raise ValueError(f"W_q shape {tuple(self.W_q.shape)} != {(H * D, self.W_k.shape[1])}")
        if self.rope_dim % 2 or not 0 <= self.rope_dim <= D:
            raise ValueError(f"rope_dim {self.rope_dim} must be even and <= {D}")

    def to(self, dtype=None, device=None) -> "IndexerWeights":
        f = lambda t: t.to(dtype=dtype, device=device)  # noqa: E731
        return IndexerWeights(f(self.W_q), f(self.W_k), f(self.gamma), f(self.beta), f(self.W_w),
                              self.rope_dim, self.eps, self.freq_base)


def rope_neox(x: Tensor, positions: Tensor, rope_dim: int, base: float) -> Tensor:
    """NEOX RoPE on the leading ``rope_dim`` dims of the last axis; x [..., T, D], positions [T]."""
    if rope_dim == 0:
        return x
    half = rope_dim // 2
    i = torch.arange(half, dtype=torch.float64, device=x.device)
    freqs = base ** (-2.0 * i / rope_dim)                                   # [R/2]
    ang = positions.to(device=x.device, dtype=torch.float64)[:, None] * freqs[None, :]              # [T, R/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rope_dim], x[..., rope_dim:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


def indexer_qkw(x: Tensor, positions: Tensor, w: IndexerWeights) -> tuple[Tensor, Tensor, Tensor]:
    """q [H, T, D] (RoPE'd), k [T, D] (LayerNorm + RoPE), weights [T, H]."""
    T = x.shape[0]
    H, D = w.n_head, w.head_dim
    q = (x @ w.W_q.T).view(T, H, D).transpose(0, 1)                          # [H, T, D]
    k = torch.nn.functional.layer_norm(x @ w.W_k.T, (D,), w.gamma, w.beta, w.eps)
    wt = x @ w.W_w.T                                                         # [T, H]
    q = rope_neox(q, positions, w.rope_dim, w.freq_base)
    k = rope_neox(k, positions, w.rope_dim, w.freq_base)
    return q, k, wt


def scores_from_qkw(q: Tensor, k: Tensor, wt: Tensor, causal: bool = True) -> Tensor:
    """score(t, s) = 1/sqrt(D·H) Σ_j w_j(t) ReLU(q_j(t)·k(s)); q [H,Tq,D], k [Ts,D], wt [Tq,H]."""
    H, Tq, D = q.shape
    logits = torch.relu(torch.einsum("htd,sd->hts", q, k))                  # [H, Tq, Ts]
    s = torch.einsum("hts,th->ts", logits, wt) * (1.0 / math.sqrt(D * H))
    if causal:
        Ts = k.shape[0]
        off = Ts - Tq   # queries are the last Tq positions of the keys
        bad = torch.ones(Tq, Ts, dtype=torch.bool, device=s.device).triu(1 + off)
        s = s.masked_fill(bad, float("-inf"))
    return s


def block_scores(q: Tensor, k: Tensor, wt: Tensor) -> Tensor:
    """FORMAT §4 scores [B, S] of queries q [H, B, D] with head weights wt [B, H] against keys k [S, D], without the
    causal mask (the selection only ranks the middle region, which is causal). No autograd: ReLU in place, and the
    head sum is one batched [1, H] x [H, S] product per row (the same reduction as ``scores_from_qkw``'s einsum)."""
    H, B, D = q.shape
    r = torch.matmul(q.transpose(0, 1).reshape(B * H, D), k.T).relu_().view(B, H, -1)   # [B, H, S]
    return torch.bmm(wt[:, None, :], r)[:, 0].mul_(1.0 / math.sqrt(D * H))


def indexer_keys(x: Tensor, positions: Tensor, w: IndexerWeights) -> Tensor:
    """float32 indexer keys k(s) [T, D] (LayerNorm + RoPE) of x [T, n_embd]: per token, so computed once per layer
    (and cached for decoding) while the queries are taken per block of rows."""
    w32 = w.to(dtype=torch.float32, device=x.device)
    D = w32.head_dim
    k = torch.nn.functional.layer_norm(x.float() @ w32.W_k.T, (D,), w32.gamma, w32.beta, w32.eps)
    return rope_neox(k, positions, w32.rope_dim, w32.freq_base)


def indexer_queries(x: Tensor, positions: Tensor, w: IndexerWeights) -> tuple[Tensor, Tensor]:
    """float32 indexer queries q [H, T, D] (RoPE'd) and head weights [T, H] of x [T, n_embd]."""
    w32 = w.to(dtype=torch.float32, device=x.device)
    T, H, D = x.shape[0], w32.n_head, w32.head_dim
    q = (x.float() @ w32.W_q.T).view(T, H, D).transpose(0, 1)
    return rope_neox(q, positions, w32.rope_dim, w32.freq_base), x.float() @ w32.W_w.T


def indexer_scores(x: Tensor, positions: Tensor, w: IndexerWeights) -> Tensor:
    """FORMAT §4 scores [T, T] for x [T, n_embd]; −inf above the diagonal (s > t). Full matrix: for short inputs
    (DsaAttention scores blocks of rows with indexer_keys / indexer_queries / block_scores)."""
    q, wt = indexer_queries(x, positions, w)
    s = block_scores(q, indexer_keys(x, positions, w), wt)
    return s.masked_fill_(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
