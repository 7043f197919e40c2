"""What a `dsa run` or `dsa serve` session will run, checked before anything loads: the file, the context size, the
attention mode and KV cache, and the llama.cpp kv overrides that select them (the same switches as `dsa eval`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..backend.llama_runner import KV_TYPES, check_kv_flash_attn
from ..errors import BadInputError
from ..eval.perplexity_llamacpp import dsa_overrides
from ..formats.gguf_read import GgufFile

DEFAULT_CTX = 4096          # llama-cli's default context, capped by the model's
MIN_CTX = 16


@dataclass
class SessionOptions:
    ctx: int | None = None              # tokens per sequence; None: min(trained context, DEFAULT_CTX)
    attn: str | None = None             # dense | sparse | local; None: as the file says
    kv: str | None = None               # f16 | f32 | q8_0 | q4_0 | asq; None: the file's default (see plan_session)
    top_k: int | None = None            # per-run indexer budget
    n_gpu_layers: int | None = None     # None: every layer where the build offloads, else 0
    flash_attn: bool = True


@dataclass
class SessionPlan:
    path: Path
    arch: str
    n_ctx: int
    n_ctx_train: int | None
    kv: str
    overrides: dict                     # {gguf key: value} for llama.cpp's kv overrides
    mode: dict                          # dsa_overrides' {"attn", "top_k", "index_keys", "sink", "local"}
    n_gpu_layers: int
    flash_attn: bool

    def describe(self) -> str:
        m = self.mode
        if m["attn"] == "dense":
            return "dense"
        return f"{m['attn']} (top-k {m['top_k']}, sinks {m['sink']}, local {m['local']})"


def plan_session(path: Path, o: SessionOptions, gpu_offload: bool = False) -> SessionPlan:
    """Every check a session can fail before llama.cpp loads (one-line BadInputError). The KV cache defaults to the
    file's own: the ASQ cache where the file has ASQ prototypes and runs sparse, else F16."""
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"file not found: {path}")
    g = GgufFile(path)                                   # not a GGUF -> one line
    try:
        arch = g.arch
        n_train = g.get(f"{arch}.context_length")
        n_train = int(n_train) if n_train is not None else None
        if o.ctx is not None and o.ctx < MIN_CTX:
            raise BadInputError(f"--ctx must be >= {MIN_CTX} (got {o.ctx})")
        if o.ctx is not None and n_train is not None and o.ctx > n_train:
            raise BadInputError(f"--ctx {o.ctx} is beyond {path.name}'s trained context of {n_train} tokens")
        n_ctx = o.ctx if o.ctx is not None else min(n_train or DEFAULT_CTX, DEFAULT_CTX)
        kv = (o.kv or "").lower() or None
        if kv is not None and kv not in KV_TYPES:
            raise BadInputError(f"unknown --kv {kv!r} (choose from {', '.join(KV_TYPES)})")
        if kv is None:
            _, mode = dsa_overrides(g, o.attn, o.top_k, "f16")
            has_asq = g.get(f"{arch}.dsa.asq.residual_bits") is not None
            kv = "asq" if has_asq and mode["attn"] == "sparse" else "f16"
        ov, mode = dsa_overrides(g, o.attn, o.top_k, kv)
        if kv != "asq" and g.get(f"{arch}.attention.indexer.top_k") is not None:
            ov[f"{arch}.dsa.asq.cache"] = False          # the requested type is what llama.cpp allocates
    finally:
        g.close()
    check_kv_flash_attn(kv, o.flash_attn)
    if o.n_gpu_layers is not None and o.n_gpu_layers < 0:
        raise BadInputError(f"--n-gpu-layers must be >= 0 (got {o.n_gpu_layers})")
    ngl = o.n_gpu_layers if o.n_gpu_layers is not None else (999 if gpu_offload else 0)
    return SessionPlan(path, arch, n_ctx, n_train, kv, ov, mode, ngl, o.flash_attn)
