"""Cross-layer index reuse (`--index-share G`, upstream's {arch}.attention.indexer.types; FORMAT.md §4a): a shared
layer attends over the top-k of the last full indexer layer before it. kernels_ref, the retrofit's file and the
patched llama.cpp (prefill, token-by-token decode, the fused decode op) must agree."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_tiny_model, requires_backend, verify_module

REPO = Path(__file__).resolve().parents[1]
TOPK, SINK, LOCAL, N, PREFILL = 24, 2, 6, 72, 20

torch.set_num_threads(2)


def _weights(n_embd: int, seed: int):
    from dsa_convert.dsa.indexer_train import init_indexer
    return init_indexer(n_embd, 2, 8, 4, 1e-6, 10000.0, seed)


def test_shared_layers_attend_over_the_last_full_layers_selection():
    from dsa_convert.kernels_ref.sparse_attention import DsaAttention

    T, E, H, hd = 40, 16, 2, 8
    g = torch.Generator().manual_seed(0)
    types = [True, False, False, True, False]
    idx = {0: _weights(E, 1), 3: _weights(E, 2)}
    att = DsaAttention(scale=0.3, attn="sparse", top_k=12, sink=1, local=3, indexers=idx, indexer_types=types)
    pos = torch.arange(T)
    masks = []
    for il in range(5):   # layers in order, each with its own input (a shared layer's input must not matter)
        q, k = torch.randn(H, T, hd, generator=g), torch.randn(H, T, hd, generator=g)
        masks.append(att._mask(il, q, k, torch.randn(T, E, generator=g), pos))
    assert masks[0] is not None and masks[3] is not None
    assert torch.equal(masks[1], masks[0]) and torch.equal(masks[2], masks[0]) and torch.equal(masks[4], masks[3])
    assert not torch.equal(masks[3], masks[0])
    # a context that fits the budget: the full layer attends densely, and so does the shared one (no stale mask)
    q, k, x = torch.randn(H, 8, hd), torch.randn(H, 8, hd), torch.randn(8, E)
    assert att._mask(0, q, k, x, torch.arange(8)) is None and att._mask(1, q, k, x, torch.arange(8)) is None
    with pytest.raises(ValueError, match="types"):
        DsaAttention(scale=0.3, attn="sparse", top_k=12, indexers=idx, indexer_types=[False, True])


def test_index_share_pattern_and_full_layer_lookup():
    from dsa_convert.dsa.config import full_layer_of, indexer_types_every
    from dsa_convert.errors import BadInputError

    t = indexer_types_every(7, 3)
    assert t == [True, False, False, True, False, False, True]
    assert [full_layer_of(t, il) for il in range(7)] == [0, 0, 0, 3, 3, 3, 6]
    assert indexer_types_every(4, 1) == [True] * 4
    with pytest.raises(BadInputError):
        full_layer_of([False, True], 0)
    # a full layer without an indexer is dense and no source for the shared layers after it (FORMAT.md §4a)
    assert full_layer_of([True, True, False], 2, sources={0}) == 0
    assert full_layer_of([True, True, False], 1, sources={0}) == 1


def test_retrofit_with_index_share_writes_indexers_on_full_layers_only(tmp_path):
    """`dsa convert --index-share 2 --index-place every` on a 4-layer model: types [1,0,1,0], indexer tensors on
    layers 0 and 2 only, the group target trains them, and kernels_ref's sparse PPL reads the file back."""
    from dsa_convert.convert import ConvertOptions, convert
    from dsa_convert.dsa.config import DsaConfig
    from dsa_convert.eval.perplexity_torch import dsa_settings_from_gguf
    from dsa_convert.formats.gguf_read import GgufFile
    from dsa_convert.kernels_ref.model import RefModel
    from test_runtime_dsa import _calib_file

    model = make_tiny_model(tmp_path / "m", "llama-llama3rope-tied-sharded", n_layer=4)
    out = tmp_path / "s.gguf"
    cfg = DsaConfig(top_k=48, sink=4, local=12, index_heads=2, index_dim=32, rope_dim=16, cluster_num=None,
                    calib=_calib_file(tmp_path), ctx=256, calib_chunks=3, split_chunks=1, steps=10, seed=0,
                    index_share=2, index_place="every", device="cpu").validate()
    res = convert(ConvertOptions(model, out, outtype="f32", quiet=True, dsa=cfg))
    assert res["dsa"]
    g = GgufFile(out)
    assert g.indexer_types() == [True, False, True, False]
    have = sorted(il for il in range(4) if g.has(f"blk.{il}.indexer.attn_qkw.weight"))
    assert have == [0, 2]
    st = dsa_settings_from_gguf(RefModel.from_gguf(out))
    assert st["indexer_types"] == [True, False, True, False] and sorted(st["indexers"]) == [0, 2]
    # `dsa inspect --heatmap` of a shared layer: its own attention against the picks it reuses (layer 2's here)
    from dsa_convert.dsa.heatmap import write_heatmap
    from dsa_convert.errors import BadInputError

    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat and the dog ran in the park " * 60)
    r = write_heatmap(out, tmp_path / "h3.png", text, 3, n_tokens=128)
    assert r["indexer_layer"] == 2 and (tmp_path / "h3.png").stat().st_size > 0
    assert write_heatmap(out, tmp_path / "h0.png", text, 0, n_tokens=128)["indexer_layer"] == 0
    with pytest.raises(BadInputError, match="out of range"):
        write_heatmap(out, tmp_path / "h9.png", text, 9, n_tokens=128)


