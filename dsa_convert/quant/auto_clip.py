"""AWQ weight clipping (after llm-awq's auto_clip): per output channel and group of `group` input
columns, shrink max|w| in steps of 1/n_grid (down to 50%; n_grid 20 → 10 steps of 5%) and keep the threshold whose fake-quantized
weights give the lowest error of that group's partial output Σ_k x_k·w_k on calibration tokens.
q/k are skipped by default (their outputs go through softmax; llm-awq skips them as well); with
`clip_qk` they are clipped on the error of their own (pre-RoPE) outputs."""
from __future__ import annotations

from typing import Callable

import torch

from .block import LINEAR_INPUT, LINEARS

QK = ("attn_q", "attn_k")      # clipped only with clip_qk (on their own outputs)


@torch.no_grad()
def clip_weight(w: torch.Tensor, x: torch.Tensor, fq: Callable, group: int, n_grid: int = 20,
                max_shrink: float = 0.5, oc_batch: int = 256, name: str | None = None,
                imp: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """w [co, ci], x [n, ci] → (clipped w, mean relative shrink). fq(w, name, imp) as in auto_scale."""
    co, ci = w.shape
    ng = ci // group
    xg = x.reshape(-1, ng, group)
    out = torch.empty_like(w)
    shrink_sum = 0.0
    for s in range(0, co, oc_batch):
        wb = w[s:s + oc_batch]
        c = wb.shape[0]
        wg = wb.reshape(c, ng, group)
        org = torch.einsum("ngk,cgk->gnc", xg, wg)
        org_max = wg.abs().amax(-1, keepdim=True)                 # [c, ng, 1]
        best_max = org_max.clone()
        best_err = torch.full((c, ng), float("inf"), device=w.device)
        for i in range(int(max_shrink * n_grid)):
            mx = org_max * (1 - i / n_grid)
            cur = torch.maximum(torch.minimum(wg, mx), -mx)
            q = fq(cur.reshape(c, ci), name, imp).reshape(c, ng, group)
            err = (torch.einsum("ngk,cgk->gnc", xg, q) - org).pow(2).mean(1).T   # [c, ng]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better[..., None], mx, best_max)
        out[s:s + c] = torch.maximum(torch.minimum(wg, best_max), -best_max).reshape(c, ci)
        shrink_sum += float((best_max / org_max.clamp(min=1e-12)).mean()) * c
    return out, 1.0 - shrink_sum / co


def auto_clip_block(blk, caps: dict[str, torch.Tensor], fq: Callable, group: int, n_tokens: int,
                    gen: torch.Generator | None = None, n_grid: int = 20, clip_qk: bool = False) -> dict:
    inputs = {n: LINEAR_INPUT[n] for n in LINEARS if clip_qk or n not in QK}
    rep = {}
    for name, key in inputs.items():
        x = caps[key].reshape(-1, caps[key].shape[-1])
        sel = torch.randperm(x.shape[0], generator=gen)[: min(n_tokens, x.shape[0])].to(x.device)
        blk.w[name], rep[name] = clip_weight(blk.w[name], x[sel], fq, group, n_grid, name=name, imp=x.pow(2).mean(0))
    return rep
