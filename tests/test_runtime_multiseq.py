"""Several sequences in one KV cache: the patched llama.cpp's sparse-attention inputs (the DSA indexer mask with its
one-sequence fast path, the decode path's picks) must keep the sequences apart. Two sequences evaluated together in
one unified cache (their cells interleaved, so neither is one run of cells from cell 0) must give each sequence the
logits it gets alone in its own context, for the sparse prefill and for the decode path (2-token ubatches, one token
of each sequence)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import requires_backend
from test_runtime_decode import tiny_dsa  # noqa: F401 (fixture)

N, PREFILL = 64, 30   # both past TOPK: the prefill rows after TOPK and every decode step select


def _run(path, seqs: list[np.ndarray], flash_attn: bool, unified: bool = True) -> list[np.ndarray]:
    """Logits of every position of each sequence: one batch with every sequence's first PREFILL tokens, then steps
    of one batch holding the next token of each sequence. unified=False: one cache stream per sequence (the
    ubatches then carry 2 streams)."""
    import llama_cpp as L

    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    assert model
    cp = L.llama_context_default_params()
    cp.n_ctx = 256
    cp.n_batch = cp.n_ubatch = 256
    cp.n_seq_max = len(seqs)
    cp.kv_unified = unified
    cp.flash_attn_type = 1 if flash_attn else 0
    cp.n_threads = cp.n_threads_batch = 2
    ctx = L.llama_init_from_model(model, cp)
    assert ctx
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(PREFILL * len(seqs), 0, len(seqs))
    out = [np.zeros((N, n_vocab)) for _ in seqs]
    try:
        def step(entries):   # entries: (seq, pos)
            batch.n_tokens = len(entries)
            for i, (s, p) in enumerate(entries):
                batch.token[i] = int(seqs[s][p])
                batch.pos[i] = p
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = s
                batch.logits[i] = 1
            assert L.llama_decode(ctx, batch) == 0
            for i, (s, p) in enumerate(entries):
                out[s][p] = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
        step([(s, p) for s in range(len(seqs)) for p in range(PREFILL)])
        for p in range(PREFILL, N):
            step([(s, p) for s in range(len(seqs))])
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return out


@requires_backend
@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
@pytest.mark.parametrize("device_mask", [False, True], ids=["host-mask", "device-mask"])
@pytest.mark.parametrize("flash_attn", [False, True], ids=["no-fa", "fa"])
def test_two_sequences_in_one_cache_match_each_alone(tiny_dsa, flash_attn, device_mask, unified, monkeypatch):  # noqa: F811
    """device-mask: the default, the prefill's indexer mask computed in the graph from the attention mask (which keeps
    the sequences apart) and the positions, and the decode's masks from the positions where a sequence is alone in its
    stream (host-mask: LLAMA_DSA_HOST_MASKS=1). streams: the two sequences in separate cache streams of one context
    (kv_unified off), so the ubatches carry 2 streams."""
    if not device_mask:
        monkeypatch.setenv("LLAMA_DSA_HOST_MASKS", "1")
    _, dsa = tiny_dsa
    rng = np.random.default_rng(11)
    a, b = rng.integers(3, 320, N), rng.integers(3, 320, N)
    together = _run(dsa, [a, b], flash_attn, unified)
    alone = [_run(dsa, [a], flash_attn)[0], _run(dsa, [b], flash_attn)[0]]
    for got, want in zip(together, alone):
        scale = want.max() - want.min()
        err = np.abs(got - want).max(axis=1) / scale
        print(f"fa={flash_attn} unified={unified}: prefill rows max {err[:PREFILL].max():.1e}, decode rows max {err[PREFILL:].max():.1e}")
        # same picks and the same math per row; only the batch shapes differ (matmul blocking): float noise
        assert err.max() < 1e-4
    # the two sequences are different inputs: mixing them up would not pass the check above
    assert np.abs(together[0] - together[1]).max() > 1e-2 * (together[0].max() - together[0].min())
