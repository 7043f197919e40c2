# A numpy emulation of dsa-lightning-indexer-mma.cuh's fragment addressing (no GPU needed): ldmatrix.x4 and
# mma.sync.m16n8k16 modelled from the PTX ISA's fragment layouts, fed with the kernel's shared-memory addresses, and
# each accumulator element compared with the q.k it is read as. Checks the index arithmetic before a GPU run;
# scripts/gpu/cuda/lip_check.cu checks the kernel itself.
#   python3 scripts/gpu/cuda/emulate_mma_fragments.py      (prints "fragment mapping OK")
import numpy as np
rng = np.random.default_rng(0)
D, TT, TK, LDQ = 64, 64, 64, 64 + 8
KS = D // 16
q_sh = rng.standard_normal((TT, LDQ))   # one head's rows (pad columns random: must never be read)
k_sh = rng.standard_normal((TK, LDQ))

def ldmatrix_x4(addr_of_lane):
    """addr_of_lane(l) -> (array, row, col) of the 8 b16 elements that lane l points to (for matrix l // 8).
    Returns regs[lane][i] = (elem0, elem1) of matrix i: row lane // 4, cols 2*(lane % 4), +1."""
    rows = [addr_of_lane(l) for l in range(32)]
    regs = [[None] * 4 for _ in range(32)]
    for lane in range(32):
        for i in range(4):
            arr, r, c = rows[i * 8 + lane // 4]        # matrix i's row lane // 4 comes from lane i*8 + lane//4
            cc = c + 2 * (lane % 4)
            regs[lane][i] = (arr[r, cc], arr[r, cc + 1])
    return regs

ok = True
for wt in range(4):
    for wk in range(2):
        # B fragments as the kernel loads them
        b = {}
        for nt in range(4):
            for j in range(KS // 2):
                regs = ldmatrix_x4(lambda l: (k_sh, wk * 32 + nt * 8 + l % 8, j * 32 + (l // 8) * 8))
                for lane in range(32):
                    b[(lane, nt, 2 * j, 0)] = regs[lane][0]; b[(lane, nt, 2 * j, 1)] = regs[lane][1]
                    b[(lane, nt, 2 * j + 1, 0)] = regs[lane][2]; b[(lane, nt, 2 * j + 1, 1)] = regs[lane][3]
        c = np.zeros((32, 4, 4))
        for ks in range(KS):
            a = ldmatrix_x4(lambda l: (q_sh, wt * 16 + l % 16, ks * 16 + (l // 16) * 8))
            # mma per PTX: assemble the 16x16 A and 16x8 B tiles from the fragments, D = A B + C
            for nt in range(4):
                A = np.zeros((16, 16)); B = np.zeros((16, 8))
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    A[g, 2 * t:2 * t + 2] = a[lane][0]; A[g + 8, 2 * t:2 * t + 2] = a[lane][1]
                    A[g, 2 * t + 8:2 * t + 10] = a[lane][2]; A[g + 8, 2 * t + 8:2 * t + 10] = a[lane][3]
                    B[2 * t:2 * t + 2, g] = b[(lane, nt, ks, 0)]; B[2 * t + 8:2 * t + 10, g] = b[(lane, nt, ks, 1)]
                Dm = A @ B
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    c[lane, nt] += [Dm[g, 2 * t], Dm[g, 2 * t + 1], Dm[g + 8, 2 * t], Dm[g + 8, 2 * t + 1]]
        # the kernel's reading of c: rows wt*16 + g (+8), key columns wk*32 + nt*8 + 2*tig (+1)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for nt in range(4):
                for hr in range(2):
                    for cc in range(2):
                        tok = wt * 16 + g + 8 * hr
                        key = wk * 32 + nt * 8 + 2 * t + cc
                        want = q_sh[tok, :D] @ k_sh[key, :D]
                        if abs(c[lane, nt, 2 * hr + cc] - want) > 1e-9:
                            ok = False
print("fragment mapping", "OK" if ok else "WRONG")
raise SystemExit(0 if ok else 1)
