"""Write a GGUF with gguf-py's writer: model keys, vocab, extra keys, tensors streamed one by one."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import gguf
import numpy as np

from .hf_config import ModelSpec
from .tensor_plan import NP_TYPES, PlannedTensor, byte_shape, encode


@dataclass
class ExtraKV:
    """Keys beyond the base model (DSA, quantization provenance): name -> (value, type)."""
    items: dict[str, tuple[Any, gguf.GGUFValueType]] = field(default_factory=dict)


def add_model_keys(w: gguf.GGUFWriter, spec: ModelSpec, file_type: gguf.LlamaFileType) -> None:
    w.add_name(spec.name)
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_rope_freq_base(spec.rope.theta)
    w.add_rope_dimension_count(spec.rope.dim)
    if spec.arch == gguf.MODEL_ARCH.LLAMA:
        w.add_vocab_size(spec.vocab_size)
    r = spec.rope
    if r.scaling == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(r.factor)
    elif r.scaling == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(r.factor)
        w.add_rope_scaling_orig_ctx_len(r.original_ctx)
        for val, fn in ((r.yarn_ext_factor, w.add_rope_scaling_yarn_ext_factor),
                        (r.yarn_attn_factor, w.add_rope_scaling_yarn_attn_factor),
                        (r.yarn_beta_fast, w.add_rope_scaling_yarn_beta_fast),
                        (r.yarn_beta_slow, w.add_rope_scaling_yarn_beta_slow)):
            if val is not None:
                fn(float(val))
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_extra_kv(w: gguf.GGUFWriter, extra: ExtraKV) -> None:
    for key, (val, vtype) in extra.items.items():
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, val)
        else:
            w.add_key_value(key, val, vtype)


def stream_tensors(w: gguf.GGUFWriter, tensors: list[PlannedTensor],
                   on_tensor: Callable[[PlannedTensor], None] | None = None) -> None:
    """Declare every tensor, write header/KV/infos, then load → encode → write each one in turn."""
    for t in tensors:
        bshape = byte_shape(t.shape, t.qtype)
        np_dtype = NP_TYPES.get(t.qtype, np.uint8)
        nbytes = int(np.prod(bshape)) * np.dtype(np_dtype).itemsize
        w.add_tensor_info(t.name, bshape, np.dtype(np_dtype), nbytes,
                          raw_dtype=None if np_dtype != np.uint8 else t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        data = t.load()
        if tuple(data.shape) != tuple(t.shape):
            raise ValueError(f"{t.name}: loader returned shape {data.shape}, planned {t.shape}")
        w.write_tensor_data(encode(data, t.qtype))
        del data
        if on_tensor is not None:
            on_tensor(t)
    w.close()


def open_writer(path: Path, arch_name: str) -> gguf.GGUFWriter:
    return gguf.GGUFWriter(str(path), arch_name)


def planned_from_arrays(arrays: Iterable[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]) -> list[PlannedTensor]:
    """In-memory tensors (indexer, ASQ prototypes) as plan entries."""
    return [PlannedTensor(name, tuple(a.shape), qt, (lambda a=a: np.asarray(a, dtype=np.float32)))
            for name, a, qt in arrays]
