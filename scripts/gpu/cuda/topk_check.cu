// Standalone check + timing of the CUDA radix-select top-k used by the patched ggml (issue #6).
//
// Includes the kernel header of the patched llama.cpp (ggml/src/ggml-cuda/top-k-radix.cuh) — the runner
// scripts/gpu/cuda/run_cuda_check.sh topk extracts it from patches/llama.cpp/*.patch — and checks, on random rows of
// 4K..128K columns, 1 and 512 rows, k = 2048 (+ edge cases), that each output row is exactly
//   {columns with value > v_k} + the lowest-index columns with value == v_k (v_k: the k-th largest value,
//   in the kernel's total order: -0 < +0), in ascending column order,
// against a CPU reference. Inputs: Gaussian, DSA-like (ReLU-sums with exact zeros, -1e-30*p tie-break,
// +1e30 forced cells, -INF causal tail), heavily tied (16 levels), constant rows.
// Then it times the new path against the old one (what ggml used for ncols > 1024 with CCCL < 3.2: CUB
// DeviceRadixSort (1 row) / DeviceSegmentedSort (more rows, in 64 MiB chunks) + cudaMemcpy2DAsync of the
// first k), and the new path replayed from a captured CUDA graph (checks stream-capture compatibility).
// Where the one-kernel select applies (topk_radix_persist: all of a call's blocks resident at once, e.g. decode rows),
// it is checked the same way (stream and graph; its scratch filled with garbage before its own memset) and timed
// (columns 1kern_us, 1kern_graph); it is a cooperative launch, taken where the device supports those and holds the whole
// grid at once (topk_radix_persist_blocks_per_sm), as the patch decides. Where the one-cluster select applies (top-k-radix-cluster.cuh, the patch's default for
// the rows the one-kernel select does not take; rows up to 8 blocks of 1024 threads x 24 keys, 1 or many rows), the same (columns clus_us,
// clus_graph). Last, a sweep of the one-kernel select for one decode row over its keys per thread (1-16: fewer blocks
// per row with more keys each; the patch's DSA_TOPK_PERSIST_MIN_EPT), checked and timed. The one-block-per-row select
// (top-k-radix-rows.cuh: the patch's default for prefill rows) in every case, stream and graph, timed (columns rows_us,
// rows_graph).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I<dir with top-k-radix.cuh> topk_check.cu -o topk_check && ./topk_check
//   ./topk_check --quick      (fewer shapes)
//   ./topk_check --one NCOLS NROWS   (one DSA-like case, e.g. under ncu -k regex:topk_radix_rows)
// Exit status 0 iff every check passed.
#include "check_common.cuh"
#include "top-k-radix-persist.cuh" // includes top-k-radix.cuh
#include "top-k-radix-cluster.cuh" // the one-cluster candidate
#include "top-k-radix-rows.cuh"    // the one-block-per-row select (prefill rows)

#include <cub/cub.cuh>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <string>
#include <vector>


enum Kind { GAUSS, DSA, TIES, CONST };
static const char * kind_name(Kind k) { return k == GAUSS ? "gauss" : k == DSA ? "dsa" : k == TIES ? "ties" : "const"; }

static void fill(std::vector<float> & x, int ncols, int nrows, Kind kind) {
    x.resize((size_t) ncols * nrows);
    for (int r = 0; r < nrows; ++r) {
        float * row = x.data() + (size_t) r * ncols;
        const int visible = ncols - nrows + r + 1; // causal: last query row sees everything
        for (int c = 0; c < ncols; ++c) {
            float v;
            switch (kind) {
                case GAUSS: v = nrand(); break;
                case TIES:  v = (float) (rng() % 16) - 8.0f; break;
                case CONST: v = 0.5f; break;
                default: {
                    // sum_j w_j relu(q_j.k): exact zero for ~1/3 of the keys, then the mask
                    float s = 0.f;
                    for (int j = 0; j < 2; ++j) { float d = nrand(); s += (d > 0.f ? d : 0.f) * (0.5f + urand()); }
                    if (rng() % 3 == 0) s = 0.f;
                    if (c >= visible)                     v = -INFINITY;
                    else if (c < 4 || c > visible - 64)   v = s + 1e30f;       // sinks + local window
                    else                                  v = s + (-1e-30f * (float) c);
                }
            }
            row[c] = v;
        }
    }
}

