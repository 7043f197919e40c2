"""`dsa quantize`: fake-quant math vs ggml, bad input (one line, exit 3, no OUT), AWQ < RTN error on
calibration data for a tiny model, DSA tensors/keys surviving Q4_0 and K-quant output."""
from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import CALIB, make_tiny_model, requires_backend, wiki_passage

EXIT_BAD_INPUT = 3
QT = gguf.GGMLQuantizationType
needs_backend = requires_backend   # marked `backend`: runs after the backend build in scripts/test.sh
from test_convert_errors import assert_clean_failure, run_dsa  # noqa: E402  (one copy of the CLI-failure checks)


def add_fake_dsa(src: Path, dst: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Copy a GGUF and add DSA keys + random blk.N.indexer.* / blk.N.dsa.* tensors (FORMAT.md §2–3)."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vt = gguf.GGUFValueType(f.types[0])
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), vt, sub_type=gguf.GGUFValueType(f.types[1]))
        else:
            w.add_key_value(key, f.contents(), vt)
    w.add_uint32(f"{arch}.attention.indexer.head_count", 2)
    w.add_uint32(f"{arch}.attention.indexer.key_length", 32)
    w.add_uint32(f"{arch}.attention.indexer.top_k", 16)
    w.add_uint32(f"{arch}.dsa.version", 1)
    w.add_uint32(f"{arch}.dsa.sink", 2)
    w.add_uint32(f"{arch}.dsa.local", 4)
    w.add_string(f"{arch}.dsa.select", "token")
    rng = np.random.default_rng(seed)
    n_embd = int(r.fields[f"{arch}.embedding_length"].contents())
    n_layer = int(r.fields[f"{arch}.block_count"].contents())
    extra: dict[str, np.ndarray] = {}
    for il in range(n_layer):
        extra[f"blk.{il}.indexer.attn_q_b.weight"] = rng.standard_normal((64, n_embd)).astype(np.float16)
        extra[f"blk.{il}.indexer.attn_k.weight"] = rng.standard_normal((32, n_embd)).astype(np.float16)
        extra[f"blk.{il}.indexer.k_norm.weight"] = rng.standard_normal(32).astype(np.float32)
        extra[f"blk.{il}.indexer.k_norm.bias"] = rng.standard_normal(32).astype(np.float32)
        extra[f"blk.{il}.indexer.proj.weight"] = rng.standard_normal((2, n_embd)).astype(np.float16)
        extra[f"blk.{il}.dsa.asq_k_proto"] = rng.standard_normal((2, 4, 16)).astype(np.float32)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=None, raw_dtype=QT(t.tensor_type)
                     if t.tensor_type not in (QT.F32, QT.F16) else None)
    for name, a in extra.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return extra


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from dsa_convert.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("q")
    model = make_tiny_model(root / "m", "llama-llama3rope-tied-sharded")
    out = root / "tiny-f16.gguf"
    convert(ConvertOptions(model, out, outtype="f16", quiet=True))
    return out


@pytest.fixture(scope="module")
def tiny_dsa(tiny_gguf) -> tuple[Path, dict]:
    dst = tiny_gguf.parent / "tiny-dsa-f16.gguf"
    return dst, add_fake_dsa(tiny_gguf, dst)


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("c") / "calib.txt"
    text = CALIB.read_text(encoding="utf-8")[:40000] if CALIB.is_file() else wiki_passage(40000) * 3
    p.write_text(text, encoding="utf-8")
    return p


# ---------------------------------------------------------------- fake quant = ggml math
@pytest.mark.parametrize("qt", ["q4_0", "q4_1"])
def test_fake_quant_matches_ggml(qt):
    from dsa_convert.quant.qformat import fq_q4_0, fq_q4_1

    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 256)) * rng.uniform(0.01, 3, (64, 1))).astype(np.float32)
    w[3, :32] = 0.0                      # all-zero block
    t = QT.Q4_0 if qt == "q4_0" else QT.Q4_1
    ref = gguf.quants.dequantize(gguf.quants.quantize(w, t), t)
    got = (fq_q4_0 if qt == "q4_0" else fq_q4_1)(torch.from_numpy(w)).numpy()
    assert np.abs(got - ref).max() <= 1e-6 * max(1.0, np.abs(ref).max())


def _ggml_available():
    from dsa_convert.quant import ggml_q
    return ggml_q.available()