def test_retrofit_runs_each_layer_forward_once_per_pass(tmp_path, monkeypatch):
    """A group's shared layers are run once per pass: their q/k for the group target, their ASQ samples and the hidden
    states the next group starts from come from the same forward (pass A with held-out chunks; pass B, after the
    calibrated split, only when pass A's data was not kept), and the last layer is not advanced (nothing reads its
    output)."""
    from dsa_convert.dsa import retrofit
    from dsa_convert.dsa.config import DsaConfig
    from test_runtime_dsa import _calib_file

    model = make_tiny_model(tmp_path / "m", "llama-llama3rope-tied-sharded", n_layer=5)
    calls: list[int] = []
    real = retrofit._advance
    monkeypatch.setattr(retrofit, "_advance", lambda m, il, h, pos: (calls.append(il), real(m, il, h, pos))[1])
    cfg = DsaConfig(top_k=48, index_heads=2, index_dim=16, rope_dim=8, cluster_num=4, calib=_calib_file(tmp_path),
                    ctx=128, calib_chunks=2, split_chunks=1, steps=2, seed=0, index_share=2, index_place="every",
                    device="cpu").validate()
    res = retrofit.run_retrofit(model, cfg)
    assert res.report["split_source"] == "calibrated"
    assert calls == [0, 1, 2, 3]              # pass A: layers 0-3 once each, layer 4 never; pass B reuses its data
    calls.clear()
    monkeypatch.setattr(retrofit, "_keeps_pass_a_data", lambda *a: False)
    res = retrofit.run_retrofit(model, cfg)
    assert calls == [0, 1, 2, 3] * 2          # without the memory for that: pass B runs the layers once more
    assert sorted(res.report["layers"]) == [0, 2, 4] and all("heldout_kl_dense_phase" in res.report["layers"][il]
                                                           for il in (0, 2, 4))
    assert sorted(res.report["asq"]["layers"]) == [0, 1, 2, 3, 4]


def _fake_layout_nlls(worth: dict, rounds: list):
    """placement.layout_nlls on a loss where each layer's indexer is worth a known amount (rounds: the layouts scored)."""
    def fake(model, tokens, indexers, full, candidates=(), **kw):
        full = set(full)
        assert 0 in full and set(candidates) <= full - {0}
        rounds.append((frozenset(full), tuple(candidates)))
        nll = lambda layers: 1.0 + sum(w for il, w in worth.items() if il not in layers)  # noqa: E731
        return nll(full), {c: nll(full - {c}) for c in candidates}
    return fake


