"""ggml's own quantizers through ctypes (libggml-base.so of the installed llama.cpp backend).

`ggml_quantize_chunk(type, src, dst, start, nrows, n_per_row, imatrix)` is exactly what
llama-quantize calls per tensor (with the imatrix's mean x² per input column as `imatrix`), and
`ggml_get_type_traits(type)->to_float` dequantizes. Used (a) as the fake quant of the AWQ search, so
the search sees the weights llama.cpp will actually produce (Q4_K / Q6_K with imatrix, Q4_0 with
imatrix), and (b) to write imatrix-weighted Q4_0/Q4_1 tensors.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ..errors import DsaError


class _Traits(ctypes.Structure):     # struct ggml_type_traits (ggml.h, llama.cpp 0c1e57098)
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def _candidates() -> list[Path]:
    out = []
    try:
        from ..backend.runtime import current_build
        cur = current_build()
        if cur is not None:
            out.append(cur / "bin" / "libggml-base.so")
    except Exception:   # noqa: BLE001
        pass
    try:
        import importlib.util
        spec = importlib.util.find_spec("llama_cpp")
        if spec is not None and spec.origin:
            out.append(Path(spec.origin).parent / "lib" / "libggml-base.so")
    except Exception:   # noqa: BLE001
        pass
    return out


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    for p in _candidates():
        if p.is_file():
            L = ctypes.CDLL(str(p))
            L.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                              ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            L.ggml_quantize_chunk.restype = ctypes.c_size_t
            L.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
            L.ggml_row_size.restype = ctypes.c_size_t
            L.ggml_get_type_traits.argtypes = [ctypes.c_int]
            L.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
            return L
    raise DsaError("ggml's quantizer (libggml-base.so) not found; run `dsa backend build`")


def available() -> bool:
    try:
        lib()
        return True
    except DsaError:
        return False


@lru_cache(maxsize=None)
def _to_float(qtype: int):
    tr = lib().ggml_get_type_traits(int(qtype)).contents
    if not tr.to_float:
        raise DsaError(f"ggml type {qtype} has no to_float")
    return _TO_FLOAT(tr.to_float)


def quantize(w: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """w [rows, n] float32 → raw blocks uint8 [rows, row_size] (the GGUF byte layout)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    rows, n = w.shape
    rs = lib().ggml_row_size(int(qtype), n)
    dst = np.empty((rows, rs), dtype=np.uint8)
    im = None
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        assert imatrix.shape == (n,)
        im = imatrix.ctypes.data
    lib().ggml_quantize_chunk(int(qtype), w.ctypes.data, dst.ctypes.data, 0, rows, n, im)
    return dst


def dequantize(q: np.ndarray, qtype: int, shape: tuple[int, int]) -> np.ndarray:
    q = np.ascontiguousarray(q)
    out = np.empty(shape, dtype=np.float32)
    _to_float(qtype)(q.ctypes.data, out.ctypes.data, int(out.size))
    return out


def fake_quant(w: torch.Tensor, qtype: int, imatrix: torch.Tensor | np.ndarray | None = None) -> torch.Tensor:
    """quantize → dequantize with ggml's quantizer (what llama-quantize would produce)."""
    shape = w.shape
    a = w.detach().float().reshape(-1, shape[-1]).cpu().numpy()
    im = None
    if imatrix is not None:
        im = imatrix.detach().float().cpu().numpy() if isinstance(imatrix, torch.Tensor) else imatrix
    d = dequantize(quantize(a, qtype, im), qtype, a.shape)
    return torch.from_numpy(d).reshape(shape).to(device=w.device, dtype=w.dtype)
