"""Which GGUF tensors a checkpoint becomes: names (gguf.TensorNameMap), transforms, output types."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import gguf
import numpy as np
import torch

from ..errors import BadInputError
from .hf_config import ModelSpec
from .safetensors_reader import CheckpointReader

QT = gguf.GGMLQuantizationType
OUTTYPES: dict[str, tuple[QT, gguf.LlamaFileType]] = {
    "f32": (QT.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (QT.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
_SKIP_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class PlannedTensor:
    name: str                           # GGUF name
    shape: tuple[int, ...]              # numpy order ([out, in] for a linear)
    qtype: QT
    load: Callable[[], np.ndarray]      # returns float32 numpy in `shape`


NP_TYPES = {QT.F32: np.float32, QT.F16: np.float16}   # stored as-is; every other type as raw uint8 blocks


def byte_shape(shape: tuple[int, ...], qtype: QT) -> tuple[int, ...]:
    if qtype in NP_TYPES:
        return shape
    return gguf.quant_shape_to_byte_shape(shape, qtype)


def encode(data: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 -> the array written to the file for `qtype` (gguf-py's reference quantizers)."""
    if qtype == QT.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == QT.F16:
        return np.ascontiguousarray(data.astype(np.float16))
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF half-split rotary rows -> GGML interleaved rows (same as llama.cpp's converter)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def choose_qtype(name: str, shape: tuple[int, ...], outtype: QT) -> QT:
    if len(shape) < 2 or name.endswith(".bias") or name == "rope_freqs.weight":
        return QT.F32
    if outtype in (QT.F32, QT.F16, QT.BF16):
        return outtype
    block = gguf.GGML_QUANT_SIZES[outtype][0]
    return outtype if shape[-1] % block == 0 else QT.F16


def llama3_rope_factors(spec: ModelSpec) -> np.ndarray:
    r = spec.rope
    base, dim = r.theta, spec.head_dim
    low_wavelen = r.original_ctx / r.low_freq_factor
    high_wavelen = r.original_ctx / r.high_freq_factor
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / (base ** (i / dim))
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(r.factor)
        else:
            smooth = (r.original_ctx / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
            out.append(1 / ((1 - smooth) / r.factor + smooth))
    return np.asarray(out, dtype=np.float32)


def plan_tensors(spec: ModelSpec, reader: CheckpointReader, outtype: QT) -> list[PlannedTensor]:
    tmap = gguf.get_tensor_name_map(spec.arch, spec.n_layer)
    plan: list[PlannedTensor] = []
    names = [n for n in reader.names() if not n.endswith(_SKIP_SUFFIXES)]
    if spec.tie_embeddings:
        names = [n for n in names if n != "lm_head.weight"]
    for hf_name in names:
        new = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise BadInputError(f"cannot map tensor {hf_name!r} of {spec.hf_arch} to a GGUF name")
        shape = reader.entries[hf_name].shape
        plan.append(PlannedTensor(new, shape, choose_qtype(new, shape, outtype), _loader(spec, reader, hf_name, new)))
    got = {p.name for p in plan}
    required = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{t}.weight" for i in range(spec.n_layer)
        for t in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
    if not spec.tie_embeddings:
        required.append("output.weight")
    missing = [r for r in required if r not in got]
    if missing:
        raise BadInputError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[0]}")
    if spec.rope.scaling == "llama3":
        f = llama3_rope_factors(spec)
        plan.append(PlannedTensor("rope_freqs.weight", f.shape, QT.F32, lambda f=f: f))
    return plan


def _loader(spec: ModelSpec, reader: CheckpointReader, hf_name: str, new: str) -> Callable[[], np.ndarray]:
    perm_heads = None
    if spec.arch == gguf.MODEL_ARCH.LLAMA:
        if ".attn_q." in new:
            perm_heads = spec.n_head
        elif ".attn_k." in new:
            perm_heads = spec.n_head_kv

    def load() -> np.ndarray:
        t = reader.load(hf_name)
        if perm_heads is not None:
            t = permute_rope(t, perm_heads)
        a = t.numpy()
        if not np.isfinite(a).all():
            raise BadInputError(f"tensor {hf_name!r} contains NaN or Inf values")
        return a
    return load
