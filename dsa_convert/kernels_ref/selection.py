"""Key selection for sparse attention (docs/FORMAT.md §5) and equal-budget baselines.

Every function returns a bool mask [T, T]: mask[t, s] = query t attends key s. Rows are causal
(s <= t); a query with t + 1 <= top_k attends densely. All masks are shared by the heads of a layer.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _check(top_k: int, sink: int, local: int) -> None:
    if top_k <= 0 or sink < 0 or local < 0 or sink + local > top_k:
        raise ValueError(f"need top_k > 0 and 0 <= sink + local <= top_k (got K={top_k} S={sink} L={local})")


def _regions(T: int, top_k: int, sink: int, local: int, device=None) -> tuple[Tensor, Tensor, Tensor]:
    """(dense_rows [T], forced [T,T], middle [T,T]) as bool tensors."""
    t = torch.arange(T, device=device)[:, None]
    s = torch.arange(T, device=device)[None, :]
    causal = s <= t
    dense_rows = (t[:, 0] + 1) <= top_k
    forced = causal & ((s < sink) | (s >= t - local + 1))
    middle = causal & (s >= sink) & (s <= t - local)
    return dense_rows, forced, middle


def _top_by_row(vals: Tensor, valid: Tensor, n: int) -> Tensor:
    """bool [T, N]: per row the n highest ``vals`` among ``valid`` (ties -> lower index)."""
    out = torch.zeros_like(valid)
    if n <= 0:
        return out
    v = vals.float().masked_fill(~valid, float("-inf"))
    # stable descending sort keeps the lower index first among equal values
    order = torch.sort(v, dim=-1, descending=True, stable=True).indices[:, :n]
    out.scatter_(1, order, True)
    return out & valid


def select_tokens(scores: Tensor, top_k: int, sink: int, local: int) -> Tensor:
    """FORMAT §5 `token` selection from indexer scores [T, T]."""
    _check(top_k, sink, local)
    T = scores.shape[0]
    dense_rows, forced, middle = _regions(T, top_k, sink, local, scores.device)
    picked = _top_by_row(scores, middle, top_k - sink - local)
    mask = forced | picked
    causal = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
    mask[dense_rows] = causal[dense_rows]
    return mask


def select_blocks(scores: Tensor, top_k: int, sink: int, local: int, block_size: int) -> Tensor:
    """FORMAT §5 `block` selection: absolute blocks ⌊s/B⌋ scored by the max over their middle part."""
    _check(top_k, sink, local)
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    T = scores.shape[0]
    B = block_size
    dense_rows, forced, middle = _regions(T, top_k, sink, local, scores.device)
    nb = (T + B - 1) // B
    pad = nb * B - T
    v = scores.float().masked_fill(~middle, float("-inf"))
    v = torch.nn.functional.pad(v, (0, pad), value=float("-inf")).view(T, nb, B)
    bscore = v.max(dim=-1).values                                           # [T, nb]
    bvalid = torch.nn.functional.pad(middle, (0, pad), value=False).view(T, nb, B).any(-1)
    pick_b = _top_by_row(bscore, bvalid, (top_k - sink - local) // B)       # [T, nb]
    picked = pick_b.repeat_interleave(B, dim=1)[:, :T] & middle
    mask = forced | picked
    causal = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
    mask[dense_rows] = causal[dense_rows]
    return mask


def select(scores: Tensor, top_k: int, sink: int, local: int, mode: str = "token", block_size: int = 64) -> Tensor:
    if mode == "token":
        return select_tokens(scores, top_k, sink, local)
    if mode == "block":
        return select_blocks(scores, top_k, sink, local, block_size)
    raise ValueError(f"unknown selection mode {mode!r}")


# ---------------------------------------------------------------- baselines at equal budget K
def local_only(T: int, top_k: int, sink: int, device=None) -> Tensor:
    """Sinks + the most recent K − S positions (a sliding window with attention sinks)."""
    _check(top_k, sink, top_k - sink)
    dense_rows, forced, _ = _regions(T, top_k, sink, top_k - sink, device)
    mask = forced.clone()
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    mask[dense_rows] = causal[dense_rows]
    return mask


def random_select(T: int, top_k: int, sink: int, local: int, seed: int = 0, device=None) -> Tensor:
    """Forced sinks/local + K − S − L uniformly random middle positions (seeded, reproducible)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(T, T, generator=g).to(device)
    return select_tokens(r, top_k, sink, local)


def oracle_scores(q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
    """Dense causal attention probabilities summed over all query heads: q [nh,T,hd], k [nkv,T,hd]."""
    from .sparse_attention import attention_probs
    return attention_probs(q, k, scale=scale).sum(0)


def oracle(q: Tensor, k: Tensor, top_k: int, sink: int, local: int, scale: float | None = None) -> Tensor:
    """Same split as the indexer, middle picks ranked by the true head-summed dense attention."""
    return select_tokens(oracle_scores(q, k, scale), top_k, sink, local)
