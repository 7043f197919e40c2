"""Baseline KV-cache quantisation round trips (real ggml block math via gguf-py) along head_dim."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import Tensor

KV_KINDS = ("f32", "f16", "q8_0", "q4_0")
_QT = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


def kv_roundtrip(x: Tensor, kind: str) -> Tensor:
    """Quantise → dequantise rows of x [..., hd] (hd a multiple of 32 for q8_0/q4_0); same dtype back.

    f16 is a cast round trip; f32 is the identity.
    """
    if kind == "f32":
        return x
    if kind == "f16":
        return x.to(torch.float16).to(x.dtype)
    if kind not in _QT:
        raise ValueError(f"unknown kv kind {kind!r} (one of {KV_KINDS})")
    if x.shape[-1] % 32:
        raise ValueError(f"{kind} needs head_dim % 32 == 0, got {x.shape[-1]}")
    a = x.detach().to(torch.float32).cpu().numpy().reshape(-1, x.shape[-1])
    # ggml quantises f32 rows; llama.cpp's KV cache receives f32 K/V from the graph
    deq = dequantize(quantize(np.ascontiguousarray(a), _QT[kind]), _QT[kind])
    return torch.from_numpy(np.asarray(deq, dtype=np.float32).reshape(x.shape)).to(x.dtype).to(x.device)
