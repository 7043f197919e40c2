#!/usr/bin/env python3
"""What the split search's NLL of one calibration chunk adds to the peak RSS: the LM head and float64 log-softmax of a
[ctx, vocab] chunk at once (as split.py did before the row blocks) against split.head_nll_sum's blocks of NLL_ROWS rows.
Each way runs in its own process (fresh VmHWM): the model's LM head (output norm, the tied or own output matrix) is
loaded and touched first, then the rise of VmHWM over the NLL alone is reported, with the NLL itself (both ways must
agree). The hidden states are the embeddings of the calibration text's first chunk (the memory does not depend on
them).

    python scripts/bench/nll_rss.py MODEL_DIR CALIB.txt [--ctx 2048] [--start 256] [--out nll_rss.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith("VmHWM:"):
                return int(ln.split()[1]) / 1024.0
    return 0.0


def one(model_dir: str, calib: str, ctx: int, start: int, mode: str) -> dict:
    import torch

    torch.set_num_threads(2)
    from dsa_convert.dsa.calib import calib_chunks
    from dsa_convert.dsa.split import NLL_ROWS, head_nll_sum
    from dsa_convert.kernels_ref.model import RefModel

    model = RefModel.from_hf(Path(model_dir), device="cpu")
    row = calib_chunks(Path(calib), Path(model_dir), ctx, 1)[0]
    with torch.no_grad():
        h = model.embed(row) * 4.0
        model.head(h[:NLL_ROWS])                   # loads the head's weights and warms the kernels
        before = _hwm_mib()
        if mode == "oneshot":
            lp = torch.log_softmax(model.head(h).double(), -1)
            nll = float(-lp[start:-1].gather(1, row[start + 1:, None]).sum())
            del lp
        else:
            nll = head_nll_sum(model, h, row, start)[0]
    return {"mode": mode, "nll_sum": nll, "hwm_before_mib": round(before, 1),
            "hwm_rise_mib": round(_hwm_mib() - before, 1), "rows_per_block": None if mode == "oneshot" else NLL_ROWS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("calib")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--start", type=int, default=256, help="first scored position (the split search: top-k)")
    ap.add_argument("--mode", choices=("oneshot", "blocked"), help=argparse.SUPPRESS)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(one(a.model_dir, a.calib, a.ctx, a.start, a.mode)))
        return
    res = {"ctx": a.ctx, "start": a.start, "runs": []}
    for mode in ("oneshot", "blocked"):
        out = subprocess.run([sys.executable, __file__, a.model_dir, a.calib, "--ctx", str(a.ctx), "--start",
                              str(a.start), "--mode", mode], capture_output=True, text=True, check=True).stdout
        res["runs"].append(json.loads(out.strip().splitlines()[-1]))
    o, b = res["runs"]
    res["nll_equal"] = o["nll_sum"] == b["nll_sum"]
    res["nll_rel_diff"] = abs(o["nll_sum"] - b["nll_sum"]) / abs(o["nll_sum"])
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
