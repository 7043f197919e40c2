"""`dsa quantize`: AWQ (or RTN) 4-bit quantization of a dsa/llama.cpp GGUF, block by block.

    IN.gguf (F16/F32/BF16 linears) ──► per block: capture inputs of every linear on calibration
    samples → AWQ scale search + fold (auto_scale) → clipping search (auto_clip) → write the block
    ──► OUT.gguf (Q4_0 / Q4_1 via gguf-py's quantizer), or for K-quants an AWQ-scaled F16/F32 GGUF
    that llama.cpp's own quantizer (llama-quantize) turns into Q4_K_M.

Only one block's weights and activations are alive at a time: the output file's tensors are
declared first and each block is calibrated when the writer asks for its first tensor.
Norms, biases, DSA tensors (blk.N.indexer.*, blk.N.dsa.*), embeddings and the output head are copied
byte for byte (the head is tied in the reference model and cannot be scaled through output_norm).
"""
from __future__ import annotations

import math
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

from ..errors import BadInputError, DsaError
from ..resources import check_threads, peak_resources
from ..formats.atomic import atomic_output, check_output
from ..formats.gguf_read import GgufFile
from ..formats.tensor_plan import byte_shape, encode
from ..kernels_ref.model import RefModel
from ..progress import task
from .auto_clip import auto_clip_block
from .auto_scale import GROUPS, auto_scale_block, o_scale_index
from .block import LINEAR_INPUT, LINEARS, Block
from .calib import load_samples
from .kq_writer import OWN_METHODS
from .qformat import FORMATS, QT, TargetFormat, fake_quant_fn

METHODS = ("awq", "rtn", "auto", *OWN_METHODS)
# --method auto: what measured best per type (docs/RESULTS.md §4): for Q4_0 GPTQ on the importance-weighted grid, the
# only method within 60 % of round-to-nearest's ΔPPL on both reference models and on both held-out texts (AWQ's
# books-fitted scales and clipping cost more than RTN on documentation text); AWQ for Q4_1 (x-only scales; GPTQ not
# measured there); for q4_k_m the own writer's per-tensor types under llama.cpp's
# Q4_K_M bytes (mix: mean KLD 0.41x / 0.41x / 0.10x llama.cpp's imatrix Q4_K_M on ref-llama-27m / -32k / SmolLM2,
# lower ΔPPL on all three: docs/data/quant/runs.md). An explicit --imatrix with auto keeps llama-quantize (rtn).
AUTO_METHOD = {"q4_0": ("gptq", None), "q4_1": ("awq", None), "q4_k_m": ("mix", None)}
_FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
_FILE_TYPES = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass
class QuantOptions:
    inp: Path
    out: Path
    method: str = "awq"
    qtype: str = "q4_0"
    group_size: int = 128
    calib: Path | None = None
    samples: int | None = None        # None: 32 for AWQ (measured better than 128, RESULTS §4) and mix (SmolLM2 in
    #                                   < 10 min; 0.416x llama.cpp's KLD as with 128: runs.md), 128 otherwise
    seq_len: int = 512
    device: str = "auto"
    imatrix: str | None = None        # None/"none": no imatrix; "auto": from calibration; else a file
    force: bool = False
    quiet: bool = False
    search_tokens: int = 8192         # tokens used by each α-grid loss (sequences for q/k/v)
    clip_tokens: int = 512            # tokens used by the clipping search (llm-awq: 512; 2048 measured worse)
    n_grid: int = 20
    clip: bool = True
    # clipping thresholds max|w|·(1 - i/clip_grid) down to 50 %, and whether attn_q/attn_k are clipped too
    # (on their own outputs). None: as measured best per type (docs/RESULTS.md, section 4): Q4_0/Q4_1 40 steps
    # with q/k; K-quants 20 steps without q/k (the settings of the measured Q4_K_M rows).
    clip_grid: int | None = None
    clip_qk: bool | None = None
    # AWQ scale form: s = mean|x|^α (False, llm-awq's original) or mean|x|^α / mean|ŵ|^(1-α) (True, AutoAWQ's
    # duo_scaling). x-only measured better (WikiText-2, 200 chunks): Q4_0 ΔPPL +1.10 (mean of 4 seeds) vs duo
    # +2.90, RTN +4.38; Q4_K_M without imatrix +2.79 vs duo +4.63 (one seed; llama.cpp's own Q4_K_M +1.81).
    duo_scaling: bool = False
    seed: int = 0
    threads: int | None = None        # llama-quantize threads
    # --method gptq: Hessian damping, a fraction of its mean diagonal. 0.1 measured better than 0.01 on ref-llama-27m
    # (mean KLD 0.717x llama.cpp's vs 0.743x) and SmolLM2 (1.032x vs 1.065x): docs/data/quant/runs.md
    damp: float = 0.1
    # own K-quant writer: the next block calibrates on the quantized block's output (GPTQ's sequential mode)
    sequential: bool = True
    act_order: bool = False           # --method gptq: columns in decreasing-importance order on a fixed grid
    gptq_types: str = "all"           # --method gptq: the types GPTQ rounds (kq_writer.GPTQ_TYPES)
    size_budget: str | None = None    # --method mix: BYTES or BPW of tensor data (None: llama.cpp's Q4_K_M mix)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise BadInputError("--device cuda: no CUDA device available to torch")
    if name not in ("cpu", "cuda"):
        raise BadInputError(f"unknown --device {name!r} (choose from auto, cpu, cuda)")
    return torch.device(name)


