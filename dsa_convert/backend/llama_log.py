"""Capture llama.cpp's own log while a model loads and read its memory figures from it.

llama.cpp's per-buffer memory breakdown (`llama_get_memory_breakdown`) is a C++-only API (a std::map),
so the numbers llama.cpp reports are taken from the lines it logs when it allocates a KV cache:

    llama_kv_cache_dsa: creating main KV cache, size = 256 cells          (sparse files only)
    llama_kv_cache:        CPU KV buffer size =     0.25 MiB              (one per device buffer)
    llama_kv_cache: size =    0.25 MiB (   256 cells,   2 layers,  1/1 seqs), K (f16):    0.12 MiB, V (f16):    0.12 MiB
    llama_kv_cache_dsa: creating indexer KV cache, size = 256 cells
    llama_kv_cache: size =    0.12 MiB (   256 cells,   2 layers,  1/1 seqs), K (f32):    0.12 MiB, V (f16):    0.00 MiB
    sched_reserve:        CPU compute buffer size =     2.47 MiB                 (last reservation per device)

llama.cpp prints MiB with two decimals, so each figure is exact to ±0.005 MiB (±5 KiB).
"""
from __future__ import annotations

import contextlib
import ctypes
import re
from dataclasses import dataclass, field
from typing import Iterator

MIB = 1 << 20

_SIZE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers.*?"
                   r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB")
_BUF = re.compile(r"llama_kv_cache:\s+(\S+) KV buffer size =\s*([\d.]+) MiB")
_DSA_PART = re.compile(r"llama_kv_cache_dsa: creating (main|indexer) KV cache")
_COMPUTE = re.compile(r"\s(\S+) compute buffer size =\s*([\d.]+) MiB")
_SPARSE = re.compile(r"sparse attention: (top-k=\d+[^\n]*|off[^\n]*)")


def _b(mib: str) -> int:
    return int(round(float(mib) * MIB))


@dataclass
class KvCacheInfo:
    """What llama.cpp logged for one context: KV caches (main + DSA indexer-key cache) and buffers."""
    kv_bytes: int = 0                                  # sum of every cache's `size =` line
    cells: int = 0                                     # KV cells allocated (n_ctx rounded up by llama.cpp)
    layers: int = 0
    k_type: str | None = None
    v_type: str | None = None
    parts: dict[str, int] = field(default_factory=dict)          # main / indexer -> bytes
    kv_buffers: dict[str, int] = field(default_factory=dict)     # device buffer name -> bytes
    compute_buffers: dict[str, int] = field(default_factory=dict)
    sparse_line: str | None = None                     # "top-k=…, sinks=…" | "off (dense override)" | None

    @property
    def found(self) -> bool:
        return self.cells > 0

    def report(self) -> dict:
        """The KV-cache fields of `dsa eval --json` and `dsa bench --json` (the caches as llama.cpp allocated them)."""
        return {"kv_k_type": self.k_type, "kv_v_type": self.v_type, "kv_bytes": self.kv_bytes, "kv_cells": self.cells,
                "kv_bytes_per_token": round(self.kv_bytes / self.cells, 2) if self.cells else None,
                "kv_main_bytes": self.parts.get("main", 0), "kv_indexer_bytes": self.parts.get("indexer", 0),
                "kv_bytes_source": "llama.cpp log: llama_kv_cache size lines (MiB, 2 decimals)"}


def parse_kv_log(text: str) -> KvCacheInfo:
    info = KvCacheInfo()
    part = "main"
    for line in text.splitlines():
        if m := _DSA_PART.search(line):
            part = m.group(1)
        elif m := _SIZE.search(line):
            nbytes = _b(m.group(1))
            info.kv_bytes += nbytes
            info.parts[part] = info.parts.get(part, 0) + nbytes
            if part == "main":
                info.cells, info.layers = int(m.group(2)), int(m.group(3))
                info.k_type, info.v_type = m.group(4), m.group(6)
        elif m := _BUF.search(line):
            info.kv_buffers[m.group(1)] = info.kv_buffers.get(m.group(1), 0) + _b(m.group(2))
        elif m := _COMPUTE.search(line):
            info.compute_buffers[m.group(1)] = _b(m.group(2))      # the last reservation counts
        elif (m := _SPARSE.search(line)) and info.sparse_line is None:
            info.sparse_line = m.group(1).strip()
    return info


@contextlib.contextmanager
def capture_log(lc) -> Iterator[list[str]]:
    """Route llama.cpp/ggml log text into a list (nothing printed) for the duration of the block;
    llama-cpp-python's own callback is restored afterwards."""
    chunks: list[str] = []

    @lc.llama_log_callback
    def _cb(level, text, user_data):
        chunks.append(text.decode("utf-8", "replace") if text else "")

    lc.llama_log_set(_cb, ctypes.c_void_p(0))
    try:
        yield chunks
    finally:
        from llama_cpp import _logger

        lc.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
