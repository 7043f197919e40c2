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


def test_mix_needs_a_k_quant_type(tiny_gguf, tmp_path, calib_file):  # noqa: F811
    # gptq / search write q4_0 / q4_1 too (9cf90e6); the per-tensor type mix is q4_k_m's only
    out = tmp_path / "o.gguf"
    r = run_dsa("quantize", str(tiny_gguf), str(out), "--type", "q4_0", "--method", "mix", "--calib",
                str(calib_file))
    assert_clean_failure(r, out, "--method mix")


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


# ---------------------------------------------------------------- --method mix (kq_alloc)
def _slot(name, pts, ref=QT.Q4_K):
    from dsa_convert.quant.kq_alloc import Cand, Slot

    s = Slot(name, (8, 256), ref, [Cand(qt, b, e, "search") for qt, b, e in pts])
    s.set_gain(1.0)
    return s


def test_allocator_obeys_the_budget_and_buys_the_larger_error_drop():
    from dsa_convert.quant.kq_alloc import allocate

    # a: Q4_K → Q6_K costs 50 B and removes 9; b: the same 50 B remove only 1; Q5_K is dominated in a
    a = _slot("a", [(QT.Q4_K, 100, 10.0), (QT.Q5_K, 120, 9.9), (QT.Q6_K, 150, 1.0), (QT.Q8_0, 200, 0.5)])
    b = _slot("b", [(QT.Q4_K, 100, 2.0), (QT.Q6_K, 150, 1.0), (QT.Q8_0, 200, 0.9)])
    pick = allocate([a, b], 250)
    assert (pick["a"].qtype, pick["b"].qtype) == (QT.Q6_K, QT.Q4_K)
    pick = allocate([a, b], 200)                                 # the smallest mix
    assert (pick["a"].qtype, pick["b"].qtype) == (QT.Q4_K, QT.Q4_K)
    rng = np.random.default_rng(0)
    for _ in range(50):                                          # random slots: never over the budget
        slots = []
        for i in range(6):
            b0 = int(rng.integers(50, 200))
            steps = np.sort(rng.uniform(0, 3, 4))[::-1]
            pts = [(qt, b0 + 40 * k + int(rng.integers(0, 30)), float(steps[k])) for k, qt in enumerate(
                (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0))]
            slots.append(_slot(f"t{i}", pts))
        lo = sum(min(c.nbytes for c in s.cands) for s in slots)
        budget = lo + int(rng.integers(0, 600))
        pick = allocate(slots, budget)
        assert sum(c.nbytes for c in pick.values()) <= budget
        rich = allocate(slots, 10 ** 9)                           # no limit: every slot its least error
        assert all(rich[s.name].err == min(c.err for c in s.cands) for s in slots)


def test_allocator_refuses_a_budget_below_the_smallest_mix():
    from dsa_convert.errors import BadInputError
    from dsa_convert.quant.kq_alloc import allocate

    a = _slot("a", [(QT.Q4_K, 100, 10.0), (QT.Q6_K, 150, 1.0)])
    with pytest.raises(BadInputError, match="below the smallest"):
        allocate([a], 99)


def test_candidates_and_budget_parsing():
    from dsa_convert.errors import BadInputError
    from dsa_convert.quant.kq_alloc import candidates, parse_budget

    assert candidates(1536) == (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0)
    assert candidates(576) == (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0)
    assert parse_budget("105000000") == ("bytes", 105e6) and parse_budget("96MiB") == ("bytes", 96 * 2 ** 20)
    assert parse_budget("4.9bpw") == ("bpw", 4.9) and parse_budget("100MB") == ("bytes", 1e8)
    for bad in ("lots", "-3", "0bpw", "40bpw"):
        with pytest.raises(BadInputError):
            parse_budget(bad)


def test_mix_budget_below_the_smallest_mix_is_refused(tiny_gguf, tmp_path, calib_file):  # noqa: F811
    out = tmp_path / "o.gguf"
    r = run_dsa("quantize", str(tiny_gguf), str(out), "--type", "q4_k_m", "--method", "mix", "--calib",
                str(calib_file), "--size-budget", "2bpw")
    assert_clean_failure(r, out, "below the smallest mix")
    r = run_dsa("quantize", str(tiny_gguf), str(out), "--type", "q4_k_m", "--method", "mix", "--calib",
                str(calib_file), "--size-budget", "much")
    assert_clean_failure(r, out, "--size-budget")
    r = run_dsa("quantize", str(tiny_gguf), str(out), "--type", "q4_k_m", "--method", "gptq", "--calib",
                str(calib_file), "--size-budget", "5bpw")
    assert_clean_failure(r, out, "--size-budget applies to --method mix")


def test_mix_refuses_unknown_type_and_quantized_input(tiny_gguf, tmp_path, calib_file):  # noqa: F811
    out = tmp_path / "o.gguf"
    r = run_dsa("quantize", str(tiny_gguf), str(out), "--type", "q4_x", "--method", "mix", "--calib", str(calib_file))
    assert_clean_failure(r, out, "unknown --type")
    q = tmp_path / "q.gguf"
    assert run_dsa("quantize", str(tiny_gguf), str(q), "--method", "rtn", "--group-size", "32").returncode == 0
    r = run_dsa("quantize", str(q), str(out), "--type", "q4_k_m", "--method", "mix", "--calib", str(calib_file))
    assert_clean_failure(r, out, "already quantized")


@requires_backend
def test_mix_file_within_budget_loads_and_keeps_dsa(tiny_dsa, calib_file, tmp_path):  # noqa: F811
    from dsa_convert.formats.gguf_read import GgufFile

    src, extra = tiny_dsa
    res = {}
    for budget in (None, "more"):
        out = tmp_path / f"m-{budget}.gguf"
        args = ["--size-budget", str(res[None]["mix"]["budget_bytes"] + 4000)] if budget else []
        r = run_dsa("quantize", str(src), str(out), "--type", "q4_k_m", "--method", "mix", "--calib",
                    str(calib_file), "--samples", "4", "--seq-len", "64", "--json", *args)
        assert r.returncode == 0, r.stderr
        res[budget] = rep = json.loads(r.stdout)
        mix = rep["mix"]
        assert mix["data_bytes"] <= mix["budget_bytes"]
        assert mix["est_kld_total"] <= mix["est_kld_total_llama_types"] + 1e-12
        assert not list(tmp_path.glob("*.candidates"))            # the candidates' folder is gone
        g, g_src = GgufFile(out), GgufFile(src)
        assert sum(t.n_bytes for t in g.tensors.values()) == mix["data_bytes"]
        for name in extra:                                        # DSA tensors byte for byte
            assert np.array_equal(np.asarray(g.raw(name)), np.asarray(g_src.raw(name))), name
        for name, t in mix["tensors"].items():                    # rows of 64: the 32-weight types only
            assert t["type"] in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") and rep["tensor_type_of"][name] == t["type"]
    assert res[None]["mix"]["budget_bytes"] == res[None]["mix"]["llama_q4_k_m_bytes"]
    assert res["more"]["mix"]["data_bytes"] > res[None]["mix"]["data_bytes"]
    assert res["more"]["mix"]["est_kld_total"] < res[None]["mix"]["est_kld_total"]
    out = tmp_path / "m-None.gguf"
    e = run_dsa("eval", str(out), "--ppl", str(calib_file), "--ctx", "64", "--chunks", "2", "--attn", "dense",
                "--kld-base", str(src), "--json")
    assert e.returncode == 0, e.stderr
    assert 0 <= json.loads(e.stdout)["kld_mean"] < 1
