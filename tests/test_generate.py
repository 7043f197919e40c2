"""`dsa run` and `dsa serve` on a tiny DSA GGUF: the checks before anything loads (one-line errors, no server left),
the server's command line, and through the patched llama.cpp a completion, the OpenAI-compatible server with
concurrent requests, greedy output equal between the two and to dense attention where every key is selected."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, make_tiny_model, requires_backend

TOPK, SINK, LOCAL = 48, 4, 12
PROMPT = "The quick brown fox jumps over the lazy dog"      # fewer tokens than TOPK: sparse selects every key


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(plain gguf, dsa gguf with a random indexer) of a tiny Llama (trained context 512)."""
    from dsa_convert.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("gen")
    plain, dsa = root / "plain.gguf", root / "dsa.gguf"
    convert(ConvertOptions(make_tiny_model(root / "m", "llama-llama3rope-tied-sharded"), plain, outtype="f32",
                           quiet=True))
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_test_dsa_gguf.py"), str(plain), str(dsa),
                    "--heads", "2", "--dim", "32", "--rope-dim", "16", "--top-k", str(TOPK), "--sink", str(SINK),
                    "--local", str(LOCAL)], check=True, capture_output=True)
    return plain, dsa


def dsa(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsa_convert.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers_on(port: int) -> list[int]:
    """pids of llama-server processes started with this port."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"llama-server") and str(port).encode() in argv:
            out.append(int(d.name))
    return out


def one_line_error(r: subprocess.CompletedProcess, code: int = 3) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


# ---- checks before anything loads (no backend needed) -----------------------------------------------------------
def test_session_plan_and_server_argv(files):
    from dsa_convert.generate.server import ServeOptions, override_arg, server_argv
    from dsa_convert.generate.session import SessionOptions, plan_session

    plain, dsa_file = files
    p = plan_session(dsa_file, SessionOptions())
    assert (p.n_ctx, p.n_ctx_train, p.kv, p.mode["attn"], p.n_gpu_layers) == (512, 512, "f16", "sparse", 0)
    assert p.overrides["llama.dsa.asq.cache"] is False and p.overrides["llama.dsa.indexer.key_f16"] is True
    d = plan_session(dsa_file, SessionOptions(ctx=256, attn="dense", n_gpu_layers=3))
    assert (d.n_ctx, d.mode["attn"], d.overrides["llama.attention.indexer.top_k"], d.n_gpu_layers) == (256, "dense", 0, 3)
    assert plan_session(plain, SessionOptions()).overrides == {}                     # a stock file: nothing to switch
    assert override_arg({"a.b": True, "c": 0, "d": 0.5, "e": "token"}) == [
        "--override-kv", "a.b=bool:true,c=int:0,d=float:0.5,e=str:token"]
    argv = server_argv("llama-server", d, ServeOptions(port=9000, parallel=4, threads=2))
    assert argv[:7] == ["llama-server", "-m", str(dsa_file), "--host", "127.0.0.1", "--port", "9000"]
    i = argv.index("-c")
    assert argv[i + 1:i + 4] == ["1024", "-np", "4"]                                # 256 per slot
    assert "llama.attention.indexer.top_k=int:0" in argv[argv.index("--override-kv") + 1]
    assert argv[argv.index("-ctk") + 1] == argv[argv.index("-ctv") + 1] == "f16"
    assert argv[argv.index("-ngl") + 1] == "3" and "-lv" not in argv


def test_bad_input_is_one_line_and_leaves_no_server(files, tmp_path):
    plain, dsa_file = files
    notgguf = tmp_path / "x.gguf"
    notgguf.write_text("not a gguf")
    port = free_port()
    cases = [
        (("serve", str(tmp_path / "missing.gguf"), "--port", str(port)), "not found"),
        (("serve", str(notgguf), "--port", str(port)), "GGUF"),
        (("serve", str(dsa_file), "--ctx", "100000", "--port", str(port)), "beyond"),
        (("serve", str(dsa_file), "--kv", "asq", "--port", str(port)), "no ASQ prototypes"),
        (("serve", str(dsa_file), "--kv", "q5_1", "--port", str(port)), "unknown --kv"),
        (("serve", str(dsa_file), "--attn", "sparse", "--port", "70000"), "--port"),
        (("serve", str(plain), "--attn", "sparse", "--port", str(port)), "no DSA indexer"),
        (("run", str(dsa_file)), "-p TEXT or -f FILE"),
        (("run", str(dsa_file), "-f", str(tmp_path / "nope.txt")), "cannot read"),
        (("run", str(dsa_file), "-p", "hi", "-n", "0"), "--n-predict"),
        (("run", str(dsa_file), "-p", "hi", "-t", "0"), "--threads must be >= 1 (got 0)"),
        (("serve", str(dsa_file), "--threads", "-2", "--port", str(port)), "--threads must be >= 1 (got -2)"),
        (("run", str(tmp_path / "missing.gguf"), "-p", "hi"), "not found"),
    ]
    for args, needle in cases:
        assert needle in one_line_error(dsa(*args)), args
    with socket.socket() as busy:                      # something already listens on the port
        busy.bind(("127.0.0.1", port))
        busy.listen(1)
        assert "in use" in one_line_error(dsa("serve", str(dsa_file), "--port", str(port)))
    assert servers_on(port) == []


# ---- through the patched llama.cpp --------------------------------------------------------------------------------
def run_json(path: Path, *args: str) -> dict:
    r = dsa("run", str(path), "-p", PROMPT, "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@requires_backend
def test_run_streams_and_reports(files):
    _, dsa_file = files
    r = dsa("run", str(dsa_file), "-p", PROMPT, "-n", "8", "--temp", "0", "--ctx", "256")
    assert r.returncode == 0, r.stderr
    footer = r.stderr.strip().splitlines()[-1]
    assert footer.startswith("prompt ") and "tok/s" in footer and "attention sparse (top-k=48" in footer
    assert "B/token" in footer and "ctx 256" in footer
    j = run_json(dsa_file, "-n", "8", "--temp", "0", "--ctx", "256")
    assert j["text"] == r.stdout                       # the stream is the text, nothing else on stdout
    assert j["attn"] == "sparse" and j["attention"].startswith("sparse (top-k=48, sinks=4, local=12")
    assert 0 < j["generated_tokens"] <= 8 and j["prompt_tokens"] < TOPK and j["gen_tps"] > 0
    assert j["kv_bytes_per_token"] > 0 and j["finish_reason"] in ("length", "stop")
    # every key selected (prompt + answer shorter than top-k): sparse generates what dense generates
    dense = run_json(dsa_file, "-n", "8", "--temp", "0", "--ctx", "256", "--attn", "dense")
    assert dense["attention"] == "dense (override)" and dense["text"] == j["text"]
    # a seed fixes a sampled completion
    a, b = (run_json(dsa_file, "-n", "8", "--temp", "1.0", "--seed", "7", "--ctx", "256") for _ in range(2))
    assert a["text"] == b["text"] and a["seed"] == 7


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@requires_backend
def test_serve_answers_openai_requests_and_stops(files, tmp_path):
    _, dsa_file = files
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    p = subprocess.Popen([sys.executable, "-m", "dsa_convert.cli", "serve", str(dsa_file), "--port", str(port),
                          "--parallel", "4", "--ctx", "256", "--threads", "2", "--verbose"], stdout=subprocess.PIPE, stderr=log,
                         text=True)
    try:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)
        reader.start()
        reader.join(240)
        assert box and box[0].strip() == f"http://127.0.0.1:{port}/v1", (box, (tmp_path / "serve.log").read_text())
        base = box[0].strip()
        with urllib.request.urlopen(base + "/models", timeout=30) as r:
            models = json.loads(r.read())
        assert models["data"] and models["data"][0]["id"]
        out = post(base + "/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        text = out["choices"][0]["text"]
        expected = run_json(dsa_file, "-n", "8", "--temp", "0", "--ctx", "256")["text"]
        assert text == expected
        results: list = [None] * 4

        def ask(i):
            results[i] = post(base + "/completions", {"prompt": f"{PROMPT} {i}", "max_tokens": 16, "temperature": 0})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert all(r is not None and r["choices"][0]["finish_reason"] in ("length", "stop") for r in results)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    log.seek(0)
    text = log.read()
    assert "sparse attention: top-k=48" in text and "serves dsa.gguf" in text
    deadline = time.time() + 10
    while servers_on(port) and time.time() < deadline:
        time.sleep(0.2)
    assert servers_on(port) == [], "llama-server left running"
