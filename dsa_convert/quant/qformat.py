"""Target formats of `dsa quantize` and their fake quantization (quantize → dequantize in torch).

Q4_0 / Q4_1 reproduce ggml's reference block-32 math bit for bit (fp16 block scales included; the
output file is written by gguf-py's quantizer, which is the same math). K-quants are written by
llama.cpp's own quantizer; the calibration search fake-quantizes them with ggml's real quantizer
(ggml_q: Q4_K, or Q6_K where llama-quantize's Q4_K_M mixture puts it, imatrix-weighted like
llama-quantize --imatrix), or — without the backend's libggml-base.so — with an asymmetric 4-bit
group fake quant (min ≤ 0 like Q4_K's sub-blocks) of `group_size` weights as a stand-in.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

QT = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class TargetFormat:
    name: str                 # CLI name
    qtype: QT | None          # gguf-py written type (None: llama.cpp's quantizer writes it)
    llama_ftype: int | None   # llama_ftype for llama-quantize (K-quants)
    llama_name: str | None    # llama-quantize type name
    block: int                # row length must be a multiple of this

    @property
    def via_llama_cpp(self) -> bool:
        return self.qtype is None


FORMATS: dict[str, TargetFormat] = {
    "q4_0": TargetFormat("q4_0", QT.Q4_0, None, None, 32),
    "q4_1": TargetFormat("q4_1", QT.Q4_1, None, None, 32),
    "q4_k_m": TargetFormat("q4_k_m", None, 15, "Q4_K_M", 256),   # LLAMA_FTYPE_MOSTLY_Q4_K_M = 15
}


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(x.dtype)


def fq_q4_0(w: torch.Tensor) -> torch.Tensor:
    """ggml quantize_row_q4_0_ref + dequantize_row_q4_0 (blocks of 32 along the last dim)."""
    shape = w.shape
    b = w.reshape(-1, 32).float()
    idx = b.abs().argmax(-1, keepdim=True)
    mx = b.gather(-1, idx)
    d = mx / -8.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.clamp(torch.floor(b * inv + 8.5), max=15.0)
    return ((q - 8.0) * _fp16(d)).reshape(shape).to(w.dtype)


def fq_q4_1(w: torch.Tensor) -> torch.Tensor:
    """ggml quantize_row_q4_1_ref + dequantize_row_q4_1."""
    shape = w.shape
    b = w.reshape(-1, 32).float()
    mn = b.min(-1, keepdim=True).values
    mx = b.max(-1, keepdim=True).values
    d = (mx - mn) / 15.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.clamp(torch.floor((b - mn) * inv + 0.5), max=15.0)
    return (q * _fp16(d) + _fp16(mn)).reshape(shape).to(w.dtype)


def fq_group_asym(w: torch.Tensor, group: int, bits: int = 4) -> torch.Tensor:
    """Asymmetric min-max fake quant per `group` weights (min clamped ≤ 0, as in Q4_K)."""
    shape = w.shape
    b = w.reshape(-1, group).float()
    mn = b.min(-1, keepdim=True).values.clamp(max=0.0)
    mx = b.max(-1, keepdim=True).values.clamp(min=0.0)
    qmax = 2 ** bits - 1
    scale = ((mx - mn) / qmax).clamp(min=1e-8)
    q = torch.clamp(torch.round((b - mn) / scale), 0, qmax)
    return (q * scale + mn).reshape(shape).to(w.dtype)


def use_more_bits(il: int, n_layer: int) -> bool:
    """llama-quantize's rule (llama-quant.cpp) for the layers that get more bits."""
    return il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2


def k_quant_type(fmt: TargetFormat, name: str, il: int, n_layer: int) -> QT:
    """Type llama-quantize gives linear `name` of block il (Q4_K_M mixture for llama-family archs:
    attn_v and ffn_down get Q6_K where use_more_bits, everything else Q4_K)."""
    if fmt.name == "q4_k_m" and name in ("attn_v", "ffn_down") and use_more_bits(il, n_layer):
        return QT.Q6_K
    return QT.Q4_K


def fake_quant_fn(fmt: TargetFormat, group_size: int, il: int = 0, n_layer: int = 1,
                  weighted: bool = False, real: bool | None = None):
    """fq(w, name=None, imp=None) → fake-quantized w for linear `name` of block il; `imp` is the
    mean x² of the linear's input columns (the imatrix), used only when `weighted`.

    q4_0/q4_1: torch reference math (= gguf-py's writer), or with `weighted` ggml's imatrix-weighted
    quantizer (what is then written). K-quants: ggml's real Q4_K/Q6_K quantizer (via ctypes, the
    llama-quantize mixture, imatrix-weighted if `weighted`) when `real` (default: if the backend's
    libggml-base.so is available), else a group-`group_size` asymmetric 4-bit stand-in."""
    from . import ggml_q

    if not fmt.via_llama_cpp:
        if not weighted:
            f = fq_q4_0 if fmt.name == "q4_0" else fq_q4_1
            return lambda w, name=None, imp=None: f(w)
        return lambda w, name=None, imp=None: ggml_q.fake_quant(w, int(fmt.qtype), imp)
    if real is None:
        real = ggml_q.available()
    if not real:
        return lambda w, name=None, imp=None: fq_group_asym(w, group_size)

    def fq(w, name=None, imp=None):
        qt = k_quant_type(fmt, name or "", il, n_layer)
        return ggml_q.fake_quant(w, int(qt), imp if weighted else None)
    return fq
