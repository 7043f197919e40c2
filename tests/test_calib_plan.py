"""The retrofit's plan under a time and a memory budget (calib.py, budget.py): which context and recipe it picks from an
estimate, what the report states, the sparse phase's data kept within the memory budget (the same result as keeping or
recomputing all of it), progress on stderr with --json, and a config without the model's context."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import make_tiny_model
from dsa_convert.dsa.calib import CalibPlan, candidate_contexts, memory_budget, plan_calibration
from dsa_convert.errors import BadInputError

KW = dict(ctx=None, calib_tokens=None, calib_chunks=None, split_chunks=None, bytes_per_token=6656, device="cpu",
          free_bytes=64 << 30, top_k=512)


def _est(per_ctx: dict):
    """An estimator: seconds = per_ctx[ctx] x steps / 300 (the light recipe halves the steps)."""
    calls = []

    def est(plan: CalibPlan) -> dict:
        calls.append((plan.ctx, plan.level))
        t = per_ctx[plan.ctx] * plan.steps / 300
        return {"train": t, "total": t}
    return est, calls


def test_candidate_contexts():
    assert candidate_contexts(8192, 1024, None) == [8192, 4096]          # at least 4 x top-k
    assert candidate_contexts(8192, 256, None) == [8192, 4096, 2048, 1024]
    assert candidate_contexts(8192, 32, None)[-1] == 256
    assert candidate_contexts(8192, 512, 2048) == [2048]
    assert candidate_contexts(512, 512, None) == [512]            # the model's own, even when top-k leaves no room


def test_estimate_uses_each_recipes_kmeans_time():
    """The ASQ stage of a plan's estimate: the k-means time measured at that recipe's number of vectors."""
    from types import SimpleNamespace

    from dsa_convert.dsa.budget import LayerCosts, estimate

    costs = LayerCosts(ctx=2048, query_rows=256, forward_s=0.0, sparse_s=0.0, head_s=0.0, step_s=0.0, kmeans_s=10.0,
                       kmeans_light_s=1.0, probe_s=0.0)
    cfg = SimpleNamespace(sink=None, local=None, index_share=1, index_place="search", key_space="auto", cluster_num=64)
    est, _ = _est({2048: 100})
    full = plan_calibration(model_ctx=2048, time_budget=1e9, estimator=est, **KW)
    light = plan_calibration(model_ctx=2048, time_budget=1, estimator=est, **KW)
    assert (full.level, light.level) == ("full", "light")
    # 30 layers x 3 KV heads x (2 key spaces + V) fits
    assert estimate(full, costs, n_layer=30, n_head_kv=3, cfg=cfg)["asq_fit"] == 30 * 3 * 3 * 10.0
    assert estimate(light, costs, n_layer=30, n_head_kv=3, cfg=cfg)["asq_fit"] == 30 * 3 * 3 * 1.0


def test_budget_picks_largest_context_then_recipe():
    est, calls = _est({8192: 3000, 4096: 1500, 2048: 700})
    p = plan_calibration(model_ctx=8192, time_budget=1000, estimator=est, **KW)
    # 8K full (3000 s) and light (1500 s) miss; 4K full (1500 s) misses, 4K light (750 s) fits
    assert calls == [(8192, "full"), (8192, "light"), (4096, "full"), (4096, "light")]
    assert (p.ctx, p.level, p.steps, p.split_search, p.asq_div) == (4096, "light", 150, "coarse", 4)
    assert p.time_budget == 1000 and p.estimate["total"] == 750
    assert "lowered to 4096" in p.reason and "fits the time budget" in p.reason
    r = p.as_report()
    assert r["time_budget_s"] == 1000 and r["estimate_s"]["total"] == 750 and r["level"] == "light"
    assert [c["fits"] for c in r["considered"]] == [False, False, False, True]
    big = plan_calibration(model_ctx=8192, time_budget=5000, estimator=_est({8192: 3000})[0], **KW)
    assert (big.ctx, big.level, big.steps, big.reason.startswith("model context, full recipe")) == \
        (8192, "full", 300, True)


def test_budget_too_small_takes_the_cheapest_and_says_so():
    est, calls = _est({8192: 3000, 4096: 1500, 2048: 700})
    p = plan_calibration(model_ctx=8192, time_budget=10, estimator=est, **KW)
    assert calls[-1] == (2048, "light") and (p.ctx, p.level) == (2048, "light")
    assert p.steps == 200 and p.n_train == 16 and "over the time budget" in p.reason


def test_given_values_hold_in_every_recipe():
    est, _ = _est({2048: 10_000})
    p = plan_calibration(model_ctx=8192, time_budget=100, estimator=est, **{**KW, "ctx": 2048, "calib_chunks": 5},
                         steps=40, query_rows=32)
    assert (p.ctx, p.n_train, p.steps, p.query_rows, p.level) == (2048, 5, 40, 32, "light")
    assert p.reason.startswith("given") and "options given" in p.recipe


def test_no_budget_is_the_full_recipe_at_the_model_context_with_an_estimate():
    est, calls = _est({8192: 3000})
    p = plan_calibration(model_ctx=8192, time_budget=None, estimator=est, **KW)
    assert (p.ctx, p.level, p.reason, p.time_budget) == (8192, "full", "model context", None)
    assert calls == [(8192, "full")] and p.estimate["total"] == 3000


def test_memory_budget():
    assert memory_budget("cpu", free_bytes=64 << 30) == 1536 << 20       # a CPU: at most DEFAULT_CPU_MEMORY
    assert memory_budget("cpu", free_bytes=2 << 30) == 1 << 30           # or half the free memory
    assert memory_budget("cpu", given=5 << 30) == 5 << 30
    # the chunks drop to fit it, then (no budget, no given context) the context halves
    p = plan_calibration(model_ctx=32768, memory_bytes=200 << 20, **{**KW, "top_k": 512})
    assert p.ctx * (p.n_train + p.n_held) * 6656 <= 200 << 20 and p.ctx < 32768 and "capped" in p.reason


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("plan") / "m", "llama-llama3rope-tied-sharded", n_layer=4)


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text(("Calibration prose about ships, weather and the price of bread in old towns. " * 30 + "\n") * 200)
    return p


def _cfg(calib, **kw):
    from dsa_convert.dsa.config import DsaConfig

    base = dict(top_k=24, calib=calib, ctx=96, calib_chunks=3, split_chunks=1, steps=3, query_rows=16,
                index_heads=2, index_dim=16, rope_dim=8, cluster_num=4, asq_samples=256, seed=1, device="cpu")
    return DsaConfig(**{**base, **kw}).validate()


def test_sparse_phase_keeps_what_the_memory_budget_holds(tiny, calib, monkeypatch):
    """Data kept for the first layer only, the rest recomputed from the hidden state there: the same file, bit for bit,
    as keeping every layer's data; the report says which."""
    from dsa_convert.dsa import retrofit

    cfg = _cfg(calib, time_budget=0)
    full = retrofit.run_retrofit(tiny, cfg)
    assert full.report["calibration"]["sparse_phase_data"] == "kept from the first pass"
    one = {}

    def one_group(hp, types, plan, dev):
        one["bytes"] = retrofit._kept_bytes(hp, plan, 1)
        return one["bytes"]
    monkeypatch.setattr(retrofit, "_keeps_pass_a_data", one_group)
    calls: list[int] = []
    real = retrofit._advance
    monkeypatch.setattr(retrofit, "_advance", lambda m, il, h, pos: (calls.append(il), real(m, il, h, pos))[1])
    part = retrofit.run_retrofit(tiny, cfg)
    cal = part.report["calibration"]
    assert cal["sparse_phase_data"] == "kept for layers 0-0, recomputed from layer 1" and cal["kept_layers"] == 1
    assert calls == [0, 1, 2] + [1, 2]          # pass A: layers 0-2 (3 feeds nothing); pass B from layer 1's input
    assert part.tensors.keys() == full.tensors.keys()
    assert all(np.array_equal(part.tensors[n], full.tensors[n]) for n in full.tensors)


