#!/usr/bin/env python3
"""Benchmark `dsa quantize` against llama.cpp's own 4-bit quantization on the reference model.

    python scripts/bench/bench_quant.py --work /tmp/qb [--chunks 60] [--samples 32] [--skip-depth]
    python scripts/bench/bench_quant.py --work /tmp/qb-full --reuse /tmp/qb --chunks 100000 --kl-chunks 0 --only KEYS
        (the same files scored on the whole test file: llama-perplexity caps --chunks at what the text holds)

Steps (each skipped when its output already exists in --work, so the script can be resumed):
  1. F16 GGUF with `dsa convert`
  2. llama.cpp baselines: llama-quantize Q4_0, Q4_K_M; llama-imatrix on the calibration text
     (-c 512 --chunks 128; the first 128×512 tokens, of which `dsa quantize --samples 32` uses the first 32) + Q4_K_M
  3. dsa quantize: RTN Q4_0, AWQ Q4_0 (clip groups of 128 and of 32; and with --imatrix auto, i.e. ggml's
     imatrix-weighted Q4_0), RTN Q4_K_M + imatrix (must equal llama.cpp's file), AWQ Q4_K_M with that imatrix
     rescaled by the AWQ scales (search through ggml's real Q4_K/Q6_K quantizer; with and without clipping);
     wall time and peak RSS of each
  4. llama-perplexity -c 512 -b 512 --chunks 60 -fa off -t 2 --no-repack on WikiText-2 test for each, and
     KL divergence to F16 (--kl-divergence, first --kl-chunks chunks)
     (--no-repack: the vendored CPU build's repacked Q4 kernels crash on this host, see docs/history §4; fixed since by building without AMX)
  5. calibration cost vs depth: the 6-layer model and a 12-layer deepening (blocks duplicated)
Writes WORK/results.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("DSA_SHARED", REPO.parent / "shared"))
MODEL = SHARED / "models" / "ref-llama-27m"
WIKI = SHARED / "data" / "wikitext-2-raw" / "wiki.test.raw"
CALIB = SHARED / "data" / "calib" / "books-calib.txt"


def tool(name: str) -> tuple[str, dict]:
    sys.path.insert(0, str(REPO))
    from dsa_convert.backend.runtime import tool_path

    p, env = tool_path(name)
    return str(p), env


def sh(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Run, log stdout+stderr, return wall seconds and peak RSS (GNU time)."""
    t0 = time.perf_counter()
    full = ["/usr/bin/time", "-v", *cmd] if Path("/usr/bin/time").exists() else cmd
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(full, stdout=f, stderr=subprocess.STDOUT, env=env)
    txt = log.read_text(errors="replace")
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)} — see {log}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", txt)
    return {"wall_s": round(time.perf_counter() - t0, 1), "peak_rss_mib": round(int(m.group(1)) / 1024, 1) if m else None,
            "cmd": " ".join(cmd)}


def ppl(gguf: Path, log: Path, chunks: int) -> float:
    exe, env = tool("llama-perplexity")
    if not (log.exists() and "Final estimate" in log.read_text(errors="replace")):
        sh([exe, "-m", str(gguf), "-f", str(WIKI), "-c", "512", "-b", "512", "--chunks", str(chunks),
            "-fa", "off", "-t", "2", "--no-repack"], log, env)
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log.read_text(errors="replace"))
    if not m:
        raise SystemExit(f"no PPL in {log}")
    return float(m.group(1))


def bpw(gguf: Path) -> float:
    sys.path.insert(0, str(REPO))
    from dsa_convert.formats.gguf_read import GgufFile

    g = GgufFile(gguf)
    n_el = sum(t.n_elements for t in g.tensors.values())
    return 8.0 * sum(t.n_bytes for t in g.tensors.values()) / n_el


