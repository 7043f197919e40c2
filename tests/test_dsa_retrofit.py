"""DSA retrofit pipeline: option validation, calibration input, tiny end-to-end run, PPL bookkeeping."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGUFValueType

from dsa_convert.dsa.config import DsaConfig
from dsa_convert.errors import BadInputError
from dsa_convert.eval.perplexity_common import NllAccumulator, chunk_nll, chunk_tokens, plan_chunks

from conftest import wiki_passage


@pytest.fixture
def calib_file(tmp_path):
    p = tmp_path / "calib.txt"
    p.write_text((wiki_passage(20000) + "\n") * 3)
    return p


@pytest.mark.parametrize("kw,msg", [
    (dict(top_k=0), "top-k"), (dict(cluster_num=1), "cluster-num"), (dict(sink=8, local=9, top_k=16), "exceeds"),
    (dict(residual_bits=3), "residual-bits"), (dict(rope_dim=3), "rope_dim"), (dict(index_share=0), "index-share"),
    (dict(index_place="first"), "index-place"), (dict(placement_search="random"), "placement-search"),
])
def test_config_rejects(kw, msg, calib_file):
    with pytest.raises(BadInputError, match=msg):
        DsaConfig(calib=calib_file, **kw).validate()


def test_config_missing_calib(tmp_path):
    with pytest.raises(BadInputError, match="not found"):
        DsaConfig(calib=tmp_path / "nope.txt").validate()


def test_calib_too_short(tiny_llama, tmp_path):
    from dsa_convert.dsa.calib import calib_chunks
    p = tmp_path / "short.txt"
    p.write_text("just a few words")
    with pytest.raises(BadInputError, match="too short"):
        calib_chunks(p, tiny_llama, 64, 4)


def test_retrofit_tiny_end_to_end(tiny_llama, calib_file, tmp_path, monkeypatch):
    from dsa_convert.dsa.retrofit import run_retrofit
    from dsa_convert.eval.perplexity_torch import perplexity_torch
    cfg = DsaConfig(top_k=16, calib=calib_file, ctx=64, calib_chunks=3, split_chunks=1, steps=4, sparse_steps=2,
                    query_rows=16, index_heads=2, index_dim=8, rope_dim=4, cluster_num=4, asq_samples=64)
    events = []
    res = run_retrofit(tiny_llama, cfg, progress=events.append)
    a = res.arch
    assert res.kv[f"{a}.attention.indexer.top_k"] == (16, GGUFValueType.UINT32)
    assert res.kv[f"{a}.dsa.split_source"][0] == "calibrated"
    S, L = res.kv[f"{a}.dsa.sink"][0], res.kv[f"{a}.dsa.local"][0]
    assert S + L <= 16 and L >= 1
    assert res.kv[f"{a}.dsa.asq.key_space"][0] in ("pre_rope", "post_rope")
    assert res.tensors["blk.0.indexer.attn_qkw.weight"].shape == (16 + 8 + 2, 64)      # H*D + D + H rows, H 2, D 8
    assert not any(n.endswith(("attn_q_b.weight", "attn_k.weight", "proj.weight")) for n in res.tensors)
    assert res.tensors["blk.0.dsa.asq_k_proto"].shape == (2, 4, 16)
    assert all(t.dtype == np.float32 for t in res.tensors.values())
    assert any(e["stage"] == "indexer_dense" for e in events) and events[-1]["stage"] == "done"
    assert "pre_rope" in str(res.report["asq"]["key_space_mean_err"])
    # the wall time split into disjoint stages that add up to (nearly all of) it
    st = res.report["stage_seconds"]
    assert {"load", "calib_forward", "train", "eval_kl", "asq_fit", "split"} <= st.keys(), st
    assert all(v >= 0 for v in st.values()) and sum(st.values()) <= res.report["seconds"] + 1e-3
    text = tmp_path / "eval.txt"
    text.write_text(wiki_passage(20000))
    for attn, kv in (("dense", "f32"), ("sparse", "f16"), ("oracle", "asq"), ("local", "f16"), ("random", "f16")):
        r = perplexity_torch(tiny_llama, text, ctx=64, chunks=2, attn=attn, kv=kv, dsa=res)
        assert math.isfinite(r["ppl"]) and r["tokens"] == 2 * 31 and r["backend"] == "torch"
    # determinism with the seed, and the sparse phase's data kept from the first pass (memory allowing, as here) is
    # what running the frozen model again gives: the same file bit for bit
    assert res.report["calibration"]["sparse_phase_data"] == "kept from the first pass"
    monkeypatch.setattr("dsa_convert.dsa.retrofit._keeps_pass_a_data", lambda *a: False)
    res2 = run_retrofit(tiny_llama, cfg)
    assert res2.report["calibration"]["sparse_phase_data"] == "recomputed"
    assert res2.tensors.keys() == res.tensors.keys()
    assert all(np.array_equal(res.tensors[n], res2.tensors[n]) for n in res.tensors)


def test_ppl_bookkeeping_matches_llama_perplexity():
    plan = plan_chunks(100, 16, None, True, 7)
    assert plan.n_chunk == 6 and plan.first == 8 and plan.tokens_scored == 6 * 7
    toks = list(range(100))
    c = chunk_tokens(toks, plan, 2)
    assert c[0].item() == 7 and c[1].item() == 33
    lg = torch.zeros(16, 50)
    nll = chunk_nll(lg, c, plan)
    assert nll.shape == (7,) and np.allclose(nll, math.log(50))
    acc = NllAccumulator()
    acc.add(np.array([1.0, 2.0, 3.0]))
    ppl, err = acc.result()
    assert ppl == pytest.approx(math.exp(2.0))
    assert err == pytest.approx(math.sqrt((14 / 3 - 4) / 2) * math.exp(2.0))
    with pytest.raises(BadInputError):
        plan_chunks(20, 16, None, False, None)


def test_plan_recipe_by_device_and_context():
    from dsa_convert.dsa.calib import plan_calibration
    kw = dict(ctx=None, calib_tokens=None, calib_chunks=None, split_chunks=None, model_ctx=32768,
              bytes_per_token=6656, free_bytes=64 << 30)
    cpu = plan_calibration(device="cpu", **kw)
    assert (cpu.ctx, cpu.n_train, cpu.n_held) == (32768, 2, 1)
    assert (cpu.steps, cpu.sparse_steps, cpu.query_rows, cpu.split_search) == (300, 300, 64, "coarse")
    assert cpu.placement_search == "oneshot" and cpu.as_report()["placement_search"] == "oneshot"
    assert cpu.recipe == "cpu long context"
    gpu = plan_calibration(device="cuda", **kw)
    assert (gpu.n_train, gpu.steps, gpu.query_rows, gpu.split_search, gpu.recipe) == (16, 400, 256, "full", "default")
    assert gpu.placement_search == "greedy"
    assert plan_calibration(device="cpu", **{**kw, "model_ctx": 16384}).query_rows == 128
    short = plan_calibration(device="cpu", **{**kw, "model_ctx": 2048})
    assert (short.n_train, short.steps, short.query_rows, short.split_search) == (32, 400, 256, "full")
    assert short.placement_search == "greedy"
    given = plan_calibration(device="cpu", steps=10, query_rows=32, split_search="full", **kw)
    assert (given.steps, given.sparse_steps, given.query_rows, given.split_search) == (10, 10, 32, "full")
    assert given.recipe == "cpu long context, options given"
    assert given.as_report()["query_rows"] == 32
    placed = plan_calibration(device="cpu", placement_search="greedy", **kw)
    assert (placed.placement_search, placed.split_search) == ("greedy", "coarse")
    assert placed.recipe == "cpu long context, options given"


def test_heldout_kl_averages_over_the_chunks_it_has():
    """One held-out chunk given two to average over: the KL is that chunk's, not half of it."""
    from dsa_convert.dsa.indexer_train import LayerCalib, eval_kl, init_indexer
    g = torch.Generator().manual_seed(0)
    T = 96
    one = LayerCalib(torch.randn(1, T, 32, generator=g), torch.randn(1, 4, T, 8, generator=g),
                     torch.randn(1, 2, T, 8, generator=g), 0.35)
    two = LayerCalib(one.x.repeat(2, 1, 1), one.q.repeat(2, 1, 1, 1), one.k.repeat(2, 1, 1, 1), 0.35)
    w = init_indexer(32, 2, 8, 4, 1e-6, 10000.0, 0)
    kl1, kl2 = eval_kl(one, w, 16, chunks=2), eval_kl(two, w, 16, chunks=2)
    assert kl1 > 0 and kl1 == pytest.approx(kl2, rel=1e-6)


def test_retrofit_coarse_split_search(tiny_llama, calib_file):
    from dsa_convert.dsa.retrofit import run_retrofit
    cfg = DsaConfig(top_k=16, calib=calib_file, ctx=64, calib_chunks=2, split_chunks=1, steps=3, query_rows=16,
                    index_heads=2, index_dim=8, rope_dim=4, cluster_num=None, split_search="coarse")
    res = run_retrofit(tiny_llama, cfg)
    sp, cal = res.report["split"], res.report["calibration"]
    assert sp["search"] == "coarse" and cal["split_search"] == "coarse" and cal["query_rows"] == 16
    # local 8 and 12 (0.875 x 16, capped at top-k - sink) at sink 4, then sink 1 at the better one; no dense forward
    assert [(c["sink"], c["local"]) for c in sp["candidates"]][:2] == [(4, 8), (4, 12)]
    assert len(sp["candidates"]) == 3 and sp["candidates"][2]["sink"] == 1 and sp["dense_nll"] is None
    best = min(sp["candidates"], key=lambda c: c["nll"])
    assert (res.report["sink"], res.report["local"]) == (best["sink"], best["local"])
    with pytest.raises(BadInputError, match="split-search"):
        DsaConfig(calib=calib_file, split_search="recall").validate()