// ---- old path (ggml argsort_f32_i32_cuda_cub, descending, + copy of the first k) ----
__global__ void init_idx(int * idx, int ncols, int nrows) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col < ncols) idx[(size_t) blockIdx.y * ncols + col] = col;
}
__global__ void init_off(int * off, int ncols, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) off[i] = i * ncols;
}
struct OldPath {
    int ncols, nrows, k, chunk;
    int *idx = nullptr, *sorted = nullptr, *off = nullptr; float *keys_out = nullptr; void * tmp = nullptr; size_t tmp_bytes = 0;
    OldPath(int ncols_, int nrows_, int k_) : ncols(ncols_), nrows(nrows_), k(k_) {
        chunk = std::min(std::max((int) ((1 << 26) / ((size_t) ncols * 4)), 1), nrows);
        CK(cudaMalloc(&idx, (size_t) ncols * chunk * 4)); CK(cudaMalloc(&sorted, (size_t) ncols * chunk * 4));
        CK(cudaMalloc(&keys_out, (size_t) ncols * chunk * 4)); CK(cudaMalloc(&off, (chunk + 1) * 4));
        size_t b1 = 0, b2 = 0;
        CK(cub::DeviceRadixSort::SortPairsDescending(nullptr, b1, (float *) nullptr, keys_out, idx, sorted, ncols, 0, 32));
        CK(cub::DeviceSegmentedSort::SortPairsDescending(nullptr, b2, (float *) nullptr, keys_out, idx, sorted,
                                                         ncols * chunk, chunk, off, off + 1));
        tmp_bytes = std::max(b1, b2); CK(cudaMalloc(&tmp, tmp_bytes));
    }
    ~OldPath() { cudaFree(idx); cudaFree(sorted); cudaFree(keys_out); cudaFree(off); cudaFree(tmp); }
    void run(const float * src, int * dst, cudaStream_t s) {
        for (int r0 = 0; r0 < nrows; r0 += chunk) {
            const int n = std::min(chunk, nrows - r0);
            init_idx<<<dim3((ncols + 255) / 256, n), 256, 0, s>>>(idx, ncols, n);
            size_t b = tmp_bytes;
            if (n == 1) {
                CK(cub::DeviceRadixSort::SortPairsDescending(tmp, b, src + (size_t) r0 * ncols, keys_out, idx, sorted, ncols, 0, 32, s));
            } else {
                init_off<<<(n + 256) / 256, 256, 0, s>>>(off, ncols, n);
                CK(cub::DeviceSegmentedSort::SortPairsDescending(tmp, b, src + (size_t) r0 * ncols, keys_out, idx, sorted,
                                                                 ncols * n, n, off, off + 1, s));
            }
            CK(cudaMemcpy2DAsync(dst + (size_t) r0 * k, k * 4, sorted, ncols * 4, k * 4, n, cudaMemcpyDeviceToDevice, s));
        }
    }
};

static int nsm_global = 0;
static bool coop_global = false;   // the device takes cooperative launches

struct Result { bool ok; double new_us, old_us, graph_us, persist_us, pgraph_us; bool persist; double clus_us, cgraph_us; bool clus; int ept, pbpr;
                double rows_us, rgraph_us; };

