#!/usr/bin/env python3
"""Q4_0: `dsa quantize` AWQ (the default, --method auto) against round-to-nearest, ΔPPL on several held-out texts.

    python scripts/bench/bench_awq_q4_0.py --f16 F16.gguf --work DIR [--chunks 40] [--text NAME=PATH ...]

Calibration is books-calib.txt (dsa quantize's defaults otherwise); the texts default to WikiText-2 test. Each step
is skipped when its output exists in DIR. llama-perplexity -c 512 -b 512 --chunks CHUNKS -fa off -t THREADS on the
F16 file, the RTN file and the AWQ file for every text; DIR/results.json holds PPLs, ΔPPL and ΔPPL(AWQ)/ΔPPL(RTN).
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
    a = ap.parse_args()
    texts = dict(t.split("=", 1) for t in a.text) or {"wikitext2": str(WIKI)}
    w = a.work
    w.mkdir(parents=True, exist_ok=True)
    res_p = w / "results.json"
    res = json.loads(res_p.read_text()) if res_p.is_file() else {}
    res.update({"f16": str(a.f16), "chunks": a.chunks, "calib": str(CALIB), "texts": texts})
    files = {"f16": a.f16}
    for name, args in (("rtn", ["--method", "rtn"]), ("awq", [])):
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
        d_rtn, d_awq = p["rtn"] - p["f16"], p["awq"] - p["f16"]
        res.setdefault("summary", {})[tname] = {"ppl_f16": p["f16"], "dppl_rtn": round(d_rtn, 4),
                                                 "dppl_awq": round(d_awq, 4),
                                                 "awq_over_rtn": round(d_awq / d_rtn, 3) if d_rtn else None}
        print(tname, res["summary"][tname])
    res_p.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
