#!/usr/bin/env python3
"""Check that every DSA node of a fully offloaded model runs on the GPU (no node of a layer on the CPU backend).

For each model shape (head counts / head dims of the real models, 2 layers, small vocab and FFN: only the attention
and indexer shapes matter for placement) and each KV cache kind (f16, asq4, asq8), this writes a synthetic DSA GGUF with
dsa's scripts/make_synth_gguf.py machinery (indexer H=4, D=64, R=32 as dsa writes by default), loads it with the
patched llama-cpp-python (n_gpu_layers=-1, flash attention on, GGML_SCHED_DEBUG=2), runs a prefill longer than top-k
and a few decode tokens (so that the sparse paths run: masked prefill, decode gather / fused op), and parses the
scheduler's node assignments ("node #  N (OP): name (size) [BACKEND cause]"). A shape FAILS when

  * any node with a DSA op (DSA_*, LIGHTNING_INDEXER, TOP_K) is assigned to the CPU backend, or
  * any node of a layer (name "...-<il>") is assigned to the CPU backend, or
  * the context cannot be created (the patch's loud refusal: the error text is printed).

With `--checks decode` (or `placement,decode`) each file's decode logits are also held to kernels_ref by
scripts/gpu/check_decode.py (prefill, single-token decodes through the fused op, its older form and the masked path;
--kv f16 for the f16 files, the file's ASQ cache for asq4 / asq8), on the GPU with --n-gpu-layers 99 or on the CPU
with --n-gpu-layers 0 (then run it with --checks decode only: placement needs a GPU).

Usage (on the GPU machine, with the patched llama_cpp importable), from the repository root:
    python3 scripts/gpu/check_placement.py --out /tmp/dsa-place            # all shapes x f16/asq4/asq8
    python3 scripts/gpu/check_placement.py --shapes qwen2.5-7b --caches asq4 -v
    python3 scripts/gpu/check_placement.py --checks placement,decode --caches f16,asq4 -v
    python3 scripts/gpu/check_placement.py --checks decode --n-gpu-layers 0 --caches f16,asq4   # the CPU backend
Exit code 0: all PASS. Files are kept in --out (reused when present; --force rewrites them).
Qwen shapes are written with the qwen2 / qwen3 architectures (q/k/v biases, q/k norms: NEOX RoPE, which the ASQ
fused op treats differently from the llama NORM RoPE).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

SHAPES = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-0.5b", "qwen2.5-7b", "qwen3-8b", "mistral-7b")
CACHES = ("f16", "asq4", "asq8")
N_LAYER, N_FF, VOCAB, N_CTX_TRAIN = 2, 256, 512, 32768

NODE_RE = re.compile(r"node #\s*(\d+) \((.{10})\): (.{20}) \((.{5})\) \[(.{5}) (.{8})\]")
DSA_OPS = ("DSA_", "LIGHTNING", "TOP_K")


def write_gguf(main: Path, shape: str, cache: str, out: Path, top_k: int, n_embd: int = 0) -> None:
    """make_synth_gguf.py's shape with 2 layers, a small FFN and vocab; n_embd > 0: that embedding width instead of
    the model's (smaller files; the attention and indexer shapes, which decide the placement, stay the model's)."""
    sys.path.insert(0, str(main))
    sys.path.insert(0, str(main / "scripts"))
    import dataclasses
    import gguf
    import make_synth_gguf as m

    spec = dataclasses.replace(m.SHAPES[shape], n_layer=N_LAYER, n_ff=N_FF, vocab_size=VOCAB, n_ctx=N_CTX_TRAIN)
    if n_embd:
        spec = dataclasses.replace(spec, n_embd=n_embd)
        if spec.attn_bias and n_embd != spec.n_head * spec.head_dim:
            # llama.cpp's qwen2 needs n_embd = n_head * head_dim: the llama architecture (NORM RoPE)
            spec = dataclasses.replace(spec, arch=gguf.MODEL_ARCH.LLAMA, hf_arch="LlamaForCausalLM", attn_bias=False)
    o = m.SynthOptions(out, shape, top_k=top_k, local=min(64, top_k - 4), asq=64 if cache != "f16" else 0,
                       asq_bits=8 if cache == "asq8" else 4, force=True, quiet=True)
    m.make(o, spec)


def run_model(path: Path, n_ctx: int, n_prompt: int, n_decode: int) -> None:
    """Child process: load with full offload, prefill + decode; the scheduler prints its assignments to stderr."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_gpu_layers=-1, n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                          flash_attn=True, verbose=True)
    toks = [300 + (i * 37) % (VOCAB - 300) for i in range(n_prompt)]
    llm.eval(toks)
    for i in range(n_decode):
        llm.eval([300 + i])
    print("RUN-OK", file=sys.stderr)


