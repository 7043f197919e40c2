"""One transformer block's weights as torch tensors plus its forward pieces, for block-by-block
calibration (same math as kernels_ref.model.RefModel.layer, batched over samples: x [N, L, d])."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels_ref.model import RefHParams, rms_norm
from ..kernels_ref.rope import apply_rope, cos_sin

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# the capture (Block.forward_capture) that holds each linear's input
LINEAR_INPUT = {"attn_q": "attn_in", "attn_k": "attn_in", "attn_v": "attn_in", "attn_output": "attn_out",
                "ffn_gate": "ffn_in", "ffn_up": "ffn_in", "ffn_down": "ffn_mid"}
OPTIONAL = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias",
            "attn_q_norm.weight", "attn_k_norm.weight")


class Block:
    """Float32 weights of block `il`: w['attn_q'] [out, in], w['attn_norm'], optional biases/qk-norms."""

    def __init__(self, hp: RefHParams, il: int, load, has, device: torch.device, seq_len: int):
        self.hp, self.il, self.device = hp, il, device
        self.w: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}
        for n in LINEARS:
            self.w[n] = self._t(load(f"blk.{il}.{n}.weight"))
        for n in ("attn_norm", "ffn_norm"):
            self.w[n] = self._t(load(f"blk.{il}.{n}.weight"))
        for n in OPTIONAL:
            if has(f"blk.{il}.{n}"):
                self.w[n.replace(".weight", "")] = self._t(load(f"blk.{il}.{n}"))
        cos, sin = cos_sin(hp.rope, torch.arange(seq_len), torch.float32)
        self.cos, self.sin = cos.to(device), sin.to(device)

    def _t(self, a) -> torch.Tensor:
        return torch.from_numpy(np.array(a, dtype=np.float32)).to(self.device)

    def lin(self, x: torch.Tensor, name: str, w: torch.Tensor | None = None) -> torch.Tensor:
        y = x @ (self.w[name] if w is None else w).T
        b = self.w.get(name + ".bias")
        return y + b if b is not None else y

    # ---- pieces ----
    def attn_core(self, x: torch.Tensor, wq=None, wk=None, wv=None, batch: int = 16) -> torch.Tensor:
        """x [N, L, d] (attn_norm output) → attention output before attn_output, [N, L, H·hd]."""
        hp = self.hp
        outs = []
        for s in range(0, x.shape[0], batch):
            xb = x[s:s + batch]
            N, L, _ = xb.shape
            q = self.lin(xb, "attn_q", wq).view(N, L, hp.n_head, hp.head_dim).transpose(1, 2)
            k = self.lin(xb, "attn_k", wk).view(N, L, hp.n_head_kv, hp.head_dim).transpose(1, 2)
            v = self.lin(xb, "attn_v", wv).view(N, L, hp.n_head_kv, hp.head_dim).transpose(1, 2)
            if "attn_q_norm" in self.w:
                q = rms_norm(q, self.w["attn_q_norm"], hp.rms_eps)
                k = rms_norm(k, self.w["attn_k_norm"], hp.rms_eps)
            cos, sin = self.cos[:L], self.sin[:L]
            q, k = apply_rope(q, cos, sin, hp.rope), apply_rope(k, cos, sin, hp.rope)
            rep = hp.n_head // hp.n_head_kv
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hp.kq_scale)
            outs.append(o.transpose(1, 2).reshape(N, L, hp.n_head * hp.head_dim))
        return torch.cat(outs, 0)

    def mlp_inner(self, y: torch.Tensor, wg=None, wu=None) -> torch.Tensor:
        return F.silu(self.lin(y, "ffn_gate", wg)) * self.lin(y, "ffn_up", wu)

    def forward_capture(self, h: torch.Tensor, batch: int = 16):
        """h [N, L, d] → (h_next, inputs) with the inputs of every linear group:
        attn_in (q/k/v), attn_out (o), ffn_in (gate/up), ffn_mid (down)."""
        caps = {k: [] for k in ("attn_in", "attn_out", "ffn_in", "ffn_mid")}
        outs = []
        for s in range(0, h.shape[0], batch):
            hb = h[s:s + batch]
            x = rms_norm(hb, self.w["attn_norm"], self.hp.rms_eps)
            o = self.attn_core(x, batch=batch)
            hb = hb + self.lin(o, "attn_output")
            y = rms_norm(hb, self.w["ffn_norm"], self.hp.rms_eps)
            m = self.mlp_inner(y)
            hb = hb + self.lin(m, "ffn_down")
            for k, t in (("attn_in", x), ("attn_out", o), ("ffn_in", y), ("ffn_mid", m)):
                caps[k].append(t)
            outs.append(hb)
        return torch.cat(outs, 0), {k: torch.cat(v, 0) for k, v in caps.items()}
