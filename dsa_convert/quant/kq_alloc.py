"""`dsa quantize --type q4_k_m --method mix`: a type per tensor under a size budget, from measured error.

Candidates per matrix are stock llama.cpp types only: for rows that are a multiple of 256 Q4_K, Q5_K, Q6_K and Q8_0;
for other rows (multiples of 32) Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0. Every linear (and the output head) is encoded at
every candidate type twice, by GPTQ and by the importance-weighted search rounded to nearest (kq_writer.encode), and
each encoding is scored by the output error it causes on the calibration activations,

    err = tr(ΔW H ΔWᵀ) / N      (H = Σ xxᵀ of the tensor's input over the N calibration tokens)

i.e. the mean squared error of the tensor's output per token. Per type the lower of the two is kept. That proxy
is in each tensor's own output units, so it is turned into an estimate of the KL divergence the tensor costs by one
gain per tensor, measured once at llama.cpp's type on a few calibration sequences: for a linear, the relative change
of its block's output E‖δh‖² / E‖h‖² (the residual stream that the next blocks see) over its proxy; for the head,
the KL divergence of its logits over its proxy. (Checked against the real per-tensor KLD on ref-llama-27m with
scripts/bench/check_sensitivity.py: KLD / proxy spreads 100x across tensors, KLD / (gain · proxy) stays within
0.55-2.1, and KLD / proxy of one tensor is the same at Q4_K and Q6_K.) A greedy Lagrangian knapsack over (Δerr, Δbytes) then picks one type per tensor so that the tensors' bytes stay within the
budget: by default the bytes of llama.cpp's own Q4_K_M mix of the same model (kq_writer.q4_k_m_type), so the file is
no larger than llama-quantize's Q4_K_M. The other tensors (norms, the token embedding when it is not the head, DSA
indexer / ASQ tensors) are written as the gptq / search writer writes them and count as fixed bytes.

The candidates' bytes wait in a folder beside the output (one block's weights and activations in memory at a time);
the next block calibrates on this block quantized at llama.cpp's Q4_K_M type (GPTQ's sequential mode).
"""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from ..errors import BadInputError
from . import kq_writer
from .kq_pack import row_bytes

QT = gguf.GGMLQuantizationType
K_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0)
B32_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0)
ROUNDINGS = ("gptq", "search")
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def candidates(n: int) -> tuple[QT, ...]:
    """The types a matrix with rows of n weights may take."""
    if n % 256 == 0:
        return K_TYPES
    if n % 32 == 0:
        return B32_TYPES
    return (QT.F16,)


def tensor_bytes(qt: QT, shape: tuple[int, ...]) -> int:
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rows * row_bytes(qt, int(shape[-1]))      # gguf's GGML_QUANT_SIZES covers F32 / F16 / BF16 too


