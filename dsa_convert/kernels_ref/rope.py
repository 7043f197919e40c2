"""Rotary position embeddings exactly as ggml applies them (NORM and NEOX layouts, linear / YaRN /
llama3-factor scaling). The single source of truth the llama.cpp output is checked against."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeParams:
    n_rot: int                      # rotated dims per head (first n_rot dims)
    base: float = 10000.0
    neox: bool = False              # False: pairs (2i, 2i+1) (GGML "normal"); True: pairs (i, i+n_rot/2)
    freq_scale: float = 1.0         # 1/factor for linear and YaRN
    ext_factor: float = 0.0         # YaRN extrapolation mix (1.0 when YaRN is on)
    attn_factor: float = 1.0
    orig_ctx: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    freq_factors: tuple[float, ...] | None = None   # llama3 `rope_freqs.weight`


def _yarn_corr_dims(p: RopeParams) -> tuple[float, float]:
    def corr(beta: float) -> float:
        return p.n_rot * math.log(p.orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(p.base))
    return max(0.0, math.floor(corr(p.beta_fast))), min(p.n_rot - 1.0, math.ceil(corr(p.beta_slow)))


def cos_sin(p: RopeParams, positions: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, n_rot/2] (already multiplied by the YaRN magnitude scale)."""
    i = torch.arange(0, p.n_rot // 2, dtype=torch.float64)
    theta_extrap = positions.to(torch.float64)[:, None] * p.base ** (-2.0 * i / p.n_rot)[None, :]
    if p.freq_factors is not None:
        theta_extrap = theta_extrap / torch.tensor(p.freq_factors, dtype=torch.float64)[None, :]
    theta_interp = p.freq_scale * theta_extrap
    theta, mscale = theta_interp, p.attn_factor
    if p.ext_factor != 0.0:
        lo, hi = _yarn_corr_dims(p)
        y = (i - lo) / max(0.001, hi - lo)
        ramp_mix = (1 - y.clamp(0, 1)) * p.ext_factor
        theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix
        mscale = mscale * (1.0 + 0.1 * math.log(1.0 / p.freq_scale))
    return (torch.cos(theta) * mscale).to(dtype), (torch.sin(theta) * mscale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: RopeParams) -> torch.Tensor:
    """x: [n_head, T, head_dim]; rotates the first n_rot dims."""
    rot, rest = x[..., : p.n_rot], x[..., p.n_rot:]
    c, s = cos[None], sin[None]
    if p.neox:
        half = p.n_rot // 2
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out
