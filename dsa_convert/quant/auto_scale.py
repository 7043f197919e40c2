"""AWQ activation-aware scale search (after llm-awq's auto_scale, AutoAWQ's `duo_scaling`).

Per group of linears sharing an input x:
    s(α) = mean|x|^α                       (x-only, llm-awq's original; AutoAWQ duo_scaling=False)
    s(α) = mean|x|^α / mean|ŵ|^(1-α)      (duo) ŵ: |W| normalised per quantization group, mean over rows
    s    ← s / sqrt(max(s)·min(s))
    W'   = Q(W·diag(s)) · diag(1/s)          Q: the target format's fake quantization
α runs over a grid of 20 points in [0, 1) plus the identity (s = 1), keeping the one with the
lowest MSE of the group's block output (attention output after attn_output for q/k/v; MLP output
for gate/up; the linear's own output for o and down). The chosen s is folded exactly: W·diag(s) in
the linears, 1/s into what produces x (attn_norm / ffn_norm weight; attn_v rows for o; ffn_up rows
for down). RoPE acts on q/k outputs, so scaling their input columns is exact.

GQA: o's input column (head h, dim d) comes from v row (kv head h // rep, dim d); the scale lives
in v-row space and is shared by the heads of a group, which keeps the fold exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .block import Block


@dataclass(frozen=True)
class ScaleGroup:
    name: str
    linears: tuple[str, ...]
    inp: str                 # capture key of the shared input
    prev: str                # what absorbs 1/s: a norm weight, or a linear whose rows are divided


GROUPS = (
    ScaleGroup("qkv", ("attn_q", "attn_k", "attn_v"), "attn_in", "attn_norm"),
    ScaleGroup("o", ("attn_output",), "attn_out", "attn_v"),
    ScaleGroup("gate_up", ("ffn_gate", "ffn_up"), "ffn_in", "ffn_norm"),
    ScaleGroup("down", ("ffn_down",), "ffn_mid", "ffn_up"),
)


def o_scale_index(blk: Block) -> torch.Tensor:
    """For each input column of attn_output, the v row (scale index) it comes from."""
    hp = blk.hp
    rep = hp.n_head // hp.n_head_kv
    j = torch.arange(hp.n_head * hp.head_dim, device=blk.device)
    return (j // hp.head_dim // rep) * hp.head_dim + (j % hp.head_dim)


def _reduce(v: torch.Tensor, idx: torch.Tensor | None, n: int) -> torch.Tensor:
    """Column statistic → scale space (mean over the columns mapped to each scale)."""
    if idx is None:
        return v
    out = torch.zeros(n, dtype=v.dtype, device=v.device).index_add_(0, idx, v)
    cnt = torch.zeros(n, dtype=v.dtype, device=v.device).index_add_(0, idx, torch.ones_like(v))
    return out / cnt


def weight_mean(ws: list[torch.Tensor], qgroup: int) -> torch.Tensor:
    w = torch.cat(ws, 0)
    g = w.abs().reshape(-1, qgroup)
    g = g / (g.amax(-1, keepdim=True) + 1e-6)
    return g.reshape(w.shape).mean(0)


def search(x_mean: torch.Tensor, ws: list[torch.Tensor], fq: Callable, loss_fn: Callable,
           qgroup: int, n_grid: int = 20, idx: torch.Tensor | None = None,
           n_scale: int | None = None, names: tuple[str, ...] | None = None,
           x_sq: torch.Tensor | None = None, duo: bool = False) -> tuple[torch.Tensor, dict]:
    """Grid search of α. Returns (s in scale space, report). fq(w, name, imp): imp is the mean x²
    of the (scaled) input columns, i.e. the imatrix llama.cpp's quantizer would get. `duo`: divide
    by the weight statistic too (AutoAWQ's duo_scaling); default x-only scales."""
    names = names or (None,) * len(ws)
    n = n_scale or x_mean.shape[0]
    xm = _reduce(x_mean, idx, n)
    wm = _reduce(weight_mean(ws, qgroup), idx, n) if duo else None
    base = loss_fn([fq(w, n, x_sq) for w, n in zip(ws, names)])
    best, best_s, best_a, hist = base, torch.ones(n, device=xm.device), None, []
    for i in range(n_grid):
        a = i / n_grid
        s = (xm.pow(a) if wm is None else xm.pow(a) / (wm.pow(1 - a) + 1e-4)).clamp(min=1e-4)
        s = s / math.sqrt(float(s.max() * s.min()))
        se = s if idx is None else s[idx]
        imp = None if x_sq is None else x_sq / se.pow(2)
        loss = loss_fn([fq(w * se, n, imp) / se for w, n in zip(ws, names)])
        hist.append(loss)
        if loss < best:
            best, best_s, best_a = loss, s, a
    return best_s, {"alpha": best_a, "loss_rtn": base, "loss": best,
                    "gain": (1 - best / base) if base > 0 else 0.0}


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean())


