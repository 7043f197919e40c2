"""`dsa bench` and scripts/make_synth_gguf.py on the `tiny` synthetic shape (CPU, small contexts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, requires_backend
from test_convert_errors import assert_clean_failure, run_dsa  # one copy of the CLI-failure checks

TOPK, SINK, LOCAL = 32, 4, 8
FIELDS = ("ctx", "attn", "prefill_tok_s", "decode_tok_s", "kv_bytes", "kv_bytes_per_token", "device")


def synth(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "make_synth_gguf.py"), str(out), "--quiet", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    r = synth(out, "--shape", "tiny", "--top-k", str(TOPK), "--sink", str(SINK), "--local", str(LOCAL))
    assert r.returncode == 0, r.stderr
    return out


def test_synth_file_follows_format(tiny):
    from dsa_convert.formats.gguf_read import GgufFile

    g = GgufFile(tiny)
    try:
        assert g.arch == "llama"
        assert g.get("llama.attention.indexer.top_k") == TOPK
        assert g.get("llama.dsa.sink") == SINK and g.get("llama.dsa.local") == LOCAL
        assert g.get("llama.dsa.version") == 1 and g.get("llama.dsa.select") == "token"
        assert g.get("llama.context_length") == 2048 and g.get("llama.block_count") == 2
        assert len(g.get("tokenizer.ggml.tokens")) == 512
        for il in range(2):
            for s in ("attn_qkw.weight", "k_norm.weight", "k_norm.bias"):
                assert g.has(f"blk.{il}.indexer.{s}")
        assert g.tensors["blk.0.indexer.attn_qkw.weight"].type_name == "F16"
        assert g.tensors["blk.0.attn_q.weight"].type_name == "F16"
        assert not g.has("output.weight")          # tied embeddings
    finally:
        g.close()


def test_synth_real_shapes_plan_the_model_tensors():
    """Every real shape plans the tensors its architecture loads with (no file written: the plans are lazy)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import make_synth_gguf as m

    for name, spec in m.SHAPES.items():
        o = m.SynthOptions(Path("unused.gguf"), name, index_share=2)
        shapes = {t.name: t.shape for t in m.plan(spec, o)}
        names = shapes.keys()
        q, kv = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
        assert shapes["blk.0.attn_q.weight"] == (q, spec.n_embd) and shapes["blk.0.attn_k.weight"] == (kv, spec.n_embd)
        assert ("blk.0.attn_q.bias" in names) == spec.attn_bias == name.startswith(("qwen2", "tiny-qwen2"))
        assert ("blk.0.attn_q_norm.weight" in names) == spec.qk_norm == name.startswith(("qwen3", "tiny-qwen3"))
        assert ("output.weight" in names) != spec.tie_embeddings
        # G = 2: an indexer in layer 0, none in layer 1
        assert "blk.0.indexer.attn_qkw.weight" in names and "blk.1.indexer.attn_qkw.weight" not in names
    s = m.SHAPES["qwen2.5-7b"]
    assert (s.n_layer, s.n_head, s.n_head_kv, s.head_dim, s.vocab_size) == (28, 28, 4, 128, 152064)


@requires_backend
@pytest.mark.parametrize("shape", ["tiny-qwen2", "tiny-qwen3"])
def test_synth_qwen_shapes_run_sparse(shape, tmp_path):
    out = tmp_path / f"{shape}.gguf"
    r = synth(out, "--shape", shape, "--top-k", str(TOPK), "--sink", str(SINK), "--local", str(LOCAL), "--asq", "16")
    assert r.returncode == 0, r.stderr
    for kv in ("f16", "asq"):
        res = run_dsa("bench", str(out), "--ctx", "256", "--gen", "4", "--attn", "sparse", "--kv", kv, "--json")
        assert res.returncode == 0, res.stderr
        (row,) = json.loads(res.stdout)
        assert row["attn"] == "sparse" and row["decode_tok_s"] > 0


def test_synth_bad_options(tmp_path):
    out = tmp_path / "x.gguf"
    for args, needle in ((["--shape", "nope"], "unknown --shape"), (["--outtype", "q8_0"], "--outtype"),
                         (["--top-k", "8", "--sink", "4", "--local", "8"], "sink + local")):
        r = synth(out, *args)
        assert r.returncode == 3 and needle in r.stderr.strip().splitlines()[-1], r.stderr
        assert not out.exists()


