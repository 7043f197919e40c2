"""The indexer's projections in a DSA GGUF: stacked (attn_qkw) and, in older files, apart (FORMAT.md §3)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsa_convert.formats import indexer_layout as L


def test_stack_then_split_gives_the_three_matrices_back():
    rng = np.random.default_rng(0)
    H, D, E = 3, 8, 20
    W_q, W_k, W_w = rng.standard_normal((H * D, E)), rng.standard_normal((D, E)), rng.standard_normal((H, E))
    qkw = L.stack(W_q, W_k, W_w)
    assert qkw.shape == (H * D + D + H, E) and qkw.flags.c_contiguous
    for a, b in zip(L.split(qkw, H, D), (W_q, W_k, W_w)):
        assert np.array_equal(a, b)
    t = L.split(torch.from_numpy(qkw), H, D)                    # torch tensors too (the torch evaluator's weights)
    assert torch.equal(t[1], torch.from_numpy(W_k))
    with pytest.raises(ValueError, match="H\\*D \\+ D \\+ H"):
        L.split(qkw, H, D + 1)


def test_projections_read_either_layout():
    rng = np.random.default_rng(1)
    H, D, E = 2, 4, 6
    W = (rng.standard_normal((H * D, E)), rng.standard_normal((D, E)), rng.standard_normal((H, E)))
    stacked = {"blk.0.indexer.attn_qkw.weight": L.stack(*W)}
    apart = {f"blk.0.indexer.{s}": w for s, w in zip(L.SEPARATE, W)}
    for tensors in (stacked, apart):
        assert L.has_indexer(tensors.__contains__, 0) and not L.has_indexer(tensors.__contains__, 1)
        got = L.projections(tensors.__contains__, tensors.__getitem__, 0, H, D)
        assert all(np.array_equal(a, b) for a, b in zip(got, W))
