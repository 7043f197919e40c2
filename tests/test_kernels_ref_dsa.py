"""Tests for the DSA reference kernels (indexer, selection, sparse attention, ASQ, KV quant)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsa_convert.kernels_ref import asq, kvquant
from dsa_convert.kernels_ref.indexer import IndexerWeights, indexer_scores, rope_neox
from dsa_convert.kernels_ref.selection import (local_only, oracle, oracle_scores, random_select,
                                               select_blocks, select_tokens)
from dsa_convert.kernels_ref.sparse_attention import DsaAttention, sparse_attention

torch.set_num_threads(2)


def _weights(n_embd=16, H=3, D=8, R=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return IndexerWeights(r(H * D, n_embd), r(D, n_embd), r(D), r(D), r(H, n_embd), R, 1e-5, 500.0)


# ----------------------------------------------------------------------------- indexer
def _naive_scores(x, pos, w):
    H, D, R = w.n_head, w.head_dim, w.rope_dim
    T = x.shape[0]

    def rope(v, p):
        v = v.clone()
        out = v.clone()
        for i in range(R // 2):
            f = w.freq_base ** (-2 * i / R)
            a = p * f
            out[i] = v[i] * math.cos(a) - v[i + R // 2] * math.sin(a)
            out[i + R // 2] = v[i] * math.sin(a) + v[i + R // 2] * math.cos(a)
        return out

    ks = []
    for s in range(T):
        k = w.W_k @ x[s]
        k = (k - k.mean()) / torch.sqrt(k.var(unbiased=False) + w.eps) * w.gamma + w.beta
        ks.append(rope(k, float(pos[s])))
    out = torch.full((T, T), float("-inf"))
    for t in range(T):
        q = (w.W_q @ x[t]).view(H, D)
        q = torch.stack([rope(q[j], float(pos[t])) for j in range(H)])
        wt = w.W_w @ x[t]
        for s in range(t + 1):
            out[t, s] = sum(wt[j] * torch.relu(q[j] @ ks[s]) for j in range(H)) / math.sqrt(D * H)
    return out


def test_indexer_matches_naive():
    w = _weights()
    x = torch.randn(7, 16)
    pos = torch.arange(3, 10)
    got = indexer_scores(x, pos, w)
    want = _naive_scores(x, pos, w)
    assert torch.isinf(got).eq(torch.isinf(want)).all()
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-4)
    assert (torch.triu(torch.ones(7, 7), 1).bool() == torch.isinf(got)).all()


def test_rope_neox_partial_and_norm():
    x = torch.randn(2, 5, 8)
    pos = torch.arange(5)
    y = rope_neox(x, pos, 4, 10000.0)
    assert torch.equal(y[..., 4:], x[..., 4:])
    torch.testing.assert_close(y[..., :4].norm(dim=-1), x[..., :4].norm(dim=-1))
    torch.testing.assert_close(rope_neox(x, torch.zeros(5, dtype=torch.long), 8, 1e4), x)
    assert torch.equal(rope_neox(x, pos, 0, 1e4), x)


def test_indexer_rejects_odd_rope_dim():
    with pytest.raises(ValueError):
        _weights(R=3)


# ----------------------------------------------------------------------------- selection
def _naive_select(scores, K, S, L, B=None):
    T = scores.shape[0]
    m = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        if t + 1 <= K:
            m[t, : t + 1] = True
            continue
        for s in range(t + 1):
            if s < S or s >= t - L + 1:
                m[t, s] = True
        M = list(range(S, t - L + 1))
        n = K - S - L
        if B is None:
            order = sorted(M, key=lambda s: (-float(scores[t, s]), s))
            for s in order[:n]:
                m[t, s] = True
        else:
            blocks = {}
            for s in M:
                b = s // B
                blocks[b] = max(blocks.get(b, float("-inf")), float(scores[t, s]))
            order = sorted(blocks, key=lambda b: (-blocks[b], b))[: n // B]
            for s in M:
                if s // B in order:
                    m[t, s] = True
    return m


@pytest.mark.parametrize("K,S,L", [(8, 2, 3), (8, 0, 0), (5, 1, 4), (12, 4, 4)])
def test_select_tokens_matches_naive(K, S, L):
    sc = torch.randn(30, 30)
    got = select_tokens(sc, K, S, L)
    assert torch.equal(got, _naive_select(sc, K, S, L))
    assert torch.equal(got.sum(1), torch.clamp(torch.arange(1, 31), max=K))
    assert not (got & ~torch.ones(30, 30, dtype=torch.bool).tril()).any()


def test_select_tokens_ties_lower_position():
    sc = torch.zeros(20, 20)
    got = select_tokens(sc, 6, 1, 2)
    assert torch.equal(got, _naive_select(sc, 6, 1, 2))
    assert got[19, 1:4].all() and not got[19, 4:18].any()


@pytest.mark.parametrize("K,S,L,B", [(16, 2, 2, 4), (16, 0, 4, 3), (20, 4, 8, 8), (10, 1, 1, 2)])
def test_select_blocks_matches_naive(K, S, L, B):
    sc = torch.randn(45, 45)
    got = select_blocks(sc, K, S, L, B)
    assert torch.equal(got, _naive_select(sc, K, S, L, B))
    assert (got.sum(1) <= K).all()


@pytest.mark.parametrize("mode", ["token", "block"])
def test_selection_of_sampled_rows_equals_the_full_problem(mode):
    # the indexer's training step selects only its sampled query rows (row0 = their positions): the same masks as
    # those rows of the whole [T, T] problem, dense rows (t + 1 <= K) and a tied row included
    T, K, S, L, B = 64, 16, 2, 4, 4
    sc = torch.randn(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    sc[40] = torch.where(torch.arange(T) <= 40, 0.0, float("-inf"))
    rows = torch.tensor([0, 3, 15, 16, 17, 40, 41, 63])
    sel = (lambda x, r=None: select_tokens(x, K, S, L, row0=r)) if mode == "token" \
        else (lambda x, r=None: select_blocks(x, K, S, L, B, row0=r))
    assert torch.equal(sel(sc[rows], rows), sel(sc)[rows])
    with pytest.raises(ValueError):
        sel(sc[rows], rows + T)


def test_selection_rejects_bad_split():
    with pytest.raises(ValueError):
        select_tokens(torch.zeros(4, 4), 4, 3, 2)
    with pytest.raises(ValueError):
        select_tokens(torch.zeros(4, 4), 0, 0, 0)


def test_baselines_budget():
    T, K, S, L = 40, 10, 2, 3
    lo = local_only(T, K, S)
    assert torch.equal(lo, _naive_select(torch.zeros(T, T), K, S, K - S))
    r1, r2 = random_select(T, K, S, L, seed=3), random_select(T, K, S, L, seed=3)
    assert torch.equal(r1, r2) and not torch.equal(r1, random_select(T, K, S, L, seed=4))
    for m in (lo, r1):
        assert torch.equal(m.sum(1), torch.clamp(torch.arange(1, T + 1), max=K))
    q, k = torch.randn(4, T, 8), torch.randn(2, T, 8)
    o = oracle(q, k, K, S, L)
    assert torch.equal(o, select_tokens(oracle_scores(q, k), K, S, L))
    torch.testing.assert_close(oracle_scores(q, k).sum(1), torch.full((T,), 4.0))


def test_oracle_max_reduce():
    """reduce='max' ranks a key that one head attends to above keys that every head attends to a little: the sum
    ranks them the other way round. The hook passes the reduction through (DsaAttention(oracle_reduce=...))."""
    T, hd = 6, 4
    q, k = torch.zeros(3, T, hd), torch.zeros(1, T, hd)
    k[0, 1, 0] = 1.0                                      # head 0 attends to key 1 alone (large logit)
    q[0, -1, 0] = 50.0
    k[0, 2, 1] = 1.0                                      # heads 1 and 2 attend to key 2 (moderate logit)
    q[1:, -1, 1] = 4.0
    sum_s, max_s = oracle_scores(q, k, 1.0)[-1], oracle_scores(q, k, 1.0, "max")[-1]
    assert sum_s[2] > sum_s[1] and max_s[1] > max_s[2]
    torch.testing.assert_close(oracle_scores(q, k, 1.0, "max"), sel_probs_max(q, k))
    o_sum, o_max = oracle(q, k, 2, 0, 1, 1.0)[-1], oracle(q, k, 2, 0, 1, 1.0, "max")[-1]
    assert o_sum[2] and not o_sum[1] and o_max[1] and not o_max[2]
    for reduce, want in (("sum", o_sum), ("max", o_max)):
        hook = DsaAttention(scale=1.0, attn="oracle", top_k=2, sink=0, local=1, oracle_reduce=reduce)
        assert torch.equal(hook._mask(0, q, k, torch.zeros(T, 2), torch.arange(T))[-1], want)
    with pytest.raises(ValueError):
        oracle_scores(q, k, reduce="mean")
    with pytest.raises(ValueError):
        DsaAttention(scale=1.0, attn="oracle", top_k=2, local=1, oracle_reduce="mean")


def sel_probs_max(q, k):
    """Per-head softmax over the causal keys, max over heads (the definition, without blocked.probs)."""
    T = q.shape[1]
    lg = (q @ k[0].T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(lg, -1).amax(0)


# ----------------------------------------------------------------------------- attention
def test_sparse_attention_dense_equals_sdpa():
    q, k, v = torch.randn(8, 12, 16), torch.randn(2, 12, 16), torch.randn(2, 12, 16)
    got = sparse_attention(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 0), v.repeat_interleave(4, 0), is_causal=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sparse_attention_mask():
    T = 10
    q, k, v = torch.randn(4, T, 8), torch.randn(2, T, 8), torch.randn(2, T, 8)
    mask = select_tokens(torch.randn(T, T), 4, 1, 1)
    got = sparse_attention(q, k, v, mask)
    for h in range(4):
        for t in range(T):
            idx = mask[t].nonzero()[:, 0]
            lg = q[h, t] @ k[h // 2, idx].T / math.sqrt(8)
            want = torch.softmax(lg, -1) @ v[h // 2, idx]
            torch.testing.assert_close(got[h, t], want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- ASQ
def test_asq_exact_rounding():
    P = torch.tensor([[0.0, 0.0, 0.0, 0.0], [10.0, 10.0, 10.0, 10.0]])
    # residual max 7 -> d = 1 (exact in f16); r/d = ±0.5 and ±2.5 round away from zero
    v = torch.tensor([[7.0, 0.5, -0.5, 2.5], [0.0, 0.0, 0.0, 0.0], [10.0, 10.0, 10.0, 10.0]])
    c = asq.encode(v, P, 4)
    assert c.code.tolist() == [0, 0, 1] and c.code.dtype == torch.uint8
    assert c.q[0].tolist() == [7, 1, -1, 3]
    assert c.scale.dtype == torch.float16 and c.scale.tolist() == [1.0, 0.0, 0.0]
    assert c.q[1:].abs().sum() == 0
    torch.testing.assert_close(asq.decode(c, P)[1:], v[1:])


def test_asq_f16_scale_and_ties():
    P = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    v = torch.tensor([[0.0, 0.3]])          # equidistant -> lower code
    c = asq.encode(v, P, 8)
    assert c.code.item() == 0
    r = v - P[0]
    d16 = (r.abs().max() / 127).to(torch.float16).float()
    want = torch.clamp(asq.round_half_away(r / d16), -127, 127)
    assert torch.equal(c.q.float(), want)
    err = (asq.decode(c, P) - v).abs().max()
    assert err <= d16 / 2 + 1e-6


def test_asq_error_bound_random():
    g = torch.Generator().manual_seed(0)
    P, v = torch.randn(16, 64, generator=g), torch.randn(500, 64, generator=g)
    for bits in (4, 8):
        vh = asq.roundtrip(v, P, bits)
        c = asq.encode(v, P, bits)
        assert ((vh - v).abs().max(-1).values <= c.scale.float() * 0.5 + 1e-5).all()
        assert c.q.abs().max() <= asq.qmax(bits)


def test_kv_bytes():
    assert asq.asq_bytes_per_vector(64, 4) == 35
    assert asq.asq_bytes_per_vector(64, 8) == 67
    assert asq.kv_bytes_per_token("f16", 64, 2, 6) == 2 * 6 * 2 * 128
    assert asq.kv_bytes_per_token("q8_0", 64, 2, 6) == 2 * 6 * 2 * 68
    assert asq.kv_bytes_per_token("q4_0", 64, 2, 6) == 2 * 6 * 2 * 36


# ----------------------------------------------------------------------------- kv quant
def test_kvquant_roundtrips():
    x = torch.randn(2, 5, 64)
    assert torch.equal(kvquant.kv_roundtrip(x, "f16"), x.half().float())
    e8 = (kvquant.kv_roundtrip(x, "q8_0") - x).abs().max()
    e4 = (kvquant.kv_roundtrip(x, "q4_0") - x).abs().max()
    assert 0 < e8 < 0.05 < e4 < 0.6
    # q8_0 block: scale = amax/127 per 32 values
    row = np.linspace(-1, 1, 32, dtype=np.float32)
    got = kvquant.kv_roundtrip(torch.from_numpy(row)[None], "q8_0")[0].numpy()
    assert np.abs(got - row).max() <= (1 / 127) / 2 + 1e-3
    with pytest.raises(ValueError):
        kvquant.kv_roundtrip(torch.randn(3, 48), "q4_0")
