"""`dsa convert`: HF checkpoint -> GGUF (optionally with a DSA indexer and ASQ prototypes)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from .errors import BadInputError
from .resources import peak_resources
from .formats.atomic import atomic_output, check_output
from .formats.gguf_write import ExtraKV, add_extra_kv, add_model_keys, open_writer, planned_from_arrays, stream_tensors
from .formats.hf_config import load_config
from .formats.safetensors_reader import CheckpointReader
from .formats.tensor_plan import OUTTYPES, plan_tensors
from .formats.tokenizer import load_vocab, write_vocab
from .progress import task


@dataclass
class ConvertOptions:
    model_dir: Path
    out: Path
    outtype: str = "f16"
    force: bool = False
    quiet: bool = False
    dsa: Any = None          # dsa_convert.dsa.config.DsaConfig or None for a plain GGUF


def convert(opts: ConvertOptions) -> dict:
    t0 = time.perf_counter()
    if opts.outtype not in OUTTYPES:
        raise BadInputError(f"unknown --outtype {opts.outtype!r} (choose from {', '.join(OUTTYPES)})")
    check_output(opts.out, opts.force)
    spec = load_config(opts.model_dir)
    vocab = load_vocab(Path(opts.model_dir), spec.vocab_size)
    reader = CheckpointReader(Path(opts.model_dir))
    qtype, ftype = OUTTYPES[opts.outtype]
    plan = plan_tensors(spec, reader, qtype)
    extra = ExtraKV()
    report: dict = {}
    if opts.dsa is not None:
        from .dsa.retrofit import run_retrofit  # heavy (torch training, sklearn); only when asked

        with task("DSA retrofit", None, quiet=opts.quiet) as rbar:
            def on_progress(ev: dict) -> None:
                if "warning" in ev:
                    print(f"warning: {ev['warning']}", file=sys.stderr, flush=True)
                    return
                rbar.advance(0, eta_s=ev.get("eta_s"),
                             info=" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in ev.items() if k not in ("elapsed_s", "eta_s")))
            res = run_retrofit(Path(opts.model_dir), opts.dsa, progress=on_progress)
        extra.items.update(res.kv)
        dsa_qt = gguf.GGMLQuantizationType.F32 if opts.outtype == "f32" else gguf.GGMLQuantizationType.F16
        plan += planned_from_arrays(
            (name, arr, gguf.GGMLQuantizationType.F32 if arr.ndim == 1 or ".dsa." in name else dsa_qt)
            for name, arr in res.tensors.items())
        report["dsa"] = res.report
    with atomic_output(opts.out) as tmp, task("convert", len(plan), quiet=opts.quiet) as bar:
        w = open_writer(tmp, spec.arch_name)
        add_model_keys(w, spec, ftype)
        write_vocab(w, vocab)
        add_extra_kv(w, extra)

        def done(t):
            bar.advance(1, info=t.name)

        stream_tensors(w, plan, on_tensor=done)
    total_bytes = Path(opts.out).stat().st_size
    reader.close()
    return {
        "input": str(opts.model_dir), "output": str(opts.out), "arch": spec.arch_name,
        "hf_arch": spec.hf_arch, "outtype": opts.outtype, "tensors": len(plan), "bytes": total_bytes,
        "seconds": round(time.perf_counter() - t0, 3), **peak_resources(),
        "dsa": opts.dsa is not None, **report,
    }


def dsa_config(opts: dict, device: str, seed: int, allow_eval_calib: bool):
    """DsaConfig from CLI options; refuses calibration text identical to the evaluation text."""
    import hashlib

    from .dsa.config import DsaConfig
    from .eval.data import candidates

    kw = {k: v for k, v in opts.items() if v is not None}
    if "calib" not in kw:
        from .eval.data import _REPO

        kw["calib"] = _REPO.parent / "shared" / "data" / "calib" / "books-calib.txt"
    cfg = DsaConfig(**kw, device=device, seed=seed).validate()
    if not allow_eval_calib:
        digest = lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest()  # noqa: E731
        mine = digest(cfg.calib)
        for c in candidates("wikitext2"):
            if c.is_file() and digest(c) == mine:
                raise BadInputError(f"calibration text {cfg.calib} is the evaluation text ({c}); "
                                    "use disjoint text or pass --allow-eval-calib")
    return cfg
