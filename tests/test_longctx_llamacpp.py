"""Long-context evaluation through the patched llama.cpp: `local` attention (sinks + window at the sparse budget,
kernels_ref's baseline), KL divergence from the dense F16 run, the greedy needle backend and llama-passkey."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, SHARED, WIKI_RAW, make_tiny_model, needs, requires_backend

TOPK, SINK, LOCAL = 48, 4, 12
REF32K = SHARED / "models" / "ref-llama-27m-32k"
PREFIX = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
          "I will quiz you about the important information there.")
JUNK = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@pytest.fixture(scope="module")
def tiny_dsa(tmp_path_factory):
    """(plain gguf, dsa gguf with a random indexer, HF model dir) of a tiny Llama."""
    from dsa_convert.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("longctx")
    model = make_tiny_model(root / "m", "llama-llama3rope-tied-sharded")
    plain, dsa = root / "plain.gguf", root / "dsa.gguf"
    convert(ConvertOptions(model, plain, outtype="f32", quiet=True))
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_test_dsa_gguf.py"), str(plain), str(dsa),
                    "--heads", "2", "--dim", "32", "--rope-dim", "16", "--top-k", str(TOPK), "--sink", str(SINK),
                    "--local", str(LOCAL)], check=True, capture_output=True)
    return plain, dsa, model


@pytest.fixture(scope="module")
def ref32k_gguf(tmp_path_factory):
    """The shared 32K-context model as a plain F16 GGUF (`dsa convert --no-dsa`)."""
    from dsa_convert.convert import ConvertOptions, convert

    out = tmp_path_factory.mktemp("ref32k") / "ref32k.gguf"
    convert(ConvertOptions(REF32K, out, outtype="f16", quiet=True))
    return out


@pytest.fixture(scope="module")
def wiki_slice(tmp_path_factory):
    p = tmp_path_factory.mktemp("wiki") / "wiki.txt"
    p.write_text(WIKI_RAW.read_text(encoding="utf-8")[:60000], encoding="utf-8")
    return p


def test_local_mode_overrides(tiny_dsa):
    from dsa_convert.errors import BadInputError
    from dsa_convert.eval.perplexity_llamacpp import dsa_overrides
    from dsa_convert.formats.gguf_read import GgufFile

    plain, dsa, _ = tiny_dsa
    g = GgufFile(dsa)
    try:
        ov, mode = dsa_overrides(g, "local", None)
        assert (ov["llama.dsa.sink"], ov["llama.dsa.local"]) == (SINK, TOPK - SINK)
        assert ov["llama.attention.indexer.top_k"] == TOPK
        assert mode["attn"] == "local" and (mode["sink"], mode["local"]) == (SINK, TOPK - SINK)
        ov, mode = dsa_overrides(g, "local", 6)             # a per-run top-k: the window is what the sinks leave
        assert (ov["llama.dsa.sink"], ov["llama.dsa.local"], mode["top_k"]) == (SINK, 6 - SINK, 6)
        with pytest.raises(BadInputError, match="no local window"):
            dsa_overrides(g, "local", SINK)
        ov, mode = dsa_overrides(g, "sparse", 10)           # top-k below sinks + window: the split shrinks (fit_split)
        assert (ov["llama.dsa.sink"], ov["llama.dsa.local"], mode["local"]) == (SINK, 10 - SINK, 10 - SINK)
        assert "llama.dsa.local" not in dsa_overrides(g, "sparse", 32)[0]
        with pytest.raises(BadInputError, match="--attn random"):
            dsa_overrides(g, "random", None)
    finally:
        g.close()
    g = GgufFile(plain)
    try:
        with pytest.raises(BadInputError, match="no DSA indexer"):
            dsa_overrides(g, "local", None)
    finally:
        g.close()


@requires_backend
def test_local_logits_match_kernels_ref_prefill_and_decode(tiny_dsa):
    from dsa_convert.backend.llama_runner import RunnerOptions, close_model, decode_rows, open_model
    from dsa_convert.eval.perplexity_llamacpp import dsa_overrides
    from dsa_convert.formats.gguf_read import GgufFile
    from dsa_convert.kernels_ref.model import RefModel
    from dsa_convert.kernels_ref.sparse_attention import DsaAttention

    plain, dsa, _ = tiny_dsa
    g = GgufFile(dsa)
    ov = dsa_overrides(g, "local", None, index_keys="f32")[0]
    g.close()
    toks = [int(t) for t in np.random.default_rng(1).integers(3, 320, size=160)]
    m = RefModel.from_gguf(dsa)
    ref = m.forward(torch.tensor(toks), attention=DsaAttention(scale=m.hp.kq_scale, attn="local", kv="f32",
                                                               top_k=TOPK, sink=SINK)).numpy()
    dense = m.forward(torch.tensor(toks)).numpy()
    scale = ref.max() - ref.min()
    assert np.abs(ref[TOPK:] - dense[TOPK:]).max() / scale > 1e-3          # the window really cuts attention
    for n_batch in (160, 4):         # one ubatch (masked) and 4-token ubatches (the decode path's gather)
        llm = open_model(dsa, RunnerOptions(n_ctx=256, n_batch=n_batch, kv_type="f32", kv_overrides=ov,
                                            logits_all=False))
        got = decode_rows(llm, toks, range(0, len(toks)))
        close_model(llm)
        assert np.abs(got - ref).max() / scale < 1e-4, n_batch


@requires_backend
@pytest.mark.skipif(not WIKI_RAW.is_file(), reason="WikiText-2 not present")
def test_local_ppl_matches_kernels_ref(tiny_dsa, wiki_slice):
    from dsa_convert.eval.perplexity_llamacpp import LlamaPplOptions, run
    from dsa_convert.eval.perplexity_torch import perplexity_torch

    _, dsa, model = tiny_dsa
    text = wiki_slice.read_text(encoding="utf-8")
    lc = run(dsa, text, LlamaPplOptions(ctx=256, chunks=3, attn="local", kv="f32", quiet=True))
    sparse = run(dsa, text, LlamaPplOptions(ctx=256, chunks=3, attn="sparse", kv="f32", quiet=True))
    th = perplexity_torch(dsa, wiki_slice, ctx=256, chunks=3, attn="local", kv="f32", tokenizer_dir=model)
    assert (lc["attn"], lc["top_k"], lc["sink"], lc["local"]) == ("local", TOPK, SINK, TOPK - SINK)
    assert lc["tokens"] == th["tokens"]
    assert abs(lc["ppl"] / th["ppl"] - 1) < 1e-3
    assert abs(lc["ppl"] / sparse["ppl"] - 1) > 1e-5          # no indexer picks: not the sparse run


@requires_backend
@pytest.mark.skipif(not WIKI_RAW.is_file(), reason="WikiText-2 not present")
def test_kld_dense_is_zero_sparse_is_not(tiny_dsa, wiki_slice):
    from dsa_convert.backend.llama_runner import RunnerOptions, close_model, eval_logits, open_model
    from dsa_convert.eval.perplexity_common import log_softmax64
    from dsa_convert.eval.perplexity_llamacpp import LlamaPplOptions, run

    _, dsa, _ = tiny_dsa
    text = wiki_slice.read_text(encoding="utf-8")
    dense = run(dsa, text, LlamaPplOptions(ctx=256, chunks=2, attn="dense", kld=True, quiet=True))
    assert dense["kld_base"] == "dense f16" and dense["kld_tokens"] == dense["tokens"] == 2 * 127
    assert dense["kld_mean"] == 0 and dense["same_top_p"] == 1 and dense["kld_max"] == 0   # the same run twice
    sparse = run(dsa, text, LlamaPplOptions(ctx=256, chunks=2, attn="sparse", kld=True, quiet=True))
    assert sparse["kld_mean"] > 1e-5 and 0 < sparse["same_top_p"] <= 1
    # the base run's own PPL on the same tokens: the dense run's
    assert dense["ppl_base"] == dense["ppl"] and sparse["ppl_base"] == dense["ppl"]
    assert abs(sparse["ppl_vs_base_pct"] - 100 * (sparse["ppl"] / dense["ppl"] - 1)) < 1e-9
    plain_run = run(dsa, text, LlamaPplOptions(ctx=256, chunks=2, attn="sparse", quiet=True))
    assert plain_run["ppl"] == sparse["ppl"] and "kld_mean" not in plain_run
    # the same figure from whole-chunk logits of two separate contexts (logits_all), KL(p_dense || p_sparse)
    one = run(dsa, text, LlamaPplOptions(ctx=256, chunks=1, attn="sparse", kld=True, quiet=True))
    a = open_model(dsa, RunnerOptions(n_ctx=256, kv_overrides={"llama.attention.indexer.top_k": 0}))
    b = open_model(dsa, RunnerOptions(n_ctx=256, kv_overrides={"llama.dsa.indexer.key_f16": True}))
    toks = a.tokenize(text.encode(), add_bos=True, special=False)[:256]
    toks[0] = a.token_bos()
    lb, lq = (log_softmax64(eval_logits(x, toks)[128:255]) for x in (a, b))
    close_model(a)
    close_model(b)
    kl = (np.exp(lb) * (lb - lq)).sum(-1)
    assert abs(one["kld_mean"] / kl.mean() - 1) < 1e-6


def _plain_greedy(path: Path, overrides: dict, prompt: list[int], max_new: int, n_batch: int) -> list[int]:
    """Reference loop: llama-cpp-python's own eval + its logits_all score table, argmax per step, the needle
    backend's stopping rule (EOS excluded, a newline token included)."""
    from dsa_convert.backend.llama_runner import RunnerOptions, close_model, open_model

    llm = open_model(path, RunnerOptions(n_ctx=256, n_batch=n_batch, kv_type="f16", flash_attn=True,
                                         kv_overrides=overrides))
    llm.eval(prompt)
    out: list[int] = []
    while len(out) < max_new:
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if tok == llm.token_eos():
            break
        out.append(tok)
        if b"\n" in llm.detokenize([tok]):
            break
        llm.eval([tok])
    close_model(llm)
    return out


