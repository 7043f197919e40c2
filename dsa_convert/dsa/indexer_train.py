"""Distil one layer's lightning indexer from the frozen dense attention (DeepSeek-V3.2 recipe).

Target for query t: the dense attention probabilities of the layer summed over heads and
renormalised, p_t(s) (s <= t); with ``--index-share G --index-place every`` (FORMAT §4a), for a full layer whose
top-k the following shared layers reuse, the mean of that target over the layer and its shared layers (the default
``search`` layout trains every layer on its own target). Phase 1 (dense warm-up) minimises KL(p_t || softmax_s score(t, s))
over all s <= t. Phase 2 (sparse) restricts both distributions to the keys the current indexer
would select (FORMAT §5) with the chosen sink/local split (``sparse_target='selected'``, DeepSeek) or
to the middle region the indexer actually picks from, [sink, t − local] (``'middle'``). Only query rows t >= top_k are used in
phase 2 (earlier rows attend densely); phase 1 samples rows from t >= min(top_k, T/2).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from ..kernels_ref.indexer import IndexerWeights, rope_neox, scores_from_qkw
from ..kernels_ref.selection import select as select_keys

ProgressFn = Callable[[dict], None]


@dataclass
class LayerCalib:
    """One layer's calibration activations for N chunks of T tokens (positions 0..T-1)."""

    x: Tensor      # [N, T, n_embd] attn_norm output
    q: Tensor      # [N, n_head, T, hd] main query after RoPE
    k: Tensor      # [N, n_kv, T, hd] main key after RoPE
    scale: float   # main attention kq scale
    members: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (q, k) of the shared layers that follow

    def target(self, n: int, rows: Tensor, dev) -> Tensor:
        """Chunk n's distillation target for query ``rows``: the layer's (and its shared layers') mean dense target."""
        qk = [(self.q, self.k)] + list(self.members)
        return sum(dense_target(q[n].to(dev, torch.float32), k[n].to(dev, torch.float32), rows, self.scale)
                   for q, k in qk) / len(qk)


@dataclass
class TrainLog:
    dense_loss: list[float] = field(default_factory=list)
    sparse_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0


def init_indexer(n_embd: int, H: int, D: int, R: int, eps: float, base: float, seed: int) -> IndexerWeights:
    g = torch.Generator().manual_seed(seed)
    std = 1.0 / math.sqrt(n_embd)
    r = lambda *s: torch.randn(*s, generator=g) * std  # noqa: E731
    return IndexerWeights(W_q=r(H * D, n_embd), W_k=r(D, n_embd), gamma=torch.ones(D), beta=torch.zeros(D),
                          W_w=r(H, n_embd), rope_dim=R, eps=eps, freq_base=base)


def dense_target(q: Tensor, k: Tensor, rows: Tensor, scale: float) -> Tensor:
    """Head-summed, renormalised dense causal attention probs for query ``rows``: [len(rows), T]."""
    T = k.shape[1]
    rep = q.shape[0] // k.shape[0]
    kk = k.repeat_interleave(rep, 0)
    lg = torch.matmul(q[:, rows], kk.transpose(-1, -2)) * scale              # [nh, R, T]
    bad = torch.arange(T, device=q.device)[None, :] > rows[:, None]
    lg = lg.masked_fill(bad[None], float("-inf"))
    return torch.softmax(lg.float(), -1).mean(0)


def _row_scores(w: IndexerWeights, x: Tensor, rows: Tensor, positions: Tensor) -> Tensor:
    """Indexer scores [R, T] for query rows (−inf for s > t). Keys for every position, queries and weights for the rows
    only: at a 32K calibration context the queries of all positions would be most of a step's work."""
    H, D = w.n_head, w.head_dim
    k = rope_neox(torch.nn.functional.layer_norm(x @ w.W_k.T, (D,), w.gamma, w.beta, w.eps), positions, w.rope_dim,
                  w.freq_base)                                                    # [T, D]
    xr = x[rows]
    q = rope_neox((xr @ w.W_q.T).view(-1, H, D).transpose(0, 1), positions[rows], w.rope_dim, w.freq_base)
    s = scores_from_qkw(q, k, xr @ w.W_w.T, causal=False)
    bad = torch.arange(x.shape[0], device=x.device)[None, :] > rows[:, None]
    return s.masked_fill(bad, float("-inf"))


def kl_loss(target: Tensor, scores: Tensor, keep: Tensor) -> Tensor:
    """mean over rows of KL(target‖softmax(scores)), both restricted to ``keep`` and renormalised."""
    t = target.masked_fill(~keep, 0.0)
    t = t / t.sum(-1, keepdim=True).clamp_min(1e-30)
    logq = torch.log_softmax(scores.masked_fill(~keep, float("-inf")), -1)
    tl = torch.where(t > 0, t * torch.log(t.clamp_min(1e-30)), torch.zeros_like(t))
    return (tl - torch.where(keep, t * logq, torch.zeros_like(t))).sum(-1).mean()