def check(path: Path, args) -> tuple[bool, str]:
    env = dict(os.environ, GGML_SCHED_DEBUG="2")
    cmd = [sys.executable, __file__, "--run", str(path), "--n-ctx", str(args.n_ctx), "--n-prompt", str(args.n_prompt),
           "--n-decode", str(args.n_decode)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace")
    log = p.stderr + p.stdout
    if "RUN-OK" not in log:
        errs = [ln for ln in log.splitlines() if "error" in ln.lower() or "not supported" in ln]
        return False, "run failed (rc %d):\n    %s" % (p.returncode, "\n    ".join(errs[-6:]))
    bad, n_nodes, n_gpu = {}, 0, 0
    for mt in NODE_RE.finditer(log):
        op, name, backend = mt.group(2).strip(), mt.group(3).strip(), mt.group(5).strip()
        n_nodes += 1
        if backend != "CPU":
            n_gpu += 1
            continue
        if op.startswith(DSA_OPS) or re.search(r"-\d+$", name):
            bad[(op, name)] = bad.get((op, name), 0) + 1
    if n_nodes == 0:
        return False, "no scheduler assignments in the log (GGML_SCHED_DEBUG=2 not honoured, or verbose logging off)"
    if bad:
        lines = [f"{op:10s} {name:20s} x{c}" for (op, name), c in sorted(bad.items())]
        return False, f"{len(bad)} DSA / layer nodes on the CPU:\n    " + "\n    ".join(lines[:40])
    return True, f"{n_nodes} node assignments parsed, {n_gpu} on the GPU, no DSA / layer node on the CPU"


def check_decode(path: Path, cache: str, args) -> tuple[bool, str]:
    """scripts/gpu/check_decode.py on one file: decode logits of the fused op / older form / masked path against
    kernels_ref (its PASS / FAIL lines, exit code 0 when all pass)."""
    cmd = [sys.executable, str(Path(__file__).with_name("check_decode.py")), str(path),
           "--kv", "f16" if cache == "f16" else "asq", "--prefill", str(args.dc_prefill), "--decode", str(args.dc_decode),
           "--n-gpu-layers", str(args.n_gpu_layers)]
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    lines = [ln.strip() for ln in p.stdout.splitlines() if ln.startswith(("[PASS]", "[FAIL]", "       "))]
    if p.returncode not in (0, 1) or not lines:
        return False, "check_decode.py failed (rc %d): %s" % (p.returncode, (p.stderr or p.stdout).strip()[-400:])
    return p.returncode == 0, "decode vs kernels_ref:\n    " + "\n    ".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--main", type=Path, default=Path(__file__).resolve().parents[2], help="dsa checkout (dsa_convert, scripts/)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/dsa-place"), help="where the synthetic GGUFs go")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--caches", default=",".join(CACHES), help="comma list of f16, asq4, asq8")
    ap.add_argument("--top-k", type=int, default=64, help="indexer top-k (small: the sparse paths run early)")
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--n-prompt", type=int, default=200, help="prefill tokens (> top-k)")
    ap.add_argument("--n-decode", type=int, default=4)
    ap.add_argument("--embd", type=int, default=0, help="embedding width of the files (0: the model's)")
    ap.add_argument("--force", action="store_true", help="rewrite the GGUFs")
    ap.add_argument("--checks", default="placement", help="comma list of placement (node assignments), decode "
                    "(logits against kernels_ref: check_decode.py)")
    ap.add_argument("--n-gpu-layers", type=int, default=99, help="layers on the GPU for the decode check (0: CPU)")
    ap.add_argument("--dc-prefill", type=int, default=300, help="decode check: prefill tokens (> top-k)")
    ap.add_argument("--dc-decode", type=int, default=16, help="decode check: single-token decodes")
    ap.add_argument("-v", action="store_true", help="print the details of passing shapes too")
    ap.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        run_model(args.run, args.n_ctx, args.n_prompt, args.n_decode)
        return 0
    checks = set(args.checks.split(","))
    if not checks or checks - {"placement", "decode"}:
        ap.error(f"--checks: placement and / or decode, not {args.checks!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    ok_all = True
    for shape in args.shapes.split(","):
        for cache in args.caches.split(","):
            path = args.out / f"{shape}-{cache}.gguf"
            if args.force or not path.exists():
                r = subprocess.run([sys.executable, __file__, "--write", shape, cache, str(path), str(args.top_k),
                                    str(args.main), str(args.embd)], capture_output=True, text=True)
                if r.returncode != 0:
                    print(f"FAIL {shape:14s} {cache:5s} cannot write GGUF: {r.stderr.strip()[-400:]}")
                    ok_all = False
                    continue
            for name, fn in (("placement", lambda: check(path, args)), ("decode", lambda: check_decode(path, cache, args))):
                if name not in checks:
                    continue
                ok, msg = fn()
                ok_all &= ok
                print(f"{'PASS' if ok else 'FAIL'} {shape:14s} {cache:5s} {name:9s} " + (msg if (not ok or args.v) else ""))
                sys.stdout.flush()
    return 0 if ok_all else 1


if __name__ == "__main__":
    if len(sys.argv) in (7, 8) and sys.argv[1] == "--write":
        shape, cache, out, top_k, main_dir = sys.argv[2:7]
        write_gguf(Path(main_dir), shape, cache, Path(out), int(top_k), int(sys.argv[7]) if len(sys.argv) == 8 else 0)
        sys.exit(0)
    sys.exit(main())