@requires_backend
@pytest.mark.parametrize("attn", ["sparse", "local", "dense"])
def test_needle_backend_generates_like_a_plain_greedy_loop(tiny_dsa, attn):
    from dsa_convert.eval.needle_llamacpp import LlamaNeedleBackend
    from dsa_convert.eval.perplexity_llamacpp import dsa_overrides
    from dsa_convert.formats.gguf_read import GgufFile

    _, dsa, _ = tiny_dsa
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 320, size=150)]   # > top-k: selection matters
    with LlamaNeedleBackend(dsa, n_ctx=256, attn=attn, n_batch=64) as be:
        assert (be.name, be.n_ctx_train, be.eos_id) == ("llama.cpp", 512, 1) and be.mode["attn"] == attn
        assert be.tokenize("The quick")[0] == be.bos_id == 0      # the tiny vocab adds BOS
        got = be.generate(prompt, 40)
        again = be.generate(prompt, 40)                 # a fresh sequence each time
        head = be.detokenize(got[:-1])                  # generation stops at the first token with a newline
    g = GgufFile(dsa)
    ov = dsa_overrides(g, attn, None)[0]
    g.close()
    ov["llama.dsa.asq.cache"] = False
    assert got == again == _plain_greedy(dsa, ov, prompt, 40, 64)
    assert got and "\n" not in head


