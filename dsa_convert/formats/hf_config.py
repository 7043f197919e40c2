"""Read a HuggingFace `config.json` into a typed, validated model description."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from ..errors import BadInputError

# HF architecture -> gguf architecture. Mistral is a Llama in llama.cpp.
SUPPORTED_ARCHS: dict[str, gguf.MODEL_ARCH] = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
}


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    dim: int = 0                       # rotary dims per head
    scaling: str = "none"              # none | linear | yarn | llama3
    factor: float = 1.0
    original_ctx: int | None = None
    low_freq_factor: float = 1.0       # llama3
    high_freq_factor: float = 4.0      # llama3
    yarn_beta_fast: float | None = None
    yarn_beta_slow: float | None = None
    yarn_ext_factor: float | None = None
    yarn_attn_factor: float | None = None


@dataclass(frozen=True)
class ModelSpec:
    hf_arch: str
    arch: gguf.MODEL_ARCH
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx: int
    vocab_size: int
    rms_eps: float
    rope: RopeSpec
    tie_embeddings: bool
    attn_bias: bool
    qk_norm: bool
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]

    @property
    def rope_neox(self) -> bool:
        """llama uses GGML's interleaved RoPE after the q/k permutation; qwen2/3 use NEOX."""
        return self.arch != gguf.MODEL_ARCH.LLAMA


def _get(cfg: dict, key: str, path: Path):
    if key not in cfg:
        raise BadInputError(f"{path}: config.json has no '{key}'")
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise BadInputError(f"{path}: config.json '{key}' must be a positive integer, got {v!r}")
    return v


def _rope(cfg: dict, head_dim: int, path: Path) -> RopeSpec:
    # transformers 5 `rope_parameters` or older `rope_theta` + `rope_scaling`
    params = dict(cfg.get("rope_parameters") or {})
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = dict(params["full_attention"])
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rtype = str(merged.get("rope_type", merged.get("type", "default")) or "default").lower()
    partial = float(cfg.get("partial_rotary_factor", merged.get("partial_rotary_factor", 1.0)))
    dim = int(head_dim * partial)
    factor = float(merged.get("factor", 1.0) or 1.0)
    if rtype in ("default", "none"):
        return RopeSpec(theta=theta, dim=dim)
    if rtype == "linear":
        return RopeSpec(theta=theta, dim=dim, scaling="linear", factor=factor)
    if rtype == "llama3":
        return RopeSpec(theta=theta, dim=dim, scaling="llama3", factor=float(merged.get("factor", 8.0)),
                        original_ctx=int(merged.get("original_max_position_embeddings", 8192)),
                        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
                        high_freq_factor=float(merged.get("high_freq_factor", 4.0)))
    if rtype == "yarn":
        if "original_max_position_embeddings" not in merged:
            raise BadInputError(f"{path}: yarn rope scaling without original_max_position_embeddings")
        return RopeSpec(theta=theta, dim=dim, scaling="yarn", factor=factor,
                        original_ctx=int(merged["original_max_position_embeddings"]),
                        yarn_beta_fast=merged.get("beta_fast"), yarn_beta_slow=merged.get("beta_slow"),
                        yarn_ext_factor=merged.get("extrapolation_factor"),
                        yarn_attn_factor=merged.get("attention_factor", merged.get("attn_factor")))
    raise BadInputError(f"{path}: unsupported rope type '{rtype}' (supported: default, linear, llama3, yarn)")


def load_config(model_dir: Path) -> ModelSpec:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise BadInputError(f"model directory not found: {model_dir}")
    path = model_dir / "config.json"
    if not path.is_file():
        raise BadInputError(f"{model_dir}: no config.json (not a HuggingFace checkpoint directory)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"{path}: not valid JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise BadInputError(f"{path}: expected a JSON object")
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    archs = cfg.get("architectures") or []
    hf_arch = archs[0] if isinstance(archs, list) and archs else None
    if hf_arch not in SUPPORTED_ARCHS:
        raise BadInputError(f"{path}: unsupported architecture {hf_arch!r} "
                            f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))})")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise BadInputError(f"{path}: unsupported hidden_act {act!r} (only silu/SwiGLU)")
    n_embd = _get(cfg, "hidden_size", path)
    n_head = _get(cfg, "num_attention_heads", path)
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = cfg.get("head_dim") or n_embd // n_head
    if n_head % n_head_kv:
        raise BadInputError(f"{path}: num_attention_heads {n_head} not a multiple of num_key_value_heads {n_head_kv}")
    arch = SUPPORTED_ARCHS[hf_arch]
    qk_norm = arch == gguf.MODEL_ARCH.QWEN3
    attn_bias = bool(cfg.get("attention_bias", arch == gguf.MODEL_ARCH.QWEN2))
    return ModelSpec(
        hf_arch=hf_arch, arch=arch,
        n_layer=_get(cfg, "num_hidden_layers", path), n_embd=n_embd,
        n_ff=_get(cfg, "intermediate_size", path), n_head=n_head, n_head_kv=n_head_kv,
        head_dim=int(head_dim), n_ctx=int(cfg.get("max_position_embeddings", 2048)),
        vocab_size=_get(cfg, "vocab_size", path), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope(cfg, int(head_dim), path),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attn_bias=attn_bias, qk_norm=qk_norm, name=model_dir.resolve().name,
        extra={"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
               "max_position_embeddings": cfg.get("max_position_embeddings")},
    )