@pytest.mark.parametrize("search", ["greedy", "oneshot"])
def test_placement_search_keeps_the_layers_whose_loss_of_an_indexer_costs_most(monkeypatch, search):
    """Both searches (placement.py) turn the cheapest layers into shared ones, never layer 0, stop at n_full and
    record what they scored: greedy a round per shared layer, oneshot one round and the chosen layout."""
    from dsa_convert.dsa import placement

    worth = {0: 9.0, 1: 0.5, 2: 3.0, 3: 0.1, 4: 2.0, 5: 1.0}
    rounds: list = []
    monkeypatch.setattr(placement, "layout_nlls", _fake_layout_nlls(worth, rounds))
    model = type("M", (), {"hp": type("H", (), {"n_layer": 6, "kq_scale": 0.125})()})()
    idx = {il: object() for il in range(6)}
    types, rep = placement.choose_full_layers(model, torch.zeros(1, 64, dtype=torch.long), idx, n_full=3, top_k=16,
                                              sink=1, local=4, search=search)
    assert types == [True, False, True, False, True, False] and rep["full_layers"] == [0, 2, 4]
    assert rep["method"] == search
    assert rep["nll"] == pytest.approx(1.0 + 0.1 + 0.5 + 1.0) and rep["nll_all_full"] == 1.0
    if search == "greedy":
        assert [s["shared"] for s in rep["steps"]] == [3, 1, 5]
        assert [len(c) for _, c in rounds] == [5, 4, 3]              # a round per shared layer, each layer once
    else:
        assert [s["shared"] for s in rep["steps"]] == [[3, 1, 5]]
        assert [len(c) for _, c in rounds] == [5, 0] and rounds[1][0] == {0, 2, 4}   # one round, then the layout
    with pytest.raises(ValueError, match="placement search"):
        placement.choose_full_layers(model, torch.zeros(1, 64, dtype=torch.long), idx, n_full=3, top_k=16, sink=1,
                                     local=4, search="random")
    assert [placement.n_full_layers(n, G) for n, G in ((6, 4), (16, 4), (5, 2), (6, 1))] == [2, 4, 3, 6]


def test_layout_nlls_forks_equal_whole_forwards(tmp_path):
    """layout_nlls' forked candidates (the layers from the candidate on, from the layout's own forward) give exactly
    the held-out NLL of a whole forward of each candidate layout."""
    from dsa_convert.dsa.indexer_train import init_indexer
    from dsa_convert.dsa.placement import layout_nlls
    from dsa_convert.dsa.split import calib_nll
    from dsa_convert.kernels_ref.model import RefModel
    from dsa_convert.kernels_ref.sparse_attention import DsaAttention

    ref = RefModel.from_hf(make_tiny_model(tmp_path / "m", "llama-llama3rope-tied-sharded", n_layer=4), device="cpu")
    hp = ref.hp
    idx = {il: init_indexer(hp.n_embd, 2, 16, 8, 1e-6, hp.rope.base, il) for il in range(4)}
    tokens = torch.randint(3, 200, (2, 96), generator=torch.Generator().manual_seed(0))
    kw = dict(top_k=24, sink=2, local=6)
    base, cands = layout_nlls(ref, tokens, idx, {0, 1, 2, 3}, [1, 2, 3], **kw)

    def whole(full):
        att = DsaAttention(scale=hp.kq_scale, attn="sparse", indexers={il: idx[il] for il in full},
                           indexer_types=[il in full for il in range(4)], **kw)
        return calib_nll(ref, tokens, att, 24)

    assert base == whole({0, 1, 2, 3})
    assert cands == {c: whole({0, 1, 2, 3} - {c}) for c in (1, 2, 3)}
    assert len(set(cands.values())) == 3            # the layouts differ, so the check can fail
    with pytest.raises(ValueError, match="candidates"):
        layout_nlls(ref, tokens, idx, {0, 2}, [1], **kw)


