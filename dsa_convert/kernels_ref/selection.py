"""Key selection for sparse attention (docs/FORMAT.md §5) and equal-budget baselines.

Masks are bool [B, S]: mask[i, s] = query row i attends key s. The rows are query positions row0 .. row0 + B − 1
over keys 0 .. S − 1; by default the rows are the last B positions of the keys (row0 = S − B, so a square [T, T]
score matrix is the whole causal problem, as in blocked.py). Rows are causal (s <= t); a query with t + 1 <= top_k
attends densely. All masks are shared by the heads of a layer.

A selection is kept compactly as its middle picks ([B, n] int32: token positions, or block ids in `block` mode);
the forced sinks / local window and the dense rows follow from the positions (``mask_from_picks``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import blocked


def _check(top_k: int, sink: int, local: int) -> None:
    if top_k <= 0 or sink < 0 or local < 0 or sink + local > top_k:
        raise ValueError(f"need top_k > 0 and 0 <= sink + local <= top_k (got K={top_k} S={sink} L={local})")


def _row_positions(n_rows: int, n_keys: int, row0: int | Tensor | None, device) -> Tensor:
    """long [B]: the query position of each row: row0 .. row0 + B − 1, or row0 itself when it is a tensor of positions
    (any rows of the problem, e.g. the query rows a training step samples)."""
    if isinstance(row0, Tensor):
        if row0.shape != (n_rows,):
            raise ValueError(f"row positions {tuple(row0.shape)} for {n_rows} rows")
        if n_rows and (int(row0.min()) < 0 or int(row0.max()) >= n_keys):
            raise ValueError(f"query rows {int(row0.min())}..{int(row0.max())} do not fit {n_keys} keys")
        return row0.to(device=device, dtype=torch.long)
    r = n_keys - n_rows if row0 is None else row0
    if r < 0 or r + n_rows > n_keys:
        raise ValueError(f"query rows {r}..{r + n_rows - 1} do not fit {n_keys} keys")
    return torch.arange(r, r + n_rows, device=device)


def top_indices(vals: Tensor, valid: Tensor | None, n: int) -> Tensor:
    """long [B, n]: per row the indices (in no particular order) of the n highest ``vals`` among ``valid`` (None:
    all), ties -> lower index.

    Invalid entries rank below every valid one (−inf); a row with fewer than n valid entries is filled with its
    lowest invalid indices (callers mask them out). The same set as a stable descending sort, at topk cost: the
    n + 1 highest are found, and only rows where the n-th and (n+1)-th are equal (a tie across the cut) are
    resolved by position."""
    B, N = vals.shape
    n = min(n, N)
    if n <= 0:
        return torch.zeros(B, 0, dtype=torch.long, device=vals.device)
    if n == N:
        return torch.arange(N, device=vals.device).expand(B, N).clone()
    v = vals.float() if valid is None else vals.float().masked_fill(~valid, float("-inf"))
    top, idx = torch.topk(v, n + 1, dim=-1, sorted=False)
    low = torch.topk(top, 2, dim=-1, largest=False)                         # the (n+1)-th and n-th highest
    keep = torch.ones_like(idx, dtype=torch.bool).scatter_(1, low.indices[:, :1], False)
    out = idx[keep].view(B, n)                                              # all but the (n+1)-th
    kth = low.values[:, 1:]
    straddle = (low.values[:, 0] == low.values[:, 1]).nonzero()[:, 0]
    if straddle.numel():
        vs, ks = v[straddle], kth[straddle]
        above, tied = vs > ks, vs == ks
        need = n - above.sum(dim=-1, keepdim=True)
        take = above | (tied & (tied.cumsum(dim=-1) <= need))             # the lowest-index ties fill the rest
        out[straddle] = take.nonzero()[:, 1].view(-1, n)
    return out


def _middle_values(scores: Tensor, t: Tensor, sink: int, local: int) -> Tensor:
    """float32 copy of scores [B, S] with −inf outside each row's middle region [sink, t − local] (t: [B])."""
    B, S = scores.shape
    last = t[:, None] - local                                                           # t − L
    v = scores.float().masked_fill(torch.arange(S, device=scores.device)[None, :] > last, float("-inf"))
    v[:, :sink] = float("-inf")
    return v