def auto_scale_block(blk: Block, caps: dict[str, torch.Tensor], fq: Callable, qgroup: int,
                     search_tokens: int, n_grid: int = 20, gen: torch.Generator | None = None,
                     duo: bool = False) -> dict:
    """Search and apply the four scale groups of one block in place (weights, norms and the cached
    inputs, which are divided by s so later steps see the scaled model). Returns a report."""
    report: dict = {}
    N, L = caps["attn_in"].shape[:2]
    n_seq = max(1, min(N, math.ceil(search_tokens / L)))
    tok = torch.randperm(N * L, generator=gen)[: min(search_tokens, N * L)].to(blk.device)

    def flat(key):
        return caps[key].reshape(N * L, -1)

    for grp in GROUPS:
        x_all = flat(grp.inp)
        x_mean = x_all.abs().mean(0)
        x_sq = x_all.pow(2).mean(0)
        ws = [blk.w[n] for n in grp.linears]
        idx, n_scale = None, None
        if grp.name == "qkv":
            x = caps["attn_in"][:n_seq]
            ref = blk.lin(blk.attn_core(x), "attn_output")

            def loss_fn(q, x=x, ref=ref):
                return _mse(blk.lin(blk.attn_core(x, *q), "attn_output"), ref)
        elif grp.name == "o":
            idx, n_scale = o_scale_index(blk), blk.w["attn_v"].shape[0]
            x = x_all[tok]
            ref = blk.lin(x, "attn_output")

            def loss_fn(q, x=x, ref=ref):
                return _mse(blk.lin(x, "attn_output", q[0]), ref)
        elif grp.name == "gate_up":
            x = x_all[tok]
            ref = blk.lin(blk.mlp_inner(x), "ffn_down")

            def loss_fn(q, x=x, ref=ref):
                return _mse(blk.lin(blk.mlp_inner(x, q[0], q[1]), "ffn_down"), ref)
        else:
            x = x_all[tok]
            ref = blk.lin(x, "ffn_down")

            def loss_fn(q, x=x, ref=ref):
                return _mse(blk.lin(x, "ffn_down", q[0]), ref)

        s, rep = search(x_mean, ws, fq, loss_fn, qgroup, n_grid, idx, n_scale, grp.linears, x_sq, duo)
        apply_scale(blk, grp, s, caps, idx)
        report[grp.name] = rep
        blk.scales[grp.name] = s
    return report


def apply_scale(blk: Block, grp: ScaleGroup, s: torch.Tensor, caps: dict[str, torch.Tensor],
                idx: torch.Tensor | None = None) -> None:
    se = s if idx is None else s[idx]
    for n in grp.linears:
        blk.w[n] = blk.w[n] * se[None, :]
    if grp.prev.endswith("_norm"):
        blk.w[grp.prev] = blk.w[grp.prev] / s
    else:   # a linear's output rows (and its bias)
        blk.w[grp.prev] = blk.w[grp.prev] / s[:, None]
        if grp.prev + ".bias" in blk.w:
            blk.w[grp.prev + ".bias"] = blk.w[grp.prev + ".bias"] / s
    caps[grp.inp] = caps[grp.inp] / se
