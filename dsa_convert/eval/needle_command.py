"""`dsa eval FILE --needle TASK`: checks every option before a model loads, builds the backends (llama.cpp or
torch) per attention mode, runs the grid (needle.run_needle), draws the heatmap and prints the tables."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInputError
from .needle import DEFAULT_LENGTHS, NeedleOptions, run_needle, validate_options
from .needle_filler import check_filler_spec, default_filler

LLAMA_ATTN = ("dense", "sparse", "local")


@dataclass
class NeedleCommand:
    file: Path
    task: str
    lengths: str | None = None          # comma list; None: DEFAULT_LENGTHS
    depths: int | None = None           # None: 10
    trials: int | None = None           # None: 1
    attn: str | None = None             # comma list; None: dense,sparse
    kv: str = "f16"
    filler: str | None = None
    backend: str = "llama.cpp"
    n_gpu_layers: int | None = None     # llama.cpp; None: every layer where the build offloads
    threads: int | None = None          # llama.cpp; None: default_threads()
    top_k: int | None = None
    index_keys: str | None = None       # llama.cpp
    flash_attn: bool = True             # llama.cpp
    tokenizer: Path | None = None       # torch
    device: str = "auto"                # torch
    seed: int = 0
    max_new: int | None = None          # None: 16
    force: bool = False
    plot: Path | None = None
    quiet: bool = False


def parse_lengths(spec: str) -> list[int]:
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            out.append(int(part))
        except ValueError:
            raise BadInputError(f"--lengths: {part!r} is not an integer") from None
    return out


def parse_attn(spec: str, allowed: tuple[str, ...], backend: str) -> list[str]:
    modes = [p.strip().lower() for p in spec.split(",") if p.strip()]
    bad = [m for m in modes if m not in allowed]
    if not modes or bad:
        raise BadInputError(f"unknown --attn {bad[0] if bad else spec!r} for --backend {backend} "
                            f"(choose from {', '.join(allowed)})")
    return list(dict.fromkeys(modes))


def options(c: NeedleCommand, allowed_attn: tuple[str, ...]) -> NeedleOptions:
    o = NeedleOptions(task=c.task.lower(),
                      lengths=parse_lengths(c.lengths) if c.lengths is not None else list(DEFAULT_LENGTHS),
                      depths=10 if c.depths is None else c.depths, trials=1 if c.trials is None else c.trials,
                      attn=parse_attn(c.attn or "dense,sparse", allowed_attn, c.backend), kv=c.kv.lower(),
                      filler=c.filler, seed=c.seed, max_new=16 if c.max_new is None else c.max_new,
                      model=Path(c.file).name, force=c.force, quiet=c.quiet)
    validate_options(o)
    check_filler_spec(o.filler or default_filler(o.task))
    if c.plot is not None:
        from .needle_plot import check_plot_path

        check_plot_path(c.plot)
    return o


def _llama_run(c: NeedleCommand) -> dict:
    from ..backend.runtime import import_llama_cpp
    from ..formats.gguf_read import GgufFile
    from .perplexity_llamacpp import dsa_overrides

    o = options(c, LLAMA_ATTN)
    kv_of = {m: ("f16" if o.kv == "asq" and m == "dense" else o.kv) for m in o.attn}   # llama.cpp: ASQ is sparse-only
    g = GgufFile(c.file)                    # missing / not a GGUF -> one line, exit 3
    try:
        n_train = g.get(f"{g.arch}.context_length")
        for m in o.attn:
            dsa_overrides(g, m, c.top_k, kv_of[m], c.index_keys if m != "dense" else None)
    finally:
        g.close()
    validate_options(o, int(n_train) if n_train is not None else None)
    lc = import_llama_cpp()
    from ..backend.llama_runner import check_kv_flash_attn, default_threads
    from .needle_llamacpp import LlamaNeedleBackend

    check_kv_flash_attn(o.kv, c.flash_attn)
    ngl = c.n_gpu_layers if c.n_gpu_layers is not None else (999 if lc.llama_supports_gpu_offload() else 0)
    n_ctx = max(o.lengths)
    threads = c.threads or default_threads()
    res = run_needle(lambda m: LlamaNeedleBackend(c.file, n_ctx=n_ctx, attn=m, kv=kv_of[m], top_k=c.top_k,
                                                  n_gpu_layers=ngl, threads=threads, flash_attn=c.flash_attn,
                                                  index_keys=c.index_keys if m != "dense" else None), o)
    res.update(n_gpu_layers=ngl, threads=threads, flash_attn=c.flash_attn, top_k=c.top_k)
    return res


def _torch_run(c: NeedleCommand) -> dict:
    from .perplexity_torch import ATTN_MODES

    if c.index_keys is not None and c.index_keys.lower() != "f32":
        raise BadInputError("--index-keys is a llama.cpp cache switch; the torch backend (kernels_ref) keeps F32 keys")
    o = options(c, ATTN_MODES)
    if not (Path(c.file).is_dir() or Path(c.file).is_file()):
        raise BadInputError(f"not a GGUF file or HF model directory: {c.file}")
    from .needle_torch import TorchNeedleBackend, resolve_device, trained_context

    validate_options(o, trained_context(Path(c.file)))
    from .needle_vocab import open_vocab
    from .perplexity_torch import load_model

    device = resolve_device(c.device)
    model = load_model(Path(c.file), device)
    vocab = open_vocab(Path(c.file), c.tokenizer)
    try:
        # every mode's checks (indexer, top-k, ASQ prototypes) before the first prompt runs
        backends = {m: TorchNeedleBackend(c.file, attn=m, kv=o.kv, top_k=c.top_k, seed=c.seed, model=model,
                                          vocab=vocab) for m in o.attn}
        res = run_needle(lambda m: backends[m], o)
    finally:
        vocab.close()
    res.update(device=device, top_k=c.top_k)
    return res


def run_command(c: NeedleCommand) -> dict:
    if c.backend == "llama.cpp":
        res = _llama_run(c)
    elif c.backend == "torch":
        res = _torch_run(c)
    else:
        raise BadInputError(f"unknown --backend {c.backend!r} (llama.cpp or torch)")
    if c.plot is not None:
        from .needle_plot import write_heatmap, write_heatmap_isolated

        draw = write_heatmap_isolated if c.backend == "llama.cpp" else write_heatmap
        res["plot"] = str(draw(res, c.plot))
    return res


def render(res: dict, console) -> None:
    """Accuracy per length and attention mode, then each mode's depth x length grid (hits/trials)."""
    from rich.table import Table

    from .needle_plot import grid, mode_label

    modes = list(dict.fromkeys(s["attn"] for s in res["summary"]))
    console.print(f"{res['model']}: {res['task']}, filler {res['filler']}, kv {res['kv']}, {res['backend']}, "
                  f"seed {res['seed']}, {res['seconds']:.0f} s")
    t = Table(title="all depths")
    t.add_column("length", justify="right")
    for m in modes:
        t.add_column(mode_label(res, m), justify="right")
    by = {(s["length"], s["attn"]): s for s in res["summary"]}
    for n in dict.fromkeys(s["length"] for s in res["summary"]):
        t.add_row(str(n), *[(f"{by[n, m]['hits']}/{by[n, m]['trials']} ({100 * by[n, m]['accuracy']:.0f} %)"
                             if (n, m) in by else "-") for m in modes])
    console.print(t)
    for m in modes:
        lengths, depths, cells = grid(res, m)
        g = Table(title=f"{mode_label(res, m)}, per depth")
        g.add_column("depth %", justify="right")
        for n in lengths:
            g.add_column(str(n), justify="right")
        for d, row in zip(depths, cells):
            g.add_row(f"{d:.0f}", *[f"{x[0]}/{x[1]}" if x else "-" for x in row])
        console.print(g)
    if res.get("plot"):
        console.print(f"heatmap: {res['plot']}")
