"""`dsa quantize --type q4_k_m --method gptq|search`: the project's own K-quant writer (no llama-quantize).

Types per tensor are llama.cpp's Q4_K_M mixture (llama-quant.cpp, llama_tensor_get_type for llama-family archs):
Q4_K; attn_v and ffn_down Q6_K in the use_more_bits layers; the output head (or the token embedding when it is tied
to the head) Q6_K (Q8_0 when its rows are not a multiple of 256); a 256-block type on rows that are not a multiple
of 256 falls back as llama-quantize does (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, else F16). So the file has exactly
llama.cpp's size, and only the rounding differs:

* search: kq_search's importance-weighted scale / min search, round to nearest (what llama-quantize --imatrix does);
* gptq:   the same search per slab, columns rounded with GPTQ's error feedback through the input Hessian (gptq.py).
"""
from __future__ import annotations

import gguf
import numpy as np
import torch

from . import gptq, kq_pack, kq_search
from .kq_search import QT
from .qformat import use_more_bits

OWN_METHODS = ("gptq", "search", "mix")      # mix: kq_alloc
_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}
# --gptq-types: the types GPTQ rounds (the others round to nearest on the same search): every type, or the K-quants
# only (not the 32-weight Q5_0 / Q8_0 that rows not a multiple of 256 fall back to)
GPTQ_TYPES = {"all": (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0),
              "k": (QT.Q4_K, QT.Q5_K, QT.Q6_K)}


def fallback(qt: QT, n: int) -> QT:
    """llama-quantize's tensor_type_fallback for a row of n weights."""
    if n % kq_search.BLOCK.get(qt, 32) == 0:
        return qt
    fb = _FALLBACK.get(qt, qt)
    return fb if n % 32 == 0 else QT.F16


def q4_k_m_type(name: str, n: int, n_layer: int, tied: bool) -> QT:
    """Q4_K_M's type of tensor `name` with rows of n weights (n_layer blocks; tied: token_embd is the head)."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return QT.Q6_K if n % 256 == 0 else QT.Q8_0
    qt = QT.Q4_K
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        if use_more_bits(int(parts[1]), n_layer):
            qt = QT.Q6_K
    return fallback(qt, n)


def hessians(caps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Σ xxᵀ over the calibration tokens of each captured linear input (float64 sum of float32 products)."""
    out = {}
    for k, x in caps.items():
        x2 = x.reshape(-1, x.shape[-1])
        H = torch.zeros(x2.shape[1], x2.shape[1], dtype=torch.float64)
        for a in range(0, x2.shape[0], 4096):     # float32 products of 4096 tokens, summed in float64
            xb = x2[a:a + 4096].float().cpu()
            H += (xb.T @ xb).double()
        out[k] = H
    return out


def encode(w: np.ndarray, qt: QT, method: str, H: torch.Tensor | None, n_tokens: int,
           damp: float = 0.1, act_order: bool = False, gptq_types: str = "all") -> np.ndarray:
    """float32 w [rows, n] → the bytes of type qt: importance-weighted search (imatrix = diag(H)/n_tokens), then
    round to nearest (search) or GPTQ (gptq). Types without a grid here (F16, Q5_1) are written by gguf-py."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qt not in kq_search.SUPPORTED:
        from ..formats.tensor_plan import encode as ref_encode
        return ref_encode(w, qt)
    imp = None if H is None else (torch.diag(H) / max(1, n_tokens)).float().numpy()
    if method == "gptq" and H is not None and qt in GPTQ_TYPES[gptq_types]:
        grid, q = gptq.quantize(w, qt, H, imp, damp=damp, act_order=act_order)
    else:
        grid = kq_search.fit(qt, w, imp)
        q = grid.codes(w)
    return kq_pack.pack(grid, q)


def dequantize(b: np.ndarray, qt: QT, shape: tuple[int, int]) -> np.ndarray:
    if qt in (QT.F16, QT.F32):
        return np.asarray(b, dtype=np.float32).reshape(shape)
    return gguf.quants.dequantize(b, qt).reshape(shape)


def fixed_type_encoder(lin_type, store: dict, method: str, damp: float, act_order: bool = False,
                       gptq_types: str = "all"):
    """encode_block's encode_linear for --method gptq|search: llama.cpp's type of each linear (lin_type(name,
    shape)); the bytes go to store[name], the dequantized weights are what the block continues with."""
    def encode_linear(name: str, w: np.ndarray, H: torch.Tensor, n_tok: int) -> np.ndarray:
        qt = lin_type(name, w.shape)
        store[name] = encode(w, qt, method, H, n_tok, damp, act_order, gptq_types)
        return dequantize(store[name], qt, w.shape)
    return encode_linear


def encode_block(blk, il: int, h: torch.Tensor, encode_linear, sequential: bool = True) -> torch.Tensor:
    """Every linear of block il encoded from the block input h [N, L, d] by encode_linear(name, w, H, n_tokens)
    (w float32 [out, in], H = Σ xxᵀ of its input), which returns the dequantized weights; returns the block's
    output. sequential (GPTQ's "true sequential"): each linear's Hessian is taken on inputs that the block's
    already quantized linears produced (q/k/v → o → gate/up → down) and the output is the quantized block's, so
    the next block calibrates on the quantized model; one forward pass. Otherwise all Hessians come from the
    float block and the output is the float block's."""
    from ..kernels_ref.model import rms_norm

    hp = blk.hp
    n_tok = h.shape[0] * h.shape[1]

    def enc(names, x):
        H = hessians({"x": x})["x"]
        for n in names:
            w = blk.w[n].cpu().numpy()
            wq = encode_linear(f"blk.{il}.{n}.weight", w, H, n_tok)
            if sequential:
                blk.w[n] = torch.from_numpy(np.ascontiguousarray(wq, dtype=np.float32)).to(blk.w[n].device)
    x = rms_norm(h, blk.w["attn_norm"], hp.rms_eps)
    enc(("attn_q", "attn_k", "attn_v"), x)
    o = blk.attn_core(x)          # with the quantized q/k/v when sequential (blk.w then holds them)
    del x
    enc(("attn_output",), o)
    h = h + blk.lin(o, "attn_output")
    del o
    y = rms_norm(h, blk.w["ffn_norm"], hp.rms_eps)
    enc(("ffn_gate", "ffn_up"), y)
    m = blk.mlp_inner(y)
    del y
    enc(("ffn_down",), m)
    return h + blk.lin(m, "ffn_down")