@requires_backend
def test_synth_q4_k_m_keeps_indexer_f16(tmp_path):
    from dsa_convert.formats.gguf_read import GgufFile

    out = tmp_path / "q4.gguf"
    r = synth(out, "--top-k", str(TOPK), "--local", str(LOCAL), "--outtype", "q4_k_m")
    assert r.returncode == 0, r.stderr
    g = GgufFile(out)
    try:
        assert g.tensors["blk.0.attn_q.weight"].type_name == "Q4_K"
        assert g.tensors["blk.1.indexer.attn_qkw.weight"].type_name == "F16"
    finally:
        g.close()


@requires_backend
def test_bench_json_sparse_and_dense(tiny, tmp_path):
    png = tmp_path / "decode.png"
    r = run_dsa("bench", str(tiny), "--ctx", "64,512", "--gen", "4", "--threads", "1", "--n-gpu-layers", "0",
                "--json", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["ctx"], x["attn"]) for x in rows] == [(64, "sparse"), (64, "dense"), (512, "sparse"), (512, "dense")]
    for x in rows:
        assert all(k in x for k in FIELDS), x
        assert x["prefill_tok_s"] > 0 and x["decode_tok_s"] > 0 and x["kv_bytes"] > 0
        assert x["device"] == "cpu" and x["llama_perf_ms"]["n_decode"] == 4   # the timed decodes only
        # llama.cpp reuses the decode graph from the 2nd decoded token on, for the DSA graph too (a graph that
        # cannot be reused is rebuilt, re-allocated and, on CUDA, re-captured every token)
        assert x["llama_perf_ms"]["n_graphs_reused"] >= 3, x["llama_perf_ms"]
        # the patch timed the host part of exactly the --gen timed decodes (not the warm-up / indexer-only ones);
        # ggml_time_us ticks in whole microseconds, so a tiny model's inputs (< 1 us a token) can average 0.0
        host = x["host_us_per_decode_token"]
        assert host["n"] == 4 and host["inputs"] >= 0 and host["launch"] > 0, host
        assert x["host_cpu"]["cpu"] is not None and x["host_cpu"]["affinity"], x["host_cpu"]
        print(f"tiny cpu ctx={x['ctx']} {x['attn']}: prefill {x['prefill_tok_s']} tok/s, decode {x['decode_tok_s']} "
              f"tok/s, kv {x['kv_bytes']} B ({x['kv_bytes_per_token']} B/token, {x['kv_cells']} cells)")
    by = {(x["ctx"], x["attn"]): x for x in rows}
    for mode in ("sparse", "dense"):
        assert by[(512, mode)]["kv_bytes"] > by[(64, mode)]["kv_bytes"]          # scales with ctx
        assert by[(512, mode)]["kv_cells"] >= 512 + 4
    assert by[(64, "sparse")]["mode_log"].startswith(f"top-k={TOPK}")          # the sparse path really ran
    assert by[(64, "dense")]["mode_log"].startswith("off")
    assert by[(64, "sparse")]["sparse_active"] and by[(64, "sparse")]["top_k"] == TOPK
    assert by[(64, "sparse")]["indexer_layers"] == 2 and by[(64, "dense")]["indexer_layers"] is None
    # main K/V: 2 layers x 2 KV heads x 64 x (K + V) x 2 bytes = 1024 B/token (f16); sparse adds the
    # indexer-key cache, F16 by default: 2 layers x 64 x 2 = 256 B/token (llama.cpp logs MiB with 2 decimals)
    assert by[(512, "dense")]["kv_bytes_per_token"] == pytest.approx(1024, rel=0.02)
    assert by[(512, "sparse")]["index_keys"] == "f16" and by[(512, "dense")]["index_keys"] is None
    assert by[(512, "sparse")]["kv_indexer_bytes"] / by[(512, "sparse")]["kv_cells"] == pytest.approx(256, rel=0.05)
    assert "indexer_share_decode_est" in by[(64, "sparse")]
    assert by[(64, "sparse")]["indexer_only_decode_s"] > 0 and "indexer_share_decode" in by[(64, "sparse")]
    assert all(x["process_peak_rss_mib"] > 0 for x in rows)
    assert by[(512, "dense")]["process_peak_rss_mib"] >= by[(64, "sparse")]["process_peak_rss_mib"]  # monotone
    for c in (64, 512):   # sparse ÷ dense of the same sweep, on the sparse rows
        want = by[(c, "sparse")]["decode_tok_s"] / by[(c, "dense")]["decode_tok_s"]
        assert by[(c, "sparse")]["decode_vs_dense"] == pytest.approx(want, rel=1e-3)
        assert "decode_vs_dense" not in by[(c, "dense")]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@requires_backend
