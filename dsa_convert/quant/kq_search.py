"""Importance-weighted scale / min search for llama.cpp's stock block types, in numpy, vectorised over blocks.

The search follows ggml's (ggml-quants.c, quantize_row_{q4_K,q5_K,q6_K,q5_0}_impl): per sub-block a grid of
candidate steps, each scored by the weighted least-squares fit of scale (and min) to the rounded codes
(make_qkx3_quants / make_qx_quants), then the sub-block scales and mins quantized to 6 (8) bits with a weighted
search of their own (make_qp_quants). The weights are the imatrix (mean x² of the input column) times
sqrt(σ² + w²), or without an imatrix av|x| + |w| (K-quants) / w² (Q6_K).

`fit(qtype, w, imp, sigma2)` returns a Grid: every weight of group g of a row is coded as value = s·q + b with an
integer q in [lo, hi]; `native` holds the fields the packer (kq_pack) writes. The grid is fitted once per slab of
columns (a super-block) so that GPTQ (gptq.py) can round the columns in order against fixed steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
QK_K = 256
EPS = 1e-15          # GROUP_MAX_EPS
F32 = np.float32


@dataclass
class Grid:
    qtype: QT
    group: int                 # weights that share (s, b)
    lo: int
    hi: int
    s: np.ndarray              # [rows, n_groups] float32 step
    b: np.ndarray              # [rows, n_groups] float32 offset (value = s*q + b)
    native: dict               # per type: the fields kq_pack writes, per block

    def codes(self, w: np.ndarray) -> np.ndarray:
        """Round-to-nearest codes of w [rows, n_groups*group] on this grid (int16)."""
        r, n = w.shape
        x = w.reshape(r, -1, self.group)
        s, b = self.s[..., None], self.b[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s != 0, np.rint((x - b) / np.where(s != 0, s, 1)), 0)
        return np.clip(q, self.lo, self.hi).astype(np.int16).reshape(r, n)

    def values(self, q: np.ndarray) -> np.ndarray:
        r, n = q.shape
        return (self.s[..., None] * q.reshape(r, -1, self.group).astype(F32) + self.b[..., None]).reshape(r, n)


BLOCK = {QT.Q4_K: QK_K, QT.Q5_K: QK_K, QT.Q6_K: QK_K, QT.Q4_0: 32, QT.Q4_1: 32, QT.Q5_0: 32, QT.Q5_1: 32,
         QT.Q8_0: 32}
SUPPORTED = tuple(BLOCK)


def _fp16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=F32).astype(np.float16).astype(F32)


# ---- ggml's searches, vectorised over the leading axis -------------------------------------------
def make_qkx3(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float = -0.9, rdelta: float = 0.05,
              nstep: int = 36) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric: x, w [B, n] → (scale [B], the_min [B] ≥ 0), value ≈ scale·l − the_min, l in [0, nmax]."""
    mn = np.minimum(x.min(1), 0).astype(F32)
    mx = x.max(1)
    ok = mx > mn
    sum_w = w.sum(1)
    sum_x = (w * x).sum(1)
    rng = np.where(ok, mx - mn, 1).astype(F32)
    iscale = F32(nmax) / rng
    scale = 1 / iscale
    lq = np.clip(np.rint(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = (w * (scale[:, None] * lq + mn[:, None] - x) ** 2).sum(1)
    for i in range(nstep + 1):
        rng = np.where(ok, mx - mn, 1).astype(F32)
        isc = F32(rmin + rdelta * i + nmax) / rng
        lq = np.clip(np.rint(isc[:, None] * (x - mn[:, None])), 0, nmax)
        sl, sl2, sxl = (w * lq).sum(1), (w * lq * lq).sum(1), (w * lq * x).sum(1)
        D = sum_w * sl2 - sl * sl
        Ds = np.where(D > 0, D, 1)
        ts = (sum_w * sxl - sum_x * sl) / Ds
        tm = (sl2 * sum_x - sl * sxl) / Ds
        pos = tm > 0
        tm = np.where(pos, 0, tm)
        ts = np.where(pos, sxl / np.where(sl2 > 0, sl2, 1), ts)
        err = (w * (ts[:, None] * lq + tm[:, None] - x) ** 2).sum(1)
        upd = (D > 0) & (err < best) & ok
        best = np.where(upd, err, best)
        scale = np.where(upd, ts, scale)
        mn = np.where(upd, tm, mn).astype(F32)
    scale = np.where(ok, scale, 0).astype(F32)
    return scale, (-mn).astype(F32)


def make_qp(x: np.ndarray, nmax: int, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative x [B, n] (sub-block scales or mins) → (step [B], codes [B, n] in [0, nmax]), weighted."""
    mx = x.max(1)
    ok = mx >= EPS
    mxs = np.where(ok, mx, 1).astype(F32)
    iscale = F32(nmax) / mxs
    L = np.rint(iscale[:, None] * x)
    best = (qw * (x - (1 / iscale)[:, None] * L) ** 2).sum(1)
    for i in (-4, -3, -2, -1, 1, 2, 3, 4):
        isc = F32(0.1 * i + nmax) / mxs
        lq = np.minimum(nmax, np.rint(isc[:, None] * x))
        mse = (qw * (x - (1 / isc)[:, None] * lq) ** 2).sum(1)
        better = mse < best
        best = np.where(better, mse, best)
        iscale = np.where(better, isc, iscale)
    L = np.minimum(nmax, np.rint(iscale[:, None] * x))
    sumlx = (qw * x * L).sum(1)
    suml2 = (qw * L * L).sum(1)
    for _ in range(5):
        changed = np.zeros(x.shape[0], bool)
        for i in range(x.shape[1]):
            w, xi, li = qw[:, i], x[:, i], L[:, i]
            slx = sumlx - w * xi * li
            sl2 = suml2 - w * li * li
            can = (slx > 0) & (sl2 > 0)
            nl = np.minimum(nmax, np.rint(xi * sl2 / np.where(can, slx, 1)))
            slx2, sl22 = slx + w * xi * nl, sl2 + w * nl * nl
            take = can & (nl != li) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = np.where(take, nl, li)
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
            changed |= take
        if not changed.any():
            break
    d = np.where(ok & (suml2 > 0), sumlx / np.where(suml2 > 0, suml2, 1), 0).astype(F32)
    return d, np.where(ok[:, None], L, 0).astype(np.int32)


def make_qx(x: np.ndarray, nmax: int, w: np.ndarray) -> np.ndarray:
    """Symmetric: x, w [B, n] → signed scale [B] (codes in [-nmax, nmax-1]; ggml's rmse_type 1 with weights)."""
    idx = np.abs(x).argmax(1)
    mx = x[np.arange(x.shape[0]), idx]
    ok = np.abs(mx) >= EPS
    mxs = np.where(ok, mx, 1).astype(F32)

    def fit(isc):
        lq = np.clip(np.rint(isc[:, None] * x), -nmax, nmax - 1)
        return (w * x * lq).sum(1), (w * lq * lq).sum(1)
    sumlx, suml2 = fit(-F32(nmax) / mxs)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), 0)
    best = scale * sumlx
    for i in range(-9, 10):
        if i == 0:
            continue
        slx, sl2 = fit(-F32(nmax + 0.1 * i) / mxs)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        sc = slx / np.where(sl2 > 0, sl2, 1)
        scale = np.where(better, sc, scale)
        best = np.where(better, sc * slx, best)
    return np.where(ok, scale, 0).astype(F32)


# ---- per type ----------------------------------------------------------------------------------
def fit(qtype: QT, w: np.ndarray, imp: np.ndarray | None = None, sigma2: np.ndarray | None = None) -> Grid:
    """Grid of w [rows, n] (n a multiple of the type's block) with importance imp [n] (mean x² of the input
    columns, or None); sigma2 [rows]: Q5_0's per-row σ² (ggml takes it over the whole row; default: over w)."""
    w = np.ascontiguousarray(w, dtype=F32)
    r, n = w.shape
    if qtype in (QT.Q4_K, QT.Q5_K):
        return _fit_k_asym(qtype, w, imp, 15 if qtype == QT.Q4_K else 31)
    if qtype == QT.Q6_K:
        return _fit_q6_k(w, imp)
    if qtype in (QT.Q4_0, QT.Q5_0):          # symmetric: value = d·q, q in [-nmax, nmax-1]
        nmax = 8 if qtype == QT.Q4_0 else 16
        x = w.reshape(r, -1, 32)
        if imp is None:       # ggml's reference: d = signed max / -nmax
            idx = np.abs(x).argmax(-1)[..., None]
            d = _fp16(np.take_along_axis(x, idx, -1)[..., 0] / -nmax)
        else:                 # quantize_row_q{4,5}_0_impl: make_qx_quants with weights imp·sqrt(σ² + x²)
            s2 = (w * w).mean(1) if sigma2 is None else sigma2
            wt = imp.reshape(1, -1, 32).astype(F32) * np.sqrt(s2[:, None, None] + x * x)
            d = _fp16(make_qx(x.reshape(-1, 32), nmax, wt.reshape(-1, 32)).reshape(r, -1))
        return Grid(qtype, 32, -nmax, nmax - 1, d, np.zeros_like(d), {"d": d})
    if qtype in (QT.Q4_1, QT.Q5_1):          # asymmetric: value = d·q + m, q in [0, nmax]
        nmax = 15 if qtype == QT.Q4_1 else 31
        x = w.reshape(r, -1, 32)
        if imp is None:       # ggml's reference: the block's min and (max - min) / nmax
            mn = x.min(-1)
            d, m = _fp16((x.max(-1) - mn) / nmax), _fp16(mn)
        else:                 # quantize_row_q{4,5}_1_impl: make_qkx3_quants with weights imp·sqrt(σ² + x²)
            s2 = (w * w).mean(1) if sigma2 is None else sigma2
            wt = imp.reshape(1, -1, 32).astype(F32) * np.sqrt(s2[:, None, None] + x * x)
            sc, the_min = make_qkx3(x.reshape(-1, 32), wt.reshape(-1, 32), nmax)
            d, m = _fp16(sc.reshape(r, -1)), _fp16(-the_min.reshape(r, -1))
        return Grid(qtype, 32, 0, nmax, d, m, {"d": d, "m": m})
    if qtype == QT.Q8_0:
        d = _fp16(np.abs(w.reshape(r, -1, 32)).max(-1) / 127)
        return Grid(qtype, 32, -128, 127, d, np.zeros_like(d), {"d": d})
    raise ValueError(f"no search for {qtype.name}")


def _fit_k_asym(qtype: QT, w: np.ndarray, imp, nmax: int) -> Grid:
    r, n = w.shape
    x = w.reshape(r, n // QK_K, 8, 32)
    sigma2 = 2 * (x * x).sum((-1, -2), keepdims=True) / QK_K
    if imp is not None:
        wt = imp.reshape(1, -1, 8, 32).astype(F32) * np.sqrt(sigma2 + x * x)
    else:
        wt = np.sqrt(sigma2) + np.abs(x)
    sc, mn = make_qkx3(x.reshape(-1, 32), wt.reshape(-1, 32), nmax)
    sw = wt.sum(-1).reshape(-1, 8)
    d, ls = make_qp(sc.reshape(-1, 8), 63, sw)
    dm, lm = make_qp(mn.reshape(-1, 8), 63, sw)
    ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    d, dm = _fp16(d), _fp16(dm)
    s = (d[:, None] * ls.astype(F32)).reshape(r, -1)
    b = -(dm[:, None] * lm.astype(F32)).reshape(r, -1)
    return Grid(qtype, 32, 0, nmax, s.astype(F32), b.astype(F32),
                {"d": d.reshape(r, -1), "dmin": dm.reshape(r, -1), "ls": ls.reshape(r, -1, 8),
                 "lm": lm.reshape(r, -1, 8)})


def _fit_q6_k(w: np.ndarray, imp) -> Grid:
    r, n = w.shape
    x = w.reshape(-1, 16)
    wt = (imp.reshape(1, -1, 16).astype(F32) * np.ones((r, 1, 1), F32)).reshape(-1, 16) if imp is not None else x * x
    sc = make_qx(x, 32, wt).reshape(-1, 16)            # [blocks, 16]
    idx = np.abs(sc).argmax(1)
    ms = sc[np.arange(sc.shape[0]), idx]
    ok = np.abs(ms) >= EPS
    iscale = np.where(ok, -128 / np.where(ok, ms, 1), 0).astype(F32)
    d = _fp16(np.where(ok, 1 / np.where(ok, iscale, 1), 0))
    ls = np.minimum(127, np.rint(iscale[:, None] * sc)).astype(np.int32)
    s = (d[:, None] * ls.astype(F32)).reshape(r, -1)
    return Grid(QT.Q6_K, 16, -32, 31, s.astype(F32), np.zeros_like(s, dtype=F32),
                {"d": d.reshape(r, -1), "ls": ls.reshape(r, -1, 16)})


def concat(grids: list[Grid]) -> Grid:
    """Grids of consecutive column slabs of the same rows → one grid of the whole rows."""
    g0 = grids[0]
    native = {k: np.concatenate([g.native[k] for g in grids], axis=1) for k in g0.native}
    return Grid(g0.qtype, g0.group, g0.lo, g0.hi, np.concatenate([g.s for g in grids], 1),
                np.concatenate([g.b for g in grids], 1), native)
