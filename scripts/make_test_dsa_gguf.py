#!/usr/bin/env python3
"""Make a DSA test GGUF: copy a stock llama/qwen2/qwen3 GGUF and add the DSA keys of
docs/FORMAT.md section 2 plus random lightning-indexer tensors (section 3).

The result exercises the patched llama.cpp sparse-attention path without a trained indexer:

    python scripts/make_test_dsa_gguf.py /tmp/ref-f32.gguf /tmp/ref-dsa.gguf \
        --heads 4 --dim 64 --rope-dim 32 --top-k 64 --sink 4 --local 16

Only the gguf-py package (``pip install gguf``) and numpy are needed. Existing DSA keys and
indexer tensors of the input are dropped and replaced.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

try:
    import gguf
except ImportError:  # pragma: no cover
    sys.exit("make_test_dsa_gguf.py needs the gguf package (pip install gguf)")

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


def _field_value(field: "gguf.ReaderField"):
    return field.contents()


def _is_dsa_key(key: str, arch: str) -> bool:
    return key.startswith(f"{arch}.dsa.") or key.startswith(f"{arch}.attention.indexer.")


def _is_indexer_tensor(name: str) -> bool:
    return name.startswith("blk.") and (".indexer." in name or ".dsa.asq_" in name)


def parse_layers(spec: str | None, n_layer: int) -> list[int]:
    if spec is None or spec == "all":
        return list(range(n_layer))
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    for il in out:
        if not 0 <= il < n_layer:
            raise SystemExit(f"layer {il} out of range [0, {n_layer})")
    return sorted(set(out))


def make_indexer_tensors(rng: np.random.Generator, n_embd: int, heads: int, dim: int,
                         dtype: np.dtype, separate: bool = False) -> dict[str, np.ndarray]:
    """Random indexer weights in numpy order (the reverse of the ggml shapes in FORMAT.md): q_b, k and proj stacked
    in attn_qkw, or with separate=True apart (the layout of files written before 2026-12-08)."""
    s = 1.0 / np.sqrt(n_embd)
    t = {
        # ggml {n_embd, H*D} -> numpy (H*D, n_embd)
        "indexer.attn_q_b.weight": (rng.standard_normal((heads * dim, n_embd)) * s).astype(dtype),
        "indexer.attn_k.weight": (rng.standard_normal((dim, n_embd)) * s).astype(dtype),
        "indexer.k_norm.weight": (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32),
        "indexer.k_norm.bias": (0.1 * rng.standard_normal(dim)).astype(np.float32),
        "indexer.proj.weight": (rng.standard_normal((heads, n_embd)) * s).astype(dtype),
    }
    # drawn in the order above, so the values do not depend on the layout
    if separate:
        return t
    qkw = np.concatenate([t["indexer.attn_q_b.weight"], t["indexer.attn_k.weight"], t["indexer.proj.weight"]])
    return {"indexer.attn_qkw.weight": qkw, "indexer.k_norm.weight": t["indexer.k_norm.weight"],
            "indexer.k_norm.bias": t["indexer.k_norm.bias"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", help="stock GGUF (llama / qwen2 / qwen3)")
    ap.add_argument("output", help="output GGUF with DSA keys + random indexer")
    ap.add_argument("--heads", type=int, default=4, help="H: indexer heads")
    ap.add_argument("--dim", type=int, default=64, help="D: indexer head dim")
    ap.add_argument("--rope-dim", type=int, default=32, help="R: rotary dims of the indexer (even, <= D)")
    ap.add_argument("--top-k", type=int, default=64, help="K: total keys per query")
    ap.add_argument("--sink", type=int, default=4, help="S: sink positions")
    ap.add_argument("--local", type=int, default=16, help="L: local window (query included)")
    ap.add_argument("--select", choices=("token", "block"), default="token")
    ap.add_argument("--block-size", type=int, default=16, help="B (written for token selection too)")
    ap.add_argument("--norm-eps", type=float, default=1e-6, help="eps of the indexer key LayerNorm")
    ap.add_argument("--layers", default="all", help="layers with an indexer: 'all' or e.g. '0,2-4'")
    ap.add_argument("--index-share", type=int, default=1,
                    help="G > 1: indexers on layers 0, G, 2G, ... only; the others reuse the top-k of the last one "
                         "before them ({arch}.attention.indexer.types, FORMAT.md section 4a; needs --layers all)")
    ap.add_argument("--full-layers", default=None,
                    help="e.g. '0,1,4': indexers on these layers only (layer 0 among them), every other layer reusing "
                         "the top-k of the last full one before it (the layouts `dsa convert --index-place search` "
                         "writes; needs --layers all, not with --index-share)")
    ap.add_argument("--dtype", choices=("f32", "f16"), default="f32", help="dtype of the indexer matrices")
    ap.add_argument("--asq", type=int, default=0, help="C > 0: random ASQ KV prototypes on every layer (FORMAT.md §6)")
    ap.add_argument("--asq-bits", type=int, choices=(4, 8), default=4, help="ASQ residual bits")
    ap.add_argument("--asq-key-space", choices=("pre_rope", "post_rope"), default="pre_rope")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--separate-projections", action="store_true",
                    help="write q_b, k and proj as three tensors (the layout before attn_qkw) instead of one")
    args = ap.parse_args(argv)
    if not 0 <= args.asq <= 256:
        ap.error("--asq must be between 0 and 256")

    if args.rope_dim % 2 or args.rope_dim > args.dim:
        ap.error("--rope-dim must be even and <= --dim")
    if args.sink + args.local > args.top_k:
        ap.error("--sink + --local must be <= --top-k")

    reader = gguf.GGUFReader(args.input)
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        ap.error("input has no general.architecture")
    arch = _field_value(arch_field)
    if arch not in SUPPORTED_ARCHS:
        ap.error(f"architecture {arch!r} not supported (expected one of {SUPPORTED_ARCHS})")

    n_embd = int(_field_value(reader.fields[f"{arch}.embedding_length"]))
    n_layer = int(_field_value(reader.fields[f"{arch}.block_count"]))
    layers = parse_layers(args.layers, n_layer)
    if args.index_share < 1:
        ap.error("--index-share must be >= 1")
    if args.index_share > 1:
        if args.layers != "all":
            ap.error("--index-share needs --layers all")
        layers = list(range(0, n_layer, args.index_share))
    if args.full_layers is not None:
        if args.layers != "all" or args.index_share > 1:
            ap.error("--full-layers needs --layers all and no --index-share")
        layers = parse_layers(args.full_layers, n_layer)
        if 0 not in layers:
            ap.error("--full-layers must include layer 0 (a shared layer reuses an earlier full layer's top-k)")
    # attention.indexer.types: only for a shared layout (plain --layers leaves the layers without indexers dense)
    types = [il in layers for il in range(n_layer)] if args.index_share > 1 or args.full_layers else None

    writer = gguf.GGUFWriter(args.output, arch)

    # 1. copy the metadata (minus any old DSA keys)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or _is_dsa_key(key, arch):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub_type = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, _field_value(field), vtype, sub_type=sub_type)

    # 2. DSA keys (FORMAT.md section 2)
    u32 = gguf.GGUFValueType.UINT32
    writer.add_key_value(f"{arch}.attention.indexer.head_count", args.heads, u32)
    writer.add_key_value(f"{arch}.attention.indexer.key_length", args.dim, u32)
    writer.add_key_value(f"{arch}.attention.indexer.top_k", args.top_k, u32)
    writer.add_key_value(f"{arch}.dsa.version", 1, u32)
    writer.add_key_value(f"{arch}.dsa.sink", args.sink, u32)
    writer.add_key_value(f"{arch}.dsa.local", args.local, u32)
    writer.add_key_value(f"{arch}.dsa.select", args.select, gguf.GGUFValueType.STRING)
    writer.add_key_value(f"{arch}.dsa.block_size", args.block_size, u32)
    writer.add_key_value(f"{arch}.dsa.indexer.rope_dim", args.rope_dim, u32)
    writer.add_key_value(f"{arch}.dsa.indexer.norm_eps", float(args.norm_eps), gguf.GGUFValueType.FLOAT32)
    writer.add_key_value(f"{arch}.dsa.split_source", "user", gguf.GGUFValueType.STRING)
    if types is not None and not all(types):
        writer.add_array(f"{arch}.attention.indexer.types", types)
    if args.asq:
        writer.add_key_value(f"{arch}.dsa.asq.cluster_num", args.asq, u32)
        writer.add_key_value(f"{arch}.dsa.asq.residual_bits", args.asq_bits, u32)
        writer.add_key_value(f"{arch}.dsa.asq.key_space", args.asq_key_space, gguf.GGUFValueType.STRING)

    # 3. copy the tensors (minus old indexer tensors) and add the random indexer
    for t in reader.tensors:
        if _is_indexer_tensor(t.name):
            continue
        ttype = gguf.GGMLQuantizationType(t.tensor_type)
        if ttype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = np.asarray(t.data).reshape(tuple(int(x) for x in reversed(t.shape)))
            writer.add_tensor(t.name, data, raw_dtype=ttype)
        else:
            writer.add_tensor(t.name, np.asarray(t.data),
                              raw_shape=[int(x) for x in reversed(t.shape)], raw_dtype=ttype)

    rng = np.random.default_rng(args.seed)
    mat_dtype = np.float32 if args.dtype == "f32" else np.float16
    for il in layers:
        for suffix, arr in make_indexer_tensors(rng, n_embd, args.heads, args.dim, mat_dtype,
                                                args.separate_projections).items():
            writer.add_tensor(f"blk.{il}.{suffix}", arr)
    if args.asq:
        n_head = int(_field_value(reader.fields[f"{arch}.attention.head_count"]))
        kvf = reader.fields.get(f"{arch}.attention.head_count_kv")
        n_head_kv = int(_field_value(kvf)) if kvf is not None else n_head
        kl, vl = reader.fields.get(f"{arch}.attention.key_length"), reader.fields.get(f"{arch}.attention.value_length")
        hd_k = int(_field_value(kl)) if kl is not None else n_embd // n_head
        hd_v = int(_field_value(vl)) if vl is not None else hd_k
        for il in range(n_layer):   # every layer: llama.cpp uses the ASQ cache only when all layers have prototypes
            for t, hd in (("asq_k_proto", hd_k), ("asq_v_proto", hd_v)):
                # ggml {head_dim, C, n_head_kv} <- numpy (n_head_kv, C, head_dim)
                writer.add_tensor(f"blk.{il}.dsa.{t}", (0.5 * rng.standard_normal((n_head_kv, args.asq, hd))).astype(np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    print(f"wrote {args.output}: arch={arch}, indexer on {len(layers)}/{n_layer} layers, "
          f"H={args.heads} D={args.dim} R={args.rope_dim} K={args.top_k} S={args.sink} L={args.local} "
          f"select={args.select}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
