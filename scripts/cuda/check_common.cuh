#pragma once
// Shared by the standalone CUDA checks in scripts/cuda/ (each still compiles alone with one nvcc line: this
// header sits next to them): a CUDA error check that exits with status 2, a small deterministic RNG, and a timer.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); exit(2); } } while (0)

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
