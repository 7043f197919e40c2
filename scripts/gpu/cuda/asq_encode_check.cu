// Standalone check + timing of the ASQ encode kernel (issue #7's open decode-speed goal), to run on a GPU:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 scripts/gpu/cuda/asq_encode_check.cu -o asq_encode_check && ./asq_encode_check
//
// "old" is a copy of the patch's dsa_asq_encode_kernel (ggml/src/ggml-cuda/dsa-asq.cu: one warp per vector,
// the C prototypes walked one after another, a warp reduction each). On one H200 the ASQ cache decoded
// 1.1-1.6 ms/token slower than a q4_0 cache (docs/history §7), most likely this kernel at decode
// (1 token = n_head_kv warps, latency-bound). "new" is the proposed replacement: one block per vector, the
// threads split the prototypes (each sums its own distance over head_dim), one argmin reduction (ties ->
// lower c), then the residual / scale / levels as before. NOT yet in the patch: it moves there once this
// check passes on a GPU. Both are compared with a CPU reference of FORMAT.md section 6 (codes equal, or an
// exact-distance tie within float rounding; then scale and levels byte-equal), and timed for 1 and 512 tokens.
#include "check_common.cuh"
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>


#define WARP_SIZE 32
#define MAX_PER_LANE 8

// ---------------------------------------------------------------- old (copy of the patch's kernel)
static __device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}
static __device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    return x;
}

template <int bits>
__global__ void encode_old(const float * __restrict__ src, const float * __restrict__ P, uint8_t * __restrict__ dst,
                           int hd, int n_head, int n_tok, int C) {
    const int64_t w = (int64_t) blockIdx.x*(blockDim.x/WARP_SIZE) + threadIdx.x/WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (w >= (int64_t) n_head*n_tok) return;
    const int t = (int) (w / n_head), h = (int) (w % n_head);
    constexpr int Q = (1 << (bits - 1)) - 1;
    const int npl = hd / WARP_SIZE;
    float v[MAX_PER_LANE];
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; ++k) if (k < npl) v[k] = src[((int64_t) t*n_head + h)*hd + lane + k*WARP_SIZE];
    const float * Ph = P + (int64_t) h*C*hd;
    int best = 0; float best_d = INFINITY;
    for (int c = 0; c < C; ++c) {
        float d = 0.0f;
#pragma unroll
        for (int k = 0; k < MAX_PER_LANE; ++k) if (k < npl) { const float e = v[k] - Ph[c*hd + lane + k*WARP_SIZE]; d += e*e; }
        d = warp_sum(d);
        if (d < best_d) { best_d = d; best = c; }
    }
    const float * pc = Ph + best*hd;
    float r[MAX_PER_LANE]; float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; ++k) if (k < npl) { r[k] = v[k] - pc[lane + k*WARP_SIZE]; amax = fmaxf(amax, fabsf(r[k])); }
    amax = warp_max(amax);
    const half d16 = __float2half_rn(__fdiv_rn(amax, (float) Q));
    const float d = __half2float(d16);
    uint8_t * out = dst + ((int64_t) t*n_head + h)*(3 + hd*bits/8);
    if (lane == 0) { const uint16_t b = __half_as_ushort(d16); out[0] = (uint8_t) best; out[1] = b & 0xFF; out[2] = b >> 8; }
    uint8_t * qs = out + 3;
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; ++k) if (k < npl) {
        int q = 0;
        if (d > 0.0f) { q = (int) roundf(__fdiv_rn(r[k], d)); q = max(-Q, min(Q, q)); }
        const int i = lane + k*WARP_SIZE;
        if (bits == 4) { const int qn = __shfl_down_sync(0xffffffff, q, 1); if ((lane & 1) == 0) qs[i/2] = (uint8_t) ((q + 8) | ((qn + 8) << 4)); }
        else qs[i] = (uint8_t) (int8_t) q;
    }
}