_BUDGET = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(bpw|[kKmMgG]i?[bB]?|[bB])?\s*$")
_UNIT = {"k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_budget(text: str) -> tuple[str, float]:
    """'--size-budget' → ('bytes', n) or ('bpw', bits per weight). BYTES may carry K/M/G (10^3..) or KiB/MiB/GiB."""
    m = _BUDGET.match(str(text))
    if not m:
        raise BadInputError(f"--size-budget {text!r}: give BYTES (e.g. 105000000, 100MB, 96MiB) or bits per "
                            "weight (e.g. 4.9bpw)")
    v, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "bpw":
        if not 0 < v <= 32:
            raise BadInputError(f"--size-budget {text}: bits per weight must be in (0, 32]")
        return "bpw", v
    mult = 1 if unit in ("", "b") else _UNIT[unit.rstrip("b")]
    if v * mult < 1:
        raise BadInputError(f"--size-budget {text}: must be at least one byte")
    return "bytes", v * mult


@dataclass
class Cand:
    qtype: QT
    nbytes: int
    proxy: float                     # tr(ΔW H ΔWᵀ) / N
    rounding: str                    # gptq | search: the better of the two by the proxy
    path: Path | None = None
    err: float = 0.0                 # gain · proxy: the estimated KL divergence (set by Slot.set_gain)


@dataclass
class Slot:
    """One allocatable matrix: its candidates and llama.cpp's Q4_K_M type."""
    name: str
    shape: tuple[int, ...]
    ref_type: QT
    cands: list[Cand] = field(default_factory=list)
    gain: float = float("nan")

    def set_gain(self, gain: float) -> None:
        self.gain = gain
        for c in self.cands:
            c.err = gain * c.proxy

    def ref(self) -> Cand:
        return next(c for c in self.cands if c.qtype == self.ref_type)


def output_error(w: np.ndarray, deq: np.ndarray, H: torch.Tensor, n_tok: int) -> float:
    """tr(ΔW H ΔWᵀ) / N for w, deq [out, in]: the tensor's mean squared output error per calibration token."""
    D = torch.from_numpy(np.ascontiguousarray(deq - w, dtype=np.float32))
    Hf = H.float()
    tot = 0.0
    for a in range(0, D.shape[0], 8192):
        d = D[a:a + 8192]
        tot += float(((d @ Hf) * d).double().sum())
    return max(tot, 0.0) / max(1, n_tok)


class Spill:
    """The candidates' bytes, in a folder beside the output until the file is written."""

    def __init__(self, tmp: Path):
        self.dir = tmp.parent / (tmp.name + ".candidates")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.n = 0

    def save(self, a: np.ndarray) -> Path:
        self.n += 1
        p = self.dir / f"{self.n}.npy"
        np.save(p, a)
        return p

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def score(slot: Slot, w: np.ndarray, H: torch.Tensor, n_tok: int, damp: float, spill: Spill) -> np.ndarray:
    """Every candidate of slot encoded by both roundings and scored; the better kept (its bytes spilled). Returns the
    dequantized weights at llama.cpp's type (what the calibration continues with)."""
    keep = None
    for qt in candidates(w.shape[1]):
        best = None
        for r in ROUNDINGS if qt != QT.F16 else ("search",):
            b = kq_writer.encode(w, qt, r, H, n_tok, damp)
            d = kq_writer.dequantize(b, qt, w.shape)
            e = output_error(w, d, H, n_tok)
            if best is None or e < best[0]:
                best = (e, r, b, d)
        e, r, b, d = best
        slot.cands.append(Cand(qt, int(b.nbytes), e, r, spill.save(b)))
        if qt == slot.ref_type:
            keep = d
    if keep is None:         # llama.cpp's type is not a candidate (cannot happen for its own fallbacks)
        keep = kq_writer.dequantize(kq_writer.encode(w, slot.ref_type, "search", H, n_tok), slot.ref_type, w.shape)
    return keep


def _hull(cands: list[Cand]) -> list[int]:
    """Indices of the lower convex hull of (bytes, err), from the cheapest, err strictly decreasing."""
    order = sorted(range(len(cands)), key=lambda i: (cands[i].nbytes, cands[i].err))
    pts: list[int] = []
    for i in order:
        c = cands[i]
        if pts and (c.nbytes == cands[pts[-1]].nbytes or c.err >= cands[pts[-1]].err):
            continue
        while len(pts) >= 2:
            a, b = cands[pts[-2]], cands[pts[-1]]
            # b lies on or above the segment a → c: drop it
            if (b.err - a.err) * (c.nbytes - a.nbytes) >= (c.err - a.err) * (b.nbytes - a.nbytes):
                pts.pop()
            else:
                break
        pts.append(i)
    return pts


def allocate(slots: list[Slot], budget: int) -> dict[str, Cand]:
    """One candidate per slot, total bytes ≤ budget, minimising Σ err: the Lagrangian greedy over each slot's
    lower convex hull (steepest error decrease per byte first), then any remaining single upgrade that fits."""
    cheapest = sum(min(c.nbytes for c in s.cands) for s in slots)
    if cheapest > budget:
        raise BadInputError(f"size budget {budget} B of matrix data is below the smallest type mix ({cheapest} B)")
    hulls = {s.name: _hull(s.cands) for s in slots}
    state = {s.name: 0 for s in slots}             # position on the hull
    left = budget - cheapest
    steps = []
    for s in slots:
        h = hulls[s.name]
        for k in range(1, len(h)):
            a, b = s.cands[h[k - 1]], s.cands[h[k]]
            steps.append(((a.err - b.err) / (b.nbytes - a.nbytes), s.name, k, b.nbytes - a.nbytes))
    steps.sort(key=lambda t: -t[0])
    for _, name, k, db in steps:
        if state[name] == k - 1 and db <= left:
            state[name], left = k, left - db
    pick = {s.name: s.cands[hulls[s.name][state[s.name]]] for s in slots}
    while True:                                   # fill: the best remaining upgrade (off the hull too)
        best = None
        for s in slots:
            cur = pick[s.name]
            for c in s.cands:
                db = c.nbytes - cur.nbytes
                if c.err < cur.err and db <= left:
                    gain = (cur.err - c.err) / max(db, 1)
                    if best is None or gain > best[0]:
                        best = (gain, s.name, c, db)
        if best is None:
            return pick
        _, name, c, db = best
        pick[name], left = c, left - db


# ---- the plan of a --method mix file ---------------------------------------------------------------
def _head_name(g) -> str:
    return "output.weight" if "output.weight" in g.tensors else "token_embd.weight"


def budget_of(g, opts, ref_plan, linears: set[str]) -> dict:
    """Sizes behind the allocation (every figure in bytes of tensor data) from the gptq / search writer's plan
    (quantize._own_plan: llama.cpp's Q4_K_M mix): the reference, the fixed tensors, the smallest mix, the budget.
    BadInputError when the budget is below the smallest mix."""
    alloc = set(linears) | {_head_name(g)}
    ref = sum(tensor_bytes(t.qtype, t.shape) for t in ref_plan)
    fixed = sum(tensor_bytes(t.qtype, t.shape) for t in ref_plan if t.name not in alloc)
    smallest = fixed + sum(min(tensor_bytes(qt, t.shape) for qt in candidates(t.shape[-1]))
                           for t in ref_plan if t.name in alloc)
    n_el = sum(int(np.prod(t.shape)) for t in ref_plan)
    if opts.size_budget is None:
        budget, how = ref, "llama.cpp's Q4_K_M mix"
    else:
        kind, v = parse_budget(opts.size_budget)
        budget, how = (int(v), "--size-budget") if kind == "bytes" else (int(v * n_el / 8), f"--size-budget {v} bpw")
    if budget < smallest:
        raise BadInputError(f"--size-budget {opts.size_budget}: {budget} B of tensor data is below the smallest "
                            f"mix of the candidate types ({smallest} B = {8 * smallest / n_el:.3f} bpw)")
    return {"budget_bytes": budget, "budget_from": how, "llama_q4_k_m_bytes": ref, "fixed_bytes": fixed,
            "smallest_bytes": smallest, "n_elements": n_el, "alloc": alloc}


GAIN_SEQS = 4          # calibration sequences of the gain measurements (block outputs, head KLD)


def mix_plan(g, cal, opts, spill: Spill, ref_plan: list, linears: set[str], out_cls) -> tuple[list, dict]:
    """Calibrates every block (scoring each linear's candidates, then the block gains), then the head, allocates,
    and returns the write plan (ref_plan with the chosen types; out_cls = quantize._Out) and the report."""
    from ..formats.tensor_plan import encode as ref_encode
    from ..kernels_ref.model import rms_norm

    info = budget_of(g, opts, ref_plan, linears)
    alloc = info.pop("alloc")
    slots = {t.name: Slot(t.name, t.shape, t.qtype) for t in ref_plan if t.name in alloc}
    block: dict[str, tuple[torch.Tensor, np.ndarray]] = {}     # this block's float weights and ref-type weights

    def encode_linear(name, w, H, n_tok):
        d = score(slots[name], w, H, n_tok, opts.damp, spill)
        block[name] = (torch.from_numpy(w.copy()), d)
        return d

    def after_block(blk, il, h_in):
        short = {n: n.split(".")[2] for n in block}
        gains = block_gains(blk, h_in, {short[n]: fw for n, (fw, _) in block.items()},
                            {short[n]: d for n, (_, d) in block.items()},
                            {short[n]: slots[n].ref().proxy for n in block})
        for n in block:
            slots[n].set_gain(gains[short[n]])
        block.clear()
    cal.encode_linear, cal.after_block, cal.gain_seqs = encode_linear, after_block, GAIN_SEQS
    for il in range(g.layer_count()):
        cal.layer(il)
    head = slots[_head_name(g)]
    w = np.asarray(g.tensor(head.name), dtype=np.float32)
    score(head, w, cal.head_hessian(), cal.n_tokens, opts.damp, spill)
    x = rms_norm(cal.h[:GAIN_SEQS], cal.m.w("output_norm.weight").float().to(cal.h.device), cal.m.hp.rms_eps)
    x = x.reshape(-1, x.shape[-1]).cpu()
    kld = head_kld(x, w, kq_writer.dequantize(np.load(head.ref().path), head.ref_type, w.shape))
    head.set_gain(kld / max(head.ref().proxy, 1e-30))
    pick = allocate(list(slots.values()), info["budget_bytes"] - info["fixed_bytes"])
    plan = []
    for t in ref_plan:
        if t.name in pick:
            c = pick[t.name]
            plan.append(out_cls(t.name, t.shape, c.qtype, (lambda p=c.path: np.load(p))))
        elif (m := _BLK.match(t.name)) and m.group(2) in ("attn_norm.weight", "ffn_norm.weight", "attn_v.bias"):
            # the tensors quantize._plan takes from the calibrated block (unchanged here): read from the input,
            # since the calibration has moved past their block
            plan.append(out_cls(t.name, t.shape, t.qtype,
                                (lambda n=t.name, qt=t.qtype: ref_encode(np.asarray(g.tensor(n), np.float32), qt))))
        else:
            plan.append(t)
    data = sum(tensor_bytes(t.qtype, t.shape) for t in plan)
    info.update({
        "data_bytes": data, "data_bpw": round(8 * data / info["n_elements"], 4), "gain_sequences": GAIN_SEQS,
        "est_kld_total": sum(c.err for c in pick.values()),
        "est_kld_total_llama_types": sum(s.ref().err for s in slots.values()),
        "tensors": {n: {"type": c.qtype.name, "rounding": c.rounding, "est_kld": c.err, "proxy": c.proxy,
                        "gain": slots[n].gain, "llama_type": slots[n].ref_type.name,
                        "est_kld_llama_type": slots[n].ref().err,
                        "candidates": {k.qtype.name: [k.nbytes, k.err, k.rounding] for k in slots[n].cands}}
                    for n, c in pick.items()},
    })
    return plan, info


@torch.no_grad()
def head_kld(x: torch.Tensor, w: np.ndarray, wq: np.ndarray, chunk: int = 256) -> float:
    """Mean KL(softmax(x wᵀ) ‖ softmax(x wqᵀ)) over the rows of x [T, d]: what the head's quantization costs."""
    W, Wq = torch.from_numpy(w), torch.from_numpy(np.ascontiguousarray(wq, dtype=np.float32))
    tot = 0.0
    for a in range(0, x.shape[0], chunk):
        lp = torch.log_softmax(x[a:a + chunk] @ W.T, -1)
        lq = torch.log_softmax(x[a:a + chunk] @ Wq.T, -1)
        tot += float((lp.exp() * (lp - lq)).sum(-1).double().sum())
    return tot / max(1, x.shape[0])


@torch.no_grad()
def block_out(blk, h: torch.Tensor) -> torch.Tensor:
    """The block's output for input h [N, L, d] with the weights blk.w holds now."""
    from ..kernels_ref.model import rms_norm

    x = rms_norm(h, blk.w["attn_norm"], blk.hp.rms_eps)
    h = h + blk.lin(blk.attn_core(x), "attn_output")
    y = rms_norm(h, blk.w["ffn_norm"], blk.hp.rms_eps)
    return h + blk.lin(blk.mlp_inner(y), "ffn_down")


@torch.no_grad()
def block_gains(blk, h: torch.Tensor, float_w: dict[str, torch.Tensor], deq: dict[str, np.ndarray],
                proxy: dict[str, float]) -> dict[str, float]:
    """Per linear n of the block: the relative change of the block's output, E‖δh‖² / E‖h‖², when n alone takes the
    dequantized weights deq[n] (the others float), divided by its proxy error tr(ΔW H ΔWᵀ)/N at the same weights.
    Multiplying a candidate's proxy error by this gain gives its error in the residual stream's terms, which the
    next blocks see alike (the proxy alone is in each tensor's own output units: q, k, gate, up and v are not
    comparable with o and down)."""
    saved = dict(blk.w)
    try:
        blk.w.update(float_w)
        ref = block_out(blk, h)
        norm = float(ref.pow(2).sum(-1).mean())
        out = {}
        for n, d in deq.items():
            blk.w[n] = torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32)).to(ref.device)
            rel = float((block_out(blk, h) - ref).pow(2).sum(-1).mean()) / max(norm, 1e-30)
            blk.w[n] = float_w[n]
            out[n] = rel / max(proxy[n], 1e-30)
        return out
    finally:
        blk.w.clear()
        blk.w.update(saved)
