#!/usr/bin/env python3
"""Make a stock GGUF from a dsa GGUF: drop the DSA keys ({arch}.dsa.*, {arch}.attention.indexer.*)
and tensors (blk.N.indexer.*, blk.N.dsa.*); everything else is copied byte for byte.

    python scripts/strip_dsa.py in-dsa.gguf out-stock.gguf
"""
from __future__ import annotations

import sys

import gguf
import numpy as np


def main(src: str, dst: str) -> None:
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
        data = np.asarray(t.data)
        w.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes,
                          raw_dtype=qt if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in keep:
        w.write_tensor_data(np.asarray(t.data))
    w.close()
    print(f"{dst}: {len(keep)} tensors ({len(r.tensors) - len(keep)} DSA tensors dropped)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
