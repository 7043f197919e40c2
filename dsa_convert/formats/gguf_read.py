"""Read a GGUF through gguf-py's reader: keys, tensor table, tensors as float32 numpy."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ..errors import BadInputError
from . import indexer_layout

GGUF_MAGIC = b"GGUF"
GGML_MAX_DIMS = 4
# GGUFValueType -> byte size of a scalar (STRING = 8 and ARRAY = 9 are walked)
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def _prescan(path: Path, size: int) -> None:
    """Walk the header, KV section and tensor infos with bounds checks before gguf-py parses them.

    gguf-py advances by the bytes it actually got, so a huge count at the end of a file (array length,
    kv/tensor count) makes it loop over empty reads for minutes and allocate GBs; it also accepts
    tensor data past the end of the file. Every loop here consumes >= 1 byte and is bounded by the size.
    Raises BadInputError with a one-line reason.
    """
    import mmap
    import struct

    name = path.name
    if size < 24:
        raise BadInputError(f"{name}: truncated GGUF ({size} bytes, header needs 24)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        (ver,) = struct.unpack_from("<I", mm, 4)
        bo = "<"
        if ver & 0xFFFF == 0:  # written on the opposite byte order
            bo = ">"
            (ver,) = struct.unpack_from(">I", mm, 4)
        if ver not in (2, 3):
            raise BadInputError(f"{name}: unsupported GGUF version {ver}")
        n_tensors, n_kv = struct.unpack_from(bo + "QQ", mm, 8)
        off = 24

        def need(n: int, what: str) -> None:
            if n < 0 or off + n > size:
                raise BadInputError(f"{name}: corrupt or truncated GGUF ({what} at byte {off} needs {n} bytes, "
                                    f"file has {size})")

        def u(fmt: str, what: str) -> int:
            nonlocal off
            n = struct.calcsize(fmt)
            need(n, what)
            (v,) = struct.unpack_from(bo + fmt, mm, off)
            off += n
            return v

        def string(what: str) -> bytes:
            nonlocal off
            n = u("Q", what)
            need(n, what)
            off += n
            return bytes(mm[off - n:off]) if n <= 4096 else b""

        def value(vtype: int, what: str, depth: int = 0) -> int | None:
            nonlocal off
            if vtype in _SCALAR_SIZE:
                sz = _SCALAR_SIZE[vtype]
                need(sz, what)
                v = struct.unpack_from(bo + "I", mm, off)[0] if vtype == _UINT32 else None
                off += sz
                return v
            if vtype == _STRING:
                string(what)
                return None
            if vtype == _ARRAY and depth < 2:
                itype = u("I", what)
                count = u("Q", what)
                if itype in _SCALAR_SIZE:
                    need(count * _SCALAR_SIZE[itype], f"{what} ({count} items)")
                    off += count * _SCALAR_SIZE[itype]
                    return None
                if itype not in (_STRING, _ARRAY):
                    raise BadInputError(f"{name}: corrupt GGUF ({what}: unknown array item type {itype})")
                need(count * (8 if itype == _STRING else 12), f"{what} ({count} items)")
                for _ in range(count):
                    value(itype, what, depth + 1)
                return None
            raise BadInputError(f"{name}: corrupt GGUF ({what}: unknown value type {vtype})")

        need(n_kv * 13, f"{n_kv} key/value pairs")
        alignment = 32
        for i in range(n_kv):
            key = string(f"key #{i}")
            v = value(u("I", f"type of key #{i}"), f"value of key #{i}")
            if key == b"general.alignment" and v is not None:
                alignment = v
        if alignment <= 0 or alignment & (alignment - 1):
            raise BadInputError(f"{name}: corrupt GGUF (general.alignment {alignment} is not a power of two)")
        need(n_tensors * 24, f"{n_tensors} tensor infos")
        infos = []
        for i in range(n_tensors):
            tname = string(f"tensor info #{i}")
            n_dims = u("I", f"tensor info #{i}")
            if n_dims > GGML_MAX_DIMS:
                raise BadInputError(f"{name}: corrupt GGUF (tensor #{i} has {n_dims} dimensions, max {GGML_MAX_DIMS})")
            dims = [u("Q", f"tensor info #{i}") for _ in range(n_dims)]
            qt = u("I", f"tensor info #{i}")
            t_off = u("Q", f"tensor info #{i}")
            infos.append((tname, dims, qt, t_off))
        data_start = (off + alignment - 1) // alignment * alignment
        for tname, dims, qt, t_off in infos:
            label = tname.decode("utf-8", "replace") or "?"
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qt)]
            except (ValueError, KeyError):
                raise BadInputError(f"{name}: corrupt GGUF (tensor {label!r} has unknown type {qt})") from None
            n_el = 1
            for d in dims:
                n_el *= d
            if dims and dims[0] % block:
                raise BadInputError(f"{name}: corrupt GGUF (tensor {label!r}: row of {dims[0]} is not a multiple "
                                    f"of the {block}-element block)")
            n_bytes = n_el * type_size // block
            if t_off % alignment:
                raise BadInputError(f"{name}: corrupt GGUF (tensor {label!r} offset {t_off} is not aligned)")
            if data_start + t_off + n_bytes > size:
                raise BadInputError(f"{name}: truncated or corrupt GGUF (tensor {label!r} needs bytes "
                                    f"{data_start + t_off}..{data_start + t_off + n_bytes}, file has {size})")


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
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise BadInputError(f"cannot read {self.path}: {e.strerror or e}") from None
        if magic != GGUF_MAGIC:
            raise BadInputError(f"{self.path.name}: not a GGUF file (bad magic {magic!r}, {size} bytes)")
        try:
            _prescan(self.path, size)
            with np.errstate(over="ignore"):
                self.reader = gguf.GGUFReader(str(self.path), "r")
        except BadInputError:
            raise
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
        try:
            return f.contents()
        except (UnicodeDecodeError, ValueError, IndexError, TypeError) as e:
            raise BadInputError(f"{self.path.name}: corrupt value for key {key} ({e.__class__.__name__})") from None

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
            return a.reshape(info.shape)
        except (ValueError, NotImplementedError, TypeError, IndexError) as e:
            raise BadInputError(f"{self.path.name}: cannot read tensor {name} ({str(e)[:160]})") from None

    def layer_count(self) -> int:
        return int(self.akey("block_count", 0))

    def indexer_types(self) -> list[bool] | None:
        """{arch}.attention.indexer.types (FORMAT.md §4a), checked as the patched llama.cpp checks it: one flag per
        layer, layer 0 full, no indexer tensors in a shared layer. None when absent (every layer full)."""
        v = self.akey("attention.indexer.types")
        if v is None:
            return None
        n = self.layer_count()
        t = [bool(x) for x in v] if isinstance(v, list) else [bool(v)] * n   # llama.cpp also takes one scalar
        name = self.path.name
        if len(t) != n:
            raise BadInputError(f"{name}: attention.indexer.types has {len(t)} entries for {n} layers")
        if t and not t[0]:
            raise BadInputError(f"{name}: attention.indexer.types[0] is 0 (shared) but a shared layer needs a full "
                                "indexer layer before it")
        for il, full in enumerate(t):
            if not full and indexer_layout.has_indexer(self.has, il):
                raise BadInputError(f"{name}: layer {il} is shared (attention.indexer.types) but carries indexer tensors")
        return t

    def close(self) -> None:
        # GGUFReader holds an np.memmap; dropping references closes it
        self._by_name.clear()
        self.reader = None  # type: ignore[assignment]
