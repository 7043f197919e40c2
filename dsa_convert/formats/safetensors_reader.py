"""Lazy, validated access to the tensors of a HuggingFace safetensors checkpoint.

Nothing is read until a tensor is asked for; tensors come from safetensors' mmap, one at a time,
so peak memory is bounded by the largest tensor.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import BadInputError

_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                   "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shard: Path
    shape: tuple[int, ...]
    dtype: str


def _read_header(path: Path) -> dict:
    """Parse and sanity-check one safetensors header without mapping the data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise BadInputError(f"{path.name}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n <= 0 or n > _MAX_HEADER or 8 + n > size:
            raise BadInputError(f"{path.name}: corrupt safetensors header (length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise BadInputError(f"{path.name}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise BadInputError(f"{path.name}: corrupt safetensors header")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BadInputError(f"{path.name}: corrupt safetensors header (__metadata__ must map strings to strings)")
    data_len = size - 8 - n
    spans = []

    def is_uint(v) -> bool:  # the format stores usize: no bools, floats, strings or negatives
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            nbytes = _ST_DTYPE_BYTES[info["dtype"]]
            shape = info["shape"]
            if not (isinstance(shape, list) and all(is_uint(d) for d in shape) and is_uint(begin) and is_uint(end)):
                raise ValueError
            numel = 1
            for d in shape:
                numel *= d
        except (KeyError, TypeError, ValueError):
            raise BadInputError(f"{path.name}: corrupt entry for tensor {name!r}") from None
        if end > data_len:
            raise BadInputError(f"{path.name}: truncated — tensor {name!r} ends at byte {end} "
                                f"but the file holds {data_len} data bytes")
        if end < begin or end - begin != numel * nbytes:
            raise BadInputError(f"{path.name}: tensor {name!r} size does not match its shape")
        spans.append((begin, end, name))
    # the format requires the data to be covered exactly: no overlaps, no holes, no trailing bytes
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise BadInputError(f"{path.name}: corrupt safetensors data layout (tensor {name!r} starts at byte "
                                f"{begin}, expected {pos}: overlapping tensors or a hole)")
        pos = end
    if pos != data_len:
        raise BadInputError(f"{path.name}: corrupt safetensors file ({data_len - pos} bytes after the last tensor)")
    return header


class CheckpointReader:
    """All tensors of a checkpoint dir (single file or sharded with an index)."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir).resolve()
        self.entries: dict[str, TensorEntry] = {}
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            shards = self._shards_from_index(index)
        else:
            shards = sorted(self.model_dir.glob("*.safetensors"))
            if not shards:
                raise BadInputError(f"{self.model_dir}: no *.safetensors weights found "
                                    "(pytorch_model.bin checkpoints are not supported; re-save with safetensors)")
        for shard in shards:
            for name, info in _read_header(shard).items():
                if name == "__metadata__":
                    continue
                if name in self.entries:
                    raise BadInputError(f"tensor {name!r} appears in two shards")
                self.entries[name] = TensorEntry(name, shard, tuple(int(d) for d in info["shape"]), info["dtype"])

    def _shards_from_index(self, index: Path) -> list[Path]:
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise BadInputError(f"{index.name}: corrupt index (no weight_map)") from None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) and v for v in wmap.values()):
            raise BadInputError(f"{index.name}: corrupt index (weight_map must map tensor names to shard files)")
        shards = []
        for tname, fname in wmap.items():
            p = (self.model_dir / str(fname)).resolve()
            if p.parent != self.model_dir:
                raise BadInputError(f"{index.name}: shard {fname!r} for {tname!r} points outside the model directory")
            if not p.is_file():
                raise BadInputError(f"{index.name}: shard {fname} (for {tname}) is missing")
            if p not in shards:
                shards.append(p)
        self._index_map = wmap
        return shards

    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def load(self, name: str) -> torch.Tensor:
        """One tensor, as float32 (copied out of the mmap)."""
        e = self.entries[name]
        # A fresh mapping per tensor: when it is dropped its pages leave the process, so peak RSS
        # stays at one tensor (+ constant) instead of growing with every shard page touched.
        with safe_open(str(e.shard), framework="pt") as h:
            t = h.get_tensor(name)
        return t.to(torch.float32) if t.dtype != torch.float32 else t.clone()

    def close(self) -> None:
        """Nothing stays open between loads; kept for symmetry with the GGUF reader."""
