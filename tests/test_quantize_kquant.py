"""The project's own K-quant writer (quant/kq_search, kq_pack, gptq, kq_writer): packing bit-exact against gguf-py's
dequantizer, the weighted search against ggml's, GPTQ below round-to-nearest on the layer output, llama.cpp's
Q4_K_M type rules, bad input, and an end-to-end file llama.cpp loads."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from conftest import requires_backend
from test_convert_errors import assert_clean_failure, run_dsa
from test_quantize import calib_file, tiny_dsa, tiny_gguf  # noqa: F401  (module fixtures)

QT = gguf.GGMLQuantizationType
TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0]


def _weights(rows=24, n=512, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, n)) * rng.uniform(0.005, 2, (rows, 1))).astype(np.float32)
    w[1] = 0                                    # an all-zero row
    w[2, :32] = 0                               # an all-zero sub-block
    w[3] = np.abs(w[3])                         # no negative weight (min clamps to 0)
    w[4, 7] = 40.0                              # an outlier
    return w, rng.uniform(0.01, 10, n).astype(np.float32)


@pytest.mark.parametrize("qt", TYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_pack_is_what_gguf_dequantizes(qt, weighted):
    from dsa_convert.quant import kq_pack, kq_search

    w, imp = _weights()
    g = kq_search.fit(qt, w, imp if weighted else None)
    q = g.codes(w)
    b = kq_pack.pack(g, q)
    assert b.shape == (w.shape[0], kq_pack.row_bytes(qt, w.shape[1]))
    assert np.array_equal(gguf.quants.dequantize(b, qt), g.values(q))
    err = ((g.values(q) - w) ** 2).mean() / (w ** 2).mean()
    assert err < {QT.Q4_K: 0.02, QT.Q5_K: 0.005, QT.Q6_K: 0.002, QT.Q4_0: 0.02, QT.Q4_1: 0.02, QT.Q5_0: 0.01,
                  QT.Q5_1: 0.005, QT.Q8_0: 1e-4}[qt]


def test_pack_refuses_codes_off_the_grid():
    from dsa_convert.quant import kq_pack, kq_search

    w, _ = _weights()
    g = kq_search.fit(QT.Q4_K, w)
    q = g.codes(w)
    q[0, 0] = 16
    with pytest.raises(ValueError):
        kq_pack.pack(g, q)


def _ggml():
    from dsa_convert.quant import ggml_q
    if not ggml_q.available():
        pytest.skip("libggml-base.so not available")
    return ggml_q


@requires_backend
@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1])
def test_search_matches_ggml(qt):
    """The numpy search reproduces ggml's imatrix quantizer: (nearly) the same bytes, the same weighted error."""
    ggml_q = _ggml()
    from dsa_convert.quant import kq_pack, kq_search

    w, imp = _weights(rows=64)
    g = kq_search.fit(qt, w, imp)
    mine = kq_pack.pack(g, g.codes(w))
    ref = ggml_q.quantize(w, int(qt), imp)
    assert (mine == ref).mean() > 0.97
    e = [(((gguf.quants.dequantize(b, qt) - w) ** 2) * imp).sum() for b in (mine, ref)]
    assert abs(e[0] - e[1]) <= 0.01 * e[1]


@pytest.mark.parametrize("qt,act_order", [(QT.Q4_K, False), (QT.Q6_K, False), (QT.Q5_0, False), (QT.Q4_K, True)])
def test_gptq_beats_round_to_nearest_on_the_output(qt, act_order):
    from dsa_convert.quant import gptq, kq_pack, kq_search

    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    n, rows = 512, 64
    A = (rng.standard_normal((n, n)) * 0.3 + np.eye(n)).astype(np.float32)
    X = rng.standard_normal((2048, n)).astype(np.float32) @ A
    X[:, :4] *= 8
    w = (rng.standard_normal((rows, n)) * 0.05).astype(np.float32)
    H = torch.from_numpy(X.T @ X)
    imp = (X ** 2).mean(0)

    def out_err(wq):
        return float(((X @ (wq - w).T) ** 2).mean())
    g = kq_search.fit(qt, w, imp)
    rtn = out_err(g.values(g.codes(w)))
    g2, q2 = gptq.quantize(w, qt, H, imp, act_order=act_order)
    deq = gguf.quants.dequantize(kq_pack.pack(g2, q2), qt)
    assert out_err(deq) < 0.6 * rtn