def test_retrofit_with_searched_placement(tmp_path):
    """`--index-share 2` (placement search, the default) on a 4-layer model: every layer's indexer is trained, two
    stay (layer 0 among them), the file carries indexer tensors on exactly those and types saying so, and the
    search's last step is the held-out NLL of the file's own layout."""
    from dsa_convert.convert import ConvertOptions, convert
    from dsa_convert.dsa.config import DsaConfig
    from dsa_convert.dsa.split import calib_nll
    from dsa_convert.dsa.calib import calib_chunks
    from dsa_convert.eval.perplexity_torch import dsa_settings_from_gguf
    from dsa_convert.formats.gguf_read import GgufFile
    from dsa_convert.kernels_ref.model import RefModel
    from dsa_convert.kernels_ref.sparse_attention import DsaAttention
    from test_runtime_dsa import _calib_file

    model = make_tiny_model(tmp_path / "m", "llama-llama3rope-tied-sharded", n_layer=4)
    out = tmp_path / "s.gguf"
    calib = _calib_file(tmp_path)
    cfg = DsaConfig(top_k=48, sink=4, local=12, index_heads=2, index_dim=32, rope_dim=16, cluster_num=None,
                    calib=calib, ctx=256, calib_chunks=3, split_chunks=1, steps=10, seed=0, index_share=2,
                    device="cpu").validate()
    res = convert(ConvertOptions(model, out, outtype="f32", quiet=True, dsa=cfg))
    pl = res["dsa"]["placement"]
    assert [len(s["candidates"]) for s in pl["steps"]] == [3, 2] and pl["n_full"] == 2
    for s in pl["steps"]:
        assert s["nll"] == min(s["candidates"].values()) and str(s["shared"]) in s["candidates"]
    g = GgufFile(out)
    types = g.indexer_types()
    assert types[0] and sum(types) == 2 and [il for il in range(4) if types[il]] == pl["full_layers"]
    assert [il for il in range(4) if g.has(f"blk.{il}.indexer.attn_qkw.weight")] == pl["full_layers"]
    ref = RefModel.from_gguf(out)
    st = dsa_settings_from_gguf(ref)
    held = calib_chunks(calib, model, 256, 3 + 1)[3:]
    att = DsaAttention(scale=ref.hp.kq_scale, attn="sparse", top_k=48, sink=4, local=12,
                       indexers=st["indexers"], indexer_types=st["indexer_types"])
    assert calib_nll(ref, held, att, 48) == pytest.approx(pl["nll"], rel=1e-4)


def test_group_target_is_the_mean_of_the_layers_targets():
    from dsa_convert.dsa.indexer_train import LayerCalib, dense_target

    g = torch.Generator().manual_seed(0)
    q = [torch.randn(1, 4, 16, 8, generator=g) for _ in range(3)]
    k = [torch.randn(1, 2, 16, 8, generator=g) for _ in range(3)]
    data = LayerCalib(torch.zeros(1, 16, 4), q[0], k[0], 0.35, members=[(q[1], k[1]), (q[2], k[2])])
    rows = torch.tensor([5, 9, 15])
    want = sum(dense_target(q[i][0], k[i][0], rows, 0.35) for i in range(3)) / 3
    got = data.target(0, rows, "cpu")
    assert torch.allclose(got, want) and torch.allclose(got.sum(-1), torch.ones(3))


@pytest.fixture(scope="module", params=["0,2,4", "0,3", "0,1,4"])
def shared_dsa(request, tmp_path_factory):
    """A 5-layer stock GGUF, the same with indexers on some layers (every 2nd, every 3rd, or an irregular layout as
    the placement search writes) shared by the layers after them, and with those indexers but the other layers dense
    (no types key)."""
    from dsa_convert.convert import ConvertOptions, convert

    full = request.param
    root = tmp_path_factory.mktemp("share" + full.replace(",", ""))
    plain, shared, holes = root / "plain.gguf", root / "shared.gguf", root / "holes.gguf"
    convert(ConvertOptions(make_tiny_model(root / "m", "mistral-gqa", n_layer=5), plain, outtype="f32", quiet=True))
    common = ["--heads", "2", "--dim", "32", "--rope-dim", "16", "--top-k", str(TOPK), "--sink", str(SINK),
              "--local", str(LOCAL)]
    script = str(REPO / "scripts" / "make_test_dsa_gguf.py")
    G = {"0,2,4": 2, "0,3": 3}.get(full)     # the periodic layouts through --index-share, the other one explicitly
    layout = ["--index-share", str(G)] if G else ["--full-layers", full]
    subprocess.run([sys.executable, script, str(plain), str(shared), *common, *layout], check=True, capture_output=True)
    subprocess.run([sys.executable, script, str(plain), str(holes), *common, "--layers", full],
                   check=True, capture_output=True)
    return [int(il) for il in full.split(",")], plain, shared, holes


