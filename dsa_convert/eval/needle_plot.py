"""The needle-in-a-haystack heatmap of a `run_needle` result: depth (%) down, context length across, one panel per
attention mode, colour = accuracy (red 0 .. green 1), every cell annotated hits/trials.

    python3 -m dsa_convert.eval.needle_plot RESULT.json OUT.png      (a saved `dsa eval --needle --json` result)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..errors import BadInputError, DsaError


def check_plot_path(out: Path) -> None:
    """Before the run: a --plot whose directory does not exist is bad input."""
    if not Path(out).resolve().parent.is_dir():
        raise BadInputError(f"--plot: directory does not exist: {Path(out).resolve().parent}")


def grid(result: dict, attn: str) -> tuple[list[int], list[float], list[list[tuple[int, int] | None]]]:
    """(lengths, depths, cells[depth][length] = (hits, trials) or None) of one attention mode."""
    rows = [r for r in result["rows"] if r["attn"] == attn]
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({(r["depth_index"], r["depth"]) for r in rows})
    at = {(r["depth_index"], r["length"]): (r["hits"], r["trials"]) for r in rows}
    return lengths, [d for _, d in depths], [[at.get((di, n)) for n in lengths] for di, _ in depths]


def mode_label(result: dict, attn: str) -> str:
    """The attention mode, with its KV cache where it differs from the run's (llama.cpp runs dense F16 for --kv asq)."""
    kv = next((r.get("kv") for r in result["rows"] if r["attn"] == attn), None)
    return attn if kv in (None, result.get("kv")) else f"{attn} (kv {kv})"


def _length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def write_heatmap(result: dict, out: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        raise DsaError("--plot needs matplotlib (pip install matplotlib)") from None
    out = Path(out)
    check_plot_path(out)
    modes = list(dict.fromkeys(r["attn"] for r in result["rows"]))
    if not modes:
        raise DsaError("no needle results to plot")
    fig, axes = plt.subplots(1, len(modes), figsize=(1.6 + 3.2 * len(modes), 5.2), squeeze=False,
                             constrained_layout=True)
    image = None
    for k, (ax, attn) in enumerate(zip(axes[0], modes)):
        lengths, depths, cells = grid(result, attn)
        acc = np.array([[np.nan if c is None else c[0] / c[1] for c in row] for row in cells], dtype=float)
        image = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        for i, row in enumerate(cells):
            for j, c in enumerate(row):
                if c is not None:
                    ax.text(j, i, f"{c[0]}/{c[1]}", ha="center", va="center", fontsize=9)
        hits = sum(c[0] for row in cells for c in row if c)
        trials = sum(c[1] for row in cells for c in row if c)
        ax.set_title(f"{mode_label(result, attn)}: {hits}/{trials}")
        ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0f}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        if k == 0:
            ax.set_ylabel("needle depth (%)")
    fig.colorbar(image, ax=list(axes[0]), label="accuracy", fraction=0.04)
    fig.suptitle(f"{result.get('model') or '?'} · {result['task']} · filler {Path(str(result['filler'])).name} · "
                 f"kv {result.get('kv', '?')}")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, out)
    except OSError as e:
        raise BadInputError(f"--plot: cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def write_heatmap_isolated(result: dict, out: Path) -> Path:
    """write_heatmap in a fresh interpreter. On the H200 image a process that held llama.cpp's CUDA backend and then
    imported matplotlib segfaulted, likely the import-order crash of backend/load_check.py (a libggml-cuda that carries
    its own libstdc++; not rechecked), so the llama.cpp grid draws its heatmap in a child that never loads llama.cpp."""
    check_plot_path(out)
    from ..backend.runtime import child_python_env

    env = child_python_env()
    r = subprocess.run([sys.executable, "-m", "dsa_convert.eval.needle_plot", "-", str(out)], input=json.dumps(result),
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise DsaError(f"--plot: drawing {out} failed: {last.removeprefix('error: ')}")
    return Path(out)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python3 -m dsa_convert.eval.needle_plot RESULT.json|- OUT.png", file=sys.stderr)
        return 2
    try:
        text = sys.stdin.read() if argv[0] == "-" else Path(argv[0]).read_text()
        result = json.loads(text)
        if not isinstance(result, dict) or "rows" not in result:
            raise BadInputError(f"{argv[0]}: not a dsa eval --needle JSON result")
        write_heatmap(result, Path(argv[1]))
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: {argv[0]}: cannot read a needle result ({e.__class__.__name__})", file=sys.stderr)
        return 3
    except DsaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