@pytest.mark.parametrize("qt", [QT.Q4_0, QT.Q4_K, QT.Q6_K])
def test_ggml_fake_quant_matches_gguf(qt):
    """ggml's quantizer via ctypes: bytes dequantized by gguf-py = our to_float; Q4_0 without imatrix =
    the torch reference; an imatrix lowers the weighted error."""
    if not _ggml_available():
        pytest.skip("libggml-base.so not available")
    from dsa_convert.quant import ggml_q
    from dsa_convert.quant.qformat import fq_q4_0

    rng = np.random.default_rng(2)
    w = (rng.standard_normal((16, 512)) * rng.uniform(0.01, 3, (16, 1))).astype(np.float32)
    q = ggml_q.quantize(w, int(qt))
    ref = gguf.quants.dequantize(q, qt)
    assert np.array_equal(ggml_q.dequantize(q, int(qt), w.shape), ref)
    if qt == QT.Q4_0:
        assert np.array_equal(ggml_q.fake_quant(torch.from_numpy(w), int(qt)).numpy(),
                              fq_q4_0(torch.from_numpy(w)).numpy())
    imp = rng.uniform(0.01, 10, 512).astype(np.float32)
    e_w = (((ggml_q.fake_quant(torch.from_numpy(w), int(qt), imp).numpy() - w) ** 2) * imp).mean()
    e_0 = (((ref - w) ** 2) * imp).mean()
    assert e_w < e_0


def test_q4_k_m_mixture_rule():
    from dsa_convert.quant.qformat import FORMATS, k_quant_type

    f = FORMATS["q4_k_m"]
    six = [il for il in range(6) if k_quant_type(f, "ffn_down", il, 6) == QT.Q6_K]
    assert six == [2, 5]                                  # = llama-quantize Q4_K_M on ref-llama-27m
    assert k_quant_type(f, "attn_v", 2, 6) == QT.Q6_K and k_quant_type(f, "attn_q", 2, 6) == QT.Q4_K


# ---------------------------------------------------------------- bad input
def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("quantize", str(bad), str(out), "--method", "rtn"), out, "not a GGUF")


def test_unknown_type(tiny_gguf, tmp_path):
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("quantize", str(tiny_gguf), str(out), "--type", "q3_z", "--method", "rtn"),
                         out, "unknown --type")


def test_group_size_not_dividing_row(tiny_gguf, tmp_path):
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("quantize", str(tiny_gguf), str(out), "--method", "rtn", "--group-size", "96"),
                         out, "does not divide")


def test_group_size_not_multiple_of_32(tiny_gguf, tmp_path):
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("quantize", str(tiny_gguf), str(out), "--method", "rtn", "--group-size", "48"),
                         out, "multiple of 32")


def test_threads_below_one(tiny_gguf, tmp_path):
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("quantize", str(tiny_gguf), str(out), "--method", "rtn", "--threads", "0"),
                         out, "--threads must be >= 1 (got 0)")


def test_already_quantized(tiny_gguf, tmp_path):
    q = tmp_path / "q.gguf"
    r = run_dsa("quantize", str(tiny_gguf), str(q), "--method", "rtn", "--group-size", "32")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("quantize", str(q), str(out), "--method", "rtn", "--group-size", "32"),
                         out, "already quantized")


@needs_backend
def test_calibration_too_short(tiny_gguf, tmp_path):
    c = tmp_path / "short.txt"
    c.write_text("Only a few words of calibration text.")
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("quantize", str(tiny_gguf), str(out), "--calib", str(c), "--group-size", "32",
                                 "--samples", "8", "--seq-len", "64"), out, "calibration text too short")


def test_awq_needs_calib(tiny_gguf, tmp_path):
    out = tmp_path / "o.gguf"
    assert_clean_failure(run_dsa("quantize", str(tiny_gguf), str(out), "--group-size", "32"), out, "--calib")


def test_existing_output_refused(tiny_gguf, tmp_path):
    out = tmp_path / "o.gguf"
    out.write_bytes(b"keep me")
    r = run_dsa("quantize", str(tiny_gguf), str(out), "--method", "rtn", "--group-size", "32")
    assert r.returncode == EXIT_BAD_INPUT and "exists" in r.stderr
    assert out.read_bytes() == b"keep me"