def clip_settings(opts: QuantOptions, fmt: TargetFormat) -> tuple[int, bool]:
    k = fmt.via_llama_cpp
    return (opts.clip_grid if opts.clip_grid is not None else (20 if k else 40),
            opts.clip_qk if opts.clip_qk is not None else (not k))


def _linear_names(g: GgufFile, n_layer: int) -> list[str]:
    return [f"blk.{il}.{n}.weight" for il in range(n_layer) for n in LINEARS]


def validate(opts: QuantOptions) -> tuple[TargetFormat, GgufFile]:
    """Every check that needs no computation, before anything is written."""
    if opts.qtype not in FORMATS:
        raise BadInputError(f"unknown --type {opts.qtype!r} (choose from {', '.join(FORMATS)})")
    if opts.method not in METHODS:
        raise BadInputError(f"unknown --method {opts.method!r} (choose from {', '.join(METHODS)})")
    if opts.method == "auto":
        opts.method, auto_imatrix = AUTO_METHOD[opts.qtype]
        if opts.imatrix is None:
            opts.imatrix = auto_imatrix
        elif opts.method in OWN_METHODS:          # an explicit --imatrix: llama-quantize with it (K-quants), or
            opts.method = "rtn" if FORMATS[opts.qtype].via_llama_cpp else "awq"   # ggml's weighted Q4_0 / Q4_1
    if opts.samples is None:
        opts.samples = 32 if opts.method in ("awq", "mix") else 128
    fmt = FORMATS[opts.qtype]
    if opts.method in OWN_METHODS:
        if opts.method == "mix" and not fmt.via_llama_cpp:
            raise BadInputError(f"--method mix allocates K-quant types (--type q4_k_m); for {opts.qtype} use gptq, "
                                "search, awq or rtn")
        if opts.imatrix not in (None, "auto"):
            raise BadInputError(f"--method {opts.method} computes its importance from --calib; --imatrix does not apply")
        if opts.calib is None:
            raise BadInputError(f"--calib FILE is required for --method {opts.method}")
        if not (0 < opts.damp < 1):
            raise BadInputError(f"--damp must be in (0, 1) (got {opts.damp})")
        from .kq_writer import GPTQ_TYPES
        if opts.gptq_types not in GPTQ_TYPES:
            raise BadInputError(f"unknown --gptq-types {opts.gptq_types!r} (choose from {', '.join(GPTQ_TYPES)})")
    if opts.group_size <= 0 or opts.group_size % 32:
        raise BadInputError(f"--group-size must be a positive multiple of 32 (got {opts.group_size})")
    check_threads(opts.threads)
    check_output(opts.out, opts.force)
    if Path(opts.inp).resolve() == Path(opts.out).resolve():
        raise BadInputError("input and output are the same file")
    g = GgufFile(Path(opts.inp))
    if g.arch not in ("llama", "qwen2", "qwen3"):
        raise BadInputError(f"{g.path.name}: architecture {g.arch!r} is not supported (llama, qwen2, qwen3)")
    n_layer = g.layer_count()
    if n_layer < 1:
        raise BadInputError(f"{g.path.name}: no transformer blocks ({g.arch}.block_count missing)")
    for name in _linear_names(g, n_layer):
        info = g.tensors.get(name)
        if info is None:
            raise BadInputError(f"{g.path.name}: missing tensor {name}")
        if info.qtype not in _FLOAT_TYPES:
            raise BadInputError(f"{g.path.name}: already quantized ({name} is {info.type_name}); "
                                "quantize from an F16/F32/BF16 GGUF")
        row = info.shape[-1]
        if row % opts.group_size and opts.method not in OWN_METHODS:     # clipping groups: AWQ/RTN only
            raise BadInputError(f"--group-size {opts.group_size} does not divide the row length {row} of {name}")
    if opts.method == "awq" or opts.imatrix == "auto":
        if opts.calib is None:
            raise BadInputError("--calib FILE is required for --method awq (and --imatrix auto)")
    if opts.imatrix not in (None, "none", "auto"):
        if not fmt.via_llama_cpp:
            raise BadInputError(f"--imatrix FILE applies to K-quants (llama.cpp's quantizer); for {opts.qtype} "
                                "use --imatrix auto")
        if not Path(opts.imatrix).is_file():
            raise BadInputError(f"imatrix file not found: {opts.imatrix}")
    if opts.imatrix == "auto" and opts.method != "awq" and not fmt.via_llama_cpp:
        raise BadInputError(f"--imatrix auto for {opts.qtype} needs --method awq")
    if opts.size_budget is not None and opts.method != "mix":
        raise BadInputError("--size-budget applies to --method mix (per-tensor types under a size budget)")
    if opts.method == "mix":                     # a budget no type mix can meet: refused before any work
        from .kq_alloc import budget_of
        budget_of(g, opts, _own_plan(g, None, opts), set(_linear_names(g, n_layer)))
    return fmt, g