@requires_backend
@needs(REF32K)
def test_needle_backend_finds_a_passkey_in_3k_tokens(ref32k_gguf):
    from dsa_convert.errors import BadInputError
    from dsa_convert.eval.needle_llamacpp import LlamaNeedleBackend

    needle = " The pass key is 48213. Remember it. 48213 is the pass key."
    prompt = PREFIX + JUNK * 40 + needle + JUNK * 80 + " What is the pass key? The pass key is"
    with LlamaNeedleBackend(ref32k_gguf, n_ctx=4096, attn=None) as be:
        assert be.n_ctx_train == 32768 and be.mode["attn"] == "dense"
        toks = be.tokenize(prompt)
        assert toks[0] == be.bos_id == 0 and toks[1] != be.bos_id   # BOS once, first: the model's training samples
        assert 2500 < len(toks) < 4000
        answer = be.detokenize(be.generate(toks, 6))
        assert answer.startswith(" 48213"), answer
        with pytest.raises(BadInputError, match="exceeds the context"):
            be.generate(toks + toks, 4)


@requires_backend
@needs(REF32K)
def test_llama_passkey_script_dense_and_sparse(ref32k_gguf, tiny_dsa):
    script = str(REPO / "scripts" / "passkey.sh")
    r = subprocess.run(["bash", script, str(ref32k_gguf), "1024", "dense", "--pos", "10", "-t", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    key = re.search(r"passkey = (\d+), inserted at position 10 /", r.stdout)
    n = re.search(r"prompt tokens: (\d+)", r.stdout)
    assert key and n and 950 <= int(n.group(1)) <= 1024, r.stdout
    assert re.search(rf"^answer: {key.group(1)}\b", r.stdout, re.M), r.stdout
    _, dsa, _ = tiny_dsa
    for mode, line in (("sparse", f"top-k={TOPK}, sinks={SINK}, local={LOCAL}"),
                       ("local", f"top-k={TOPK}, sinks={SINK}, local={TOPK - SINK}")):
        r = subprocess.run(["bash", script, str(dsa), "400", mode, "-t", "2"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert f"sparse attention: {line}" in r.stdout and re.search(r"^answer:", r.stdout, re.M), r.stdout
    r = subprocess.run(["bash", script, str(dsa), "100000", "sparse"], capture_output=True, text=True)
    assert r.returncode == 3 and r.stderr.strip().startswith("error: LENGTH 100000 exceeds the trained context")
