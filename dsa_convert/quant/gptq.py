"""GPTQ (Frantar et al. 2022) onto llama.cpp's block grids: columns rounded in order, each rounding error spread over
the columns not yet rounded through the inverse input Hessian H = XᵀX of the linear (the OBS update), so the layer's
output error ‖(W − Ŵ)X‖² is what is minimised, not each weight's own error.

The grid is not fixed up front: at the start of every slab of columns (a K-quant super-block of 256, or 128 / 32
for the 32-weight types) the importance-weighted scale / min search (kq_search.fit) runs on the slab's weights as
the earlier columns' updates left them, and the slab's columns are then rounded on that grid ("lazy batch" GPTQ
with the slab as the batch). Torch float32 on the CPU (or the calibration device)."""
from __future__ import annotations

import numpy as np
import torch

from .kq_search import BLOCK, QT, Grid, concat, fit


def slab_width(qtype: QT, n: int) -> int:
    b = BLOCK[qtype]
    if b == 256:
        return 256
    return 128 if n % 128 == 0 else b


def hessian_inverse_chol(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor of (H + λI)⁻¹, dead-column mask); λ = damp · mean diag(H). Retries with 10x the
    damping when H is not positive definite in float precision."""
    H = H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    lam = damp * float(torch.diag(H).mean())
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for _ in range(6):
        try:
            L = torch.linalg.cholesky(H + lam * eye)
            Hinv = torch.cholesky_inverse(L)
            return torch.linalg.cholesky(Hinv, upper=True).float(), dead
        except RuntimeError:  # torch.linalg.LinAlgError: not positive definite
            lam *= 10
    raise RuntimeError("GPTQ: input Hessian not positive definite even with damping")


def quantize(w: np.ndarray, qtype: QT, H: torch.Tensor, imp: np.ndarray | None, damp: float = 0.01,
             sigma2: np.ndarray | None = None, act_order: bool = False) -> tuple[Grid, np.ndarray]:
    """w [rows, n] float32, H [n, n] (Σ xxᵀ over calibration tokens) → (grid, codes [rows, n] int16).
    act_order: the grid fitted once on w ("static groups"), the columns rounded in decreasing diag(H) order."""
    if act_order:
        return _quantize_act_order(w, qtype, H, imp, damp, sigma2)
    W = torch.from_numpy(np.array(w, dtype=np.float32))
    rows, n = W.shape
    U, dead = hessian_inverse_chol(H.cpu(), damp)
    W[:, dead] = 0
    if sigma2 is None:
        sigma2 = (np.asarray(w, np.float32) ** 2).mean(1)
    B = slab_width(qtype, n)
    grids, codes = [], np.empty((rows, n), np.int16)
    for i1 in range(0, n, B):
        i2 = i1 + B
        W1 = W[:, i1:i2].clone()
        g = fit(qtype, W1.numpy(), None if imp is None else imp[i1:i2], sigma2)
        grids.append(g)
        s, b = torch.from_numpy(g.s), torch.from_numpy(g.b)
        nz = s != 0
        s_safe = torch.where(nz, s, torch.ones_like(s))
        E = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(B):
            gi = i // g.group
            col = W1[:, i]
            q = torch.where(nz[:, gi], torch.round((col - b[:, gi]) / s_safe[:, gi]), torch.zeros_like(col))
            q = q.clamp(g.lo, g.hi)
            dq = s[:, gi] * q + b[:, gi]
            err = (col - dq) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E[:, i] = err
            codes[:, i1 + i] = q.to(torch.int16).numpy()
        if i2 < n:
            W[:, i2:] -= E @ U[i1:i2, i2:]
    return concat(grids), codes


def _quantize_act_order(w, qtype, H, imp, damp, sigma2, block: int = 128):
    w = np.asarray(w, dtype=np.float32)
    rows, n = w.shape
    grid = fit(qtype, w, imp, sigma2)
    perm = torch.argsort(torch.diag(H), descending=True)
    inv = torch.argsort(perm)
    Hp = H[perm][:, perm]
    U, dead = hessian_inverse_chol(Hp.cpu(), damp)
    W = torch.from_numpy(w)[:, perm].clone()
    W[:, dead] = 0
    S = torch.from_numpy(np.repeat(grid.s, grid.group, axis=1))[:, perm]
    Bo = torch.from_numpy(np.repeat(grid.b, grid.group, axis=1))[:, perm]
    nz = S != 0
    S_safe = torch.where(nz, S, torch.ones_like(S))
    Q = torch.zeros_like(W)
    for i1 in range(0, n, block):
        i2 = min(n, i1 + block)
        W1 = W[:, i1:i2].clone()
        E = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            col = W1[:, i]
            q = torch.where(nz[:, c], torch.round((col - Bo[:, c]) / S_safe[:, c]), torch.zeros_like(col))
            q = q.clamp(grid.lo, grid.hi)
            err = (col - (S[:, c] * q + Bo[:, c])) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E[:, i] = err
            Q[:, c] = q
        if i2 < n:
            W[:, i2:] -= E @ U[i1:i2, i2:]
    return grid, Q[:, inv].to(torch.int16).numpy()