def test_bench_no_indexer_share_skips_the_second_context(tiny):
    r = run_dsa("bench", str(tiny), "--ctx", "64", "--gen", "2", "--threads", "1", "--no-indexer-share", "--json")
    assert r.returncode == 0, r.stderr
    sp = next(x for x in json.loads(r.stdout) if x["attn"] == "sparse")
    assert sp["indexer_only_decode_s"] is None and "indexer_share_decode" not in sp
    assert sp["indexer_share_decode_est"] is not None        # the whole overhead's share needs no second context


@requires_backend
def test_bench_dense_flash_attn_both_runs_dense_twice(tiny):
    r = run_dsa("bench", str(tiny), "--ctx", "64", "--gen", "2", "--threads", "1", "--no-indexer-share",
                "--dense-flash-attn", "both", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["attn"], x["flash_attn"]) for x in rows] == [("sparse", True), ("dense", True), ("dense", False)]
    fast = {m: max(rows[1:], key=lambda x: x[f"{m}_tok_s"]) for m in ("decode", "prefill")}
    assert rows[0]["decode_vs_dense"] == pytest.approx(rows[0]["decode_tok_s"] / fast["decode"]["decode_tok_s"],
                                                       rel=1e-3)
    assert rows[0]["vs_dense_flash_attn"] == {m: fast[m]["flash_attn"] for m in ("decode", "prefill")}
    off = run_dsa("bench", str(tiny), "--ctx", "64", "--gen", "2", "--threads", "1", "--no-indexer-share",
                  "--attn", "dense", "--dense-flash-attn", "off", "--json")
    assert off.returncode == 0, off.stderr
    assert [x["flash_attn"] for x in json.loads(off.stdout)] == [False]


