#!/usr/bin/env python3
"""Q4_0: `dsa quantize` methods against round-to-nearest, ΔPPL on several held-out texts.

    python scripts/bench/bench_q4_0.py --f16 F16.gguf --work DIR [--chunks 40] [--text NAME=PATH ...] \
        [--methods rtn,awq,gptq]

Calibration is books-calib.txt (dsa quantize's defaults otherwise: --samples 32 for awq, 128 for gptq); the texts
default to WikiText-2 test. Each step is skipped when its output exists in DIR. llama-perplexity -c 512 -b 512
--chunks CHUNKS -fa off -t THREADS on the F16 file and each method's file for every text; DIR/results.json holds the
PPLs, each method's ΔPPL and its ratio to RTN's.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant import CALIB, REPO, WIKI, sh, tool  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--f16", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--text", action="append", default=[], help="NAME=PATH (default wikitext2=WikiText-2 test)")
    ap.add_argument("--methods", default="rtn,awq,gptq", help="comma-separated --method values; rtn is always run")
    a = ap.parse_args()
    texts = dict(t.split("=", 1) for t in a.text) or {"wikitext2": str(WIKI)}
    w = a.work
    w.mkdir(parents=True, exist_ok=True)
    res_p = w / "results.json"
    res = json.loads(res_p.read_text()) if res_p.is_file() else {}
    res.update({"f16": str(a.f16), "chunks": a.chunks, "calib": str(CALIB), "texts": texts})
    files = {"f16": a.f16}
    methods = ["rtn"] + [m for m in a.methods.split(",") if m and m != "rtn"]
    for name in methods:
        args = ["--method", name]
        path = w / f"q4_0-{name}.gguf"
        files[name] = path
        if not path.is_file():
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "dsa_convert.cli", "quantize", str(a.f16), str(path), "--type", "q4_0",
                   "--calib", str(CALIB), "--json", *args]
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if r.returncode != 0:
                raise SystemExit(f"dsa quantize failed: {r.stderr[-2000:]}")
            rep = json.loads(r.stdout)
            res[f"quantize_{name}"] = {"seconds": round(time.perf_counter() - t0, 1), "method": rep["method"],
                                       "bytes": rep["bytes"], "samples": rep.get("calib", {}).get("samples")}
            res_p.write_text(json.dumps(res, indent=1))
    exe, env = tool("llama-perplexity")
    for tname, tpath in texts.items():
        for fname, path in files.items():
            key = f"{tname}/{fname}"
            if key in res.get("ppl", {}):
                continue
            log = w / f"{tname}-{fname}.log"
            sh([exe, "-m", str(path), "-f", tpath, "-c", "512", "-b", "512", "--chunks", str(a.chunks), "-fa", "off",
                "-t", str(a.threads)], log, env)
            m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log.read_text(errors="replace"))
            res.setdefault("ppl", {})[key] = [float(m.group(1)), float(m.group(2))]
            res_p.write_text(json.dumps(res, indent=1))
        p = {f: res["ppl"][f"{tname}/{f}"][0] for f in files}
        d_rtn = p["rtn"] - p["f16"]
        summ = {"ppl_f16": p["f16"], "dppl_rtn": round(d_rtn, 4)}
        for m in methods[1:]:
            d = p[m] - p["f16"]
            summ[f"dppl_{m}"] = round(d, 4)
            summ[f"{m}_over_rtn"] = round(d / d_rtn, 3) if d_rtn else None
        res.setdefault("summary", {})[tname] = summ
        print(tname, res["summary"][tname])
    res_p.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