# ---------------------------------------------------------------------------------------------
class Calibrator:
    """Runs the model block by block over the calibration samples; `layer(il)` returns block il's
    final float32 weights (AWQ-scaled and clipped, or untouched for RTN)."""

    def __init__(self, m: RefModel, g: GgufFile, tokens: torch.Tensor | None, opts: QuantOptions,
                 fmt: TargetFormat, device: torch.device, want_imatrix: bool, bar=None):
        self.m, self.g, self.opts, self.fmt, self.device = m, g, opts, fmt, device
        # imatrix-weighted quantization downstream (llama-quantize --imatrix, or ggml's weighted Q4_0/Q4_1
        # writer for --imatrix auto): the search's fake quant gets the mean x² of each linear's input
        self.weighted = opts.imatrix not in (None, "none")
        self.qgroup = 32 if not fmt.via_llama_cpp else opts.group_size
        self.want_imatrix = want_imatrix
        self.awq = opts.method == "awq"
        self.own = opts.method in OWN_METHODS
        self._head_h: torch.Tensor | None = None
        self.enc: dict[str, np.ndarray] = {}          # the current block's encoded linears (own K-quant writer)
        self.encode_linear = None                      # own K-quant writer: (name, w, H, n_tokens) -> dequantized w
        self.after_block, self.gain_seqs = None, 0     # --method mix: (blk, il, first block inputs) after a block
        self.next, self.cur_il, self.cur = 0, -1, {}
        self.report: list[dict] = []
        self.imatrix: dict[str, np.ndarray] = {}       # weight name -> Σ x² over tokens (scaled inputs)
        self.tok_per_block = 0
        self.col_scales: dict[str, np.ndarray] = {}    # weight name -> input-column scale (AWQ)
        self.n_tokens = 0 if tokens is None else tokens.numel()
        self.gen = torch.Generator().manual_seed(opts.seed)
        self.bar = bar
        self.h = self._embed(tokens) if tokens is not None else None
        self.seconds = 0.0

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        info = self.g.tensors["token_embd.weight"]
        flat = tokens.reshape(-1).numpy()
        if info.qtype in (QT.F32, QT.F16):
            rows = np.asarray(self.g.raw("token_embd.weight"))[flat].astype(np.float32)
        else:
            rows = self.g.tensor("token_embd.weight")[flat]
        return torch.from_numpy(rows).to(self.device).view(*tokens.shape, -1)

    def layer(self, il: int) -> dict[str, np.ndarray]:
        while self.cur_il < il:
            self._process(self.cur_il + 1)
        if self.cur_il != il:
            raise RuntimeError(f"block {il} requested after block {self.cur_il} (tensor order)")
        return self.cur

    @torch.no_grad()
    def _process(self, il: int) -> None:
        t0 = time.perf_counter()
        self.cur = {}
        L = self.opts.seq_len
        blk = Block(self.m.hp, il, self.g.tensor, self.g.has, self.device, L)
        rep: dict = {"layer": il}
        self.fq = fake_quant_fn(self.fmt, self.opts.group_size, il, self.m.hp.n_layer, self.weighted)
        if self.h is not None and self.own:     # own K-quant writer: calibrate and encode in one pass
            from .kq_writer import encode_block
            self.tok_per_block = self.h.shape[0] * self.h.shape[1]
            self.enc.clear()
            h_in = self.h[:self.gain_seqs]
            self.h = encode_block(blk, il, self.h, self.encode_linear, self.opts.sequential)
            if self.after_block is not None:      # --method mix: the block gains (kq_alloc)
                self.after_block(blk, il, h_in)
        elif self.h is not None:
            h_next, caps = blk.forward_capture(self.h)
            if self.awq:
                rep["rtn_mse"] = self._block_mse(blk, caps)
                rep["scale"] = auto_scale_block(blk, caps, self.fq, self.qgroup, self.opts.search_tokens,
                                                self.opts.n_grid, self.gen, self.opts.duo_scaling)
                if self.opts.clip:
                    rep["clip_shrink"] = auto_clip_block(blk, caps, self.fq, self.opts.group_size,
                                                         self.opts.clip_tokens, self.gen,
                                                         *clip_settings(self.opts, self.fmt))
                rep["awq_mse"] = self._block_mse(blk, caps)
            if self.want_imatrix or self.weighted:
                self.tok_per_block = caps["attn_in"].shape[0] * caps["attn_in"].shape[1]
                for grp in GROUPS:
                    x = caps[grp.inp]
                    s2 = x.reshape(-1, x.shape[-1]).double().pow(2).sum(0).float().cpu().numpy()
                    for n in grp.linears:
                        self.imatrix[f"blk.{il}.{n}.weight"] = s2
            del caps
            self.h = h_next
        linears = {g.name: g.linears for g in GROUPS}
        for grp, s in blk.scales.items():
            s = s.cpu().numpy()
            if grp == "o":
                s = s[o_scale_index(blk).cpu().numpy()]
            for n in linears[grp]:
                self.col_scales[f"blk.{il}.{n}.weight"] = s
        for n, t in blk.w.items():
            suffix = ".weight" if not n.endswith(".bias") else ""
            self.cur[f"blk.{il}.{n}{suffix}"] = t.cpu().numpy()
        self.cur_il = il
        rep["seconds"] = round(time.perf_counter() - t0, 2)
        self.seconds += rep["seconds"]
        self.report.append(rep)
        if self.bar is not None:
            info = ""
            if "awq_mse" in rep:
                info = f"block {il}: out-MSE rtn {rep['rtn_mse']:.3g} → awq {rep['awq_mse']:.3g}"
            self.bar.advance(1, info=info)

    def head_hessian(self) -> torch.Tensor:
        """Σ xxᵀ of the output head's input (output_norm of the last block's output), after every block."""
        if self._head_h is None:
            from ..kernels_ref.model import rms_norm
            from .kq_writer import hessians
            self.layer(self.m.hp.n_layer - 1)
            x = rms_norm(self.h, self.m.w("output_norm.weight").float().to(self.h.device), self.m.hp.rms_eps)
            self._head_h = hessians({"head": x})["head"]
        return self._head_h

    def _block_mse(self, blk: Block, caps: dict[str, torch.Tensor]) -> float:
        """MSE of the block's residual update with all 7 linears fake-quantized (first sequences)."""
        n_seq = max(1, min(caps["attn_in"].shape[0], math.ceil(self.opts.search_tokens / self.opts.seq_len)))
        x = caps["attn_in"][:n_seq]
        imp = {k: caps[k].reshape(-1, caps[k].shape[-1]).pow(2).mean(0) for k in set(LINEAR_INPUT.values())}
        q = {n: self.fq(blk.w[n], n, imp[LINEAR_INPUT[n]]) for n in LINEARS}
        o_ref = blk.attn_core(x)
        o_q = blk.attn_core(x, q["attn_q"], q["attn_k"], q["attn_v"])
        a_ref, a_q = blk.lin(o_ref, "attn_output"), blk.lin(o_q, "attn_output", q["attn_output"])
        y = caps["ffn_in"][:n_seq]
        f_ref = blk.lin(blk.mlp_inner(y), "ffn_down")
        f_q = blk.lin(blk.mlp_inner(y, q["ffn_gate"], q["ffn_up"]), "ffn_down", q["ffn_down"])
        return float(((a_q + f_q) - (a_ref + f_ref)).pow(2).mean())