// sweep: the one-kernel select only, planned with at least min_ept keys per thread (topk_radix_persist_plan), timed
static Result run_case(int ncols, int nrows, int k, Kind kind, bool timing, bool sweep = false, int min_ept = 1) {
    std::vector<float> h;
    fill(h, ncols, nrows, kind);
    float * d_src; int * d_dst; void * d_scr;
    CK(cudaMalloc(&d_src, h.size() * 4));
    CK(cudaMalloc(&d_dst, (size_t) nrows * k * 4));
    const int bpr = topk_radix_blocks_per_row(ncols, nrows, nsm_global);
    CK(cudaMalloc(&d_scr, topk_radix_scratch_bytes(nrows, bpr)));
    CK(cudaMemcpy(d_src, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    std::vector<int> got((size_t) nrows * k);
    auto check = [&](const char * what) -> bool {
        CK(cudaMemcpy(got.data(), d_dst, got.size() * 4, cudaMemcpyDeviceToHost));
        std::vector<int> ref; std::vector<uint32_t> keys;
        int bad_rows = 0;
        for (int r = 0; r < nrows; ++r) {
            reference_row(h.data() + (size_t) r * ncols, ncols, k, ref, keys);
            if (memcmp(ref.data(), got.data() + (size_t) r * k, (size_t) k * 4) != 0) {
                if (bad_rows < 3) {
                    // distinguish "same set, other tie pick/order" from a wrong set (for the report)
                    std::vector<int> g(got.begin() + (size_t) r * k, got.begin() + (size_t) (r + 1) * k);
                    std::sort(g.begin(), g.end());
                    bool inrange = true; for (int c : g) inrange &= c >= 0 && c < ncols;
                    uint64_t sg = 0, sr = 0;
                    if (inrange) for (int i = 0; i < k; ++i) { sg += keys[g[i]]; sr += keys[ref[i]]; }
                    fprintf(stderr, "  MISMATCH %s row %d: same set after sort: %s; same key multiset: %s\n", what, r,
                            g == ref ? "yes" : "no", inrange && sg == sr ? "maybe" : "no");
                }
                ++bad_rows;
            }
        }
        if (bad_rows) fprintf(stderr, "  %s: %d/%d rows wrong\n", what, bad_rows, nrows);
        return bad_rows == 0;
    };

    // launch() on the stream, check; the same launch captured into a CUDA graph (as ggml's CUDA graphs do), replayed
    // twice, check; *ge: the instantiated graph (for the timing)
    auto check_stream_and_graph = [&](const char * what, const char * what_graph, auto launch, cudaGraph_t * g,
                                      cudaGraphExec_t * ge) -> bool {
        CK(cudaMemsetAsync(d_dst, 0xff, (size_t) nrows * k * 4, s));
        launch();
        CK(cudaStreamSynchronize(s));
        bool ok = check(what);
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
        launch();
        CK(cudaStreamEndCapture(s, g));
        CK(cudaGraphInstantiate(ge, *g, 0));
        CK(cudaMemsetAsync(d_dst, 0xff, (size_t) nrows * k * 4, s));
        CK(cudaGraphLaunch(*ge, s)); CK(cudaGraphLaunch(*ge, s));
        CK(cudaStreamSynchronize(s));
        return check(what_graph) && ok;
    };

    Result res{true, 0, 0, 0, 0, 0, false, 0, 0, false, 0, 0, 0, 0};
    auto run_new = [&] { CK(topk_radix_launch(d_src, d_dst, ncols, nrows, k, bpr, d_scr, s)); };
    cudaGraph_t g; cudaGraphExec_t ge;
    res.ok = check_stream_and_graph("stream", "graph", run_new, &g, &ge);

    // the one-kernel select (topk_radix_persist), where it applies: same checks, stream and graph
    int ept = 0, pbpr = 0;
    void * d_pscr = nullptr;
    cudaGraph_t pg = nullptr; cudaGraphExec_t pge = nullptr;
    auto run_persist = [&] { CK(topk_radix_persist_launch(d_src, d_dst, ncols, nrows, k, ept, pbpr, d_pscr, s, false)); };
    res.persist = coop_global && topk_radix_persist_plan(ncols, nrows, nsm_global, &ept, &pbpr, min_ept) &&
                  topk_radix_persist_blocks_per_sm(ept) * nsm_global >= nrows * pbpr;
    res.ept = ept;
    res.pbpr = pbpr;
    if (res.persist) {
        CK(cudaMalloc(&d_pscr, topk_radix_persist_scratch_bytes(nrows, pbpr)));
        CK(cudaMemsetAsync(d_pscr, 0xff, topk_radix_persist_scratch_bytes(nrows, pbpr), s)); // garbage before the memset
        res.ok = check_stream_and_graph("persist", "persist graph", run_persist, &pg, &pge) && res.ok;
    }

    // the one-cluster select, where it applies: same checks, stream and graph
    int cept = 0, cblk = 0;
    cudaGraph_t cg = nullptr; cudaGraphExec_t cge = nullptr;
    auto run_cluster = [&] { CK(topk_radix_cluster_launch(d_src, d_dst, ncols, nrows, k, cept, cblk, s)); };
    res.clus = !sweep && topk_radix_cluster_applies(ncols, nrows, k, &cept, &cblk);
    if (res.clus) {
        res.ok = check_stream_and_graph("cluster", "cluster graph", run_cluster, &cg, &cge) && res.ok;
    }

    // the one-block-per-row select: any shape; same checks, stream and graph
    cudaGraph_t rg = nullptr; cudaGraphExec_t rge = nullptr;
    auto run_rows = [&] { CK(topk_radix_rows_launch(d_src, d_dst, ncols, nrows, k, s)); };
    if (!sweep) {
        res.ok = check_stream_and_graph("rows", "rows graph", run_rows, &rg, &rge) && res.ok;
    }

    if (timing) {   // no warm-up: every path has run above
        const int reps = nrows == 1 ? 200 : 10;
        res.new_us   = time_us(s, 0, reps, run_new);
        res.graph_us = time_us(s, 0, reps, [&] { CK(cudaGraphLaunch(ge, s)); });
        if (res.persist) {
            res.persist_us = time_us(s, 0, reps, run_persist);
            res.pgraph_us  = time_us(s, 0, reps, [&] { CK(cudaGraphLaunch(pge, s)); });
        }
        if (res.clus) {
            res.clus_us   = time_us(s, 0, reps, run_cluster);
            res.cgraph_us = time_us(s, 0, reps, [&] { CK(cudaGraphLaunch(cge, s)); });
        }
        if (!sweep) {
            res.rows_us   = time_us(s, 0, reps, run_rows);
            res.rgraph_us = time_us(s, 0, reps, [&] { CK(cudaGraphLaunch(rge, s)); });
        }
        if (!sweep) {
            OldPath old(ncols, nrows, k);
            old.run(d_src, d_dst, s); CK(cudaStreamSynchronize(s));
            res.old_us = time_us(s, 0, reps, [&] { old.run(d_src, d_dst, s); });
        }
    }
    CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    if (pge) { CK(cudaGraphExecDestroy(pge)); CK(cudaGraphDestroy(pg)); }
    if (cge) { CK(cudaGraphExecDestroy(cge)); CK(cudaGraphDestroy(cg)); }
    if (rge) { CK(cudaGraphExecDestroy(rge)); CK(cudaGraphDestroy(rg)); }
    if (d_pscr) CK(cudaFree(d_pscr));
    CK(cudaStreamDestroy(s));
    CK(cudaFree(d_src)); CK(cudaFree(d_dst)); CK(cudaFree(d_scr));
    return res;
}

int main(int argc, char ** argv) {
    bool quick = argc > 1 && std::string(argv[1]) == "--quick";
    int dev = 0; CK(cudaGetDevice(&dev));
    cudaDeviceProp p; CK(cudaGetDeviceProperties(&p, dev));
    nsm_global = p.multiProcessorCount;
    printf("device: %s, %d SMs\n", p.name, nsm_global);
    int coop = 0; CK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
    coop_global = coop != 0;
    if (argc > 3 && std::string(argv[1]) == "--one") {
        // one DSA-like case, checked and timed (e.g. under a profiler: --one NCOLS NROWS)
        Result r = run_case(atoi(argv[2]), atoi(argv[3]), 2048, DSA, true);
        printf("DSA %s x %s: %s, cluster %.1f us, rows %.1f us\n", argv[2], argv[3], r.ok ? "ok" : "FAIL",
               r.clus_us, r.rows_us);
        return r.ok ? 0 : 1;
    }
    bool all_ok = true;

    // edge cases (correctness only)
    struct E { int ncols, nrows, k; Kind kind; } edges[] = {
        {1025, 1, 1, GAUSS}, {1025, 3, 1025, GAUSS}, {5000, 7, 7, TIES}, {4096, 2, 2048, CONST},
        {70001, 5, 2048, TIES}, {131072, 1, 2048, CONST}, {33333, 9, 4000, DSA}, {2049, 1, 2048, DSA}, {2500, 600, 2048, DSA},
        {131072, 1, 2048, TIES}, {131071, 1, 1, GAUSS}, {262144, 1, 2048, DSA}, {524288, 1, 2048, DSA}, {100000, 2, 99999, GAUSS},
        {4097, 1, 4097, DSA}, {65536, 1, 2048, GAUSS},
        {131328, 1, 2048, DSA}, {131328, 2, 2048, TIES}, {65536, 3, 2048, TIES}, {3000, 1, 3000, CONST}, {7000, 2, 5, DSA},
    };
    for (const E & e : edges) {
        Result r = run_case(e.ncols, e.nrows, e.k, e.kind, false);
        printf("edge  ncols=%6d nrows=%3d k=%5d %-5s : %s%s%s\n", e.ncols, e.nrows, e.k, kind_name(e.kind), r.ok ? "ok" : "FAIL",
               r.persist ? " (3-kernel and one-kernel)" : "", r.clus ? " (+ cluster)" : "");  // (+ rows: always)
        all_ok &= r.ok;
    }

    printf("%-6s %-7s %-5s %-5s %-4s %12s %12s %12s %8s %12s %12s %12s %12s %12s %12s\n", "kind", "ncols", "nrows", "k", "ok", "old_us",
           "new_us", "graph_us", "speedup", "1kern_us", "1kern_graph", "clus_us", "clus_graph", "rows_us", "rows_graph");
    std::vector<int> cols = quick ? std::vector<int>{4096, 65536} : std::vector<int>{4096, 16384, 32768, 65536, 131072};
    for (Kind kind : {DSA, GAUSS, TIES}) {
        for (int nrows : {1, 512}) {
            for (int ncols : cols) {
                if (kind != DSA && (ncols == 16384 || ncols == 32768)) continue;
                Result r = run_case(ncols, nrows, 2048, kind, true);
                printf("%-6s %-7d %-5d %-5d %-4s %12.1f %12.1f %12.1f %7.1fx %12.1f %12.1f %12.1f %12.1f %12.1f %12.1f\n", kind_name(kind),
                       ncols, nrows, 2048, r.ok ? "ok" : "FAIL", r.old_us, r.new_us, r.graph_us, r.old_us / r.new_us, r.persist_us,
                       r.pgraph_us, r.clus_us, r.cgraph_us, r.rows_us, r.rgraph_us);
                fflush(stdout);
                all_ok &= r.ok;
            }
        }
    }
    // the one-kernel select of one decode row with more keys per thread (fewer blocks per row):
    // DSA_TOPK_PERSIST_MIN_EPT in the patch; checked and timed (us per call, back to back and in a CUDA graph)
    printf("%-6s %-7s %-7s %-4s %-4s %-4s %12s %12s\n", "sweep", "ncols", "min_ept", "ept", "bpr", "ok", "1kern_us", "1kern_graph");
    for (int ncols : quick ? std::vector<int>{131072} : std::vector<int>{16384, 65536, 131072}) {
        int prev_ept = 0;
        for (int min_ept : {1, 2, 4, 8, 16}) {
            Result r = run_case(ncols, 1, 2048, DSA, true, true, min_ept);
            if (!r.persist || r.ept == prev_ept) continue;   // not applicable / the plan of a smaller min_ept
            prev_ept = r.ept;
            printf("%-6s %-7d %-7d %-4d %-4d %-4s %12.1f %12.1f\n", "DSA", ncols, min_ept, r.ept, r.pbpr, r.ok ? "ok" : "FAIL",
                   r.persist_us, r.pgraph_us);
            fflush(stdout);
            all_ok &= r.ok;
        }
    }
    printf("%s\n", all_ok ? "ALL OK" : "SOME CHECKS FAILED");
    return all_ok ? 0 : 1;
}
