#!/usr/bin/env python3
"""`dsa quantize --type q4_k_m` against llama.cpp's imatrix Q4_K_M on one model, by KL divergence to the F16 file.

    python scripts/bench/bench_kquant.py --f16 F16.gguf --work DIR [--chunks 40] [--samples 128] \
        [--variant NAME='--method gptq' ...] [--file NAME=PATH ...] [--threads 1]

Steps (each skipped when its output already exists in DIR, so a run can be resumed or extended by variants):
  1. llama-imatrix -m F16 -f books-calib.txt -c 512 --chunks SAMPLES (the calibration tokens dsa quantize
     --samples SAMPLES --seq-len 512 uses) and llama-quantize --imatrix F16 base-q4km.gguf Q4_K_M
  2. llama-perplexity -m F16 -f WikiText-2 test -c 512 --chunks CHUNKS -fa off --kl-divergence-base f16.kld
  3. each variant: dsa quantize F16 DIR/NAME.gguf --type q4_k_m --calib books-calib.txt --samples SAMPLES ARGS
     (wall time, the --json report kept), then llama-perplexity --kl-divergence --kl-divergence-base f16.kld
Writes DIR/results.json: per file bytes, ratio to the baseline's bytes, PPL, ΔPPL, mean / median / p99 KLD and
same-top-token %, and each step's wall seconds.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench_quant import CALIB, REPO, WIKI, sh, tool  # noqa: E402  (this folder is sys.path[0])


_PAT = {"ppl": r"Mean\s+PPL\(Q\)\s*:\s*([\d.]+)", "ppl_base": r"Mean\s+PPL\(base\)\s*:\s*([\d.]+)",
        "kld_mean": r"Mean\s+KLD:\s*([\d.eE+-]+)", "kld_median": r"Median\s+KLD:\s*([\d.eE+-]+)",
        "kld_p99": r"99\.0%\s+KLD:\s*([\d.eE+-]+)", "same_top_pct": r"Same top p:\s*([\d.]+)"}


def parse_kld(text: str) -> dict:
    out = {}
    for k, p in _PAT.items():
        m = re.search(p, text)
        if m:
            out[k] = float(m.group(1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--f16", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval", type=Path, default=WIKI)
    ap.add_argument("--variant", action="append", default=[], help="NAME='dsa quantize args'")
    ap.add_argument("--file", action="append", default=[], help="NAME=PATH: a GGUF made otherwise, scored as well")
    a = ap.parse_args()
    w = a.work
    w.mkdir(parents=True, exist_ok=True)
    res_p = w / "results.json"
    res = json.loads(res_p.read_text()) if res_p.is_file() else {"files": {}}
    res.update({"f16": str(a.f16), "chunks": a.chunks, "samples": a.samples, "threads": a.threads,
                "eval": str(a.eval), "calib": str(CALIB)})
    t = str(a.threads)
    imat, base = w / "imatrix.dat", w / "base-q4km.gguf"
    if not base.is_file():
        exe, env = tool("llama-imatrix")
        res["imatrix_s"] = sh([exe, "-m", str(a.f16), "-f", str(CALIB), "-c", "512", "--chunks", str(a.samples),
                               "-t", t, "-o", str(imat)], w / "imatrix.log", env)["wall_s"]
        exe, env = tool("llama-quantize")
        res["llama_quantize_s"] = sh([exe, "--imatrix", str(imat), str(a.f16), str(base), "Q4_K_M", t],
                                     w / "quantize-base.log", env)["wall_s"]
    kld = w / "f16.kld"
    ppl_exe, ppl_env = tool("llama-perplexity")
    common = ["-f", str(a.eval), "-c", "512", "-b", "512", "--chunks", str(a.chunks), "-fa", "off", "-t", t]
    if not kld.is_file():
        sh([ppl_exe, "-m", str(a.f16), *common, "--kl-divergence-base", str(kld)], w / "f16-ppl.log", ppl_env)
    files = {"llama.cpp-imatrix-q4km": (base, None)}
    for v in a.variant:
        name, _, args = v.partition("=")
        files[name] = (w / f"{name}.gguf", args)
    for f in a.file:
        name, _, path = f.partition("=")
        files[name] = (Path(path), None)
    for name, (path, args) in files.items():
        ent = res["files"].get(name, {})
        if args is not None and not path.is_file():
            cmd = [sys.executable, "-m", "dsa_convert.cli", "quantize", str(a.f16), str(path), "--type", "q4_k_m",
                   "--calib", str(CALIB), "--samples", str(a.samples), "--json", *shlex.split(args)]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if r.returncode != 0:
                raise SystemExit(f"dsa quantize failed: {r.stderr[-2000:]}")
            rep = json.loads(r.stdout)
            rep.pop("blocks", None)
            ent = {"args": args, "quantize_s": round(time.perf_counter() - t0, 1), "report": rep}
        if "kld_mean" not in ent:
            log = w / f"{name}-kld.log"
            sh([ppl_exe, "-m", str(path), *common, "--kl-divergence-base", str(kld), "--kl-divergence"], log,
               ppl_env)
            ent.update(parse_kld(log.read_text(errors="replace")))
        ent["bytes"] = path.stat().st_size
        res["files"][name] = ent
        res_p.write_text(json.dumps(res, indent=1))
    b = res["files"]["llama.cpp-imatrix-q4km"]
    print("| file | bytes / llama.cpp | PPL | ΔPPL | mean KLD | / llama.cpp | median | p99 | same top % |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, e in res["files"].items():
        if "kld_mean" not in e:
            continue
        d = e["ppl"] - e["ppl_base"]
        print(f"| {name} | {e['bytes'] / b['bytes']:.4f} | {e['ppl']:.4f} | {d:+.4f} | {e['kld_mean']:.6f} | "
              f"{e['kld_mean'] / b['kld_mean']:.3f} | {e.get('kld_median', float('nan')):.6f} | "
              f"{e.get('kld_p99', float('nan')):.5f} | {e.get('same_top_pct', float('nan')):.2f} |")
    res_p.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
