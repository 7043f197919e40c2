"""Packing of llama.cpp's stock block types in numpy: a Grid (kq_search) and integer codes → the GGUF byte layout
of Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (ggml-common.h's block_* structs, row-major, blocks along
the row).

gguf-py's `gguf.quants.dequantize` reads these bytes back; tests check that it returns exactly Grid.values(codes).
"""
from __future__ import annotations

import gguf
import numpy as np

from .kq_search import QK_K, Grid

QT = gguf.GGMLQuantizationType


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def _k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [nb, 8] → the 12-byte packing of block_q4_K / block_q5_K (get_scale_min_k4)."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def pack(grid: Grid, q: np.ndarray) -> np.ndarray:
    """codes q [rows, n] (in [grid.lo, grid.hi]) → uint8 [rows, row_bytes]."""
    r, n = q.shape
    qt, nat = grid.qtype, grid.native
    if q.min() < grid.lo or q.max() > grid.hi:
        raise ValueError(f"{qt.name}: codes outside [{grid.lo}, {grid.hi}]")
    if qt in (QT.Q4_K, QT.Q5_K):
        nb = r * n // QK_K
        L = q.reshape(nb, 4, 2, 32).astype(np.uint8)         # 64-weight chunks: low half, high half
        head = np.concatenate([_f16_bytes(nat["d"]), _f16_bytes(nat["dmin"]),
                               _k_scales(nat["ls"].reshape(nb, 8), nat["lm"].reshape(nb, 8))], 1)
        qs = ((L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)).reshape(nb, 128)
        if qt == QT.Q4_K:
            blocks = np.concatenate([head, qs], 1)
        else:
            hi = (q.reshape(nb, 8, 32).astype(np.uint8) >> 4) & 1      # bit j of qh[l]: sub-block j's fifth bit
            qh = (hi << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
            blocks = np.concatenate([head, qh, qs], 1)
    elif qt == QT.Q6_K:
        nb = r * n // QK_K
        L = (q.reshape(nb, 2, 4, 32).astype(np.int16) + 32).astype(np.uint8)   # 128-weight halves, 4 quarters
        ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                             (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(nb, 128)
        qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
              | ((L[:, :, 3] >> 4) << 6)).reshape(nb, 64)
        sc = nat["ls"].reshape(nb, 16).astype(np.int8).view(np.uint8)
        blocks = np.concatenate([ql, qh, sc, _f16_bytes(nat["d"])], 1)
    elif qt in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):       # block_q{4,5}_{0,1}: d [, m] [, qh[4]], qs[16]
        nb = r * n // 32
        L = (q.reshape(nb, 32).astype(np.int16) - grid.lo).astype(np.uint8)   # stored codes, from 0
        qs = (L[:, :16] & 0xF) | ((L[:, 16:] & 0xF) << 4)
        parts = [_f16_bytes(nat["d"])]
        if qt in (QT.Q4_1, QT.Q5_1):
            parts.append(_f16_bytes(nat["m"]))
        if qt in (QT.Q5_0, QT.Q5_1):
            parts.append(np.packbits(L >> 4, axis=-1, bitorder="little").reshape(nb, 4))
        blocks = np.concatenate([*parts, qs], 1)
    elif qt == QT.Q8_0:
        nb = r * n // 32
        blocks = np.concatenate([_f16_bytes(nat["d"]), q.reshape(nb, 32).astype(np.int8).view(np.uint8)], 1)
    else:
        raise ValueError(f"no packer for {qt.name}")
    return np.ascontiguousarray(blocks).reshape(r, -1)


def row_bytes(qtype: QT, n: int) -> int:
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    return n // bs * ts
