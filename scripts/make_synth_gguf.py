#!/usr/bin/env python3
"""Write a synthetic DSA GGUF of a real model shape with random weights (for speed benchmarks).

Decode/prefill speed does not depend on the weight values, so a file with the exact tensor shapes,
keys and DSA indexer of docs/FORMAT.md (random values) measures what a converted model would:

    python scripts/make_synth_gguf.py /tmp/l8b.gguf --shape llama-3.1-8b --top-k 2048
    python scripts/make_synth_gguf.py /tmp/l1b-q4.gguf --shape llama-3.2-1b --outtype q4_k_m
    dsa bench /tmp/l8b.gguf --ctx 4096,16384 --attn sparse,dense

Tensors are generated, written and freed one at a time (gguf_write.stream_tensors), so an 8B F16
file (16 GB) needs about 2 GB of RAM (the largest tensor, token_embd, plus its encoded copy).
Weights are F16 with random signs and mantissas at one exponent per tensor (|w| in
[s/2, s), s ≈ 1/sqrt(fan-in): fast to generate, activations stay finite); norms are 1.
The vocabulary is a minimal SentencePiece-style one of the shape's size (<unk> <s> </s>, 256 byte
tokens, filler pieces): llama.cpp loads it; benchmarks feed random token ids.
`--outtype q4_k_m` writes F16, then runs the backend's llama-quantize with the indexer matrices
pinned to F16 (as `dsa quantize --type q4_k_m` does).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import gguf
except ImportError:  # pragma: no cover
    sys.exit("make_synth_gguf.py needs the gguf package (pip install gguf)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_test_dsa_gguf import make_indexer_tensors  # noqa: E402
from dsa_convert.dsa.config import indexer_types_every  # noqa: E402
from dsa_convert.formats.hf_config import SUPPORTED_ARCHS, ModelSpec, RopeSpec  # noqa: E402

from dsa_convert.errors import BadInputError, DsaError  # noqa: E402

QT = gguf.GGMLQuantizationType


def _spec(name: str, hf_arch: str, n_layer: int, d: int, ff: int, n_head: int, n_head_kv: int, head_dim: int, vocab: int,
          tied: bool, n_ctx: int = 131072, theta: float = 500000.0, llama3_factor: float | None = None,
          eps: float = 1e-5) -> ModelSpec:
    """The ModelSpec `dsa convert` would read from the model's config.json (llama3 rope scaling with original ctx
    8192 when llama3_factor is set: rope_freqs.weight; Qwen2 q/k/v biases, Qwen3 q/k norms, as hf_config reads them).
    n_ctx is 128K for every real shape so that benchmarks run there (the Qwen configs say 32K; speed does not depend
    on it)."""
    rope = RopeSpec(theta=theta, dim=head_dim, scaling="llama3" if llama3_factor else "none",
                    factor=llama3_factor or 1.0, original_ctx=8192)
    arch = SUPPORTED_ARCHS[hf_arch]
    return ModelSpec(hf_arch, arch, n_layer, d, ff, n_head, n_head_kv, head_dim, n_ctx, vocab, eps, rope, tied,
                     arch == gguf.MODEL_ARCH.QWEN2, arch == gguf.MODEL_ARCH.QWEN3, name=f"synth-{name}")


LLAMA, MISTRAL, QWEN2, QWEN3 = "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
SHAPES: dict[str, ModelSpec] = {
    "llama-3.2-1b": _spec("llama-3.2-1b", LLAMA, 16, 2048, 8192, 32, 8, 64, 128256, True, llama3_factor=32.0),
    "llama-3.2-3b": _spec("llama-3.2-3b", LLAMA, 28, 3072, 8192, 24, 8, 128, 128256, True, llama3_factor=32.0),
    "llama-3.1-8b": _spec("llama-3.1-8b", LLAMA, 32, 4096, 14336, 32, 8, 128, 128256, False, llama3_factor=8.0),
    "qwen2.5-0.5b": _spec("qwen2.5-0.5b", QWEN2, 24, 896, 4864, 14, 2, 64, 151936, True, theta=1e6, eps=1e-6),
    "qwen2.5-7b": _spec("qwen2.5-7b", QWEN2, 28, 3584, 18944, 28, 4, 128, 152064, False, theta=1e6, eps=1e-6),
    "qwen3-8b": _spec("qwen3-8b", QWEN3, 36, 4096, 12288, 32, 8, 128, 151936, False, theta=1e6, eps=1e-6),
    "mistral-7b": _spec("mistral-7b", MISTRAL, 32, 4096, 14336, 32, 8, 128, 32768, False, theta=1e6),
    # tests: K-quant friendly row lengths (multiples of 256), small vocab and context
    "tiny": _spec("tiny", LLAMA, 2, 256, 512, 4, 2, 64, 512, True, n_ctx=2048, theta=10000.0),
    "tiny-qwen2": _spec("tiny-qwen2", QWEN2, 2, 256, 512, 4, 2, 64, 512, True, n_ctx=2048, theta=10000.0),
    "tiny-qwen3": _spec("tiny-qwen3", QWEN3, 2, 256, 512, 4, 2, 64, 512, True, n_ctx=2048, theta=10000.0),
}


@dataclass
class SynthOptions:
    out: Path
    shape: str = "tiny"
    top_k: int = 2048
    index_heads: int = 4
    index_dim: int = 64
    rope_dim: int = 32
    sink: int = 4
    local: int = 64
    outtype: str = "f16"
    asq: int = 0                      # C > 0: random ASQ prototypes (C per layer, KV head, K/V), pre-RoPE keys
    asq_bits: int = 4                 # ASQ residual bits b (4 or 8)
    index_share: int = 1              # G > 1: an indexer every G layers, the others reuse its top-k (FORMAT.md §4a)
    seed: int = 0
    force: bool = False
    quiet: bool = False


def rand_f16(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    """Random F16 with random sign and mantissa at exponent ~log2(1/sqrt(fan_in)) (bit tricks: ~10x
    faster than normal samples, which matters for 8B parameters)."""
    e = int(np.clip(15 + round(-0.5 * np.log2(fan_in)), 1, 30))
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits &= np.uint16(0x83FF)                 # keep sign + mantissa
    bits |= np.uint16(e << 10)                # fixed exponent
    return bits.view(np.float16)


def plan(spec: ModelSpec, o: SynthOptions):
    """PlannedTensor list: base model in GGUF order (qwen2 biases, qwen3 q/k norms), the indexer (FORMAT.md §3)."""
    from dsa_convert.formats.tensor_plan import PlannedTensor, llama3_rope_factors

    rng = np.random.default_rng(o.seed)
    out: list = []

    def mat(name: str, rows: int, cols: int):
        out.append(PlannedTensor(name, (rows, cols), QT.F16, lambda: rand_f16(rng, (rows, cols), cols)))

    def ones(name: str, n: int):
        out.append(PlannedTensor(name, (n,), QT.F32, lambda: np.ones(n, np.float32)))

    def zeros(name: str, n: int):
        out.append(PlannedTensor(name, (n,), QT.F32, lambda: np.zeros(n, np.float32)))

    d, q, kv = spec.n_embd, spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    full = indexer_types_every(spec.n_layer, o.index_share)
    mat("token_embd.weight", spec.vocab_size, d)
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        ones(p + "attn_norm.weight", d)
        mat(p + "attn_q.weight", q, d)
        mat(p + "attn_k.weight", kv, d)
        mat(p + "attn_v.weight", kv, d)
        if spec.attn_bias:
            for t, n in (("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)):
                zeros(p + t, n)
        if spec.qk_norm:
            ones(p + "attn_q_norm.weight", spec.head_dim)
            ones(p + "attn_k_norm.weight", spec.head_dim)
        mat(p + "attn_output.weight", d, q)
        ones(p + "ffn_norm.weight", d)
        mat(p + "ffn_gate.weight", spec.n_ff, d)
        mat(p + "ffn_up.weight", spec.n_ff, d)
        mat(p + "ffn_down.weight", d, spec.n_ff)
        for suffix, a in (make_indexer_tensors(rng, d, o.index_heads, o.index_dim, np.float16).items()
                          if full[il] else ()):
            qt = QT.F16 if a.dtype == np.float16 else QT.F32
            out.append(PlannedTensor(p + suffix, a.shape, qt, (lambda a=a: a)))
        if o.asq:
            # ggml {head_dim, C, n_head_kv} -> numpy (n_head_kv, C, head_dim); F32 as FORMAT.md §3 says
            for t in ("asq_k_proto", "asq_v_proto"):
                a = (0.5 * rng.standard_normal((spec.n_head_kv, o.asq, spec.head_dim))).astype(np.float32)
                out.append(PlannedTensor(p + "dsa." + t, a.shape, QT.F32, (lambda a=a: a)))
    ones("output_norm.weight", d)
    if not spec.tie_embeddings:
        mat("output.weight", spec.vocab_size, d)
    if spec.rope.scaling == "llama3":
        f = llama3_rope_factors(spec)
        out.append(PlannedTensor("rope_freqs.weight", f.shape, QT.F32, lambda f=f: f))
    return out


def validate(o: SynthOptions) -> ModelSpec:
    if o.shape not in SHAPES:
        raise BadInputError(f"unknown --shape {o.shape!r} (choose from {', '.join(SHAPES)})")
    if o.outtype not in ("f16", "q4_k_m"):
        raise BadInputError(f"--outtype must be f16 or q4_k_m (got {o.outtype!r})")
    if o.index_heads <= 0 or o.index_dim <= 0:
        raise BadInputError("--index-heads and --index-dim must be > 0")
    if o.rope_dim % 2 or not 0 <= o.rope_dim <= o.index_dim:
        raise BadInputError(f"--rope-dim must be even and <= --index-dim (got {o.rope_dim})")
    if o.index_share < 1:
        raise BadInputError(f"--index-share must be >= 1 (got {o.index_share})")
    if not 0 <= o.asq <= 256:
        raise BadInputError(f"--asq must be between 0 and 256 prototypes (got {o.asq})")
    if o.asq_bits not in (4, 8):
        raise BadInputError(f"--asq-bits must be 4 or 8 (got {o.asq_bits})")
    if o.top_k <= 0 or o.sink < 0 or o.local < 1 or o.sink + o.local > o.top_k:
        raise BadInputError(f"need top_k > 0, sink >= 0, local >= 1, sink + local <= top_k "
                            f"(got {o.top_k}, {o.sink}, {o.local})")
    return SHAPES[o.shape]


def _write_f16(path: Path, o: SynthOptions, spec: ModelSpec) -> int:
    from dsa_convert.dsa.config import DsaConfig
    from dsa_convert.dsa.retrofit import dsa_kv
    from dsa_convert.formats.gguf_write import ExtraKV, add_extra_kv, add_model_keys, open_writer, stream_tensors
    from dsa_convert.formats.tokenizer import byte_vocab, write_vocab
    from dsa_convert.progress import task

    w = open_writer(path, spec.arch_name)
    add_model_keys(w, spec, gguf.LlamaFileType.MOSTLY_F16)
    write_vocab(w, byte_vocab(spec.vocab_size))
    cfg = DsaConfig(top_k=o.top_k, sink=o.sink, local=o.local, index_heads=o.index_heads, index_dim=o.index_dim,
                    rope_dim=o.rope_dim, cluster_num=o.asq or None, residual_bits=o.asq_bits, index_share=o.index_share)
    add_extra_kv(w, ExtraKV(dsa_kv(spec.arch_name, cfg, o.sink, o.local, "user", "pre_rope" if o.asq else None,
                                   cfg.indexer_types(spec.n_layer))))
    w.add_string("dsa.synthetic", f"{o.shape} seed={o.seed} (random weights, for speed only)")
    tensors = plan(spec, o)
    with task(f"synth {o.shape}", len(tensors), quiet=o.quiet) as bar:
        stream_tensors(w, tensors, on_tensor=lambda t: bar.advance(1, info=t.name))
    return len(tensors)


def make(o: SynthOptions, spec: ModelSpec | None = None) -> dict:
    from dsa_convert.formats.atomic import atomic_output, check_output

    t0 = time.perf_counter()
    shape_spec = validate(o)
    spec = spec or shape_spec     # a caller's variant of the shape (check_placement.py: 2 layers, small vocab)
    check_output(o.out, o.force)
    with atomic_output(o.out) as tmp:
        if o.outtype == "f16":
            n = _write_f16(tmp, o, spec)
        else:
            from dsa_convert.quant.qformat import FORMATS
            from dsa_convert.quant.quantize import _run_llama_quantize

            src = tmp.parent / (tmp.name + ".f16.gguf")
            try:
                n = _write_f16(src, o, spec)
                keep = {f"blk.{il}.indexer.attn_qkw.weight": QT.F16
                        for il, full in enumerate(indexer_types_every(spec.n_layer, o.index_share)) if full}
                _run_llama_quantize(src, tmp, FORMATS["q4_k_m"], keep, None, None)
            finally:
                src.unlink(missing_ok=True)
    return {"output": str(o.out), "shape": o.shape, "outtype": o.outtype, "tensors": n,
            "bytes": Path(o.out).stat().st_size, "top_k": o.top_k, "index_heads": o.index_heads,
            "index_dim": o.index_dim, "index_share": o.index_share, "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", type=Path, help="output .gguf")
    ap.add_argument("--shape", default="tiny", help=f"one of {', '.join(SHAPES)}")
    ap.add_argument("--top-k", type=int, default=2048, help="K: total keys per query")
    ap.add_argument("--index-heads", type=int, default=4, help="H: indexer heads")
    ap.add_argument("--index-dim", type=int, default=64, help="D: indexer head dim")
    ap.add_argument("--rope-dim", type=int, default=None, help="R: indexer rotary dims (default min(32, D))")
    ap.add_argument("--sink", type=int, default=4, help="S: sink positions")
    ap.add_argument("--local", type=int, default=None, help="L: local window (default min(64, K - S))")
    ap.add_argument("--outtype", default="f16", help="f16 | q4_k_m")
    ap.add_argument("--asq", type=int, default=0, help="C > 0: add random ASQ KV prototypes (pre-RoPE keys)")
    ap.add_argument("--asq-bits", type=int, default=4, help="ASQ residual bits: 4 or 8")
    ap.add_argument("--index-share", type=int, default=1,
                    help="G: an indexer every G layers, the layers between reuse its top-k (default 1: every layer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="overwrite OUTPUT")
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    a = ap.parse_args(argv)
    rope_dim = a.rope_dim if a.rope_dim is not None else min(32, a.index_dim - a.index_dim % 2)
    local = a.local if a.local is not None else max(1, min(64, a.top_k - a.sink))
    o = SynthOptions(a.output, a.shape, a.top_k, a.index_heads, a.index_dim, rope_dim, a.sink, local,
                     a.outtype.lower(), a.asq, a.asq_bits, a.index_share, a.seed, a.force, a.quiet)
    try:
        r = make(o)
    except DsaError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"wrote {r['output']} ({r['shape']}, {r['outtype']}, {r['bytes'] / 2**20:.1f} MiB, {r['tensors']} tensors, "
          f"top-k {r['top_k']}, {r['seconds']:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