class _Params(torch.nn.Module):
    def __init__(self, w: IndexerWeights):
        super().__init__()
        self.W_q, self.W_k = torch.nn.Parameter(w.W_q.clone()), torch.nn.Parameter(w.W_k.clone())
        self.gamma, self.beta = torch.nn.Parameter(w.gamma.clone()), torch.nn.Parameter(w.beta.clone())
        self.W_w = torch.nn.Parameter(w.W_w.clone())
        self.meta = (w.rope_dim, w.eps, w.freq_base)

    def weights(self) -> IndexerWeights:
        return IndexerWeights(self.W_q, self.W_k, self.gamma, self.beta, self.W_w, *self.meta)


def train_layer(data: LayerCalib, w0: IndexerWeights, *, steps: int, top_k: int, lr: float,
                query_rows: int, seed: int, device: str = "cpu", phase: str = "dense",
                sink: int = 0, local: int = 1, select: str = "token", block_size: int = 64,
                sparse_target: str = "selected", layer: int = 0, progress: Optional[ProgressFn] = None, log: Optional[TrainLog] = None
                ) -> IndexerWeights:
    """Run ``steps`` Adam steps of one phase ('dense' | 'sparse') and return detached CPU weights."""
    log = log if log is not None else TrainLog()
    if steps <= 0:
        return w0
    t0 = time.time()
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed * 1000 + layer * 2 + (phase == "sparse"))
    mod = _Params(w0.to(torch.float32, dev)).to(dev)
    opt = torch.optim.Adam(mod.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / max(1, steps // 10)) * (0.5 * (1 + math.cos(math.pi * i / steps))))
    N, T = data.x.shape[0], data.x.shape[1]
    lo = min(top_k, T // 2) if phase == "dense" else min(top_k, T - 1)
    positions = torch.arange(T, device=dev)
    losses = log.dense_loss if phase == "dense" else log.sparse_loss
    for step in range(steps):
        n = int(torch.randint(N, (1,), generator=gen))
        nr = min(query_rows, T - lo)
        rows = (torch.randperm(T - lo, generator=gen)[:nr] + lo).sort().values.to(dev)
        x = data.x[n].to(dev, torch.float32)
        with torch.no_grad():
            tgt = data.target(n, rows, dev)
        sc = _row_scores(mod.weights(), x, rows, positions)
        causal = torch.arange(T, device=dev)[None, :] <= rows[:, None]
        if phase == "dense":
            keep = causal
        elif sparse_target == "middle":   # rank only the candidates the indexer chooses from
            r = rows[:, None]
            s_idx = torch.arange(T, device=dev)[None, :]
            keep = causal & (s_idx >= sink) & (s_idx <= r - local)
        else:
            with torch.no_grad():     # the selection of the sampled rows only (a row's picks depend on its own scores)
                keep = select_keys(sc.detach(), top_k, sink, local, select, block_size, row0=rows)
        loss = kl_loss(tgt, sc, keep)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress is not None and (step % 25 == 0 or step == steps - 1):
            progress({"stage": f"indexer_{phase}", "layer": layer, "step": step + 1, "steps": steps,
                      "loss": losses[-1]})
    log.seconds += time.time() - t0
    w = mod.weights()
    return IndexerWeights(*(t.detach().float().cpu() for t in (w.W_q, w.W_k, w.gamma, w.beta, w.W_w)),
                          w.rope_dim, w.eps, w.freq_base)


@torch.no_grad()
def eval_kl(data: LayerCalib, w: IndexerWeights, top_k: int, rows_n: int = 256, device: str = "cpu",
            chunks: int = 2) -> float:
    """Held-out diagnostic: the dense-phase KL on ``rows_n`` query rows spread over [top_k, T), averaged over the first
    ``chunks`` chunks of ``data`` (as many as it has)."""
    dev = torch.device(device)
    T = data.x.shape[1]
    n_chunks = min(chunks, data.x.shape[0])
    kl = 0.0
    lo = min(top_k, T - 1)
    rows = torch.linspace(lo, T - 1, min(rows_n, T - lo)).long().to(dev)
    wd = w.to(torch.float32, dev)
    for n in range(n_chunks):
        tgt = data.target(n, rows, dev)
        sc = _row_scores(wd, data.x[n].to(dev, torch.float32), rows, torch.arange(T, device=dev))
        causal = torch.arange(T, device=dev)[None, :] <= rows[:, None]
        kl += float(kl_loss(tgt, sc, causal)) / n_chunks
    return kl