def test_awq_scale_forms():
    """Default x-only scales are a power of mean|x| (normalised); duo_scaling divides by the weights too."""
    from dsa_convert.quant.auto_scale import search
    from dsa_convert.quant.qformat import fq_q4_0

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g) * torch.linspace(0.1, 4.0, 64)
    w = torch.randn(32, 64, generator=g)
    ref = x @ w.T

    def loss(q):
        return float((x @ q[0].T - ref).pow(2).mean())

    def fq(w, name=None, imp=None):
        return fq_q4_0(w)

    xm = x.abs().mean(0)
    s, rep = search(xm, [w], fq, loss, 32)
    assert rep["alpha"] and rep["loss"] < rep["loss_rtn"]
    e = xm.pow(rep["alpha"])
    assert torch.allclose(s, e / (e.max() * e.min()).sqrt(), rtol=1e-5)
    s_duo, rep_duo = search(xm, [w], fq, loss, 32, duo=True)
    assert rep_duo["loss"] < rep_duo["loss_rtn"] and not torch.allclose(s_duo, s)


# ---------------------------------------------------------------- functional
def _final_hidden(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    from dsa_convert.kernels_ref.model import RefModel, rms_norm

    m = RefModel.from_gguf(path)
    outs = []
    with torch.no_grad():
        for seq in tokens:
            pos = torch.arange(seq.shape[0])
            h = m.embed(seq)
            for il in range(m.hp.n_layer):
                h = m.layer(il, h, pos)
            outs.append(rms_norm(h, m.w("output_norm.weight"), m.hp.rms_eps))
    return torch.stack(outs)


@needs_backend
def test_awq_beats_rtn_and_keeps_dsa(tiny_dsa, calib_file, tmp_path):
    from dsa_convert.formats.gguf_read import GgufFile
    from dsa_convert.quant.calib import load_samples

    src, extra = tiny_dsa
    common = ["--type", "q4_0", "--group-size", "32", "--calib", str(calib_file), "--samples", "8",
              "--seq-len", "64", "--json"]
    outs = {}
    for method in ("rtn", "awq"):
        outs[method] = tmp_path / f"{method}.gguf"
        r = run_dsa("quantize", str(src), str(outs[method]), "--method", method, *common)
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["tensor_types"].get("Q4_0", 0) == 14          # 7 linears × 2 blocks
    g_src = GgufFile(src)
    tokens = load_samples(src, g_src, calib_file, 8, 64)
    ref = _final_hidden(src, tokens)
    mse = {k: float((_final_hidden(p, tokens) - ref).pow(2).mean()) for k, p in outs.items()}
    assert mse["awq"] < 0.97 * mse["rtn"], mse

    for method, p in outs.items():
        g = GgufFile(p)
        assert g.get("dsa.quant.method") == method
        arch = g.arch
        for k in (f"{arch}.dsa.version", f"{arch}.dsa.select", f"{arch}.attention.indexer.top_k"):
            assert g.get(k) == g_src.get(k), k
        for name, a in extra.items():
            assert g.tensors[name].qtype == g_src.tensors[name].qtype
            assert np.array_equal(np.asarray(g.raw(name)), np.asarray(g_src.raw(name))), name
        assert g.tensors["token_embd.weight"].qtype == QT.F16     # embeddings untouched


def test_q4_0_gptq_own_writer(tiny_dsa, calib_file, tmp_path):
    """--type q4_0 --method gptq|search: the own writer's Q4_0 (no llama.cpp); GPTQ's error feedback gives a lower
    final-hidden error than round-to-nearest on the calibration tokens; DSA tensors and embeddings kept."""
    from dsa_convert.formats.gguf_read import GgufFile
    from dsa_convert.quant.calib import load_samples

    src, extra = tiny_dsa
    outs = {}
    for method in ("rtn", "search", "gptq"):
        outs[method] = tmp_path / f"{method}.gguf"
        r = run_dsa("quantize", str(src), str(outs[method]), "--type", "q4_0", "--method", method, "--calib",
                    str(calib_file), "--samples", "8", "--seq-len", "64", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["tensor_types"].get("Q4_0", 0) == 14      # 7 linears × 2 blocks
    g_src = GgufFile(src)
    tokens = load_samples(src, g_src, calib_file, 8, 64)
    ref = _final_hidden(src, tokens)
    mse = {k: float((_final_hidden(p, tokens) - ref).pow(2).mean()) for k, p in outs.items()}
    assert mse["gptq"] < 0.9 * mse["rtn"], mse
    for method in ("search", "gptq"):
        g = GgufFile(outs[method])
        assert g.get("dsa.quant.method") == method and g.get("general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q4_0)
        assert g.tensors["token_embd.weight"].qtype == QT.F16
        for name in extra:
            assert np.array_equal(np.asarray(g.raw(name)), np.asarray(g_src.raw(name))), name
    r = run_dsa("quantize", str(src), str(tmp_path / "m.gguf"), "--type", "q4_0", "--method", "mix", "--calib",
                str(calib_file))
    assert_clean_failure(r, tmp_path / "m.gguf", "--method mix")


@needs_backend
def test_q4_0_imatrix_auto(tiny_gguf, calib_file, tmp_path):
    """--imatrix auto for Q4_0: ggml's imatrix-weighted Q4_0 (search and writer); valid Q4_0 blocks."""
    if not _ggml_available():
        pytest.skip("libggml-base.so not available")
    from dsa_convert.formats.gguf_read import GgufFile

    out = tmp_path / "q.gguf"
    r = run_dsa("quantize", str(tiny_gguf), str(out), "--type", "q4_0", "--group-size", "32", "--calib",
                str(calib_file), "--samples", "4", "--seq-len", "64", "--imatrix", "auto", "--json")
    assert r.returncode == 0, r.stderr
    g = GgufFile(out)
    assert g.get("dsa.quant.imatrix") == "auto"
    assert g.tensors["blk.0.ffn_up.weight"].qtype == QT.Q4_0
    assert np.isfinite(g.tensor("blk.0.ffn_up.weight")).all()
    r = run_dsa("quantize", str(tiny_gguf), str(tmp_path / "r.gguf"), "--method", "rtn", "--type", "q4_0",
                "--imatrix", "auto")
    assert r.returncode != 0


@needs_backend
def test_kquant_path_keeps_dsa(tiny_dsa, calib_file, tmp_path):
    from dsa_convert.backend.runtime import BackendMissing, tool_path
    from dsa_convert.formats.gguf_read import GgufFile

    try:
        tool_path("llama-quantize")
    except BackendMissing:
        pytest.skip("llama-quantize not built")
    src, extra = tiny_dsa
    out = tmp_path / "k.gguf"
    r = run_dsa("quantize", str(src), str(out), "--type", "q4_k_m", "--group-size", "32", "--calib",
                str(calib_file), "--samples", "4", "--seq-len", "64", "--imatrix", "auto", "--json")
    assert r.returncode == 0, r.stderr
    g, g_src = GgufFile(out), GgufFile(src)
    # --method auto (the default) for K-quants: RTN + an imatrix from the calibration text
    assert g.get("dsa.quant.method") == "rtn" and g.get("dsa.quant.type") == "q4_k_m"
    assert g.get("dsa.quant.imatrix") == "auto"
    assert g.get("general.file_type") == 15
    for name in extra:
        assert g.tensors[name].qtype == g_src.tensors[name].qtype, name
        assert np.array_equal(np.asarray(g.raw(name)), np.asarray(g_src.raw(name))), name
    # 64-wide rows are not multiples of 256: llama.cpp falls back to other types, but not to F16/F32
    assert g.tensors["blk.0.ffn_up.weight"].qtype not in (QT.F16, QT.F32)
    assert not list(tmp_path.glob(".k.gguf*"))


def test_method_auto_resolves_per_type(tiny_gguf, tmp_path):
    from dsa_convert.quant.quantize import AUTO_METHOD, QuantOptions, validate

    calib = tmp_path / "c.txt"
    calib.write_text("x")
    for qtype, (method, imatrix) in AUTO_METHOD.items():
        o = QuantOptions(tiny_gguf, tmp_path / f"{qtype}.gguf", method="auto", qtype=qtype, group_size=32,
                         calib=calib)
        validate(o)
        assert (o.method, o.imatrix) == (method, imatrix)
    o = QuantOptions(tiny_gguf, tmp_path / "k.gguf", method="auto", qtype="q4_k_m", group_size=32,
                     calib=calib, imatrix="none")
    validate(o)
    assert (o.method, o.imatrix) == ("rtn", "none")      # an explicit --imatrix wins
