# A numpy transcription of scripts/gpu/cuda/mmvq_check.cu's work split (no GPU needed): every layout's threads take the
# 8-byte "pieces" of a Q4_K row in the kernel's order, each piece's sum uses the kernel's formula (low / high nibbles
# against the two Q8_1 blocks, the mins against partial Q8 sums), and the row's total must equal the dequantized dot
# product; every piece must be taken exactly once. It checks the indexing before a GPU run; it does not replace the
# check itself.
#   python3 scripts/gpu/cuda/emulate_mmvq_pieces.py [SEED]      (exit 0 iff every layout and width matches)
import sys

import numpy as np

LAYOUTS = ((4, 1, 1), (4, 1, 2), (2, 2, 1), (1, 4, 1), (1, 4, 2), (1, 8, 1), (1, 8, 2))   # (W, R, V) as in the .cu


def scale_min_k4(j, q):
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), int((q[j + 4] >> 4) | ((q[j] >> 6) << 4))


def reference(dm, scales, qs, y, d8):
    a = (y * d8[:, None]).reshape(-1)
    s = 0.0
    for b in range(qs.shape[0]):
        for j in range(8):
            sc, m = scale_min_k4(j, scales[b])
            byte = qs[b, 32 * (j // 2):32 * (j // 2) + 32].astype(np.int64)
            q = (byte >> 4) if j % 2 else (byte & 0xF)
            s += float(((dm[b, 0] * sc * q - dm[b, 1] * m) * a[b * 256 + j * 32:b * 256 + j * 32 + 32]).sum())
    return s


def piece(p, v, dm, scales, qs, y, d8):
    b, t = divmod(p, 16)
    c, u = divmod(t, 4)
    sc_lo, m_lo = scale_min_k4(2 * c, scales[b])
    sc_hi, m_hi = scale_min_k4(2 * c + 1, scales[b])
    byts = qs[b, 32 * c + 8 * u:32 * c + 8 * u + 8 * v].astype(np.int64)
    ylo, yhi = y[b * 8 + 2 * c, 8 * u:8 * u + 8 * v], y[b * 8 + 2 * c + 1, 8 * u:8 * u + 8 * v]
    dl, dh = int(((byts & 0xF) * ylo).sum()), int(((byts >> 4) * yhi).sum())
    sl, sh = int(ylo.sum()), int(yhi.sum())
    d8l, d8h = d8[b * 8 + 2 * c], d8[b * 8 + 2 * c + 1]
    return dm[b, 0] * (sc_lo * d8l * dl + sc_hi * d8h * dh) - dm[b, 1] * (m_lo * d8l * sl + m_hi * d8h * sh)


def main(seed: int) -> int:
    rng = np.random.default_rng(seed)
    ok = True
    for ncols in (2048, 4096, 8192, 14336):
        nsb = ncols // 256
        dm = rng.uniform(1e-3, 2e-3, (nsb, 2))
        scales = rng.integers(0, 256, (nsb, 12), dtype=np.uint8)
        qs = rng.integers(0, 256, (nsb, 128), dtype=np.uint8)
        y = rng.integers(-127, 128, (ncols // 32, 32)).astype(np.int64)
        d8 = rng.uniform(0.01, 0.02, ncols // 32)
        ref = reference(dm, scales, qs, y, d8)
        for w, r, v in LAYOUTS:
            total, seen = 0.0, []
            for warp in range(w):                  # one row's W warps (the R rows of a block are independent)
                for lane in range(32):
                    p = (warp * 32 + lane) * v
                    while p < ncols // 16:
                        assert (p % 16) % 4 + v <= 4, "a thread's pieces must stay in one 32-byte chunk"
                        total += piece(p, v, dm, scales, qs, y, d8)
                        seen += range(p, p + v)
                        p += 32 * w * v
            err = abs(total - ref) / max(abs(ref), 1e-30)
            good = sorted(seen) == list(range(ncols // 16)) and err < 1e-9
            ok &= good
            print(f"K {ncols:>5}  {w}x{r} ({v})  pieces {len(seen):>4}  rel err {err:.1e}  {'ok' if good else 'FAIL'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
