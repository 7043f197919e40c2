"""ASQ compressed KV cache in the patched llama.cpp (issue #7): a DSA GGUF with ASQ prototypes runs with a
K/V cache of prototype ids + low-bit residuals (docs/FORMAT.md section 6), encoded on write and decoded on
read (all rows on the prefill path, only the selected rows on the decode path). It must match kernels_ref's
ASQ math, really be compressed (llama.cpp allocates I8 rows of 3 + head_dim*b/8 bytes per KV head), and
switch back to the ordinary cache types per run."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import dsa_eval_json, make_tiny_model, requires_backend, verify_module
from test_convert_errors import assert_clean_failure, run_dsa

REPO = Path(__file__).resolve().parents[1]
TOPK, SINK, LOCAL, N, PREFILL, C = 24, 2, 6, 72, 20, 16


def _make_asq(root: Path, kind: str, key_space: str, bits: int):
    """(stock gguf, DSA gguf with random indexer + ASQ prototypes on every layer, arch, key space, bits)."""
    from dsa_convert.convert import ConvertOptions, convert
    from dsa_convert.formats.gguf_read import GgufFile

    plain, dsa = root / "plain.gguf", root / "dsa.gguf"
    convert(ConvertOptions(make_tiny_model(root / "m", kind), plain, outtype="f32", quiet=True))
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_test_dsa_gguf.py"), str(plain), str(dsa),
                    "--heads", "2", "--dim", "32", "--rope-dim", "16", "--top-k", str(TOPK), "--sink", str(SINK),
                    "--local", str(LOCAL), "--asq", str(C), "--asq-bits", str(bits), "--asq-key-space", key_space],
                   check=True, capture_output=True)
    g = GgufFile(dsa)
    arch = g.arch
    g.close()
    return plain, dsa, arch, key_space, bits


@pytest.fixture(scope="module", params=[("mistral-gqa", "pre_rope", 4), ("qwen3-qknorm-headdim", "post_rope", 8)],
                ids=["gqa-pre_rope-b4", "qwen3-post_rope-b8"])
def tiny_asq(request, tmp_path_factory):
    return _make_asq(tmp_path_factory.mktemp("asq"), *request.param)


@pytest.fixture(scope="module")
def tiny_asq_neox_pre_rope(tmp_path_factory):
    """qwen3 (NEOX RoPE) with a pre-RoPE ASQ key cache: the in-op RoPE's NEOX pairing."""
    return _make_asq(tmp_path_factory.mktemp("asq-neox"), "qwen3-qknorm-headdim", "pre_rope", 4)


@requires_backend
def test_asq_cache_matches_kernels_ref_prefill_and_decode(tiny_asq):
    plain, dsa, arch, _, _ = tiny_asq
    v = verify_module()
    toks = np.random.default_rng(5).integers(3, 320, N)
    ref = v.ref_logits(str(dsa), toks, sparse=True, kv="asq")
    ref_plain_kv = v.ref_logits(str(dsa), toks, sparse=True)
    one_batch = v.llama_logits(str(dsa), toks, n_ctx=128)                  # ASQ: the file has prototypes
    decode = v.llama_logits(str(dsa), toks, n_ctx=128, prefill=PREFILL)    # gather path: selected rows decoded
    off = v.llama_logits(str(dsa), toks, n_ctx=128, overrides={f"{arch}.dsa.asq.cache": False})
    scale = ref.max() - ref.min()
    # the ASQ round trip changes the logits far beyond float noise, and llama.cpp follows kernels_ref's ASQ math
    assert np.abs(ref - ref_plain_kv).max() / scale > 1e-3
    assert np.abs(one_batch - ref).max() / scale < 2e-4
    assert np.abs(decode - ref).max() / scale < 2e-4
    # the per-run switch gives back the ordinary (here f32) cache: kernels_ref without ASQ
    assert np.abs(off - ref_plain_kv).max() / scale < 1e-4


