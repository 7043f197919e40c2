#!/usr/bin/env python3
"""Benchmark: `dsa convert` vs llama.cpp's own convert_hf_to_gguf.py (from the same llama-cpp-python
sdist), same model, same machine, one run, side by side: wall time and peak RSS of each process.

    python scripts/bench/bench_convert.py [MODEL_DIR] [--outtype f16] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from dsa_convert.backend.build import find_sdist, BuildConfig  # noqa: E402


# llama.cpp's converter recognises pre-tokenizers by hashing sample output and refuses this model's
# tokenizer ("BPE pre-tokenizer was not recognized"); for timing we tell it the answer (gpt-2, which is
# what `dsa convert` derives from the regex) and otherwise run it unchanged.
_UPSTREAM = """
import sys, runpy
root = sys.argv.pop(1)
sys.path.insert(0, root)
import conversion.base as b
b.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def measure(cmd: list[str], env: dict | None = None) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode(errors="replace")
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}\n{err[-2000:]}")
    return {"seconds": round(wall, 2), "peak_rss_mib": round(ru.ru_maxrss / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(REPO.parent / "shared" / "models" / "ref-llama-27m"))
    ap.add_argument("--outtype", default="f16")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-convert-"))
    with tarfile.open(find_sdist(BuildConfig())) as tf:
        members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name and
                   ("/gguf-py/" in m.name or "/conversion/" in m.name or m.name.endswith("convert_hf_to_gguf.py"))]
        tf.extractall(work, members=members, filter="data")
    llama = next(work.glob("*/vendor/llama.cpp"))
    env = dict(os.environ, PYTHONPATH=str(llama / "gguf-py"))
    rows = {"dsa": [], "llama.cpp": []}
    for i in range(a.repeat):  # interleaved so that both see the same machine state
        out1, out2 = work / f"dsa-{i}.gguf", work / f"ref-{i}.gguf"
        rows["dsa"].append(measure([sys.executable, "-m", "dsa_convert.cli", "convert", a.model, str(out1),
                                    "--outtype", a.outtype, "--force"]))
        rows["llama.cpp"].append(measure([sys.executable, "-c", _UPSTREAM, str(llama), a.model,
                                          "--outtype", a.outtype, "--outfile", str(out2)], env=env))
        sizes = (out1.stat().st_size, out2.stat().st_size)
        out1.unlink(); out2.unlink()
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in rows.items()}
    res = {
        "model": a.model, "outtype": a.outtype, "repeat": a.repeat, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"), "runs": rows, "best": best, "file_bytes": {"dsa": sizes[0], "llama.cpp": sizes[1]},
        "ratio_time_dsa_over_llamacpp": round(best["dsa"]["seconds"] / best["llama.cpp"]["seconds"], 3),
        "ratio_rss_dsa_over_llamacpp": round(best["dsa"]["peak_rss_mib"] / best["llama.cpp"]["peak_rss_mib"], 3),
    }
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
