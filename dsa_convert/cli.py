"""The `dsa` command line (Typer). Each command is a thin shell over a module that does the work.

Exit codes: 0 ok · 1 runtime failure · 2 usage error · 3 bad input · 130 interrupted.
Expected failures print one line `error: …` on stderr (a traceback only with --debug).
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import EXIT_INTERRUPTED, EXIT_RUNTIME, DsaError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="HF checkpoint -> GGUF with sparse attention, compressed KV cache and AWQ INT4.")
backend_app = typer.Typer(no_args_is_help=True, help="Build and describe the patched llama.cpp backend.")
app.add_typer(backend_app, name="backend")

_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")):
    _state["debug"] = debug


def _fail(msg: str, code: int):
    print(f"error: {msg}", file=sys.stderr)
    raise typer.Exit(code)


def guarded(fn):
    """One-line errors and documented exit codes for every command."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except typer.Exit:
            raise
        except DsaError as e:
            if _state["debug"]:
                raise
            _fail(str(e).splitlines()[0] if str(e) else e.__class__.__name__, e.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted", EXIT_INTERRUPTED)
        except MemoryError:
            _fail("out of memory", EXIT_RUNTIME)
        except Exception as e:  # unexpected: still one line unless --debug
            if _state["debug"]:
                raise
            first = (str(e).splitlines() or [""])[0][:300]
            _fail(f"internal error: {e.__class__.__name__}: {first} (run with --debug for the traceback)", EXIT_RUNTIME)
    return wrapper


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


@app.command()
@guarded
def convert(
    model_dir: Path = typer.Argument(..., help="HuggingFace checkpoint directory"),
    out: Path = typer.Argument(..., help="output .gguf"),
    outtype: str = typer.Option("f16", help="f32 | f16 | bf16 | q8_0"),
    force: bool = typer.Option(False, "--force", help="overwrite OUT"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary on stdout"),
    no_dsa: bool = typer.Option(False, "--no-dsa", help="plain GGUF (no indexer, no ASQ)"),
    cluster_num: Optional[int] = typer.Option(None, help="ASQ prototypes per layer/KV head (enables DSA)"),
    top_k: Optional[int] = typer.Option(None, help="total keys per query (sinks + local + picks)"),
    index_heads: Optional[int] = typer.Option(None, help="indexer heads H"),
    index_dim: Optional[int] = typer.Option(None, help="indexer head dim D"),
    sink: Optional[int] = typer.Option(None, help="always-attended first tokens"),
    local: Optional[int] = typer.Option(None, help="local window; omitted = chosen by calibration"),
    select: Optional[str] = typer.Option(None, help="token | block"),
    block_size: Optional[int] = typer.Option(None, help="block size for --select block"),
    residual_bits: Optional[int] = typer.Option(None, help="ASQ residual bits: 4 | 8"),
    calib: Optional[Path] = typer.Option(None, help="calibration text file"),
    steps: Optional[int] = typer.Option(None, help="indexer training steps"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    seed: int = typer.Option(0, help="random seed"),
    allow_eval_calib: bool = typer.Option(False, "--allow-eval-calib",
                                          help="allow calibration text identical to the evaluation text"),
):
    """Convert a HuggingFace checkpoint to GGUF (with the DSA retrofit unless --no-dsa)."""
    from .convert import ConvertOptions, convert as run

    dsa_opts = dict(cluster_num=cluster_num, top_k=top_k, index_heads=index_heads, index_dim=index_dim,
                    sink=sink, local=local, select=select, block_size=block_size, residual_bits=residual_bits,
                    calib=calib, steps=steps)
    wants_dsa = any(v is not None for v in dsa_opts.values())
    if no_dsa and wants_dsa:
        raise typer.BadParameter("--no-dsa cannot be combined with DSA options")
    dsa_cfg = None
    if wants_dsa:
        from .dsa.config import make_dsa_config

        dsa_cfg = make_dsa_config(**{k: v for k, v in dsa_opts.items() if v is not None},
                                  device=device, seed=seed, allow_eval_calib=allow_eval_calib)
    res = run(ConvertOptions(model_dir, out, outtype=outtype, force=force, quiet=as_json, dsa=dsa_cfg))
    if as_json:
        emit_json(res)
    else:
        print(f"wrote {res['output']} ({res['bytes'] / 2**20:.1f} MiB, {res['tensors']} tensors, "
              f"{res['seconds']:.1f} s, peak RSS {res['peak_rss_mib']:.0f} MiB)", file=sys.stderr)


@app.command()
@guarded
def inspect(
    file: Path = typer.Argument(..., help="GGUF file"),
    as_json: bool = typer.Option(False, "--json"),
    heatmap: Optional[Path] = typer.Option(None, help="PNG: indexer selection vs dense attention"),
    text: Optional[Path] = typer.Option(None, help="text for --heatmap"),
    layer: int = typer.Option(0, help="layer for --heatmap"),
):
    """Show architecture, hyper-parameters, tokenizer, DSA keys and the tensor table."""
    from .inspect_gguf import render, summarize

    s = summarize(file)
    if heatmap is not None:
        from .dsa.heatmap import write_heatmap

        s["heatmap"] = write_heatmap(file, heatmap, text, layer)
    if as_json:
        emit_json(s)
    else:
        from rich.console import Console

        render(s, Console())


@backend_app.command("build")
@guarded
def backend_build(cuda: bool = typer.Option(False, "--cuda", help="build with CUDA (sm_90 by default)"),
                  cuda_arch: str = typer.Option("90", help="CMAKE_CUDA_ARCHITECTURES"),
                  sdist: Optional[Path] = typer.Option(None, help="llama-cpp-python sdist (else cache or PyPI)")):
    """Build llama-cpp-python from its sdist with patches/llama.cpp/*.patch (cached by patch hash)."""
    from .backend.build import BuildConfig, BuildError, build

    try:
        out = build(BuildConfig(cuda=cuda, cuda_arch=cuda_arch, sdist=sdist),
                    say=lambda m: print(m, file=sys.stderr))
    except BuildError as e:
        raise DsaError(str(e)) from None
    print(out)


@backend_app.command("info")
@guarded
def backend_info(as_json: bool = typer.Option(False, "--json")):
    """Version, patch hash, CPU/CUDA and whether sparse attention is compiled in."""
    from .backend.runtime import backend_info as info

    d = info()
    if as_json:
        emit_json(d)
    else:
        for k, v in d.items():
            print(f"{k}: {v}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
