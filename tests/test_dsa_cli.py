"""`dsa convert` with the DSA retrofit: the written GGUF round-trips (same sparse PPL from the file as
from the in-memory result) and bad DSA options/inputs fail cleanly with no OUT file."""
from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from conftest import WIKI_RAW, make_tiny_model, wiki_passage
from test_convert_errors import assert_clean_failure, run_dsa


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("dsacli") / "m", "qwen3-qknorm-headdim")


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text(("Calibration prose, not the evaluation text. " * 40 + "\n") * 400)
    return p


def test_gguf_roundtrip_same_sparse_ppl(model, calib, tmp_path):
    from dsa_convert.convert import ConvertOptions, convert
    from dsa_convert.dsa.config import DsaConfig
    from dsa_convert.dsa.retrofit import run_retrofit
    from dsa_convert.eval.perplexity_torch import perplexity_torch
    from dsa_convert.inspect_gguf import summarize

    cfg = dict(top_k=24, calib=calib, ctx=96, calib_chunks=3, split_chunks=1, steps=6, sparse_steps=3, query_rows=32,
               index_heads=2, index_dim=16, rope_dim=8, cluster_num=4, asq_samples=256, seed=3)
    out = tmp_path / "dsa.gguf"
    convert(ConvertOptions(model, out, outtype="f32", quiet=True, dsa=DsaConfig(**cfg).validate()))
    mem = run_retrofit(model, DsaConfig(**cfg).validate())          # same seed -> same result, kept in memory
    s = summarize(out)
    names = {t["name"] for t in s["tensors"]}
    assert set(mem.tensors) <= names                                  # every indexer / ASQ tensor is listed
    arch = s["architecture"]
    for key in mem.kv:                                                # and every DSA key
        assert key[len(arch) + 1:] in s["dsa"], key
    text = tmp_path / "eval.txt"
    text.write_text(wiki_passage(30000))
    for attn, kv in (("sparse", "f32"), ("sparse", "asq")):
        a = perplexity_torch(out, text, ctx=96, chunks=3, attn=attn, kv=kv, tokenizer_dir=model)
        b = perplexity_torch(model, text, ctx=96, chunks=3, attn=attn, kv=kv, dsa=mem)
        assert math.isfinite(a["ppl"]) and abs(a["ppl"] / b["ppl"] - 1) < 1e-5, (attn, kv, a["ppl"], b["ppl"])


@pytest.mark.parametrize("args,needle", [
    (["--top-k", "0"], "top-k"),
    (["--top-k", "100000"], "top-k"),
    (["--cluster-num", "1"], "cluster-num"),
    (["--top-k", "32", "--sink", "20", "--local", "20"], "exceeds"),
    (["--index-share", "2", "--index-place", "random"], "index-place"),
])
def test_bad_dsa_options(model, calib, tmp_path, args, needle):
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out), "--calib", str(calib), "--steps", "2", *args),
                         out, needle)


def test_calib_missing(model, tmp_path):
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out), "--cluster-num", "8", "--calib",
                                 str(tmp_path / "nope.txt")), out, "calibration file not found")


def test_calib_too_short(model, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out), "--cluster-num", "8", "--top-k", "64", "--calib",
                                 str(short)), out, "is too short")


@pytest.mark.skipif(not WIKI_RAW.is_file(), reason="WikiText-2 not present")
def test_calib_identical_to_eval_text_refused(model, tmp_path):
    same = tmp_path / "calib.txt"
    shutil.copy(WIKI_RAW, same)
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("convert", str(model), str(out), "--cluster-num", "8", "--calib", str(same)),
                         out, "is the evaluation text")