# ---------------------------------------------------------------------------------------------
@dataclass
class _Out:
    name: str
    shape: tuple[int, ...]     # numpy element shape
    qtype: QT
    load: Callable[[], np.ndarray]   # returns the array to write (already encoded)


def _order_key(name: str) -> tuple:
    m = _BLK.match(name)
    return (1, int(m.group(1)), name) if m else (0, 0, name)


def _plan(g: GgufFile, cal: Calibrator, lin_qtype: Callable[[str, tuple], QT],
          lin_encode: Callable[[str, np.ndarray, QT], np.ndarray] | None = None) -> list[_Out]:
    lin = set(_linear_names(g, g.layer_count()))
    out: list[_Out] = []
    for name in sorted(g.tensors, key=_order_key):
        info = g.tensors[name]
        m = _BLK.match(name)
        short = m.group(2) if m else ""
        modified = name in lin or short in ("attn_norm.weight", "ffn_norm.weight", "attn_v.bias")
        if m and modified:
            il = int(m.group(1))
            qt = lin_qtype(name, info.shape) if name in lin else (QT.F32 if info.qtype == QT.F32 or len(info.shape) == 1 else QT.F16)

            def load(il=il, name=name, qt=qt):
                a = cal.layer(il)[name].astype(np.float32)
                if lin_encode is not None and name in lin:
                    return lin_encode(name, a, qt)
                return encode(a, qt)
            out.append(_Out(name, info.shape, qt, load))
        else:   # byte-for-byte copy
            out.append(_Out(name, info.shape, info.qtype, (lambda name=name: np.asarray(g.raw(name)))))
    return out


