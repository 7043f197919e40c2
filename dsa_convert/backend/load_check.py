"""The backend build's load check: the wheel just built loads a one-layer model and decodes, in a child process.

A build can compile and link and still crash on first use. A compiler that links libstdc++ statically into a shared
library is one way: the library then exports its private copy of libstdc++'s internals (std::locale, operator new,
__cxa_guard_*), and llama.cpp's C++ calls bind to that copy and segfault in llama_model_load. When the toolchain does
this to libllama (CXX), every process crashes. When it does it only to libggml-cuda (nvcc links with CUDAHOSTCXX), only
a process that loaded libstdc++ before llama_cpp crashes (numpy, torch and gguf load it), since the system libstdc++
then sits outside the global symbol scope that llama_cpp's libraries are opened into. Seen on a GPU image whose CXX and
CUDAHOSTCXX were such a GCC; the system g++ for both built a library that works in any import order. The child
therefore loads libstdc++ privately (RTLD_LOCAL, as a numpy extension does) before it imports llama_cpp, and
`dsa backend build` runs it on the unpacked wheel before it publishes or installs anything, so a toolchain like that
fails the build with one line instead of later commands with SIGSEGV.

    write_check_model(path)                       # F32 random weights, byte vocabulary, 1 layer
    run_load_check(site_dir, path, gpu_layers, log)   # raises LoadCheckFailed
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

from dsa_convert.formats.gguf_write import add_model_keys, open_writer, planned_from_arrays, stream_tensors
from dsa_convert.formats.hf_config import ModelSpec, RopeSpec
from dsa_convert.formats.tokenizer import byte_vocab, write_vocab

SPEC = ModelSpec(hf_arch="LlamaForCausalLM", arch=gguf.MODEL_ARCH.LLAMA, n_layer=1, n_embd=64, n_ff=128, n_head=4,
                 n_head_kv=2, head_dim=16, n_ctx=256, vocab_size=320, rms_eps=1e-5, rope=RopeSpec(dim=16),
                 tie_embeddings=True, attn_bias=False, qk_norm=False, name="dsa-load-check")
TOKENS = (1, 259, 260, 261, 262)   # BOS, then filler pieces

# Runs in the child: libstdc++ loaded privately first (what importing numpy or torch does), then llama_cpp; load on
# the given layers, decode, check the logits.
_CHILD = """
import ctypes, ctypes.util, sys
ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
import llama_cpp
m = llama_cpp.Llama(sys.argv[1], n_ctx=int(sys.argv[4]), n_batch=64, n_gpu_layers=int(sys.argv[2]), verbose=False)
m.eval([int(t) for t in sys.argv[3].split(",")])
import numpy as np
row = np.asarray(m.scores[m.n_tokens - 1])
if row.shape != (m.n_vocab(),) or not np.isfinite(row).all():
    sys.exit(f"decode gave {row.shape} logits, finite: {bool(np.isfinite(row).all())}")
print(f"load check: decoded {m.n_tokens} tokens with {llama_cpp.__file__}")
"""


class LoadCheckFailed(RuntimeError):
    """The built library could not load or run the check model; the message says how it failed."""


def write_check_model(path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    d, q, kv, ff = SPEC.n_embd, SPEC.n_head * SPEC.head_dim, SPEC.n_head_kv * SPEC.head_dim, SPEC.n_ff
    F32 = gguf.GGMLQuantizationType.F32

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    arrays = [("token_embd.weight", mat(SPEC.vocab_size, d), F32), ("blk.0.attn_norm.weight", np.ones(d), F32),
              ("blk.0.attn_q.weight", mat(q, d), F32), ("blk.0.attn_k.weight", mat(kv, d), F32),
              ("blk.0.attn_v.weight", mat(kv, d), F32), ("blk.0.attn_output.weight", mat(d, q), F32),
              ("blk.0.ffn_norm.weight", np.ones(d), F32), ("blk.0.ffn_gate.weight", mat(ff, d), F32),
              ("blk.0.ffn_up.weight", mat(ff, d), F32), ("blk.0.ffn_down.weight", mat(d, ff), F32),
              ("output_norm.weight", np.ones(d), F32)]
    w = open_writer(path, SPEC.arch_name)
    add_model_keys(w, SPEC, gguf.LlamaFileType.ALL_F32)
    write_vocab(w, byte_vocab(SPEC.vocab_size))
    stream_tensors(w, planned_from_arrays(arrays))


def run_load_check(site: Path, model: Path, gpu_layers: int, log, timeout: float = 300.0) -> None:
    """Load *model* with the llama_cpp package under *site* in a child process and decode a few tokens; the child's
    output goes to *log*. Raises LoadCheckFailed on a crash, an error or a timeout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(site) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-c", _CHILD, str(model), str(gpu_layers), ",".join(map(str, TOKENS)), str(SPEC.n_ctx)]
    log.write(f"$ python -c <load check> {model} {gpu_layers}\n")
    log.flush()
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LoadCheckFailed(f"loading a 1-layer model did not finish in {timeout:.0f} s") from None
    log.write(p.stdout)
    log.flush()
    if p.returncode < 0:
        name = signal.Signals(-p.returncode).name if -p.returncode in signal.valid_signals() else str(-p.returncode)
        raise LoadCheckFailed(f"the built library crashed ({name}) loading a 1-layer model")
    if p.returncode != 0:
        last = next((ln for ln in reversed(p.stdout.splitlines()) if ln.strip()), "no output")
        raise LoadCheckFailed(f"loading a 1-layer model failed (exit {p.returncode}): {last.strip()}")