def deepen(src: Path, dst: Path, factor: int = 2) -> None:
    """A synthetic deeper model: block i of the new GGUF = block i // factor of src."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    n = int(r.fields[f"{arch}.block_count"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vt = gguf.GGUFValueType(f.types[0])
        val = n * factor if key == f"{arch}.block_count" else f.contents()
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, val, vt, sub_type=gguf.GGUFValueType(f.types[1]))
        else:
            w.add_key_value(key, val, vt)
    by = {t.name: t for t in r.tensors}
    for t in r.tensors:
        if not t.name.startswith("blk."):
            w.add_tensor(t.name, np.array(t.data))
    for il in range(n * factor):
        for t in r.tensors:
            if t.name.startswith(f"blk.{il // factor}."):
                w.add_tensor(t.name.replace(f"blk.{il // factor}.", f"blk.{il}.", 1), np.array(by[t.name].data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dsa_quantize(src: Path, dst: Path, log: Path, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "dsa_convert.cli", "quantize", str(src), str(dst), "--force", "--json", *args]
    res = sh(cmd, log)
    res["cmd"] = "dsa quantize " + " ".join([str(src), str(dst), *args])
    txt = log.read_text(errors="replace")
    j = json.loads(txt[txt.index("{"): txt.rindex("}") + 1]) if "{" in txt else {}
    res.update({k: j.get(k) for k in ("calib_seconds", "seconds", "peak_rss_mib", "bits_per_weight", "bytes")})
    res["blocks"] = j.get("blocks")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/qb"))
    ap.add_argument("--chunks", type=int, default=60)
    ap.add_argument("--samples", type=int, default=32, help="AWQ calibration sequences of 512 tokens")
    ap.add_argument("--imatrix-chunks", type=int, default=128, help="llama-imatrix chunks of 512 tokens")
    ap.add_argument("--depth-samples", type=int, default=8)
    ap.add_argument("--kl-chunks", type=int, default=20, help="chunks for the KL divergence to F16 (0: skip)")
    ap.add_argument("--skip-depth", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated row keys to build/evaluate (F16 always)")
    ap.add_argument("--reuse", type=Path, default=None,
                    help="a finished --work dir whose GGUFs are linked instead of rebuilt (e.g. to re-score with "
                         "another --chunks in a new --work)")
    a = ap.parse_args()
    W = a.work
    W.mkdir(parents=True, exist_ok=True)
    res_path = W / "results.json"
    R = json.loads(res_path.read_text()) if res_path.exists() else {"runs": {}, "depth": {}}

    def save():
        res_path.write_text(json.dumps(R, indent=2))

    f16 = W / "ref-f16.gguf"
    if a.reuse and not f16.exists() and (a.reuse / f16.name).exists():
        f16.symlink_to((a.reuse / f16.name).resolve())
    if not f16.exists():
        R["runs"]["f16"] = sh([sys.executable, "-m", "dsa_convert.cli", "convert", str(MODEL), str(f16),
                               "--outtype", "f16", "--force"], W / "convert.log")
    q, qenv = tool("llama-quantize")
    imx, ienv = tool("llama-imatrix")
    imatrix = W / "imatrix.gguf"
    steps = [
        ("lc-q4_0", "llama.cpp Q4_0", lambda o: sh([q, str(f16), str(o), "Q4_0", "2"], W / "lc-q4_0.qlog", qenv)),
        ("lc-q4_k_m", "llama.cpp Q4_K_M", lambda o: sh([q, str(f16), str(o), "Q4_K_M", "2"], W / "lc-q4_k_m.qlog", qenv)),
        ("lc-q4_k_m-imat", "llama.cpp Q4_K_M + imatrix",
         lambda o: (imatrix.exists() or R["runs"].__setitem__("imatrix", sh(
             [imx, "-m", str(f16), "-f", str(CALIB), "-o", str(imatrix), "-c", "512", "-b", "512",
              "--chunks", str(a.imatrix_chunks), "-t", "2"], W / "imatrix.log", ienv))) and
         sh([q, "--imatrix", str(imatrix), str(f16), str(o), "Q4_K_M", "2"], W / "lc-q4_k_m-imat.qlog", qenv)),
        ("rtn-q4_0", "dsa RTN Q4_0", lambda o: dsa_quantize(f16, o, W / "rtn-q4_0.qlog", ["--method", "rtn", "--type", "q4_0"])),
        ("awq-test", "dsa AWQ Q4_0 (g128 clip, 16×512 calib)", lambda o: dsa_quantize(f16, o, W / "awq-test.qlog", [
            "--type", "q4_0", "--calib", str(CALIB), "--samples", "16", "--seq-len", "512"])),
        ("awq-imat-q4_0", "dsa AWQ Q4_0 (g32 clip) + imatrix auto (ggml weighted Q4_0)",
         lambda o: dsa_quantize(f16, o, W / "awq-imat-q4_0.qlog", [
             "--type", "q4_0", "--calib", str(CALIB), "--samples", str(a.samples), "--seq-len", "512",
             "--group-size", "32", "--imatrix", "auto"])),
        ("rtn-q4_k_m-limat", "dsa RTN Q4_K_M + imatrix", lambda o: dsa_quantize(
            f16, o, W / "rtn-q4_k_m-limat.qlog", ["--method", "rtn", "--type", "q4_k_m", "--imatrix", str(imatrix)])),
        ("awq-q4_0", "dsa AWQ Q4_0 (g32 + q/k clip, 40-step grid)", lambda o: dsa_quantize(f16, o, W / "awq-q4_0.qlog", [
            "--type", "q4_0", "--calib", str(CALIB), "--samples", str(a.samples), "--seq-len", "512",
            "--group-size", "32"])),
        ("awq-real-q4_k_m-limat", "dsa AWQ Q4_K_M + imatrix (rescaled; ggml Q4_K/Q6_K in the search)",
         lambda o: dsa_quantize(f16, o, W / "awq-real-q4_k_m-limat.qlog", [
                "--type", "q4_k_m", "--calib", str(CALIB), "--samples", str(a.samples), "--seq-len", "512",
                "--group-size", "32", "--imatrix", str(imatrix)])),
        ("awq-noclip-q4_k_m-limat", "dsa AWQ (no clip) Q4_K_M + imatrix (rescaled)", lambda o: dsa_quantize(
            f16, o, W / "awq-noclip-q4_k_m-limat.qlog", [
                "--type", "q4_k_m", "--calib", str(CALIB), "--samples", str(a.samples), "--seq-len", "512",
                "--group-size", "32", "--no-clip", "--imatrix", str(imatrix)])),
    ]
    rows = [("f16", "F16", f16)]
    only = {k for k in a.only.split(",") if k}
    for key, label, make in steps:
        if only and key not in only:
            continue
        out = W / f"{key}.gguf"
        if a.reuse and not out.exists() and (a.reuse / out.name).exists():
            out.symlink_to((a.reuse / out.name).resolve())
        if not out.exists():
            R["runs"][key] = make(out)
            save()
        rows.append((key, label, out))
    table = []
    base = None
    for key, label, path in rows:
        p = ppl(path, W / f"ppl-{key}.log", a.chunks)
        base = p if key == "f16" else base
        table.append({"key": key, "label": label, "ppl": p, "dppl": p - base, "dppl_pct": 100 * (p - base) / base,
                      "bytes": path.stat().st_size, "bpw": round(bpw(path), 3)})
    if a.kl_chunks:
        exe, env = tool("llama-perplexity")
        base_kl = W / "kl-base.bin"
        common = [exe, "-f", str(WIKI), "-c", "512", "-b", "512", "--chunks", str(a.kl_chunks), "-fa", "off",
                  "-t", "2", "--no-repack", "--kl-divergence-base", str(base_kl)]
        if not base_kl.exists():
            sh([*common[:1], "-m", str(f16), *common[1:]], W / "kl-base.log", env)
        for r in table[1:]:
            log = W / f"kl-{r['key']}.log"
            if not (log.exists() and "Mean    KLD" in log.read_text(errors="replace")):
                sh([*common[:1], "-m", str(W / f"{r['key']}.gguf"), *common[1:], "--kl-divergence"], log, env)
            m = re.search(r"Mean +KLD: +([0-9.]+) ± ([0-9.]+)", log.read_text(errors="replace"))
            r["kld"] = float(m.group(1)) if m else None
    R["table"] = table
    save()
    if not a.skip_depth:
        deep = W / "ref-f16-x2.gguf"
        if not deep.exists():
            deepen(f16, deep)
        for key, src in (("6", f16), ("12", deep)):
            if key not in R["depth"]:
                R["depth"][key] = dsa_quantize(src, W / f"depth-{key}.gguf", W / f"depth-{key}.qlog", [
                    "--type", "q4_0", "--calib", str(CALIB), "--samples", str(a.depth_samples), "--seq-len", "512",
                    "--group-size", "32"])
                save()
    print("| model | PPL | ΔPPL vs F16 | KLD | file | bits/weight |\n|---|---:|---:|---:|---:|---:|")
    for r in table:
        kld = f"{r['kld']:.5f}" if r.get("kld") is not None else "–"
        print(f"| {r['label']} | {r['ppl']:.2f} | {r['dppl']:+.2f} ({r['dppl_pct']:+.2f}%) | {kld} | "
              f"{r['bytes'] / 2**20:.1f} MiB | {r['bpw']:.2f} |")
    for k, d in R.get("depth", {}).items():
        print(f"depth {k}: wall {d['wall_s']} s, calib {d.get('calib_seconds')} s, peak RSS {d['peak_rss_mib']} MiB")


if __name__ == "__main__":
    main()