@requires_backend
def test_asq_decode_with_flash_attention(tiny_asq, monkeypatch):
    """With flash attention and LLAMA_DSA_FUSED=0 the decode path runs the decoded selected rows through
    ggml_flash_attn_ext; the masked FA decode (gather off) decodes the whole cache. Both follow kernels_ref's ASQ
    math. (The default, the in-place op, is checked against this form below.)"""
    plain, dsa, arch, _, _ = tiny_asq
    v = verify_module()
    monkeypatch.setenv("LLAMA_DSA_FUSED", "0")
    toks = np.random.default_rng(5).integers(3, 320, N)
    ref = v.ref_logits(str(dsa), toks, sparse=True, kv="asq")
    decode = v.llama_logits(str(dsa), toks, n_ctx=128, prefill=PREFILL, flash_attn=True)
    masked = v.llama_logits(str(dsa), toks, n_ctx=128, prefill=PREFILL, flash_attn=True, gather=False)
    scale = ref.max() - ref.min()
    assert not np.array_equal(decode[PREFILL:], masked[PREFILL:])     # two different graphs ran
    assert np.abs(decode - masked).max() / scale < 2e-3
    # FA rounds differently from kernels_ref; on these random tiny models that can flip a near-tie of a later
    # layer's top-k for a row (seen once: the same row, by the same amount, on the masked FA path): per-row check
    row_err = np.abs(decode - ref).max(axis=1) / scale
    assert np.median(row_err) < 1e-3 and np.mean(row_err < 3e-3) > 0.95


def _check_fused_asq(model, monkeypatch):
    """The decode path (flash attention on) attends over the picks with one op that decodes the ASQ rows in place
    (pre-RoPE keys RoPE'd at their cells' positions inside the op) instead of decoding them into F32 copies, a RoPE
    pass and flash attention (LLAMA_DSA_FUSED=0). It must agree with that form and follow kernels_ref's ASQ
    math."""
    plain, dsa, arch, _, _ = model
    v = verify_module()
    toks = np.random.default_rng(5).integers(3, 320, N)
    ref = v.ref_logits(str(dsa), toks, sparse=True, kv="asq")
    monkeypatch.setenv("LLAMA_DSA_FUSED", "0")
    unfused = v.llama_logits(str(dsa), toks, n_ctx=128, prefill=PREFILL, flash_attn=True)
    monkeypatch.delenv("LLAMA_DSA_FUSED")
    fused = v.llama_logits(str(dsa), toks, n_ctx=128, prefill=PREFILL, flash_attn=True)
    fused_ub4 = v.llama_logits(str(dsa), toks, n_ctx=128, n_ubatch=4, flash_attn=True)
    scale = ref.max() - ref.min()
    assert not np.array_equal(fused[PREFILL:], unfused[PREFILL:])     # two different graphs ran
    np.testing.assert_array_equal(fused[:PREFILL], unfused[:PREFILL])  # prefill: the same masked path
    print("fused vs decode+FA", np.abs(fused - unfused).max() / scale, "fused vs ref", np.abs(fused - ref).max() / scale,
          "ubatch 4 vs ref", np.abs(fused_ub4 - ref).max() / scale)
    assert np.abs(fused - unfused).max() / scale < 2e-3
    for got in (fused, fused_ub4):
        row_err = np.abs(got - ref).max(axis=1) / scale
        assert np.median(row_err) < 1e-3 and np.mean(row_err < 3e-3) > 0.95


@requires_backend
def test_asq_decode_fused_attention(tiny_asq, monkeypatch):
    _check_fused_asq(tiny_asq, monkeypatch)


@requires_backend
def test_asq_decode_fused_attention_neox_pre_rope(tiny_asq_neox_pre_rope, monkeypatch):
    _check_fused_asq(tiny_asq_neox_pre_rope, monkeypatch)


@requires_backend
def test_eval_kv_bytes_as_allocated(tiny_asq, tmp_path):
    plain, dsa, arch, _, bits = tiny_asq
    from dsa_convert.formats.gguf_read import GgufFile

    g = GgufFile(dsa)
    n_layer, n_head_kv = int(g.get(f"{arch}.block_count")), int(g.get(f"{arch}.attention.head_count_kv"))
    hd = int(g.get(f"{arch}.attention.key_length") or g.get(f"{arch}.embedding_length") // g.get(f"{arch}.attention.head_count"))
    g.close()
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i % 97}" for i in range(20000)))
    ctx = 2048
    asq = dsa_eval_json(str(dsa), "--ppl", str(text), "--ctx", str(ctx), "--chunks", "1", "--kv", "asq")
    f16 = dsa_eval_json(str(dsa), "--ppl", str(text), "--ctx", str(ctx), "--chunks", "1", "--kv", "f16")
    assert asq["kv_k_type"] == "i8" and asq["kv_v_type"] == "i8" and f16["kv_k_type"] == "f16"
    vec = 3 + hd * bits // 8                                  # FORMAT.md §6: code + f16 scale + residual
    want_main = 2 * n_layer * n_head_kv * vec                 # K + V bytes per token
    # llama.cpp logs the cache size in MiB with 2 decimals: exact to 0.005 MiB
    tol = 0.005 * 2**20 + 1
    assert abs(asq["kv_main_bytes"] - want_main * asq["kv_cells"]) <= tol, (asq["kv_main_bytes"], want_main)
    assert abs(f16["kv_main_bytes"] - 2 * n_layer * n_head_kv * 2 * hd * f16["kv_cells"]) <= tol
    assert asq["kv_bytes_per_token"] < f16["kv_bytes_per_token"]
    assert abs(asq["ppl"] / f16["ppl"] - 1) < 0.2 and asq["ppl"] != f16["ppl"]