def _own_plan(g: GgufFile, cal: Calibrator, opts: QuantOptions) -> list[_Out]:
    """The own writer's plan (kq_writer): linears by block; for q4_k_m the head (token_embd when tied) last, since its
    input Hessian needs every block's output; for q4_0 / q4_1 the embeddings and head are copied as --method rtn
    copies them."""
    from . import kq_writer

    n_layer = g.layer_count()
    tied = "output.weight" not in g.tensors
    block_type = FORMATS[opts.qtype].qtype      # Q4_0 / Q4_1: every linear of that type, the rest as --method rtn

    def lin_qtype(name, shape):
        if block_type is not None:
            return block_type if shape[-1] % 32 == 0 else QT.F16
        return kq_writer.q4_k_m_type(name, shape[-1], n_layer, tied)

    def lin_encode(name, a, qt):
        return cal.enc[name]
    if cal is not None:
        cal.encode_linear = kq_writer.fixed_type_encoder(lin_qtype, cal.enc, opts.method, opts.damp, opts.act_order,
                                                         opts.gptq_types)

    plan, last = [], []
    for t in _plan(g, cal, lin_qtype, lin_encode):
        if block_type is None and t.name in ("token_embd.weight", "output.weight") and len(t.shape) == 2:
            qt = lin_qtype(t.name, t.shape)
            head = t.name == "output.weight" or tied

            def load(name=t.name, qt=qt, head=head):
                H = cal.head_hessian() if head else None
                return kq_writer.encode(np.asarray(g.tensor(name), dtype=np.float32), qt, opts.method, H,
                                        cal.n_tokens, opts.damp, opts.act_order, opts.gptq_types)
            last.append(_Out(t.name, t.shape, qt, load))
        else:
            plan.append(t)
    return plan + last


