"""`dsa convert` output runs exactly like transformers: in kernels_ref and in llama.cpp."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import REF_MODEL, VARIANTS, hf_logits, hf_tokens, needs, requires_backend, wiki_passage
from dsa_convert.convert import ConvertOptions, convert
from dsa_convert.kernels_ref.model import RefModel


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / (a.max() - a.min()))


@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    res = {}
    for v, d in tiny_models.items():
        p = out / f"{v}.gguf"
        convert(ConvertOptions(d, p, outtype="f32", quiet=True))
        toks = hf_tokens(d, wiki_passage(3000))[:300]
        res[v] = (d, p, toks, hf_logits(d, torch.tensor(toks)).numpy())
    return res


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernels_ref_matches_transformers(converted, variant):
    d, p, toks, ref = converted[variant]
    got = RefModel.from_gguf(p).forward(torch.tensor(toks)).numpy()
    assert _rel_err(ref, got) <= 1e-3
    assert (ref.argmax(-1) == got.argmax(-1)).all()


@requires_backend
@pytest.mark.backend
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_cpp_matches_transformers(converted, variant):
    from dsa_convert.backend.llama_runner import RunnerOptions, eval_logits, open_model

    d, p, toks, ref = converted[variant]
    got = eval_logits(open_model(p, RunnerOptions(n_ctx=512, kv_type="f32")), toks)
    assert _rel_err(ref, got) <= 1e-3
    assert (ref.argmax(-1) == got.argmax(-1)).all()


@needs(REF_MODEL)
@pytest.mark.backend
@requires_backend
def test_reference_model_f32_and_f16(tmp_path):
    from dsa_convert.backend.llama_runner import RunnerOptions, eval_logits, open_model

    toks = hf_tokens(REF_MODEL, wiki_passage(6000))[:1024]
    ref = hf_logits(REF_MODEL, torch.tensor(toks)).numpy()
    f32, f16 = tmp_path / "f32.gguf", tmp_path / "f16.gguf"
    convert(ConvertOptions(REF_MODEL, f32, outtype="f32", quiet=True))
    convert(ConvertOptions(REF_MODEL, f16, outtype="f16", quiet=True))
    got = eval_logits(open_model(f32, RunnerOptions(n_ctx=1024, kv_type="f32")), toks)
    assert _rel_err(ref, got) <= 1e-3
    assert (ref.argmax(-1) == got.argmax(-1)).all()
    kref = RefModel.from_gguf(f32).forward(torch.tensor(toks)).numpy()
    assert _rel_err(ref, kref) <= 1e-3 and (ref.argmax(-1) == kref.argmax(-1)).all()
    got16 = eval_logits(open_model(f16, RunnerOptions(n_ctx=1024, kv_type="f16")), toks)
    assert (ref.argmax(-1) == got16.argmax(-1)).mean() >= 0.99
