"""Plain PyTorch forward pass of a dsa/llama.cpp GGUF (llama, qwen2, qwen3 graphs).

Dense attention by default (computed per block of query rows: no [T, T] tensor exists); `attention=`
swaps in sparse attention or a quantized KV cache and `capture=` exposes activations (calibration), so
the DSA retrofit, the perplexity reference and the llama.cpp parity checks all run the very same math.

    attention(layer, q, k, v, x, k_pre, positions) -> [n_head, T, head_dim]
        q [n_head, T, hd], k/v [n_kv, T, hd] after RoPE; k_pre: k before RoPE;
        x [T, n_embd]: the attention input (attn_norm output)
    capture(layer, name, tensor)  names: "attn_in", "q", "k", "v", "k_pre", "attn_out", "h"
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from . import blocked
from .rope import RopeParams, apply_rope, cos_sin

FFN_ROWS = 8192   # tokens per feed-forward block: its [rows, n_ff] activations stay bounded at long context


class AttentionFn(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                 k_pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class RefHParams:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope: RopeParams
    vocab_size: int

    @property
    def kq_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """q [H,T,d] (the last T rows of the keys), k/v [Hkv,S,d] (GQA), mask bool [T,S] shared by all heads (None:
    causal); computed per block of query rows (blocked.py)."""
    return blocked.masked_attention(q, k, v, mask, scale)


def dense_attention(hp: RefHParams):
    def attn(layer, q, k, v, x, k_pre, positions):
        return blocked.causal_attention(q, k, v, hp.kq_scale)
    return attn


class RefModel:
    def __init__(self, hp: RefHParams, load: Callable[[str], np.ndarray], has: Callable[[str], bool],
                 device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.hp, self._load, self._has = hp, load, has
        self.device, self.dtype = torch.device(device), dtype
        self._cache: dict[str, torch.Tensor] = {}

    # ---- construction ----
    @classmethod
    def from_gguf(cls, path: Path | str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "RefModel":
        from ..formats.gguf_read import GgufFile

        g = GgufFile(Path(path))
        arch = g.arch
        if arch not in ("llama", "qwen2", "qwen3"):
            from ..errors import BadInputError
            raise BadInputError(f"{g.path.name}: architecture {arch!r} is not supported by kernels_ref")
        n_head = int(g.akey("attention.head_count"))
        n_embd = int(g.akey("embedding_length"))
        head_dim = int(g.akey("attention.key_length", n_embd // n_head))
        n_rot = int(g.akey("rope.dimension_count", head_dim))
        base = float(g.akey("rope.freq_base", 10000.0))
        stype = g.akey("rope.scaling.type", "none")
        factor = float(g.akey("rope.scaling.factor", 1.0) or 1.0)
        freq_scale = 1.0 / factor if stype in ("linear", "yarn") else 1.0
        yarn = stype == "yarn"
        ff = tuple(float(x) for x in g.tensor("rope_freqs.weight")) if g.has("rope_freqs.weight") else None
        rope = RopeParams(
            n_rot=n_rot, base=base, neox=arch != "llama", freq_scale=freq_scale,
            ext_factor=float(g.akey("rope.scaling.yarn_ext_factor", 1.0)) if yarn else 0.0,
            attn_factor=float(g.akey("rope.scaling.yarn_attn_factor", 1.0)) if yarn else 1.0,
            orig_ctx=int(g.akey("rope.scaling.original_context_length", 0) or 0),
            beta_fast=float(g.akey("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(g.akey("rope.scaling.yarn_beta_slow", 1.0)), freq_factors=ff)
        vocab = g.tensors["token_embd.weight"].shape[0]
        hp = RefHParams(arch, g.layer_count(), n_embd, n_head, int(g.akey("attention.head_count_kv", n_head)),
                        head_dim, float(g.akey("attention.layer_norm_rms_epsilon", 1e-6)), rope, vocab)
        m = cls(hp, g.tensor, g.has, device, dtype)
        m.gguf = g
        return m

    @classmethod
    def from_hf(cls, model_dir: Path | str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "RefModel":
        """Same graph from a HF checkpoint, through the converter's own tensor plan (names, permutes)."""
        import gguf

        from ..formats.hf_config import load_config
        from ..formats.safetensors_reader import CheckpointReader
        from ..formats.tensor_plan import llama3_rope_factors, plan_tensors

        spec = load_config(Path(model_dir))
        plan = {p.name: p for p in plan_tensors(spec, CheckpointReader(Path(model_dir)), gguf.GGMLQuantizationType.F32)}
        r = spec.rope
        yarn = r.scaling == "yarn"
        rope = RopeParams(
            n_rot=r.dim, base=r.theta, neox=spec.rope_neox,
            freq_scale=1.0 / r.factor if r.scaling in ("linear", "yarn") else 1.0,
            ext_factor=float(r.yarn_ext_factor if r.yarn_ext_factor is not None else 1.0) if yarn else 0.0,
            attn_factor=float(r.yarn_attn_factor if r.yarn_attn_factor is not None else 1.0) if yarn else 1.0,
            orig_ctx=int(r.original_ctx or 0), beta_fast=float(r.yarn_beta_fast or 32.0),
            beta_slow=float(r.yarn_beta_slow or 1.0),
            freq_factors=tuple(llama3_rope_factors(spec).tolist()) if r.scaling == "llama3" else None)
        hp = RefHParams(spec.arch_name, spec.n_layer, spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim,
                        spec.rms_eps, rope, plan["token_embd.weight"].shape[0])
        m = cls(hp, lambda n: plan[n].load(), lambda n: n in plan, device, dtype)
        m.spec = spec
        return m

    # ---- weights ----
    def has(self, name: str) -> bool:
        return self._has(name)

    def w(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is None:
            t = torch.tensor(np.asarray(self._load(name), dtype=np.float32), dtype=self.dtype, device=self.device)
            self._cache[name] = t
        return t

    def _opt(self, name: str) -> torch.Tensor | None:
        return self.w(name) if self.has(name) else None

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ self.w(name + ".weight").T
        b = self._opt(name + ".bias")
        return y + b if b is not None else y

    # ---- forward ----
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.w("token_embd.weight")[tokens.to(self.device)]

    def attn_input(self, il: int, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.w(f"blk.{il}.attn_norm.weight"), self.hp.rms_eps)

    def qkv(self, il: int, x: torch.Tensor, positions: torch.Tensor):
        """q [H,T,d], k [Hkv,T,d], v [Hkv,T,d], k_pre — q/k after (Qwen3) norm and RoPE."""
        hp, T = self.hp, x.shape[0]
        q = self._linear(x, f"blk.{il}.attn_q").view(T, hp.n_head, hp.head_dim).transpose(0, 1)
        k = self._linear(x, f"blk.{il}.attn_k").view(T, hp.n_head_kv, hp.head_dim).transpose(0, 1)
        v = self._linear(x, f"blk.{il}.attn_v").view(T, hp.n_head_kv, hp.head_dim).transpose(0, 1)
        if self.has(f"blk.{il}.attn_q_norm.weight"):
            q = rms_norm(q, self.w(f"blk.{il}.attn_q_norm.weight"), hp.rms_eps)
            k = rms_norm(k, self.w(f"blk.{il}.attn_k_norm.weight"), hp.rms_eps)
        cos, sin = cos_sin(hp.rope, positions.cpu(), self.dtype)
        cos, sin = cos.to(self.device), sin.to(self.device)
        return apply_rope(q, cos, sin, hp.rope), apply_rope(k, cos, sin, hp.rope), v, k

    def rope_keys(self, k_pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = cos_sin(self.hp.rope, positions.cpu(), self.dtype)
        return apply_rope(k_pre, cos.to(self.device), sin.to(self.device), self.hp.rope)

    def layer(self, il: int, h: torch.Tensor, positions: torch.Tensor,
              attention: AttentionFn | None = None, capture=None) -> torch.Tensor:
        hp, T = self.hp, h.shape[0]
        x = self.attn_input(il, h)
        q, k, v, k_pre = self.qkv(il, x, positions)
        if capture is not None:
            for name, t in (("attn_in", x), ("q", q), ("k", k), ("v", v), ("k_pre", k_pre)):
                capture(il, name, t)
        attn = attention or dense_attention(hp)
        o = attn(il, q, k, v, x, k_pre, positions)
        o = o.transpose(0, 1).reshape(T, hp.n_head * hp.head_dim)
        if capture is not None:
            capture(il, "attn_out", o)
        h = h + self._linear(o, f"blk.{il}.attn_output")
        if T <= FFN_ROWS:
            h = h + self.ffn(il, h)
        else:
            h = torch.cat([h[a:a + FFN_ROWS] + self.ffn(il, h[a:a + FFN_ROWS]) for a in range(0, T, FFN_ROWS)])
        if capture is not None:
            capture(il, "h", h)
        return h

    def ffn(self, il: int, h: torch.Tensor) -> torch.Tensor:
        y = rms_norm(h, self.w(f"blk.{il}.ffn_norm.weight"), self.hp.rms_eps)
        g = F.silu(self._linear(y, f"blk.{il}.ffn_gate")) * self._linear(y, f"blk.{il}.ffn_up")
        return self._linear(g, f"blk.{il}.ffn_down")

    def head(self, h: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h, self.w("output_norm.weight"), self.hp.rms_eps)
        out = "output.weight" if self.has("output.weight") else "token_embd.weight"
        return h @ self.w(out).T

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, attention: AttentionFn | None = None, capture=None,
                positions: torch.Tensor | None = None, hidden: bool = False) -> torch.Tensor:
        """Logits [T, vocab]; with ``hidden`` the last layer's output [T, n_embd] instead, for ``head`` to be
        applied to the rows that are needed (a 32K x 16K-vocab logits matrix is 2 GB)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        pos = positions if positions is not None else torch.arange(tokens.shape[0])
        h = self.layers_from(0, self.embed(tokens), pos, attention, capture)
        return h if hidden else self.head(h)

    @torch.no_grad()
    def layers_from(self, start: int, h: torch.Tensor, positions: torch.Tensor, attention: AttentionFn | None = None,
                    capture=None) -> torch.Tensor:
        """Layers start .. n_layer - 1 on h, the input of layer ``start`` (the rest of a forward pass)."""
        for il in range(start, self.hp.n_layer):
            h = self.layer(il, h, positions, attention, capture)
        return h