@requires_backend
def test_kv_switch_errors(tiny_asq, tmp_path):
    plain, dsa, _, _, _ = tiny_asq
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 500)
    # a quantized V cache needs flash attention in llama.cpp: say so instead of a load failure
    no_out = tmp_path / "no-output"            # eval writes no file; the helper checks none appeared
    assert_clean_failure(run_dsa("eval", str(dsa), "--ppl", str(text), "--ctx", "128", "--kv", "q4_0"), no_out, "flash")
    # ASQ needs prototypes, and the sparse (DSA) cache
    assert_clean_failure(run_dsa("eval", str(plain), "--ppl", str(text), "--ctx", "128", "--kv", "asq"), no_out,
                         "prototypes")
    assert_clean_failure(run_dsa("eval", str(dsa), "--ppl", str(text), "--ctx", "128", "--kv", "asq",
                                 "--attn", "dense"), no_out, "sparse")


@requires_backend
def test_index_keys_f16_switch(tiny_asq, tmp_path):
    """--index-keys f16 (the default; the patched llama.cpp's {arch}.dsa.indexer.key_f16): the indexer-key cache is
    allocated as F16, half its F32 bytes, the main cache is untouched and the sparse PPL stays close to F32 keys."""
    plain, dsa, _, _, _ = tiny_asq
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i % 89}" for i in range(6000)))
    common = ("--ppl", str(text), "--ctx", "256", "--chunks", "2", "--kv", "f16")
    f32 = dsa_eval_json(str(dsa), *common, "--index-keys", "f32")
    f16 = dsa_eval_json(str(dsa), *common, "--index-keys", "f16")
    default = dsa_eval_json(str(dsa), *common)
    assert (f32["index_keys"], f16["index_keys"], default["index_keys"]) == ("f32", "f16", "f16")
    assert f16["attn"] == "sparse" and default["ppl"] == f16["ppl"]
    assert dsa_eval_json(str(plain), *common)["index_keys"] is None     # a stock file: no indexer-key cache
    assert f16["kv_main_bytes"] == f32["kv_main_bytes"]
    assert f16["kv_indexer_bytes"] * 2 == pytest.approx(f32["kv_indexer_bytes"], rel=0.02)
    assert abs(f16["ppl"] / f32["ppl"] - 1) < 0.02
    no_out = tmp_path / "no-output"
    assert_clean_failure(run_dsa("eval", str(dsa), *common, "--index-keys", "q8_0"), no_out, "index-keys")
    assert_clean_failure(run_dsa("eval", str(plain), *common, "--index-keys", "f16"), no_out, "no DSA indexer")


@requires_backend
def test_asq_cache_state_save_restore(tiny_asq):
    """The ASQ cache is plain I8 rows to llama.cpp's state code: save, evaluate on, restore, evaluate again."""
    from llama_cpp import Llama

    _, dsa, _, _, _ = tiny_asq
    toks = [int(t) for t in np.random.default_rng(9).integers(3, 320, 60)]
    llm = Llama(model_path=str(dsa), n_ctx=128, n_batch=32, n_ubatch=32, logits_all=True, verbose=False)
    llm.eval(toks[:40])
    state = llm.save_state()
    llm.eval(toks[40:])
    first = np.array(llm.scores[40:60])
    llm.load_state(state)
    llm.eval(toks[40:])
    again = np.array(llm.scores[40:60])
    llm.close()
    assert np.array_equal(first, again)


def test_backend_info_detects_a_stale_installed_library(tmp_path):
    """`dsa backend info` says patch_up_to_date only if the installed libllama is the cached build's wheel copy."""
    import zipfile

    from dsa_convert.backend.runtime import _installed_from_wheel

    wheel_dir = tmp_path / "wheel"
    wheel_dir.mkdir()
    with zipfile.ZipFile(wheel_dir / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl", "w") as z:
        z.writestr("llama_cpp/lib/libllama.so", b"new build")
    installed = tmp_path / "libllama.so"
    installed.write_bytes(b"new build")
    assert _installed_from_wheel(installed, wheel_dir)
    installed.write_bytes(b"old build")             # same size, other bytes
    assert not _installed_from_wheel(installed, wheel_dir)
    assert not _installed_from_wheel(installed, tmp_path / "no-wheel")
