"""Read a GGUF through gguf-py's reader: keys, tensor table, tensors as float32 numpy."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ..errors import BadInputError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]      # numpy order (reverse of ggml ne)
    n_bytes: int

    @property
    def type_name(self) -> str:
        return self.qtype.name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.n_bytes / max(1, self.n_elements)


class GgufFile:
    """A validated, memory-mapped GGUF. Raises BadInputError for anything unreadable."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise BadInputError(f"file not found: {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise BadInputError(f"{self.path.name}: not a GGUF file (bad magic {magic!r}, {size} bytes)")
        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as e:  # gguf-py raises ValueError/IndexError/struct errors/overflow on corrupt files
            msg = str(e).splitlines()[0] if str(e) else e.__class__.__name__
            raise BadInputError(f"{self.path.name}: corrupt or truncated GGUF ({msg[:160]})") from None
        self.tensors: dict[str, TensorInfo] = {}
        for t in self.reader.tensors:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorInfo(t.name, gguf.GGMLQuantizationType(t.tensor_type), shape, int(t.n_bytes))
        self._by_name = {t.name: t for t in self.reader.tensors}

    # ---- keys ----
    def keys(self) -> list[str]:
        return [k for k in self.reader.fields if not k.startswith("GGUF.")]

    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def require(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise BadInputError(f"{self.path.name}: missing key {key}")
        return v

    @property
    def arch(self) -> str:
        return str(self.require("general.architecture"))

    def akey(self, suffix: str, default: Any = None) -> Any:
        """Architecture-scoped key: akey('block_count') -> '{arch}.block_count'."""
        return self.get(f"{self.arch}.{suffix}", default)

    # ---- tensors ----
    def has(self, name: str) -> bool:
        return name in self._by_name

    def raw(self, name: str) -> np.ndarray:
        return self._by_name[name].data

    def tensor(self, name: str) -> np.ndarray:
        """Dequantized float32 array in numpy order."""
        if name not in self._by_name:
            raise BadInputError(f"{self.path.name}: missing tensor {name}")
        t = self._by_name[name]
        info = self.tensors[name]
        try:
            if info.qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                a = np.asarray(t.data, dtype=np.float32)
            else:
                a = gguf.quants.dequantize(np.asarray(t.data), info.qtype)
        except (ValueError, NotImplementedError) as e:
            raise BadInputError(f"{self.path.name}: cannot read tensor {name} ({e})") from None
        return a.reshape(info.shape)

    def layer_count(self) -> int:
        return int(self.akey("block_count", 0))

    def close(self) -> None:
        # GGUFReader holds an np.memmap; dropping references closes it
        self._by_name.clear()
        self.reader = None  # type: ignore[assignment]
