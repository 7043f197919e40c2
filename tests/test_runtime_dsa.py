"""The patched llama.cpp runs a `dsa convert` DSA GGUF sparse (matching kernels_ref) and dense
(matching the plain file), switchable per run; CI builds that backend and runs this."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import CALIB, WIKI_RAW, dsa_eval_json, make_tiny_model, requires_backend

TOPK, SINK, LOCAL = 48, 4, 12


def _calib_file(tmp: Path) -> Path:
    if CALIB.is_file():
        return CALIB
    import random  # no shared data: plain filler text is enough to exercise the path

    rng = random.Random(0)
    words = "the of and to in a is that was he for it with as his on be at by had not are but from".split()
    p = tmp / "calib.txt"
    p.write_text("\n".join(" ".join(rng.choice(words) for _ in range(50)) for _ in range(3000)))
    return p


@pytest.fixture(scope="module")
def dsa_pair(tmp_path_factory):
    """(plain gguf, dsa gguf, model dir) for a tiny Llama, retrofitted with a short real training run."""
    from dsa_convert.convert import ConvertOptions, convert
    from dsa_convert.dsa.config import DsaConfig

    root = tmp_path_factory.mktemp("rt")
    model = make_tiny_model(root / "m", "llama-llama3rope-tied-sharded")
    plain, dsa = root / "plain.gguf", root / "dsa.gguf"
    convert(ConvertOptions(model, plain, outtype="f32", quiet=True))
    cfg = DsaConfig(top_k=TOPK, sink=SINK, local=LOCAL, index_heads=2, index_dim=32, rope_dim=16, cluster_num=8,
                    calib=_calib_file(root), ctx=256, calib_chunks=4, split_chunks=1, steps=20, seed=0, asq_samples=2048,
                    device="cpu").validate()
    res = convert(ConvertOptions(model, dsa, outtype="f32", quiet=True, dsa=cfg))
    assert res["dsa"]
    return plain, dsa, model


@requires_backend
def test_sparse_matches_kernels_ref_and_dense_override_matches_plain(dsa_pair):
    from dsa_convert.backend.llama_runner import RunnerOptions, eval_logits, open_model
    from dsa_convert.eval.perplexity_torch import DsaAttention, dsa_settings_from_gguf
    from dsa_convert.kernels_ref.model import RefModel

    plain, dsa, model = dsa_pair
    toks = list(np.random.default_rng(0).integers(3, 320, size=200))
    dense_plain = eval_logits(open_model(plain, RunnerOptions(n_ctx=256, kv_type="f32")), toks)
    dense_ovr = eval_logits(open_model(dsa, RunnerOptions(n_ctx=256, kv_type="f32",
                                                          kv_overrides={"llama.attention.indexer.top_k": 0})), toks)
    assert np.array_equal(dense_plain, dense_ovr)          # per-run dense switch == the plain file, bit for bit
    sparse = eval_logits(open_model(dsa, RunnerOptions(n_ctx=256, kv_type="f32")), toks)
    m = RefModel.from_gguf(dsa)
    st = dsa_settings_from_gguf(m)
    hook = DsaAttention(scale=m.hp.kq_scale, attn="sparse", kv="f32", top_k=st["top_k"], sink=st["sink"],
                        local=st["local"], select="token", block_size=st["block_size"], indexers=st["indexers"],
                        asq_protos=None, residual_bits=4, key_space="pre_rope", rope_keys=m.rope_keys, seed=0)
    ref = m.forward(torch.tensor(toks), attention=hook).numpy()
    rng = ref.max() - ref.min()
    assert np.abs(sparse - ref).max() / rng < 1e-4
    # proof that sparse really ran: the selection changes the logits far beyond fp noise
    assert np.abs(sparse - dense_plain).max() / rng > 1e-2
    # rows that attend densely (t + 1 <= top_k) are untouched by sparsity
    assert np.abs(sparse[:TOPK] - dense_plain[:TOPK]).max() / rng < 1e-5


@requires_backend
def test_load_log_line_names_the_mode(dsa_pair):
    plain, dsa, _ = dsa_pair
    code = ("import sys, llama_cpp; llama_cpp.Llama(sys.argv[1], n_ctx=128, verbose=True, "
            "kv_overrides=({'llama.attention.indexer.top_k': int(sys.argv[2])} if sys.argv[2] != '-' else None))")
    r = subprocess.run([sys.executable, "-c", code, str(dsa), "-"], capture_output=True, text=True)
    assert f"sparse attention: top-k={TOPK}, sinks={SINK}, local={LOCAL}, select=token" in r.stderr
    r = subprocess.run([sys.executable, "-c", code, str(dsa), "0"], capture_output=True, text=True)
    assert "sparse attention: off (dense override)" in r.stderr
    r = subprocess.run([sys.executable, "-c", code, str(plain), "-"], capture_output=True, text=True)
    assert r.returncode == 0 and "sparse attention" not in r.stderr


@requires_backend
@pytest.mark.skipif(not WIKI_RAW.is_file(), reason="WikiText-2 not present")
def test_ppl_llamacpp_vs_torch_sparse_and_dense(dsa_pair):
    plain, dsa, model = dsa_pair
    common = ["--ppl", "wikitext2", "--ctx", "256", "--chunks", "3"]
    lc_sparse = dsa_eval_json(str(dsa), *common, "--kv", "f32")
    lc_dense = dsa_eval_json(str(dsa), *common, "--kv", "f32", "--attn", "dense")
    plain_dense = dsa_eval_json(str(plain), *common, "--kv", "f32")
    th_sparse = dsa_eval_json(str(dsa), *common, "--backend", "torch", "--attn", "sparse", "--kv", "f32")
    assert lc_sparse["attn"] == "sparse" and lc_sparse["top_k"] == TOPK
    assert abs(lc_sparse["ppl"] / th_sparse["ppl"] - 1) < 0.005
    assert abs(lc_dense["ppl"] / plain_dense["ppl"] - 1) < 0.001
    assert abs(lc_sparse["ppl"] / lc_dense["ppl"] - 1) > 0.001      # sparse is measurably not dense
    k16 = dsa_eval_json(str(dsa), *common, "--kv", "f32", "--top-k", "16")    # per-run top-k override
    assert k16["top_k"] == 16 and k16["ppl"] != lc_sparse["ppl"]
    assert "warning:" not in subprocess.run([sys.executable, "-m", "dsa_convert.cli", "eval", str(dsa), *common,
                                             "--top-k", "17"], capture_output=True, text=True).stderr
    # a per-run top-k within the file's sinks + window leaves no indexer pick: the run says it is local attention
    r = subprocess.run([sys.executable, "-m", "dsa_convert.cli", "eval", str(dsa), *common, "--top-k", str(SINK + LOCAL)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "no key is picked by the indexer" in r.stderr, r.stderr