def _copy_kv(w: gguf.GGUFWriter, g: GgufFile, skip: set[str]) -> None:
    for key, f in g.reader.fields.items():
        if key.startswith("GGUF.") or key in skip or key == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(f.types[0])
        val = f.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            if len(f.types) < 2 or f.types[1] == gguf.GGUFValueType.ARRAY:
                continue  # nested arrays: not used by llama-family GGUFs
            w.add_key_value(key, val, vtype, sub_type=gguf.GGUFValueType(f.types[1]))
        else:
            w.add_key_value(key, val, vtype)


def _write(path: Path, g: GgufFile, plan: list[_Out], kv: dict, file_type: int, bar=None) -> None:
    w = gguf.GGUFWriter(str(path), g.arch)
    _copy_kv(w, g, skip=set(kv) | {"general.file_type"})
    w.add_file_type(file_type)
    for k, (v, vt) in kv.items():
        w.add_key_value(k, v, vt)
    for t in plan:
        bshape = byte_shape(t.shape, t.qtype)
        dt = np.float32 if t.qtype == QT.F32 else np.float16 if t.qtype == QT.F16 else np.uint8
        if t.qtype == QT.BF16:
            dt = np.uint8
            bshape = gguf.quant_shape_to_byte_shape(t.shape, QT.BF16)
        nbytes = int(np.prod(bshape)) * np.dtype(dt).itemsize
        w.add_tensor_info(t.name, bshape, np.dtype(dt), nbytes, raw_dtype=None if dt != np.uint8 else t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in plan:
        data = t.load()
        w.write_tensor_data(np.ascontiguousarray(data))
        del data
    w.close()


def write_imatrix(path: Path, sums: dict[str, np.ndarray], n_tokens: int, chunk_size: int, dataset: str) -> None:
    """llama.cpp's GGUF imatrix format (llama-imatrix): NAME.in_sum2 [1, n] and NAME.counts [1, 1]."""
    w = gguf.GGUFWriter(str(path), "imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", [dataset])
    w.add_uint32("imatrix.chunk_count", max(1, n_tokens // max(1, chunk_size)))
    w.add_uint32("imatrix.chunk_size", chunk_size)
    for name, s in sums.items():
        w.add_tensor(f"{name}.in_sum2", np.asarray(s, dtype=np.float32).reshape(1, -1))
        w.add_tensor(f"{name}.counts", np.array([[float(n_tokens)]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rescale_imatrix(src: Path, dst: Path, col_scales: dict[str, np.ndarray]) -> None:
    """An external imatrix (computed on the unscaled model) → the AWQ-scaled model: inputs of scaled
    linears are x/s, so Σx² of column j becomes Σx²/s_j²."""
    r = gguf.GGUFReader(str(src), "r")
    sums, counts, keys = {}, {}, {}
    for t in r.tensors:
        if t.name.endswith(".in_sum2"):
            sums[t.name[:-8]] = np.array(t.data, dtype=np.float32).reshape(-1)
        elif t.name.endswith(".counts"):
            counts[t.name[:-7]] = np.array(t.data, dtype=np.float32).reshape(-1)
    if not sums:
        raise BadInputError(f"{Path(src).name}: not a GGUF imatrix (llama-imatrix ≥ b5900 format) — no *.in_sum2 tensors")
    for k in ("imatrix.chunk_size", "imatrix.chunk_count"):
        f = r.fields.get(k)
        keys[k] = int(f.contents()) if f is not None else 512
    w = gguf.GGUFWriter(str(dst), "imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", [str(src)])
    w.add_uint32("imatrix.chunk_count", keys["imatrix.chunk_count"])
    w.add_uint32("imatrix.chunk_size", keys["imatrix.chunk_size"])
    for name, s in sums.items():
        sc = col_scales.get(name)
        if sc is not None and sc.shape[0] == s.shape[0]:
            s = s / (sc.astype(np.float32) ** 2)
        w.add_tensor(f"{name}.in_sum2", s.reshape(1, -1))
        w.add_tensor(f"{name}.counts", counts.get(name, np.ones(1, np.float32)).reshape(1, -1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _run_llama_quantize(src: Path, dst: Path, fmt: TargetFormat, keep: dict[str, QT], imatrix: Path | None,
                        threads: int | None) -> None:
    from ..backend.runtime import BackendMissing, tool_path

    try:
        exe, env = tool_path("llama-quantize")
    except BackendMissing as e:
        raise DsaError(f"--type {fmt.name} needs llama.cpp's quantizer: {e}") from None
    cmd = [str(exe)]
    tt = None
    if keep:
        tt = dst.parent / (dst.name + ".tensor-types")
        tt.write_text("".join(f"^{re.escape(n)}$={qt.name.lower()}\n" for n, qt in keep.items()))
        cmd += ["--tensor-type-file", str(tt)]
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    cmd += [str(src), str(dst), fmt.llama_name]
    if threads:
        cmd.append(str(threads))
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        if tt is not None:
            tt.unlink(missing_ok=True)
    if p.returncode != 0 or not dst.is_file():
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        raise DsaError(f"llama-quantize failed (exit {p.returncode}): {' | '.join(tail)[:300]}")


# ---------------------------------------------------------------------------------------------
def quantize(opts: QuantOptions) -> dict:
    t0 = time.perf_counter()
    fmt, g = validate(opts)
    device = _device(opts.device)
    own = opts.method in OWN_METHODS
    want_imatrix = opts.imatrix == "auto" and not own
    need_calib = opts.method == "awq" or want_imatrix or own
    tokens = load_samples(Path(opts.inp), g, Path(opts.calib), opts.samples, opts.seq_len) if need_calib else None
    m = RefModel.from_gguf(Path(opts.inp), device="cpu")
    n_layer = m.hp.n_layer
    kv = {
        "dsa.quant.method": (opts.method, gguf.GGUFValueType.STRING),
        "dsa.quant.type": (opts.qtype, gguf.GGUFValueType.STRING),
        "dsa.quant.group_size": (opts.group_size, gguf.GGUFValueType.UINT32),
    }
    if need_calib:
        kv["dsa.quant.calib"] = (Path(opts.calib).name, gguf.GGUFValueType.STRING)
        kv["dsa.quant.samples"] = (opts.samples, gguf.GGUFValueType.UINT32)
        kv["dsa.quant.seq_len"] = (opts.seq_len, gguf.GGUFValueType.UINT32)
    if (fmt.via_llama_cpp and not own) or want_imatrix:
        kv["dsa.quant.imatrix"] = ("none" if opts.imatrix in (None, "none") else
                                   "auto" if opts.imatrix == "auto" else Path(opts.imatrix).name,
                                   gguf.GGUFValueType.STRING)
    result: dict = {"input": str(opts.inp), "output": str(opts.out), "method": opts.method, "type": opts.qtype,
                    "group_size": opts.group_size, "device": str(device), "layers": n_layer}
    with task(f"quantize ({opts.method})", n_layer, quiet=opts.quiet) as bar, atomic_output(opts.out) as tmp:
        cal = Calibrator(m, g, tokens, opts, fmt, device, want_imatrix, bar if need_calib else None)
        if opts.method == "mix":
            from .kq_alloc import Spill, mix_plan
            spill = Spill(tmp)
            try:
                plan, result["mix"] = mix_plan(g, cal, opts, spill, _own_plan(g, cal, opts),
                                               set(_linear_names(g, n_layer)), _Out)
                _write(tmp, g, plan, kv, gguf.LlamaFileType.MOSTLY_Q4_K_M)
            finally:
                spill.close()
        elif own:
            _write(tmp, g, _own_plan(g, cal, opts), kv, _FILE_TYPES.get(opts.qtype, gguf.LlamaFileType.MOSTLY_Q4_K_M))
        elif fmt.via_llama_cpp:
            def lin_qtype(name, shape):
                return QT.F32 if g.tensors[name].qtype == QT.F32 else QT.F16
            src = tmp.parent / (tmp.name + ".scaled.gguf")
            imat = tmp.parent / (tmp.name + ".imatrix.gguf")
            try:
                _write(src, g, _plan(g, cal, lin_qtype), kv, gguf.LlamaFileType.MOSTLY_F16)
                imatrix_path = None
                if want_imatrix:
                    write_imatrix(imat, cal.imatrix, cal.n_tokens, opts.seq_len, str(opts.calib))
                    imatrix_path = imat
                elif opts.imatrix not in (None, "none"):
                    rescale_imatrix(Path(opts.imatrix), imat, cal.col_scales)
                    imatrix_path = imat
                keep = {n: i.qtype for n, i in g.tensors.items()
                        if (".indexer." in n or ".dsa." in n) and len(i.shape) >= 2}
                t_q = time.perf_counter()
                _run_llama_quantize(src, tmp, fmt, keep, imatrix_path, opts.threads)
                result["llama_quantize_seconds"] = round(time.perf_counter() - t_q, 2)
            finally:
                src.unlink(missing_ok=True)
                imat.unlink(missing_ok=True)
        else:
            def lin_qtype(name, shape):
                return fmt.qtype if shape[-1] % fmt.block == 0 else QT.F16
            lin_encode = None
            if want_imatrix:     # ggml's imatrix-weighted Q4_0/Q4_1 (as llama-quantize --imatrix would do)
                from . import ggml_q

                def lin_encode(name, a, qt):
                    if qt not in (QT.Q4_0, QT.Q4_1):
                        return encode(a, qt)
                    return ggml_q.quantize(a, int(qt), cal.imatrix[name] / max(1, cal.tok_per_block))
            _write(tmp, g, _plan(g, cal, lin_qtype, lin_encode), kv, _FILE_TYPES[opts.qtype])
        if need_calib and cal.cur_il < n_layer - 1:
            raise RuntimeError("not every block was calibrated")
    out_g = GgufFile(Path(opts.out))
    n_el = sum(t.n_elements for t in out_g.tensors.values())
    n_b = sum(t.n_bytes for t in out_g.tensors.values())
    types: dict[str, int] = {}
    for t in out_g.tensors.values():
        types[t.type_name] = types.get(t.type_name, 0) + 1
    result["tensor_type_of"] = {n: t.type_name for n, t in out_g.tensors.items() if len(t.shape) >= 2}
    if need_calib:
        result["calib"] = {"file": str(opts.calib), "samples": opts.samples, "seq_len": opts.seq_len}
    result.update({
        "bytes": Path(opts.out).stat().st_size, "bits_per_weight": round(8.0 * n_b / max(1, n_el), 3),
        "tensor_types": types, "calib_tokens": cal.n_tokens, "calib_seconds": round(cal.seconds, 2),
        "seconds": round(time.perf_counter() - t0, 2), **peak_resources(),
        "blocks": cal.report,
    })
    return result
