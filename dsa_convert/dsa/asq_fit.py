"""Fit ASQ prototypes (FORMAT §6) per layer and KV head with k-means on calibration K/V vectors,
and measure pre-RoPE vs post-RoPE key reconstruction so the key space is chosen with numbers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from ..kernels_ref import asq
from ..kernels_ref.kvquant import kv_roundtrip


class AsqSampler:
    """Collects a random subset of one layer's token vectors over calibration chunks."""

    def __init__(self, per_chunk: int, seed: int):
        self.per_chunk = per_chunk
        self.gen = torch.Generator().manual_seed(seed)
        self.k_pre: list[Tensor] = []
        self.k_post: list[Tensor] = []
        self.v: list[Tensor] = []
        self.pos: list[Tensor] = []

    def add(self, k_pre: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """k_pre/k/v [n_kv, T, hd] (k after RoPE), positions [T]."""
        T = k.shape[1]
        idx = torch.randperm(T, generator=self.gen)[: self.per_chunk].sort().values
        self.k_pre.append(k_pre[:, idx].float().cpu())
        self.k_post.append(k[:, idx].float().cpu())
        self.v.append(v[:, idx].float().cpu())
        self.pos.append(positions[idx].cpu())

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return (torch.cat(self.k_pre, 1), torch.cat(self.k_post, 1), torch.cat(self.v, 1), torch.cat(self.pos))


@dataclass
class LayerAsq:
    k_proto: dict[str, Tensor]          # key_space -> [n_kv, C, hd]
    v_proto: Tensor                     # [n_kv, C, hd]
    errors: dict = field(default_factory=dict)


def kmeans(x: Tensor, C: int, seed: int) -> Tensor:
    from sklearn.cluster import KMeans
    km = KMeans(n_clusters=C, n_init=1, max_iter=100, random_state=seed)
    km.fit(x.double().numpy())
    return torch.from_numpy(km.cluster_centers_.astype(np.float32))


def rel_err(a: Tensor, b: Tensor) -> float:
    """‖a − b‖² / ‖b‖² over all entries."""
    return float(((a - b) ** 2).sum() / (b ** 2).sum().clamp_min(1e-30))


def fit_layer(sampler: AsqSampler, rope_keys: Callable[[Tensor, Tensor], Tensor], C: int, bits: int,
              seed: int, holdout: float = 0.2, spaces: tuple[str, ...] = ("pre_rope", "post_rope")) -> LayerAsq:
    """k-means per KV head for K (each key space asked) and V; errors on a held-out fraction.

    errors: k_{space} = relative MSE of the decoded post-RoPE key (pre_rope keys are decoded, then
    RoPE'd), v = relative MSE of V, logit_{space} = relative MSE of q·k logits with random queries
    drawn like the keys (a proxy for attention-score error); plus q8_0 / q4_0 reference errors.
    """
    k_pre, k_post, v, pos = sampler.tensors()
    n_kv, M, _ = k_post.shape
    perm = torch.randperm(M, generator=torch.Generator().manual_seed(seed))
    n_ho = max(1, int(M * holdout))
    ho, tr = perm[:n_ho], perm[n_ho:]
    src = {"pre_rope": k_pre, "post_rope": k_post}
    kp = {s: torch.stack([kmeans(src[s][h, tr], C, seed + h) for h in range(n_kv)]) for s in spaces}
    vp = torch.stack([kmeans(v[h, tr], C, seed + 100 + h) for h in range(n_kv)])
    errs: dict = {}
    k_true = k_post[:, ho]
    pos_ho = pos[ho]
    for s in spaces:
        dec = asq.roundtrip_heads(src[s][:, ho], kp[s], bits)
        k_hat = (rope_keys(dec, pos_ho) if s == "pre_rope" else dec).cpu()
        errs[f"k_{s}"] = rel_err(k_hat, k_true)
    errs["v"] = rel_err(asq.roundtrip_heads(v[:, ho], vp, bits), v[:, ho])
    for kind in ("q8_0", "q4_0") if k_true.shape[-1] % 32 == 0 else ():
        errs[f"k_{kind}"] = rel_err(kv_roundtrip(k_true, kind), k_true)
        errs[f"v_{kind}"] = rel_err(kv_roundtrip(v[:, ho], kind), v[:, ho])
    return LayerAsq(kp, vp, errs)


def choose_key_space(layers: list[LayerAsq]) -> tuple[str, dict]:
    """The key space with the lower mean post-RoPE key error over layers, with the numbers."""
    spaces = [s for s in ("pre_rope", "post_rope") if f"k_{s}" in layers[0].errors]
    mean = {s: float(np.mean([la.errors[f"k_{s}"] for la in layers])) for s in spaces}
    return min(mean, key=mean.get), mean
