#!/usr/bin/env python3
"""Peak RSS of `dsa convert … --top-k …` (the DSA retrofit) stage by stage: runs the command in this process and, on a
sampling thread (every 20 ms), reads VmRSS / VmHWM from /proc/self/status; each rise of VmHWM is billed to the stage
that was running (the retrofit's own StageClock names: load, plan, calib_forward, train, eval_kl, asq_fit, split,
placement; "startup" before the retrofit, "write" after it: the GGUF). The sampler also tags the split stage's part
within the sparse phase ("sparse_phase" for the training after the split search).

    python scripts/bench/rss_stages.py --out stages.json -- convert MODEL OUT.gguf --top-k 256 --calib-ctx 2048 …

The JSON: the command, the peak RSS (VmHWM, MiB) and the stage that reached it, per stage the largest RSS sampled and
the VmHWM rise billed to it, the stage seconds, and the convert's own JSON report's retrofit block (when --json).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import threading
import time
from contextlib import contextmanager


def _status() -> tuple[float, float]:
    rss = hwm = 0.0
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith("VmRSS:"):
                rss = int(ln.split()[1]) / 1024.0
            elif ln.startswith("VmHWM:"):
                hwm = int(ln.split()[1]) / 1024.0
    return rss, hwm


class Sampler:
    def __init__(self, every: float = 0.02):
        self.every, self.stage, self.stop = every, "startup", threading.Event()
        self.max_rss: dict[str, float] = {}
        self.hwm_rise: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.order: list[str] = []
        self.hwm = 0.0
        self.peak_stage = "startup"
        self.t = threading.Thread(target=self._run, daemon=True)

    def set(self, stage: str) -> None:
        self.sample()
        self.stage = stage
        if stage not in self.order:
            self.order.append(stage)

    def sample(self) -> None:
        rss, hwm = _status()
        s = self.stage
        self.max_rss[s] = max(self.max_rss.get(s, 0.0), rss)
        if hwm > self.hwm:
            self.hwm_rise[s] = self.hwm_rise.get(s, 0.0) + hwm - self.hwm
            self.hwm, self.peak_stage = hwm, s

    def _run(self) -> None:
        last, t = self.stage, time.monotonic()
        while not self.stop.is_set():
            self.sample()
            now = time.monotonic()
            self.seconds[last] = self.seconds.get(last, 0.0) + now - t
            last, t = self.stage, now
            time.sleep(self.every)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON written here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the dsa command line (convert …)")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    import torch

    torch.set_num_threads(a.threads)
    from dsa_convert import cli
    from dsa_convert.dsa import retrofit

    smp = Sampler()
    smp.order.append("startup")
    orig_call = retrofit.StageClock.__call__
    state = {"split_done": False}

    @contextmanager
    def staged(self, stage: str):
        name = stage
        if stage == "split":
            state["split_done"] = True
        elif state["split_done"] and stage in ("train", "calib_forward"):
            name = f"sparse_phase_{stage}"
        prev = smp.stage
        smp.set(name)
        try:
            with orig_call(self, stage):
                yield
        finally:
            smp.set(prev)

    retrofit.StageClock.__call__ = staged
    orig_run = retrofit.run_retrofit

    def run(*args, **kw):
        smp.set("retrofit_other")
        try:
            return orig_run(*args, **kw)
        finally:
            smp.set("write")

    retrofit.run_retrofit = run
    out = io.StringIO()
    smp.t.start()
    t0 = time.time()
    rc = 0
    sys.argv = ["dsa", *cmd]
    with contextlib.redirect_stdout(out):
        try:
            cli.main()
        except SystemExit as e:
            rc = int(e.code or 0)
    smp.stop.set()
    smp.t.join()
    smp.sample()
    try:
        report = json.loads(out.getvalue())
    except ValueError:
        report = None
    dsa = (report or {}).get("dsa") or {}
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    res = {"command": "dsa " + " ".join(cmd), "rc": rc, "wall_s": round(time.time() - t0, 1),
           "loadavg_at_end": [float(x) for x in load], "threads": a.threads,
           "peak_rss_mib": round(smp.hwm, 1), "peak_stage": smp.peak_stage,
           "stages": {s: {"max_rss_mib": round(smp.max_rss.get(s, 0.0), 1),
                          "hwm_rise_mib": round(smp.hwm_rise.get(s, 0.0), 1),
                          "sampled_s": round(smp.seconds.get(s, 0.0), 1)} for s in smp.order},
           "retrofit_stage_seconds": dsa.get("stage_seconds"),
           "calibration": {k: v for k, v in (dsa.get("calibration") or {}).items()
                           if k not in ("considered", "probes")},
           "split": {k: (dsa.get("split") or {}).get(k) for k in ("search", "sink", "local", "best_ppl", "candidates")},
           "convert_peak_rss_mib": (report or {}).get("peak_rss_mib")}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("peak_rss_mib", "peak_stage", "wall_s")}))
    for s, v in res["stages"].items():
        print(f"  {s:28s} max RSS {v['max_rss_mib']:8.1f} MiB  HWM rise {v['hwm_rise_mib']:8.1f}  "
              f"{v['sampled_s']:7.1f} s")
    sys.exit(rc)


if __name__ == "__main__":
    main()