def pick_middle(scores: Tensor, top_k: int, sink: int, local: int, mode: str = "token", block_size: int = 64,
                row0: int | Tensor | None = None) -> Tensor:
    """int32 [B, n] middle picks of scores [B, S] (FORMAT §5 steps 3/4): token positions (n = K − S − L) or block
    ids (n = ⌊(K − S − L) / B⌋). Rows that attend densely carry arbitrary picks. row0: the first row's position, or
    a long [B] tensor of every row's position."""
    _check(top_k, sink, local)
    if mode not in ("token", "block"):
        raise ValueError(f"unknown selection mode {mode!r}")
    B, S = scores.shape
    v = _middle_values(scores, _row_positions(B, S, row0, scores.device), sink, local)
    if mode == "token":
        return top_indices(v, None, top_k - sink - local).to(torch.int32)
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    nb = (S + block_size - 1) // block_size
    v = torch.nn.functional.pad(v, (0, nb * block_size - S), value=float("-inf")).view(B, nb, block_size)
    vmax = v.amax(dim=-1)                                                   # [B, nb]
    bvalid = (v > float("-inf")).any(dim=-1)
    return top_indices(vmax, bvalid, (top_k - sink - local) // block_size).to(torch.int32)


def mask_from_picks(picks: Tensor, n_keys: int, top_k: int, sink: int, local: int, mode: str = "token",
                    block_size: int = 64, row0: int | Tensor | None = None) -> Tensor:
    """bool [B, n_keys] for the rows of ``picks`` [B, n]: forced sinks / window | picks within the middle region,
    and the causal row for rows with t + 1 <= top_k."""
    B, dev = picks.shape[0], picks.device
    t = _row_positions(B, n_keys, row0, dev)[:, None]
    s = torch.arange(n_keys, device=dev)[None, :]
    causal = s <= t
    mask = causal & (s >= t - local + 1)                                    # the local window
    mask[:, :sink] = causal[:, :sink]                                       # the sinks
    if picks.shape[1]:
        if mode == "token":
            picked = torch.zeros(B, n_keys, dtype=torch.bool, device=dev).scatter_(1, picks.long(), True)
        else:
            nb = (n_keys + block_size - 1) // block_size
            pb = torch.zeros(B, nb, dtype=torch.bool, device=dev).scatter_(1, picks.long(), True)
            picked = pb.repeat_interleave(block_size, dim=1)[:, :n_keys]
        picked &= s <= t - local                                            # the middle region [sink, t − L]
        picked[:, :sink] = False
        mask |= picked
    dense = t[:, 0] + 1 <= top_k                                            # rows t + 1 <= K: dense
    mask[dense] = causal[dense]
    return mask


def select_tokens(scores: Tensor, top_k: int, sink: int, local: int, row0: int | Tensor | None = None) -> Tensor:
    """FORMAT §5 `token` selection from indexer scores [B, S] (rows row0 .., or at the positions of a row0 tensor;
    default the last B positions)."""
    picks = pick_middle(scores, top_k, sink, local, "token", row0=row0)
    return mask_from_picks(picks, scores.shape[1], top_k, sink, local, "token", row0=row0)


def select_blocks(scores: Tensor, top_k: int, sink: int, local: int, block_size: int,
                  row0: int | Tensor | None = None) -> Tensor:
    """FORMAT §5 `block` selection: absolute blocks ⌊s/B⌋ scored by the max over their middle part."""
    picks = pick_middle(scores, top_k, sink, local, "block", block_size, row0)
    return mask_from_picks(picks, scores.shape[1], top_k, sink, local, "block", block_size, row0)


def select(scores: Tensor, top_k: int, sink: int, local: int, mode: str = "token", block_size: int = 64,
           row0: int | Tensor | None = None) -> Tensor:
    if mode == "token":
        return select_tokens(scores, top_k, sink, local, row0)
    if mode == "block":
        return select_blocks(scores, top_k, sink, local, block_size, row0)
    raise ValueError(f"unknown selection mode {mode!r}")


@dataclass
class Selection:
    """One layer's selection for the query rows row0 .. row0 + n − 1 of a forward call, stored as middle picks
    [n, m] int32 (4·m bytes per row instead of a [T, T] mask); ``mask(a, b, n_keys)`` rebuilds rows [a, b)."""

    picks: Tensor
    row0: int
    top_k: int
    sink: int
    local: int
    mode: str = "token"
    block_size: int = 64

    def mask(self, a: int, b: int, n_keys: int) -> Tensor:
        return mask_from_picks(self.picks[a:b], n_keys, self.top_k, self.sink, self.local, self.mode,
                               self.block_size, self.row0 + a)


# ---------------------------------------------------------------- baselines at equal budget K
def local_only(T: int, top_k: int, sink: int, device=None, n_rows: int | None = None) -> Tensor:
    """Sinks + the most recent K − S positions (a sliding window with attention sinks); [n_rows, T] for the last
    n_rows query rows (default all T)."""
    _check(top_k, sink, top_k - sink)
    B = T if n_rows is None else n_rows
    return mask_from_picks(torch.zeros(B, 0, dtype=torch.int32, device=device), T, top_k, sink, top_k - sink)


_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x · c) mod 2³² for int64 x in [0, 2³²) without leaving the int64 range."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (lowbias32: xor-shift / multiply rounds) of int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_scores(rows: Tensor, n_keys: int, seed: int) -> Tensor:
    """float32 [B, n_keys] in [0, 1): a hash of (seed, query position, key position). Each entry depends on nothing
    else, so a row is the same whatever the block, the context length or the device (not torch's generator)."""
    h_seed = _mix32(torch.tensor(seed & _M32, dtype=torch.int64))
    h_row = _mix32((rows.to(torch.int64) ^ h_seed) & _M32)
    s = torch.arange(n_keys, dtype=torch.int64, device=rows.device)
    h = _mix32((_mul32(h_row, 0x9E3779B1)[:, None] + s[None, :]) & _M32)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def random_select(T: int, top_k: int, sink: int, local: int, seed: int = 0, device=None) -> Tensor:
    """Forced sinks/local + K − S − L uniformly random middle positions (seeded, reproducible: random_scores)."""
    return select_tokens(random_scores(torch.arange(T, device=device), T, seed), top_k, sink, local)


ORACLE_REDUCE = ("sum", "max")


def oracle_scores(q: Tensor, k: Tensor, scale: float | None = None, reduce: str = "sum") -> Tensor:
    """Dense causal attention probabilities of q [nh,B,hd] (the last B rows) over k [nkv,S,hd], reduced over all
    query heads: ``sum`` (the indexer's distillation target, up to a factor) or ``max`` (a key any one head needs
    ranks high). One selection per layer either way, as the runtime shares it by all heads (FORMAT §5)."""
    if reduce not in ORACLE_REDUCE:
        raise ValueError(f"oracle reduce must be one of {', '.join(ORACLE_REDUCE)} (got {reduce!r})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = blocked.probs(q, k, blocked.causal_rows_mask(q.shape[1], k.shape[1], q.device), scale)
    return p.sum(0) if reduce == "sum" else p.amax(0)


def oracle(q: Tensor, k: Tensor, top_k: int, sink: int, local: int, scale: float | None = None,
           reduce: str = "sum") -> Tensor:
    """Same split as the indexer, middle picks ranked by the true dense attention reduced over heads."""
    return select_tokens(oracle_scores(q, k, scale, reduce), top_k, sink, local)