def test_q4_k_m_types_follow_llama_cpp():
    from dsa_convert.quant.kq_writer import q4_k_m_type

    # 30 layers as SmolLM2-135M: rows of 576 fall back (Q4_K → Q5_0, Q6_K → Q8_0), 1536 do not
    assert q4_k_m_type("blk.5.attn_q.weight", 576, 30, True) == QT.Q5_0
    assert q4_k_m_type("blk.0.attn_v.weight", 576, 30, True) == QT.Q8_0       # use_more_bits(0)
    assert q4_k_m_type("blk.4.attn_v.weight", 576, 30, True) == QT.Q5_0       # not more bits
    assert q4_k_m_type("blk.0.ffn_down.weight", 1536, 30, True) == QT.Q6_K
    assert q4_k_m_type("blk.4.ffn_down.weight", 1536, 30, True) == QT.Q4_K
    assert q4_k_m_type("token_embd.weight", 576, 30, True) == QT.Q8_0         # tied: the head's type
    assert q4_k_m_type("token_embd.weight", 512, 6, True) == QT.Q6_K
    assert q4_k_m_type("token_embd.weight", 512, 6, False) == QT.Q4_K
    assert q4_k_m_type("output.weight", 512, 6, False) == QT.Q6_K
    assert q4_k_m_type("blk.0.attn_q.weight", 48, 6, False) == QT.F16          # not even a multiple of 32


def test_gptq_needs_a_k_quant_type(tiny_gguf, tmp_path, calib_file):  # noqa: F811
    out = tmp_path / "o.gguf"
    r = run_dsa("quantize", str(tiny_gguf), str(out), "--type", "q4_0", "--method", "gptq", "--calib",
                str(calib_file))
    assert_clean_failure(r, out, "--method gptq")


def test_gptq_needs_calibration(tiny_gguf, tmp_path):  # noqa: F811
    out = tmp_path / "o.gguf"
    r = run_dsa("quantize", str(tiny_gguf), str(out), "--type", "q4_k_m", "--method", "gptq")
    assert_clean_failure(r, out, "--calib")


@requires_backend
def test_gptq_file_loads_in_llama_cpp_and_keeps_dsa(tiny_dsa, calib_file, tmp_path):  # noqa: F811
    from dsa_convert.formats.gguf_read import GgufFile

    src, extra = tiny_dsa
    out = tmp_path / "g.gguf"
    r = run_dsa("quantize", str(src), str(out), "--type", "q4_k_m", "--method", "gptq", "--calib",
                str(calib_file), "--samples", "4", "--seq-len", "64", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["calib"]["samples"] == 4 and res["bits_per_weight"] > 4
    g, g_src = GgufFile(out), GgufFile(src)
    assert g.get("dsa.quant.method") == "gptq" and g.get("general.file_type") == 15
    for name in extra:                         # DSA tensors byte for byte
        assert np.array_equal(np.asarray(g.raw(name)), np.asarray(g_src.raw(name))), name
    # rows of 64: Q4_K falls back to Q5_0, the tied head to Q8_0, as llama-quantize does
    assert res["tensor_type_of"]["blk.0.ffn_up.weight"] == "Q5_0"
    assert res["tensor_type_of"]["token_embd.weight"] == "Q8_0"
    e = run_dsa("eval", str(out), "--ppl", str(calib_file), "--ctx", "64", "--chunks", "2", "--attn", "dense",
                "--kld-base", str(src), "--json")
    assert e.returncode == 0, e.stderr
    ev = json.loads(e.stdout)
    assert 0 < ev["kld_mean"] < 1 and ev["kld_base"] == str(src)


def test_unknown_gptq_types(tiny_gguf, tmp_path, calib_file):  # noqa: F811
    out = tmp_path / "o.gguf"
    r = run_dsa("quantize", str(tiny_gguf), str(out), "--type", "q4_k_m", "--method", "gptq", "--calib",
                str(calib_file), "--gptq-types", "q5")
    assert_clean_failure(r, out, "--gptq-types")


@requires_backend
def test_kld_base_scores_against_another_file(tiny_gguf, calib_file, tmp_path):  # noqa: F811
    """--kld-base: a byte copy of the file scores KLD 0 and the same top token everywhere; the file itself is
    refused in one line."""
    import shutil

    copy = tmp_path / "copy.gguf"
    shutil.copy(tiny_gguf, copy)
    e = run_dsa("eval", str(copy), "--ppl", str(calib_file), "--ctx", "64", "--chunks", "2", "--kld-base",
                str(tiny_gguf), "--json")
    assert e.returncode == 0, e.stderr
    ev = json.loads(e.stdout)
    assert ev["kld_mean"] == 0 and ev["same_top_p"] == 1 and ev["kld_tokens"] == ev["tokens"] == 2 * 31
    r = run_dsa("eval", str(copy), "--ppl", str(calib_file), "--ctx", "64", "--chunks", "2", "--kld-base", str(copy))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 3 and lines[-1].startswith("error: ") and "--kld-base" in lines[-1], r.stderr
