# A numpy transcription of the patch's top-k-radix-cluster.cuh (no GPU needed): the same passes, ranges, winner rule,
# quotas and output offsets per block and thread, checked against a reference top-k (the k largest keys in the IEEE
# total order, ties to the lowest columns, ascending column order) on the shapes of topk_check's edge cases, for the
# plans the header picks for 1 and 512 rows. It checks the algorithm's bookkeeping before a GPU run; it does not
# replace scripts/gpu/cuda/topk_check.cu, which runs the kernel itself.
#   python3 scripts/gpu/cuda/emulate_topk_cluster.py [SEED]      (exit 0 iff every case matches)
import numpy as np, sys
NT = 1024

def key_of(x):
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    neg = (b >> 31) == 1
    k = np.where(neg, (~b) & 0xFFFFFFFF, b | 0x80000000)
    return k.astype(np.uint64)

def applies(ncols, nrows, k):
    if k < 1 or k > ncols: return None
    best = None
    for e in (1, 2, 4, 8, 16, 24):
        need = -(-ncols // (NT * e))
        if need > 8: continue
        c = 1
        while c < need: c *= 2
        if best is None or (nrows > 16 and c < best[1]): best = (e, c)
        if nrows <= 16: break
    return best

def emulate(row, k, EPT, C):
    ncols = len(row)
    keys = key_of(row)
    # per block b, per thread t, per j: column (b*NT + t)*EPT + j
    cols = np.arange(C * NT * EPT).reshape(C, NT, EPT)
    valid = cols < ncols
    kk = np.zeros(cols.shape, dtype=np.uint64); kk[valid] = keys[cols[valid]]
    prefix, mask, rank = 0, 0, k
    for p in range(3):
        nb = 4096 if p == 0 else 1024
        shift = 20 if p == 0 else (10 if p == 1 else 0)
        per = nb // C
        match = valid & ((kk & mask) == prefix)
        digit = ((kk >> shift) & (nb - 1)).astype(np.int64)
        hist = np.zeros((C, nb), dtype=np.int64)
        for b in range(C):
            hist[b] = np.bincount(digit[b][match[b]], minlength=nb)
        total = hist.sum(0)
        tot = total.reshape(C, per)          # block b's range: bins b*per ..
        range_sum = tot.sum(1)
        above, rs = 0, C - 1
        while rs > 0:
            s = range_sum[rs]
            if above + s >= rank: break
            above += s; rs -= 1
        pick1 = above
        rt = tot[rs]
        per_t = -(-per // NT)
        found = None
        cnts = np.zeros((NT, 4), dtype=np.int64)
        for q in range(4):
            i = per - 1 - (np.arange(NT) * per_t + q)
            ok = (q < per_t) & (i >= 0)
            cnts[ok, q] = rt[i[ok]]
        own = cnts.sum(1)
        incl = np.cumsum(own)
        ab = pick1 + incl - own
        win = np.nonzero((ab < rank) & (rank <= pick1 + incl))[0]
        assert len(win) == 1, ("winners", len(win))
        t = win[0]; a = ab[t]
        for q in range(4):
            if a + cnts[t, q] >= rank:
                found = (rs * per + per - 1 - (t * per_t + q), a, cnts[t, q]); break
            a += cnts[t, q]
        binv, n_above, count = found
        prefix |= int(binv) << shift; mask |= (nb - 1) << shift; rank -= int(n_above)
        if count == rank: break
    m = kk & mask
    gt = ((m > prefix) & valid).sum(2); eq = ((m == prefix) & valid).sum(2)   # [C, NT]
    blk_gt, blk_eq = gt.sum(1), eq.sum(1)
    out = np.full(k, -1, dtype=np.int64)
    for b in range(C):
        gt_prev, eq_prev = blk_gt[:b].sum(), blk_eq[:b].sum()
        quota = min(max(rank - eq_prev, 0), blk_eq[b])
        gt_before = np.cumsum(gt[b]) - gt[b]; eq_before = np.cumsum(eq[b]) - eq[b]
        for t in range(NT):
            off = gt_prev + min(rank, eq_prev) + gt_before[t] + min(quota, eq_before[t])
            seen = eq_before[t]
            for j in range(EPT):
                if not valid[b, t, j]: continue
                mv = m[b, t, j]
                if mv > prefix:
                    out[off] = cols[b, t, j]; off += 1
                elif mv == prefix:
                    if seen < quota:
                        out[off] = cols[b, t, j]; off += 1
                    seen += 1
    return out

def reference(row, k):
    keys = key_of(row)
    order = sorted(range(len(row)), key=lambda c: (-int(keys[c]), c))[:k]
    return np.array(sorted(order), dtype=np.int64)

rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
cases = 0
for ncols, k, kind in [(1025, 1, 'g'), (1025, 1025, 'g'), (5000, 7, 't'), (4096, 2048, 'c'), (70001, 2048, 't'),
                       (33333, 4000, 'd'), (2049, 2048, 'd'), (131328, 2048, 'd'), (131072, 2048, 't'), (3000, 3000, 'c'),
                       (7000, 5, 'd'), (65536, 2048, 'g'), (100000, 99999, 'g'), (4097, 4097, 'd'), (20000, 2048, 'z')]:
    if kind == 'g': row = rng.standard_normal(ncols).astype(np.float32)
    elif kind == 't': row = rng.integers(0, 16, ncols).astype(np.float32)
    elif kind == 'c': row = np.full(ncols, 1.5, np.float32)
    elif kind == 'z': row = np.where(rng.random(ncols) < 0.5, 0.0, -0.0).astype(np.float32); row[:5] = 1.0
    else:
        p1 = ncols - 1
        row = np.maximum(rng.standard_normal(ncols), 0).astype(np.float32) + (-1e-30 * np.arange(ncols)).astype(np.float32)
        row[:4] = 1e30; row[p1 - 64:p1] = 1e30; row[-3:] = -np.inf
    for nrows in (1, 512):
        plan = applies(ncols, nrows, k)
        if plan is None: print("n/a", ncols, k); continue
        EPT, C = plan
        got = emulate(row, k, EPT, C)
        ref = reference(row, k)
        ok = np.array_equal(got, ref)
        cases += 1
        print(f"{kind} ncols {ncols:6d} k {k:5d} nrows {nrows:3d} EPT {EPT:2d} C {C}: {'ok' if ok else 'MISMATCH'}")
        if not ok: sys.exit(1)
print("ALL OK", cases)