@requires_backend
def test_bench_text_output_kv_type_and_jsonl(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_DSA_FUSED", "0")        # the patch's switches in effect are recorded with the row
    monkeypatch.setenv("GGML_CUDA_GRAPH_OPT", "1")    # and ggml's CUDA ones (no effect on the CPU)
    monkeypatch.setenv("LLAMA_NOT_A_SWITCH", "x")     # but not the rest of the environment
    jl = tmp_path / "runs.jsonl"
    r = run_dsa("bench", str(tiny), "--ctx", "64", "--gen", "2", "--attn", "dense", "--kv", "q8_0",
                "--threads", "1", "--jsonl", str(jl))
    assert r.returncode == 0, r.stderr
    assert "decode tok/s" in r.stdout and "dense" in r.stdout
    rows = [json.loads(line) for line in jl.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["kv_type"] == "q8_0" and rows[0]["kv_bytes"] > 0
    assert rows[0]["llama_env"].get("LLAMA_DSA_FUSED") == "0"
    assert rows[0]["llama_env"].get("GGML_CUDA_GRAPH_OPT") == "1" and "LLAMA_NOT_A_SWITCH" not in rows[0]["llama_env"]


@requires_backend
def test_bench_variant_runs_a_switch_in_the_same_sweep(tiny, monkeypatch):
    """--variant LLAMA_DSA_FUSED=0: per ctx one more sparse run with the switch set (the A/B in one run);
    the plain runs do not see it. Each variant run has a process of its own (switches the CUDA backend reads once
    per process take effect there), the plain runs share the sweep's. Several switches join with '+', upstream's
    GGML_CUDA_* ones included."""
    for name in ("LLAMA_DSA_FUSED", "GGML_CUDA_GRAPH_OPT"):
        monkeypatch.delenv(name, raising=False)
    both = "LLAMA_DSA_FUSED=0+GGML_CUDA_GRAPH_OPT=1"
    r = run_dsa("bench", str(tiny), "--ctx", "64,128", "--gen", "2", "--threads", "1", "--n-gpu-layers", "0",
                "--variant", "LLAMA_DSA_FUSED=0", "--variant", both, "--cpus", "0", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["ctx"], x["attn"], x["variant"]) for x in rows] == [
        (64, "sparse", None), (64, "dense", None), (64, "sparse", "LLAMA_DSA_FUSED=0"), (64, "sparse", both),
        (128, "sparse", None), (128, "dense", None), (128, "sparse", "LLAMA_DSA_FUSED=0"), (128, "sparse", both)]
    for x in rows:
        assert x["llama_env"].get("LLAMA_DSA_FUSED") == ("0" if x["variant"] else None), x["llama_env"]
        assert x["llama_env"].get("GGML_CUDA_GRAPH_OPT") == ("1" if x["variant"] == both else None), x["llama_env"]
    assert rows[2]["decode_tok_s"] > 0 and "indexer_share_decode_est" in rows[2]
    plain = {x["pid"] for x in rows if not x["variant"]}
    own = [x["pid"] for x in rows if x["variant"]]
    assert len(plain) == 1 and len(set(own)) == 4 and not plain & set(own), [x["pid"] for x in rows]
    # --cpus 0 pinned the sweep, and the variant processes inherited it
    assert all(x["host_cpu"]["affinity"] == "0" and x["host_cpu"]["cpu"] == 0 for x in rows), [x["host_cpu"] for x in rows]


@requires_backend
def test_bench_default_threads_are_the_pinned_cpus(tiny):
    """Without --threads llama.cpp gets one thread per CPU the process may run on (--cpus 0: one), not one per CPU of
    the host, so that sweeps pinned side by side do not oversubscribe their cores."""
    r = run_dsa("bench", str(tiny), "--ctx", "64", "--gen", "2", "--attn", "dense", "--n-gpu-layers", "0",
                "--no-indexer-share", "--cpus", "0", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["threads"] for x in rows] == [1] and rows[0]["host_cpu"]["affinity"] == "0", rows


@requires_backend
def test_bench_force_allows_ctx_beyond_training(tiny):
    r = run_dsa("bench", str(tiny), "--ctx", "2100", "--gen", "2", "--attn", "dense", "--threads", "1",
                "--force", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["ctx"] == 2100


@pytest.mark.parametrize("args,needle", [
    (["--ctx", "0"], "--ctx must be > 0"),
    (["--ctx", "64,-8"], "--ctx must be > 0"),
    (["--ctx", "64,abc"], "not an integer"),
    (["--ctx", "4096"], "exceeds the model's trained context 2048"),
    (["--attn", "sparse,oracle"], "unknown --attn 'oracle'"),
    (["--kv", "int3"], "unknown --kv"),
    (["--kv", "asq"], "no ASQ prototypes"),
    (["--kv", "q4_0", "--no-flash-attn"], "flash attention"),
    (["--kv", "q4_0", "--dense-flash-attn", "both"], "flash attention"),
    (["--dense-flash-attn", "sometimes"], "unknown --dense-flash-attn 'sometimes'"),
    (["--gen", "0"], "--gen must be > 0"),
    (["--threads", "0"], "--threads must be >= 1 (got 0)"),
    (["--index-keys", "q8_0"], "unknown --index-keys"),
    (["--variant", "FUSED=0"], "expected LLAMA_DSA_NAME=VALUE"),
    (["--variant", "LLAMA_DSA_FUSED=0+PATH=/tmp"], "expected LLAMA_DSA_NAME=VALUE"),
    (["--variant", "LLAMA_DSA_FUSED=0+LLAMA_DSA_FUSED=1"], "expected LLAMA_DSA_NAME=VALUE"),
    (["--variant", "LLAMA_DSA_FUSED=0+"], "expected LLAMA_DSA_NAME=VALUE"),
    (["--variant", "LLAMA_DSA_FUSED_ATTN=0"], "LLAMA_DSA_GATHER=never|always"),        # a switch the patch lacks
    (["--variant", "LLAMA_DSA_GATHER=sometimes"], "expected LLAMA_DSA_NAME=VALUE"),
    (["--variant", "LLAMA_DSA_INDEXER_ONLY=1"], "expected LLAMA_DSA_NAME=VALUE"),  # the bench's own measurement
    (["--variant", "LLAMA_DSA_FUSED=0", "--attn", "dense"], "needs --attn sparse"),
    (["--cpus", "x"], "--cpus: 'x' is not a CPU number or range"),
    (["--cpus", "3-1"], "--cpus: '3-1' is not a CPU number or range"),
    (["--cpus", "0,100000"], "--cpus: CPU 100000 is not available"),
])
def test_bench_bad_options(tiny, tmp_path, args, needle):
    png = tmp_path / "p.png"
    assert_clean_failure(run_dsa("bench", str(tiny), "--plot", str(png), *args), png, needle)


def test_bench_bad_files(tmp_path):
    png = tmp_path / "p.png"
    assert_clean_failure(run_dsa("bench", str(tmp_path / "missing.gguf")), png, "not found")
    txt = tmp_path / "notes.gguf"
    txt.write_text("this is not a gguf file\n" * 4)
    assert_clean_failure(run_dsa("bench", str(txt)), png, "not a GGUF")


def test_bench_plot_dir_missing(tiny, tmp_path):
    png = tmp_path / "nope" / "p.png"
    assert_clean_failure(run_dsa("bench", str(tiny), "--ctx", "64", "--plot", str(png)), png, "--plot")
    assert_clean_failure(run_dsa("bench", str(tiny), "--ctx", "64", "--jsonl", str(png)), png, "--jsonl")


def test_bench_sparse_needs_indexer(tiny, tmp_path):
    plain = tmp_path / "plain.gguf"
    subprocess.run([sys.executable, str(REPO / "scripts" / "strip_dsa.py"), str(tiny), str(plain)], check=True,
                   capture_output=True)
    assert_clean_failure(run_dsa("bench", str(plain), "--ctx", "64", "--attn", "sparse"), tmp_path / "p.png",
                         "no DSA indexer")


def test_plot_bench_script_plots_saved_rows_and_rejects_bad_input(tmp_path):
    """scripts/plot_bench.py: saved rows -> PNG (only the --match file's rows); bad input -> one line, exit 3."""
    rows = [{"ctx": c, "attn": a, "decode_tok_s": v, "file": f}
            for f in ("a-1b.gguf", "b-8b.gguf") for c, a, v in ((1024, "sparse", 50.0), (1024, "dense", 40.0),
                                                               (4096, "sparse", 45.0), (4096, "dense", 20.0))]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = str(REPO / "scripts" / "plot_bench.py")
    out = tmp_path / "p.png"
    r = subprocess.run([sys.executable, script, str(src), "--match", "1b", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pre = tmp_path / "pre.png"   # --metric prefill: the rows' prefill tok/s
    src2 = tmp_path / "rows2.jsonl"
    src2.write_text("".join(json.dumps(dict(r, prefill_tok_s=10 * r["decode_tok_s"])) + "\n" for r in rows))
    r = subprocess.run([sys.executable, script, str(src2), "--metric", "prefill", "--out", str(pre)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert pre.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": 1}\n')
    q = str(tmp_path / "q.png")
    for args in ([str(src), "--match", "none", "--out", q], [str(bad), "--out", q],
                 [str(tmp_path / "missing.jsonl"), "--out", q]):
        r = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 3 and r.stderr.startswith("error: ") and len(lines) == 1, r.stderr
        assert not Path(q).exists()


def test_plot_bench_first_rows_and_labels():
    """--first keeps one row per (ctx, attn, variant); --label renames a variant, and a label no row has is an error."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plot_bench", REPO / "scripts" / "plot_bench.py")
    pb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb)
    rows = [{"ctx": 1024, "attn": "sparse", "decode_tok_s": 1.0, "pid": 1},
            {"ctx": 1024, "attn": "dense", "decode_tok_s": 2.0, "pid": 1},
            {"ctx": 1024, "attn": "sparse", "decode_tok_s": 3.0, "pid": 2, "variant": "LLAMA_DSA_A=1+LLAMA_DSA_B=1"},
            {"ctx": 1024, "attn": "sparse", "decode_tok_s": 4.0, "pid": 3}]
    assert [r["decode_tok_s"] for r in pb.first_rows(rows)] == [1.0, 2.0, 3.0]
    got = pb.relabel(rows, ["V1=LLAMA_DSA_A=1+LLAMA_DSA_B=1"])
    assert [r.get("variant") for r in got] == [None, None, "V1", None]
    assert rows[2]["variant"] == "LLAMA_DSA_A=1+LLAMA_DSA_B=1"          # the input rows are left alone
    for bad in (["V1"], ["=LLAMA_DSA_A=1"], ["V1=LLAMA_DSA_C=1"]):
        with pytest.raises(pb.BadInputError):
            pb.relabel(rows, bad)


def _children(pid: int) -> list[int]:
    """Direct child processes of pid (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


@requires_backend
@pytest.mark.parametrize("sig, code, msg", [("SIGTERM", 143, "terminated"), ("SIGINT", 130, "interrupted")])
def test_bench_stop_during_a_variant_stops_its_process(tiny, sig, code, msg):
    """SIGTERM to the sweep (a batch scheduler's stop), or Ctrl-C to its process group, while a variant runs in its
    own process: the sweep's exit code and one-line message at once, no traceback from either process, and the
    variant's process does not outlive the sweep."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "dsa_convert.cli", "bench", str(tiny), "--ctx", "64", "--attn",
                             "sparse", "--gen", "2500", "--threads", "1", "--n-gpu-layers", "0", "--force",
                             "--variant", "LLAMA_DSA_FUSED=0", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        t0, kids = time.monotonic(), []
        while not kids and time.monotonic() - t0 < 240 and proc.poll() is None:
            time.sleep(0.05)
            kids = [k for k in _children(proc.pid)
                    if "variant_proc" in (Path("/proc") / str(k) / "cmdline").read_bytes().decode(errors="replace")]
        assert kids, f"no variant process appeared (exit {proc.poll()})"
        time.sleep(0.5)
        if sig == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)   # a terminal's Ctrl-C: every process of the group
        t_term = time.monotonic()
        _, err = proc.communicate(timeout=60)
        stopped_s = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == f"error: {msg}" and "Traceback" not in err, err
    assert stopped_s < 5, stopped_s   # not after the variant's run (~10 s of decodes here) has finished
    time.sleep(0.2)
    assert not [k for k in kids if (Path("/proc") / str(k)).exists()
                and (Path("/proc") / str(k) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]


def test_variant_process_module_imports_no_numpy():
    """A variant's process loads llama.cpp before anything imports numpy (with a CUDA library that carries its own
    libstdc++ the other order segfaults inside llama_model_load, backend/load_check.py): its module imports nothing
    heavy, and the job (which imports eval.bench and numpy when unpickled) is read after the preload."""
    code = ("import sys, dsa_convert.eval.variant_proc as v, inspect; "
            "src = inspect.getsource(v.main); "
            "print('numpy' in sys.modules, src.index('preload_llama_cpp()') < src.index('pickle.load'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"], r.stdout


def test_parse_variant_joins_switches_with_plus():
    from dsa_convert.eval.bench import parse_variant
    assert parse_variant("LLAMA_DSA_FUSED=0") == {"LLAMA_DSA_FUSED": "0"}
    assert parse_variant("LLAMA_DSA_FUSED=0+GGML_CUDA_GRAPH_OPT=1+LLAMA_DSA_GATHER=always") == {
        "LLAMA_DSA_FUSED": "0", "GGML_CUDA_GRAPH_OPT": "1", "LLAMA_DSA_GATHER": "always"}
    assert parse_variant("LLAMA_DSA_HOST_MASKS=1+GGML_CUDA_X=") == {"LLAMA_DSA_HOST_MASKS": "1", "GGML_CUDA_X": ""}
    for bad in ("FUSED=0", "LLAMA_DSA_FUSED", "LLAMA_DSA_FUSED=0+", "+LLAMA_DSA_FUSED=0",
                "LLAMA_DSA_FUSED=1+LLAMA_DSA_FUSED=0", "LLAMA_DSA_FUSED=0+CUDA_VISIBLE_DEVICES=1", "llama_dsa_fused=0",
                "LLAMA_DSA_SATTN_SF=1", "LLAMA_DSA_FUSED=2", "LLAMA_DSA_GATHER=0", "LLAMA_DSA_HOST_TIMING=1",
                "LLAMA_DSA_INDEXER_ONLY=1"):
        assert parse_variant(bad) is None, bad


def test_render_prints_sparse_over_dense_per_ctx():
    """The text table ends with issue #6's measure: sparse ÷ dense tok/s per ctx of the sweep, variants against the
    sweep's dense row; a ctx without a dense row (or with an error) gets none."""
    from dsa_convert.eval.bench_summary import add_ratios, ratios, render

    def row(ctx, attn, pre, dec, variant=None):
        return {"ctx": ctx, "attn": attn, "prefill_tok_s": pre, "decode_tok_s": dec, "kv_bytes": 2**20,
                "kv_bytes_per_token": 64.0, "device": "cuda", "variant": variant,
                "indexer_decode_ms_per_tok": None, "host_us_per_decode_token": None}
    rows = [row(65536, "sparse", 10000.0, 540.0), row(65536, "dense", 25000.0, 400.0),
            row(65536, "sparse", 11000.0, 600.0, "LLAMA_DSA_FUSED=0"), row(131072, "sparse", 6000.0, 480.0),
            {"ctx": 16384, "attn": "dense", "error": "out of memory"}, row(16384, "sparse", 20000.0, 550.0)]
    got = ratios(rows)
    assert [(x["ctx"], x["variant"]) for x in got] == [(65536, None), (65536, "LLAMA_DSA_FUSED=0")]
    assert got[0]["decode"] == pytest.approx(1.35) and got[0]["prefill"] == pytest.approx(0.4)
    assert got[1]["decode"] == pytest.approx(1.5) and got[1]["prefill"] == pytest.approx(0.44)
    text = render(rows)
    assert "sparse ÷ dense" in text
    assert "   65536  decode 1.35×  prefill 0.40×" in text
    assert "   65536  decode 1.50×  prefill 0.44×  [LLAMA_DSA_FUSED=0]" in text
    assert "131072  decode" not in text and "16384  decode" not in text
    assert "sparse ÷ dense" not in render([row(65536, "sparse", 10000.0, 540.0)])
    add_ratios(rows)   # the sweep's returned / --json rows carry them too
    assert rows[0]["decode_vs_dense"] == 1.35 and rows[0]["prefill_vs_dense"] == 0.4
    assert rows[2]["decode_vs_dense"] == 1.5 and "decode_vs_dense" not in rows[3] and "decode_vs_dense" not in rows[5]


def test_ratios_take_the_faster_dense_row_per_metric(tmp_path):
    """--dense-flash-attn both: a ctx has a dense row with and one without flash attention; sparse ÷ dense takes, per
    metric, the faster (the CPU case: dense decodes faster without it, prefills faster with it), says which, and the
    indexer share compares with the dense row of the sparse row's own flash attention."""
    from dsa_convert.eval.bench_summary import add_indexer_share, add_ratios, ratios, render, write_plot

    base = {"ctx": 32768, "kv_bytes": 2**20, "kv_bytes_per_token": 64.0, "device": "cpu", "variant": None,
            "indexer_decode_ms_per_tok": None, "host_us_per_decode_token": None, "decode_tokens": 16}
    sparse = {**base, "attn": "sparse", "flash_attn": True, "decode_tok_s": 12.0, "prefill_tok_s": 60.0,
              "decode_s": 16 / 12.0, "prefill_s": 32768 / 60.0, "indexer_only_decode_s": None}
    fa_on = {**base, "attn": "dense", "flash_attn": True, "decode_tok_s": 1.0, "prefill_tok_s": 30.0,
             "decode_s": 16.0, "prefill_s": 32768 / 30.0}
    fa_off = {**base, "attn": "dense", "flash_attn": False, "decode_tok_s": 4.0, "prefill_tok_s": 20.0,
              "decode_s": 4.0, "prefill_s": 32768 / 20.0}
    rows = [sparse, fa_on, fa_off]
    (x,) = ratios(rows)
    assert x["decode"] == pytest.approx(3.0) and x["prefill"] == pytest.approx(2.0)
    assert x["dense_flash_attn"] == {"decode": False, "prefill": True}
    text = render(rows)
    assert "against the faster dense row per metric" in text
    assert "   32768  decode 3.00×  prefill 2.00×  (dense fa: decode off, prefill on)" in text
    assert "   32768  dense off" in text and "   32768  dense  on" in text
    add_ratios(rows)
    assert sparse["decode_vs_dense"] == 3.0 and sparse["vs_dense_flash_attn"] == {"decode": False, "prefill": True}
    add_indexer_share(rows)          # against the flash-attention dense row, like the sparse run
    assert sparse["indexer_share_decode_est"] == pytest.approx(1 - 16.0 / (16 / 12.0), rel=1e-3)
    single = [dict(sparse), dict(fa_on)]
    assert "dense fa:" not in render(single) and "per metric" not in render(single)
    png = write_plot(rows, tmp_path / "d.png", "mixed")            # one dense line per flash-attention setting
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_crossover_is_the_first_ctx_from_which_sparse_stays_ahead():
    """The CPU issue's summary: the shortest context from which on sparse decode (prefill) is at least dense's at every
    measured context; a dip at a longer context moves it there; None where sparse is behind at the longest; variant
    rows do not count. The JSON rows and the text table carry it."""
    from dsa_convert.eval.bench_summary import add_ratios, crossover, render

    def pair(ctx, dec_ratio, pre_ratio, variant=None):
        base = {"kv_bytes": 2**20, "kv_bytes_per_token": 64.0, "device": "cpu", "indexer_decode_ms_per_tok": None,
                "host_us_per_decode_token": None}
        return [{**base, "ctx": ctx, "attn": "sparse", "variant": variant, "decode_tok_s": 10.0 * dec_ratio,
                 "prefill_tok_s": 100.0 * pre_ratio},
                {**base, "ctx": ctx, "attn": "dense", "variant": None, "decode_tok_s": 10.0, "prefill_tok_s": 100.0}]
    rows = pair(4096, 0.9, 0.8) + pair(8192, 1.01, 0.9) + pair(16384, 1.5, 1.1) + pair(32768, 2.0, 1.3)
    assert crossover(rows) == 8192 and crossover(rows, "prefill") == 16384
    dip = pair(4096, 1.2, 1.0) + pair(8192, 0.95, 1.0) + pair(16384, 1.1, 1.0)
    assert crossover(dip) == 16384 and crossover(dip, "prefill") == 4096
    assert crossover(pair(4096, 1.2, 1.0) + pair(8192, 0.99, 1.0)) is None
    assert crossover(pair(4096, 0.5, 0.5) + [pair(8192, 2.0, 2.0, "LLAMA_DSA_GATHER=always")[0]]) is None
    text = render(rows)
    assert "crossover, decode: sparse ≥ dense from ctx 8192 on (measured up to 32768)" in text
    assert "crossover, prefill: sparse ≥ dense from ctx 16384 on" in text
    slow = pair(4096, 0.9, 0.9)
    assert "crossover, decode: sparse slower than dense at ctx 4096, the longest measured" in render(slow)
    add_ratios(rows)
    assert rows[0]["decode_crossover_ctx"] == 8192 and rows[0]["prefill_crossover_ctx"] == 16384
    assert "decode_crossover_ctx" not in rows[1]


def test_parse_host_timing_keeps_decode_and_prefill_lines_apart():
    from dsa_convert.eval import bench
    log = ("dsa_host_timing: n=4 graph_us=3.0 inputs_us=1.5 launch_us=80.2\n"
           "dsa_host_timing_prefill: n=3 wait_us=10.0 graph_us=250.5 inputs_us=40.0 launch_us=900.0\n")
    assert bench.parse_host_timing(log) == {"n": 4, "graph": 3.0, "inputs": 1.5, "launch": 80.2}
    assert bench.parse_host_timing_prefill(log) == {"n": 3, "wait": 10.0, "graph": 250.5, "inputs": 40.0,
                                                    "launch": 900.0}
    assert bench.parse_host_timing(log.splitlines()[1]) is None       # the prefill line is not a decode line
    assert bench.parse_host_timing_prefill(log.splitlines()[0]) is None


@requires_backend
def test_profile_prefill_reports_host_time_per_fill_ubatch(tiny):
    """scripts/bench/profile_decode.py --what prefill: the context is created with the patch's host timing, one record
    per multi-token ubatch (the fill's and the measured last one), read back from the log at context free."""
    script = REPO / "scripts" / "bench" / "profile_decode.py"
    r = subprocess.run([sys.executable, str(script), str(tiny), "--ctx", "512", "--batch", "128", "--what", "prefill",
                        "--attn", "sparse,dense"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert [x["attn"] for x in rows] == ["sparse", "dense"]
    for x in rows:
        host = x["host_us_per_fill_ubatch"]
        assert host["n"] == 4, host                      # (512 - 128) / 128 fill ubatches and the measured one
        assert host["graph"] > 0 and host["launch"] > 0 and host["wait"] >= 0 and host["inputs"] >= 0, host
        assert x["last_ubatch_ms"] > 0