def test_report_states_budget_estimate_and_measured(tiny, calib):
    from dsa_convert.dsa.retrofit import run_retrofit

    events: list[dict] = []
    res = run_retrofit(tiny, _cfg(calib, time_budget=900, memory_budget=0.5), progress=events.append)
    cal = res.report["calibration"]
    assert cal["time_budget_s"] == 900 and cal["memory_budget_mib"] == 512 and cal["level"] == "full"
    assert cal["estimate_s"]["total"] > 0 and cal["measured_s"] > 0 and cal["considered"][0]["fits"]
    assert {"calib_forward", "train", "split", "asq_fit"} <= cal["estimate_s"].keys()
    p = cal["probes"][0]
    assert p["ctx"] == 96 and p["forward_s"] > 0 and p["step_s"] > 0 and p["kmeans_s"] > 0
    assert cal["asq_samples_divisor"] == 1 and cal["asq_samples"] == 256
    assert "plan" in res.report["stage_seconds"]
    train = [e for e in events if e["stage"].startswith("indexer_")]
    assert train and all("elapsed_s" in e and "eta_s" in e for e in train)


def _dsa(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dsa_convert.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_convert_json_progress_on_stderr(tiny, calib, tmp_path):
    out = tmp_path / "o.gguf"
    r = _dsa("convert", str(tiny), str(out), "--top-k", "24", "--calib-ctx", "96", "--calib-tokens", "288",
             "--steps", "3", "--query-rows", "16", "--cluster-num", "4", "--calib", str(calib), "--time-budget", "600",
             "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)                         # stdout: the JSON alone
    assert rep["dsa"]["calibration"]["time_budget_s"] == 600
    lines = r.stderr.splitlines()
    assert any(ln.startswith("DSA retrofit:") and "stage=plan" in ln for ln in lines), r.stderr
    assert any(ln.startswith("convert:") and "ETA" in ln for ln in lines), r.stderr


def test_convert_over_budget_warns(tiny, calib, tmp_path):
    out = tmp_path / "o.gguf"
    r = _dsa("convert", str(tiny), str(out), "--top-k", "24", "--calib-ctx", "96", "--calib-tokens", "288",
             "--steps", "3", "--query-rows", "16", "--cluster-num", "4", "--calib", str(calib), "--time-budget",
             "0.01", "--json")
    assert r.returncode == 0 and out.is_file(), r.stderr[-2000:]
    cal = json.loads(r.stdout)["dsa"]["calibration"]
    assert cal["level"] == "light" and "over the time budget" in cal["ctx_source"]
    assert cal["asq_samples_divisor"] == 4 and cal["asq_samples"] == 32768 // 4       # DsaConfig's default, quartered
    p = cal["probes"][0]
    assert 0 < p["kmeans_light_s"] and 0 < p["kmeans_s"]
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warn) == 1 and "over the 0 s time budget" in warn[0], r.stderr


def test_config_without_model_context(tiny, calib, tmp_path):
    """A config without max_position_embeddings: the retrofit cannot pick a calibration context; one line, no file
    (with --calib-ctx it runs)."""
    import shutil

    m = tmp_path / "m"
    shutil.copytree(tiny, m)
    cfg = json.loads((m / "config.json").read_text())
    del cfg["max_position_embeddings"]
    (m / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o.gguf"
    r = _dsa("convert", str(m), str(out), "--top-k", "24", "--steps", "2", "--cluster-num", "4", "--calib", str(calib))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 3 and "Traceback" not in r.stderr and lines[-1].startswith("error: "), r.stderr[-2000:]
    assert "max_position_embeddings" in lines[-1] and "--calib-ctx" in lines[-1]
    assert not out.exists() and not list(tmp_path.glob(".o.gguf.partial-*"))
    from dsa_convert.dsa.retrofit import run_retrofit

    with pytest.raises(BadInputError, match="max_position_embeddings"):
        run_retrofit(m, _cfg(calib, ctx=None, time_budget=0))
