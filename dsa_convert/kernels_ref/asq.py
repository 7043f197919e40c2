"""ASQ compressed KV vectors (docs/FORMAT.md §6): nearest prototype + low-bit residual.

Arrays per (layer, KV head): vectors v [N, hd], prototypes P [C, hd]. All float32 math.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AsqCodes:
    code: Tensor    # [N] uint8 prototype index
    scale: Tensor   # [N] float16 residual scale d
    q: Tensor       # [N, hd] int8 residual levels in [-Q, Q]


def qmax(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"residual_bits must be 4 or 8, got {bits}")
    return 2 ** (bits - 1) - 1


def nearest_prototype(v: Tensor, protos: Tensor, chunk: int = 65536) -> Tensor:
    """argmin_c ‖v − P_c‖² (ties -> lower c), computed as the explicit squared difference."""
    out = []
    P = protos.float()
    for i in range(0, v.shape[0], chunk):
        d = ((v[i:i + chunk].float()[:, None, :] - P[None, :, :]) ** 2).sum(-1)
        out.append(torch.argmin(d, dim=-1))   # torch returns the first minimum
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def round_half_away(x: Tensor) -> Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def encode(v: Tensor, protos: Tensor, bits: int) -> AsqCodes:
    """Encode v [N, hd] against prototypes [C, hd] (C <= 256)."""
    if protos.shape[0] > 256:
        raise ValueError("at most 256 prototypes (u8 codes)")
    Q = qmax(bits)
    v = v.float()
    c = nearest_prototype(v, protos)
    r = v - protos.float()[c]
    d16 = (r.abs().amax(dim=-1) / Q).to(torch.float16)
    d = d16.float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.clamp(round_half_away(r / safe[:, None]), -Q, Q)
    q = torch.where((d > 0)[:, None], q, torch.zeros_like(q))
    return AsqCodes(c.to(torch.uint8), d16, q.to(torch.int8))


def decode(codes: AsqCodes, protos: Tensor) -> Tensor:
    return protos.float()[codes.code.long()] + codes.scale.float()[:, None] * codes.q.float()


def roundtrip(v: Tensor, protos: Tensor, bits: int) -> Tensor:
    """decode(encode(v)) in v's shape [..., hd] (all leading dims flattened)."""
    shp = v.shape
    flat = v.reshape(-1, shp[-1])
    return decode(encode(flat, protos, bits), protos).reshape(shp)


def roundtrip_heads(x: Tensor, protos: Tensor, bits: int) -> Tensor:
    """x [n_kv, T, hd] with per-head prototypes [n_kv, C, hd]."""
    return torch.stack([roundtrip(x[h], protos[h], bits) for h in range(x.shape[0])]).to(x.dtype)


# ------------------------------------------------------------------ bytes per token accounting
def asq_bytes_per_vector(head_dim: int, bits: int) -> float:
    """1 (u8 code) + 2 (f16 scale) + head_dim·b/8 bytes for one K or V vector of one KV head."""
    qmax(bits)
    return 1 + 2 + head_dim * bits / 8


def kv_bytes_per_token(kind: str, head_dim: int, n_kv: int, n_layer: int, bits: int = 4) -> float:
    """KV-cache bytes per token (K + V, all layers and KV heads) for f16 | q8_0 | q4_0 | asq."""
    per_vec = {
        "f16": 2.0 * head_dim,
        "f32": 4.0 * head_dim,
        "q8_0": head_dim / 32 * 34,     # 32 int8 + f16 scale per block
        "q4_0": head_dim / 32 * 18,     # 16 bytes of nibbles + f16 scale per block
    }
    if kind == "asq":
        v = asq_bytes_per_vector(head_dim, bits)
    elif kind in per_vec:
        v = per_vec[kind]
    else:
        raise ValueError(f"unknown kv kind {kind!r}")
    return 2 * n_layer * n_kv * v
