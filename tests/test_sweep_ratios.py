"""scripts/bench/sweep_ratios.py: pairing of bench rows into same-run sparse ÷ dense ratios, and the per-ctx
summary."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import sweep_ratios as sr  # noqa: E402


def row(attn, ctx, tok_s, *, variant=None, source="s1", file="/w/synth-1b-share2.gguf", host=(5.0, 1.0, 50.0),
        prefill=1000.0):
    r = {"ctx": ctx, "attn": attn, "variant": variant, "decode_tok_s": tok_s, "decode_ms_per_tok": 1000.0 / tok_s,
         "prefill_tok_s": prefill, "file": file, "source": source,
         "host_us_per_decode_token": {"n": 32, "graph": host[0], "inputs": host[1], "launch": host[2]}}
    return r


def test_pairs_sparse_with_the_next_dense_of_its_ctx_and_variants_with_the_last():
    rows = [row("sparse", 131072, 750), row("dense", 131072, 300),
            row("sparse", 131072, 700, variant="X=1"),
            row("sparse", 65536, 760), row("dense", 65536, 400),
            row("sparse", 131072, 720), row("dense", 131072, 240)]     # a second sweep under the same tag
    pairs, unpaired = sr.pair_rows(rows)
    assert unpaired == 0
    got = [(p.ctx, p.variant, round(p.decode, 3)) for p in pairs]
    assert got == [(131072, None, 2.5), (131072, "X=1", round(700 / 300, 3)), (65536, None, 1.9),
                   (131072, None, 3.0)]


def test_groups_never_mix_and_rows_without_dense_are_counted():
    rows = [row("sparse", 131072, 750, source="a"), row("dense", 131072, 300, source="b"),
            row("sparse", 131072, 700, variant="X=1", source="c"),
            row("sparse", 131072, 740, file="/w/synth-8b-share2.gguf", source="b"),
            {"ctx": 131072, "attn": "dense", "error": "out of memory"}]
    pairs, unpaired = sr.pair_rows(rows)
    assert pairs == [] and unpaired == 3


def test_gpu_side_ratio_takes_each_rows_host_time_off():
    p = sr.Pair("g", "m", 131072, None, row("sparse", 131072, 1000, host=(0, 0, 100)),
                row("dense", 131072, 250, host=(0, 400, 100)))
    # sparse 1.0 ms - 0.1 = 0.9; dense 4.0 ms - 0.5 = 3.5
    assert p.gpu_side == pytest.approx(3.5 / 0.9)


def test_summary_median_and_goal_count():
    rows = []
    for s, d in ((750, 300), (745, 305), (760, 290), (700, 290)):
        rows += [row("sparse", 131072, s, source=f"{s}"), row("dense", 131072, d, source=f"{s}")]
    pairs, _ = sr.pair_rows(rows)
    (s,) = sr.summarize(pairs, {131072: 2.5})
    ratios = sorted([750 / 300, 745 / 305, 760 / 290, 700 / 290])
    assert s["n"] == 4 and s["median"] == pytest.approx((ratios[1] + ratios[2]) / 2)
    assert s["meets"] == sum(r >= 2.5 for r in ratios) == 2


def test_cli_markdown_and_bad_input(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [row("sparse", 65536, 700), row("dense", 65536, 400)]) + "\n")

    def run(*a):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "sweep_ratios.py"), *a],
                              capture_output=True, text=True)

    ok = run(str(f), "--markdown")
    assert ok.returncode == 0 and "| synth-1b-share2, 64K | 1 | 1.75 | **1.75** |" in ok.stdout
    assert "1 of 1 (goal 1.7)" in ok.stdout
    bad = run(str(f), "--goal", "64K")
    assert bad.returncode == 2 and "expected CTX=RATIO" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "x.jsonl").write_text("{not json\n")
    broken = run(str(tmp_path / "x.jsonl"))
    assert broken.returncode != 0 and "x.jsonl:1: not JSON" in broken.stderr and "Traceback" not in broken.stderr
    none = run(str(f), "--match", "8b")
    assert none.returncode == 1 and "no sparse row" in none.stderr


def test_floor_gives_each_longer_ctx_its_sweeps_attention_free_bound(tmp_path):
    rows = []
    for src, fl, d128, s128 in (("a", 900, 300, 720), ("b", 880, 440, 700)):
        rows += [row("sparse", 1024, 850, source=src), row("dense", 1024, fl, source=src),
                 row("sparse", 131072, s128, source=src), row("dense", 131072, d128, source=src)]
    rows += [row("sparse", 131072, 700, source="c"), row("dense", 131072, 350, source="c")]   # no floor row
    pairs = sr.attach_floor(sr.pair_rows(rows)[0], 1024)
    assert [p.ctx for p in pairs] == [131072] * 3
    assert pairs[0].bound == pytest.approx(3.0) and pairs[0].of_floor == pytest.approx(0.8)
    assert pairs[1].bound == pytest.approx(2.0) and pairs[1].of_floor == pytest.approx(700 / 880)
    assert pairs[2].floor is None and pairs[2].bound is None
    (s,) = sr.summarize(pairs, {})
    assert s["bound_median"] == pytest.approx(2.5) and s["n"] == 3

    f = tmp_path / "b.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows[:4]) + "\n")
    run = [sys.executable, str(ROOT / "scripts" / "bench" / "sweep_ratios.py"), str(f), "--markdown"]
    ok = subprocess.run(run + ["--floor", "1024"], capture_output=True, text=True)
    assert ok.returncode == 0 and "| synth-1b-share2, 128K | 1 | 2.40 | **2.40** |" in ok.stdout
    assert ok.stdout.rstrip().endswith("| 3.00 | 0.80 |")
    miss = subprocess.run(run + ["--floor", "2048"], capture_output=True, text=True)
    assert miss.returncode == 1 and "--floor 2048: no sweep" in miss.stderr and "Traceback" not in miss.stderr
