#!/usr/bin/env python3
"""Make a stock GGUF from a dsa GGUF: drop the DSA keys ({arch}.dsa.*, {arch}.attention.indexer.*)
and tensors (blk.N.indexer.*, blk.N.dsa.*); everything else is copied byte for byte, or with --f32 the
F16 tensors are widened to F32 (exactly; for a GPU decode check whose weights are not rounded again).

    python scripts/strip_dsa.py in-dsa.gguf out-stock.gguf [--f32]
"""
from __future__ import annotations

import sys

import gguf
import numpy as np


def _tensor(t, f32: bool) -> np.ndarray:
    data = np.asarray(t.data)
    qt = gguf.GGMLQuantizationType(t.tensor_type)
    if f32 and qt == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float32)
    if f32 and qt not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I32):
        sys.exit(f"--f32: tensor {t.name} is {qt.name}; only F16 tensors are widened")
    return data


def main(src: str, dst: str, f32: bool = False) -> None:
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key.startswith((f"{arch}.dsa.", f"{arch}.attention.indexer.")):
            continue
        vtype = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub_type=sub)
    keep = [t for t in r.tensors if ".indexer." not in t.name and ".dsa." not in t.name]
    for t in keep:
        qt = gguf.GGMLQuantizationType(t.tensor_type)
        data = _tensor(t, f32)
        w.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes,
                          raw_dtype=qt if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in keep:
        w.write_tensor_data(_tensor(t, f32))
    w.close()
    print(f"{dst}: {len(keep)} tensors ({len(r.tensors) - len(keep)} DSA tensors dropped)")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--f32"]
    if len(args) != 2:
        sys.exit(__doc__)
    main(args[0], args[1], f32="--f32" in sys.argv[1:])
