"""The retrofit's memory (issue #69 point 3): the split search's NLL is computed over row blocks of the LM head's output,
never as one [T, vocab] (float64) matrix, and gives the one-shot values to float64 rounding."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import make_tiny_model


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from dsa_convert.kernels_ref.model import RefModel

    d = make_tiny_model(tmp_path_factory.mktemp("mem") / "m", "llama-llama3rope-tied-sharded", n_layer=2)
    return RefModel.from_hf(d, device="cpu")


def _one_shot(ref, row, start, attention=None) -> float:
    """The NLL as the split search computed it before: the whole chunk's logits, one float64 log-softmax."""
    lp = torch.log_softmax(ref.forward(row, attention=attention).double(), -1)
    return float(-lp[start:-1].gather(1, row[start + 1:, None]).sum())


@pytest.mark.parametrize("rows", [1, 7, 16, 256])
def test_blocked_nll_equals_one_shot(ref, rows):
    """Blocks of given logits: the one-shot values to float64 rounding (the sum's order); through the LM head over
    blocks: to float32 rounding of the logits (a BLAS may round a small block's matmul differently)."""
    from dsa_convert.dsa.split import head_nll_sum, nll_sum

    row = torch.randint(3, ref.hp.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    start = 24
    want = _one_shot(ref, row, start)
    got, n = nll_sum(ref.forward(row), row, start, rows)
    assert n == 96 - start - 1
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    h = ref.forward(row, hidden=True)
    got_h, n_h = head_nll_sum(ref, h, row, start, rows=rows)
    assert n_h == n and got_h == pytest.approx(want, rel=1e-8, abs=0)
    # a wrong target or row offset would change the sum
    assert nll_sum(ref.forward(row), row, start + 1, rows)[0] != pytest.approx(want, rel=1e-6)


def test_split_search_never_builds_whole_logits(ref, monkeypatch):
    """choose_split scores each candidate through the LM head over at most NLL_ROWS rows at a time, and each
    candidate's NLL is the one-shot computation's (to float32 rounding of the logits, test above)."""
    from dsa_convert.dsa import split
    from dsa_convert.dsa.indexer_train import init_indexer
    from dsa_convert.kernels_ref.sparse_attention import DsaAttention

    hp = ref.hp
    idx = {il: init_indexer(hp.n_embd, 2, 16, 8, 1e-6, hp.rope.base, il) for il in range(hp.n_layer)}
    tokens = torch.randint(3, hp.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(split, "NLL_ROWS", 16)
    seen = []
    head = ref.head

    def counting_head(h):
        seen.append(h.shape[0])
        return head(h)

    monkeypatch.setattr(ref, "head", counting_head)
    S, L, rep = split.choose_split(ref, tokens, idx, top_k=24, sink=None, search="full")
    assert seen and max(seen) <= 16
    monkeypatch.setattr(ref, "head", head)
    for c in rep["candidates"]:
        att = DsaAttention(scale=hp.kq_scale, attn="sparse", top_k=24, sink=c["sink"], local=c["local"],
                           indexers=idx)
        want = sum(_one_shot(ref, row, 24, att) for row in tokens) / (2 * (96 - 24 - 1))
        assert c["nll"] == pytest.approx(want, rel=1e-8, abs=0)
    dense = sum(_one_shot(ref, row, 24) for row in tokens) / (2 * (96 - 24 - 1))
    assert rep["dense_nll"] == pytest.approx(dense, rel=1e-8, abs=0)
    assert len({c["nll"] for c in rep["candidates"]}) > 1 and math.isfinite(rep["best_ppl"])


def test_sparse_phase_keeps_x_only(ref):
    """The sparse phase keeps a layer's attention input x alone (the budget counts x's bytes), and q / k projected
    from it again are the first pass's bit for bit."""
    from dsa_convert.dsa import retrofit
    from dsa_convert.dsa.calib import CalibPlan

    hp = ref.hp
    plan = CalibPlan(ctx=64, n_train=3, n_held=1, reason="given", bytes_per_token=1)
    x_bytes = 4 * 3 * 64 * hp.n_embd
    assert retrofit._kept_bytes(hp, plan, 1) == x_bytes
    assert retrofit._kept_bytes(hp, plan, 2) == x_bytes + 4 * 3 * 64 * (hp.n_head + hp.n_head_kv) * hp.head_dim
    types = [True] * hp.n_layer
    assert [retrofit._kept_layers(hp, types, plan, n * x_bytes) for n in range(hp.n_layer + 1)] == \
        list(range(hp.n_layer + 1))
    assert retrofit._kept_layers(hp, types, plan, hp.n_layer * x_bytes - 1) == hp.n_layer - 1
    pos = torch.arange(64)
    h = ref.embed(torch.randint(3, hp.vocab_size, (3, 64), generator=torch.Generator().manual_seed(2)))
    train, held, _ = retrofit._group_pass(ref, 1, 2, h, pos, 3, {})
    kept = retrofit._keep(train)
    assert kept.q is None and kept.k is None and kept.x is train.x
    back = retrofit._unkeep(ref, 1, kept, pos)
    assert torch.equal(back.q, train.q) and torch.equal(back.k, train.k) and back.x is train.x
