"""scripts/bench/trace_summary.py on a hand-made timeline (the CSV that scripts/gpu/cuda/kernel_trace.c writes)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "bench" / "trace_summary.py"


def _module():
    spec = importlib.util.spec_from_file_location("trace_summary", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["trace_summary"] = mod   # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _token(t0: int, corr: int) -> list[str]:
    """One decode graph launch (ns): a chain on stream 7 with a kernel launched early (PDL) and one branch on stream 9
    beside it, a graph memset node (its own correlation id) and a 500 ns launch gap before `attn`."""
    return [
        f"K,{t0},{t0 + 1000},7,{corr},1,1,256,norm",
        f"K,{t0 + 1000},{t0 + 4000},7,{corr},2,64,128,proj",
        f"K,{t0 + 1500},{t0 + 3000},9,{corr},3,8,256,qkv",           # the branch, overlapping proj
        f"K,{t0 + 2000},{t0 + 6000},7,{corr},4,32,128,indexer",      # launched early, waits for proj (PDL)
        f"S,{t0 + 6000},{t0 + 6200},7,{corr + 1000},0,0,0,4096",
        f"K,{t0 + 6200},{t0 + 8000},7,{corr},5,129,256,topk",
        f"K,{t0 + 8500},{t0 + 9500},7,{corr},6,512,128,attn",        # 500 ns idle before it
        f"K,{t0 + 9500},{t0 + 10000},7,{corr},7,32,256,combine",
        f"K,{t0 + 10000},{t0 + 12000},7,{corr},8,2048,128,ffn",
    ]


@pytest.fixture
def trace_csv(tmp_path):
    lines = []
    for i in range(3):
        lines += _token(1_000_000 + 100_000 * i, 50 + i)
    lines.append("K,5000000,5001000,7,99,1,1,1,outside_the_window")
    lines.append("C,1050000,1050100,7,77,0,1,8192")                 # an input copy between two tokens
    lines.append("window,0,999000,1400000")
    p = tmp_path / "t.csv"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_tokens_spans_and_charged_time_add_up(trace_csv):
    ts = _module()
    windows, recs = ts.load(trace_csv)
    assert windows == [(999000, 1400000)]
    inside = [r for r in recs if windows[0][0] <= r.start <= windows[0][1]]
    s = ts.summarise("sparse", inside)
    assert (s.n_tokens, s.kernels_per_token) == (3, 8)
    assert s.others == 1                                                 # the copy between tokens
    assert s.streams == [7, 9]
    assert s.span_us == pytest.approx(12.0)
    assert s.busy_us == pytest.approx(11.5)                              # the 0.5 µs gap before attn is idle
    assert s.between_us == pytest.approx(100.0 - 12.0)
    rows = {name: (n, dur, charged, gap) for name, n, dur, charged, gap in s.rows}
    assert rows["[memset 4096 B]"][0] == 1.0                             # the graph's memset node joined its token
    assert rows["attn"][3] == pytest.approx(0.5)
    # proj runs 1.0-4.0 µs beside qkv (1.5-3.0, ends first) and indexer (from 2.0, ends last): proj is charged
    # 1.0-1.5 and 3.0-4.0, the indexer only after proj's end (4.0-6.0), qkv its whole 1.5 µs
    assert rows["proj"][2] == pytest.approx(1.5)
    assert rows["qkv"][2] == pytest.approx(1.5)
    assert rows["indexer"][2] == pytest.approx(2.0)
    assert rows["indexer"][1] == pytest.approx(4.0)                      # its duration includes the PDL wait
    assert sum(r[2] + r[3] for r in rows.values()) == pytest.approx(s.span_us)
    # a layer's attention block: from the end of its norm to the end of the attention's last kernel
    assert ts.chain(s, "norm", "combine") == pytest.approx((1.0, 9.0))
    assert ts.chain(s, "combine", "norm") is None                        # no norm after a combine in a token
    # the kernel after another: gap from the first's end to its start, its duration, end to end, per token
    assert ts.follow(s, "indexer", "topk") == pytest.approx((0.2, 1.8, 2.0, 1.0))   # the memset node in between
    assert ts.follow(s, "proj", "indexer") == pytest.approx((-2.0, 4.0, 2.0, 1.0))  # launched early: starts before
    assert ts.follow(s, "ffn", "norm") is None
    # a kernel alone or with another stream's kernels running during it: proj has qkv (stream 9) beside it for
    # 1.5 µs; topk runs alone; qkv has proj and the early-launched indexer beside it
    assert ts.beside(s, "topk") == ts.Beside(1.0, pytest.approx(1.8), 0.0, None, None, None)
    assert ts.beside(s, "proj") == ts.Beside(0.0, None, 1.0, pytest.approx(3.0), 1, pytest.approx(1.5))
    assert ts.beside(s, "qkv") == ts.Beside(0.0, None, 1.0, pytest.approx(1.5), 2, pytest.approx(2.5))
    assert ts.beside(s, "nothing") is None


def test_cli_prints_a_table_and_rejects_a_trace_without_window(trace_csv, tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(trace_csv), "--names",
                          "sparse", "--chain", "norm,combine", "--follow", "indexer,topk", "--beside", "proj",
                          "--beside", "topk"],
                         capture_output=True, text=True, check=True).stdout
    assert "== sparse: 3 tokens of 8 kernels each" in out
    assert "chain norm -> combine: 9.00 µs, 1.0 times per token" in out
    assert ("follow indexer -> topk: median 0.20 µs from indexer's end to topk's start, topk 1.80 µs, 2.00 µs end to "
            "end, 1.0 times per token") in out
    assert ("beside proj: alone 0.0 per token, with other streams' kernels 1.0 (median 3.00 µs, 1 kernels overlapping "
            "it for 1.50 µs)") in out
    assert "beside topk: alone 1.0 per token (median 1.80 µs), with other streams' kernels 0.0" in out
    assert "outside_the_window" not in out
    bare = tmp_path / "bare.csv"
    bare.write_text("K,1,2,7,1,1,1,1,k\n")
    res = subprocess.run([sys.executable, str(SCRIPT), str(bare)],
                         capture_output=True, text=True)
    assert res.returncode != 0 and "no profiler window" in res.stderr and "Traceback" not in res.stderr
    for opt in ("--chain", "--follow"):
        res = subprocess.run([sys.executable, str(SCRIPT), str(trace_csv), opt, "norm"],
                             capture_output=True, text=True)
        assert res.returncode != 0 and f"{opt} 'norm': give two name parts" in res.stderr and "Traceback" not in res.stderr
