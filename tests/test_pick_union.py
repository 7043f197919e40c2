"""scripts/bench/pick_union.py's tile-union arithmetic (docs/history §4q item 7)."""
import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "pick_union.py"
_spec = importlib.util.spec_from_file_location("pick_union", SCRIPT)
pick_union = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pick_union)


def test_identical_rows_union_is_one_row():
    T, K = 64, 8
    m = torch.zeros(T, T, dtype=torch.bool)
    m[:, :K] = True                       # every query picks the same K cells
    size, share = pick_union.unions(m, 4, 16)
    assert size == K
    # tiles start at 16, 20, ..., 60: share = K / (t0 + 4)
    expect = sum(K / (t0 + 4) for t0 in range(16, 61, 4)) / len(range(16, 61, 4))
    assert abs(share - expect) < 1e-12


def test_disjoint_rows_union_is_tile_times_k():
    T, K, Q = 64, 2, 4
    m = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        m[t, (2 * t) % T: (2 * t) % T + K] = True   # consecutive rows pick disjoint cells
    size, _ = pick_union.unions(m, Q, 8)
    assert size == Q * K


def test_rows_before_t_min_and_a_partial_tile_are_left_out():
    T = 10
    m = torch.ones(T, T, dtype=torch.bool).tril()
    size, share = pick_union.unions(m, 4, 3)   # tiles at 3 (rows 3-6) only; rows 7-9 make no whole tile
    assert size == 7 and share == 1.0