@requires_backend
def test_shared_file_matches_kernels_ref_prefill_and_decode(shared_dsa):
    full, plain, shared, holes = shared_dsa
    v = verify_module()
    toks = np.random.default_rng(5).integers(3, 320, N)
    ref = v.ref_logits(str(shared), toks, sparse=True)
    scale = ref.max() - ref.min()
    one_batch = v.llama_logits(str(shared), toks, n_ctx=128)
    decode = v.llama_logits(str(shared), toks, n_ctx=128, prefill=PREFILL)
    fused = v.llama_logits(str(shared), toks, n_ctx=128, prefill=PREFILL, cache_type=1, flash_attn=True)
    assert np.abs(one_batch - ref).max() / scale < 1e-4
    assert np.abs(decode - ref).max() / scale < 1e-4
    # f16 cache (and f16 index keys): a near-tie in a layer's indexer scores can flip one pick, which moves that
    # row's logits by ~1e-2 of their range (2 of 72 rows with the irregular layout's random indexers; kernels_ref
    # itself moves one of them by 1.9e-2 with its K/V rounded to f16); the layout is pinned by the F32 decode above
    row_err = np.abs(fused - ref).max(1) / scale
    assert np.median(row_err) < 5e-4 and (row_err > 3e-3).sum() <= 3 and row_err.max() < 5e-2
    # the shared layers really are sparse: the same indexers with those layers dense give other logits
    holes_l = v.llama_logits(str(holes), toks, n_ctx=128, prefill=PREFILL)
    assert np.abs(decode[TOPK:] - holes_l[TOPK:]).max() / scale > 1e-3
    assert np.array_equal(decode[:TOPK], holes_l[:TOPK])   # t < top_k: every key selected in both


@requires_backend
def test_shared_file_load_log_and_bad_types(shared_dsa, tmp_path):
    import gguf

    full, plain, shared, _ = shared_dsa
    code = "import sys, llama_cpp; llama_cpp.Llama(sys.argv[1], n_ctx=128, verbose=True)"
    r = subprocess.run([sys.executable, "-c", code, str(shared)], capture_output=True, text=True)
    n_shared = 5 - len(full)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"5 of 5 layers sparse ({n_shared} reuse an earlier layer's top-k)" in r.stderr
    # layer 0 marked shared: refused at load by llama.cpp, and by dsa eval with a one-line error
    bad = tmp_path / "bad.gguf"
    rd = gguf.GGUFReader(str(shared))
    w = gguf.GGUFWriter(str(bad), "llama")
    for key, f in rd.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vt = gguf.GGUFValueType(f.types[0])
        val = f.contents()
        if key == "llama.attention.indexer.types":
            val = [False] + list(val[1:])
        w.add_key_value(key, val, vt, sub_type=gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None)
    for t in rd.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=[int(x) for x in reversed(t.shape)],
                     raw_dtype=gguf.GGMLQuantizationType(t.tensor_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True)
    assert r.returncode != 0 and "layer 0 is shared" in r.stderr
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 200)
    r = subprocess.run([sys.executable, "-m", "dsa_convert.cli", "eval", str(bad), "--ppl", str(text), "--ctx", "64"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "attention.indexer.types[0] is 0" in r.stderr and len(r.stderr.strip().splitlines()) == 1
