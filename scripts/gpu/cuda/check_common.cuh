#pragma once
// Shared by the standalone CUDA checks in scripts/gpu/cuda/ (each still compiles alone with one nvcc line: this
// header sits next to them): a CUDA error check that exits with status 2, a small deterministic RNG, the CPU top-k
// reference of one row (reference_row, in the kernels' key order and tie rule), and two timers:
// time_us (back-to-back calls: the inputs stay in L2 from one call to the next) and time_us_cold (L2 flushed before
// each call, as in a model where every layer reads its own cache: a 128K-cell layer's F32 index keys are 33.5 MB,
// the H200's L2 50 MB, the 16 layers' 536 MB).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); exit(2); } } while (0)

// The kernel headers launch through ggml's ggml_cuda_kernel_launch (ggml-cuda/common.cuh), whose two host helpers are
// defined in ggml-cuda.cu: these definitions stand in for them in a check, which does not link ggml (the checks
// that include no kernel header just do not call them)
[[noreturn]] void ggml_cuda_error(const char * stmt, const char * func, const char * file, int line, const char * msg) {
    fprintf(stderr, "CUDA error %s in %s at %s:%d: %s\n", msg, func, file, line, stmt);
    exit(2);
}
int ggml_cuda_get_device() {
    int id = 0;
    CK(cudaGetDevice(&id));
    return id;
}

// xorshift64: the same sequence on every machine (the checks' inputs are reproducible)
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static inline uint64_t rng() { rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17; return rng_state; }
static inline float urand() { return (rng() >> 40) * (1.0f / 16777216.0f); }
static inline float nrand() { float u = urand() + 1e-7f, v = urand(); return sqrtf(-2.f * logf(u)) * cosf(6.2831853f * v); }

// microseconds per call of launch() (returns nothing; checks its own errors): `warmup` untimed calls, then `reps`
// calls back to back between two events recorded on stream s
template <typename F> static double time_us(cudaStream_t s, int warmup, int reps, F launch) {
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    for (int r = 0; r < warmup; ++r) launch();
    CK(cudaEventRecord(e0, s));
    for (int r = 0; r < reps; ++r) launch();
    CK(cudaEventRecord(e1, s)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
    return 1e3 * ms / reps;
}

// reads n 16-byte words (the L2 flush: every line of the buffer is loaded, nothing is written unless the impossible
// happens)
static __global__ void check_l2_flush_kernel(const int4 * p, size_t n, int * sink) {
    int acc = 0;
    for (size_t i = (size_t) blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) {
        const int4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x7fffffff) {
        *sink = acc;
    }
}

// microseconds per call of launch() with a cold L2: before each of `reps` calls, a read of a buffer of 4x the L2
// size evicts the inputs; each call is timed alone between two events (so a call's launch gap is included, about
// 1-2 us more than back to back). `warmup` untimed calls first.
template <typename F> static double time_us_cold(cudaStream_t s, int warmup, int reps, F launch) {
    static int4 * buf = nullptr;
    static size_t n = 0;
    static int * sink = nullptr;
    if (buf == nullptr) {
        int dev = 0, l2 = 0;
        CK(cudaGetDevice(&dev));
        CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
        n = 4 * (size_t) (l2 > 0 ? l2 : 64 << 20) / sizeof(int4);
        CK(cudaMalloc(&buf, n * sizeof(int4)));
        CK(cudaMemset(buf, 1, n * sizeof(int4)));
        CK(cudaMalloc(&sink, sizeof(int)));
    }
    for (int r = 0; r < warmup; ++r) launch();
    double total_us = 0.0;
    for (int r = 0; r < reps; ++r) {
        check_l2_flush_kernel<<<1024, 256, 0, s>>>(buf, n, sink);
        total_us += time_us(s, 0, 1, launch);   // this call alone, after the flush
    }
    return total_us / reps;
}

// the order-preserving key of a float, as the top-k kernels' topk_radix_key
static inline uint32_t host_key(float v) {
    uint32_t b; memcpy(&b, &v, 4);
    return b ^ ((uint32_t) (-(int32_t) (b >> 31)) | 0x80000000u);
}

// the top-k reference of one row (topk_check.cu): the columns of the k largest values in the kernels'
// total order (host_key: -0 < +0), ties at the k-th value taken by the lowest columns, in ascending column order
static inline void reference_row(const float * row, int ncols, int k, std::vector<int> & out, std::vector<uint32_t> & keys) {
    keys.resize(ncols);
    for (int c = 0; c < ncols; ++c) keys[c] = host_key(row[c]);
    std::vector<uint32_t> tmp(keys);
    std::nth_element(tmp.begin(), tmp.begin() + (k - 1), tmp.end(), std::greater<uint32_t>());
    const uint32_t thr = tmp[k - 1];
    int n_gt = 0;
    for (int c = 0; c < ncols; ++c) n_gt += keys[c] > thr;
    int take_eq = k - n_gt;
    out.clear();
    for (int c = 0; c < ncols; ++c) {
        if (keys[c] > thr) out.push_back(c);
        else if (keys[c] == thr && take_eq > 0) { out.push_back(c); --take_eq; }
    }
}