// ---------------------------------------------------------------- new (proposed): prototypes over the threads
#define NEW_THREADS 128
template <int bits>
__global__ void __launch_bounds__(NEW_THREADS) encode_new(const float * __restrict__ src, const float * __restrict__ P,
                                                          uint8_t * __restrict__ dst, int hd, int n_head, int C) {
    const int t = blockIdx.x / n_head, h = blockIdx.x % n_head, tid = threadIdx.x;
    constexpr int Q = (1 << (bits - 1)) - 1;
    __shared__ float v[256];
    __shared__ float red_d[NEW_THREADS];
    __shared__ int   red_c[NEW_THREADS];
    __shared__ float red_a[NEW_THREADS];
    const float * x = src + ((int64_t) t*n_head + h)*hd;
    for (int i = tid; i < hd; i += NEW_THREADS) v[i] = x[i];
    __syncthreads();
    const float * Ph = P + (int64_t) h*C*hd;
    // each thread: its prototypes c = tid, tid + NEW_THREADS (C <= 256), full distance summed in order over i
    float best_d = INFINITY; int best = C;
    for (int c = tid; c < C; c += NEW_THREADS) {
        const float * pc = Ph + (int64_t) c*hd;
        float d = 0.0f;
        for (int i = 0; i < hd; i += 4) {
            const float4 p = *(const float4 *) (pc + i);   // hd % 4 == 0 and 16-byte aligned rows
            const float e0 = v[i] - p.x, e1 = v[i + 1] - p.y, e2 = v[i + 2] - p.z, e3 = v[i + 3] - p.w;
            d += e0*e0; d += e1*e1; d += e2*e2; d += e3*e3;
        }
        if (d < best_d) { best_d = d; best = c; }            // c increases: ties keep the lower c
    }
    red_d[tid] = best_d; red_c[tid] = best;
    __syncthreads();
    for (int s = NEW_THREADS/2; s > 0; s >>= 1) {
        if (tid < s) {
            const float d2 = red_d[tid + s]; const int c2 = red_c[tid + s];
            if (d2 < red_d[tid] || (d2 == red_d[tid] && c2 < red_c[tid])) { red_d[tid] = d2; red_c[tid] = c2; }
        }
        __syncthreads();
    }
    const int code = red_c[0];
    const float * pc = Ph + (int64_t) code*hd;
    float amax = 0.0f;
    for (int i = tid; i < hd; i += NEW_THREADS) amax = fmaxf(amax, fabsf(v[i] - pc[i]));
    red_a[tid] = amax;
    __syncthreads();
    for (int s = NEW_THREADS/2; s > 0; s >>= 1) { if (tid < s) red_a[tid] = fmaxf(red_a[tid], red_a[tid + s]); __syncthreads(); }
    const half d16 = __float2half_rn(__fdiv_rn(red_a[0], (float) Q));
    const float d = __half2float(d16);
    uint8_t * out = dst + ((int64_t) t*n_head + h)*(3 + hd*bits/8);
    if (tid == 0) { const uint16_t b = __half_as_ushort(d16); out[0] = (uint8_t) code; out[1] = b & 0xFF; out[2] = b >> 8; }
    auto level = [&](int i) {
        int q = 0;
        if (d > 0.0f) { q = (int) roundf(__fdiv_rn(v[i] - pc[i], d)); q = max(-Q, min(Q, q)); }
        return q;
    };
    uint8_t * qs = out + 3;
    if (bits == 4) { for (int j = tid; j < hd/2; j += NEW_THREADS) qs[j] = (uint8_t) ((level(2*j) + 8) | ((level(2*j + 1) + 8) << 4)); }
    else           { for (int i = tid; i < hd; i += NEW_THREADS) qs[i] = (uint8_t) (int8_t) level(i); }
}

// ---------------------------------------------------------------- CPU reference (FORMAT.md section 6)
static uint16_t f32_to_f16_bits(float f) { return __half_as_ushort(__float2half_rn(f)); }   // host-callable in cuda_fp16.h
static float f16_bits_to_f32(uint16_t b) { return __half2float(__ushort_as_half(b)); }

static void cpu_encode(const float * v, const float * Ph, int hd, int C, int bits, uint8_t * out, std::vector<double> & dist) {
    const int Q = (1 << (bits - 1)) - 1;
    dist.assign(C, 0.0);
    int best = 0;
    for (int c = 0; c < C; ++c) {
        double d = 0;
        for (int i = 0; i < hd; ++i) { const double e = (double) v[i] - Ph[c*hd + i]; d += e*e; }
        dist[c] = d;
        if (d < dist[best]) best = c;
    }
    const float * pc = Ph + best*hd;
    float amax = 0;
    for (int i = 0; i < hd; ++i) amax = std::max(amax, std::fabs(v[i] - pc[i]));
    const uint16_t db = f32_to_f16_bits(amax / (float) Q);
    const float d = f16_bits_to_f32(db);
    out[0] = (uint8_t) best; out[1] = db & 0xFF; out[2] = db >> 8;
    for (int i = 0; i < hd; ++i) {
        int q = 0;
        if (d > 0) q = std::min(Q, std::max(-Q, (int) std::round((v[i] - pc[i]) / d)));
        if (bits == 4) { if (i % 2 == 0) out[3 + i/2] = (uint8_t) (q + 8); else out[3 + i/2] |= (uint8_t) ((q + 8) << 4); }
        else out[3 + i] = (uint8_t) (int8_t) q;
    }
}

// a GPU vector is accepted if it equals the CPU bytes, or if its code is a float-rounding tie of the best
// distance (then it is re-encoded on the CPU with that code and must equal that)
static int compare(const std::vector<uint8_t> & gpu, const std::vector<float> & src, const std::vector<float> & P,
                   int hd, int n_head, int n_tok, int C, int bits) {
    const int vb = 3 + hd*bits/8;
    std::vector<uint8_t> ref(vb);
    std::vector<double> dist;
    int bad = 0;
    for (int t = 0; t < n_tok; ++t) for (int h = 0; h < n_head; ++h) {
        const float * v = &src[((size_t) t*n_head + h)*hd];
        const float * Ph = &P[(size_t) h*C*hd];
        cpu_encode(v, Ph, hd, C, bits, ref.data(), dist);
        const uint8_t * g = &gpu[((size_t) t*n_head + h)*vb];
        if (memcmp(g, ref.data(), vb) == 0) continue;
        const int gc = g[0];
        const double dmin = *std::min_element(dist.begin(), dist.end());
        if (gc < C && gc != ref[0] && dist[gc] <= dmin*(1 + 1e-5)) {
            std::vector<float> Pone(Ph + (size_t) gc*hd, Ph + (size_t) (gc + 1)*hd);   // re-encode with the GPU's code
            std::vector<uint8_t> ref2(vb);
            cpu_encode(v, Pone.data(), hd, 1, bits, ref2.data(), dist);
            ref2[0] = (uint8_t) gc;
            if (memcmp(g, ref2.data(), vb) == 0) continue;
        }
        ++bad;
    }
    return bad;
}

template <int bits>
static void launch(bool use_new, const float * s, const float * p, uint8_t * d, int hd, int n_head, int n_tok, int C, cudaStream_t st) {
    if (use_new) encode_new<bits><<<n_tok*n_head, NEW_THREADS, 0, st>>>(s, p, d, hd, n_head, C);
    else { const int wpb = 4; encode_old<bits><<<(n_tok*n_head + wpb - 1)/wpb, wpb*WARP_SIZE, 0, st>>>(s, p, d, hd, n_head, n_tok, C); }
}

int main() {
    std::mt19937 rng(0);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    int fails = 0;
    printf("%-4s %-4s %-5s %-5s %-6s %-8s %-8s %10s %10s %8s\n", "bits", "hd", "C", "heads", "tokens", "old_bad", "new_bad",
           "old_us", "new_us", "speedup");
    for (int bits : {4, 8}) for (int hd : {64, 128}) for (int C : {16, 64, 256}) for (int n_tok : {1, 512}) {
        const int n_head = 8, vb = 3 + hd*bits/8;
        std::vector<float> src((size_t) n_tok*n_head*hd), P((size_t) n_head*C*hd);
        for (auto & x : P) x = 0.5f*nd(rng);
        for (int t = 0; t < n_tok; ++t) for (int h = 0; h < n_head; ++h) {   // near a prototype + noise, as real K/V
            const int c = rng() % C;
            for (int i = 0; i < hd; ++i) src[((size_t) t*n_head + h)*hd + i] = P[((size_t) h*C + c)*hd + i] + 0.1f*nd(rng);
        }
        if (n_tok > 1) for (int i = 0; i < hd; ++i) src[i] = P[i];          // an exact prototype: residual 0, d = 0
        float *ds, *dp; uint8_t *dd;
        CK(cudaMalloc(&ds, src.size()*4)); CK(cudaMalloc(&dp, P.size()*4)); CK(cudaMalloc(&dd, (size_t) n_tok*n_head*vb));
        CK(cudaMemcpy(ds, src.data(), src.size()*4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dp, P.data(), P.size()*4, cudaMemcpyHostToDevice));
        cudaStream_t st; CK(cudaStreamCreate(&st));
        int bad[2]; float us[2];
        for (int k = 0; k < 2; ++k) {
            CK(cudaMemset(dd, 0xAB, (size_t) n_tok*n_head*vb));
            if (bits == 4) launch<4>(k, ds, dp, dd, hd, n_head, n_tok, C, st); else launch<8>(k, ds, dp, dd, hd, n_head, n_tok, C, st);
            CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
            std::vector<uint8_t> out((size_t) n_tok*n_head*vb);
            CK(cudaMemcpy(out.data(), dd, out.size(), cudaMemcpyDeviceToHost));
            bad[k] = compare(out, src, P, hd, n_head, n_tok, C, bits);
            cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
            const int reps = 200;
            CK(cudaEventRecord(e0, st));
            for (int r = 0; r < reps; ++r) { if (bits == 4) launch<4>(k, ds, dp, dd, hd, n_head, n_tok, C, st); else launch<8>(k, ds, dp, dd, hd, n_head, n_tok, C, st); }
            CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); us[k] = 1000*ms/reps;
            CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
        }
        fails += bad[0] + bad[1];
        printf("%-4d %-4d %-5d %-5d %-6d %-8d %-8d %10.2f %10.2f %7.1fx\n", bits, hd, C, n_head, n_tok, bad[0], bad[1], us[0], us[1], us[0]/us[1]);
        CK(cudaFree(ds)); CK(cudaFree(dp)); CK(cudaFree(dd)); CK(cudaStreamDestroy(st));
    }
    printf(fails ? "MISMATCHES: %d\n" : "ALL OK\n", fails);
    return fails ? 1 : 0;
}
