// Standalone check + timing of the decode lightning-indexer kernel of the patched ggml (issue #6), to run on a GPU.
//
// Includes ggml/src/ggml-cuda/dsa-lightning-indexer-decode.cuh (scripts/gpu/cuda/run_cuda_check.sh lid extracts it from
// patches/llama.cpp/*.patch) and compares it, for one query token per stream, with
//  - "staged": a copy of the decode kernel the patch had before (sessions 5-7): the tile of keys staged in padded
//    shared memory one 16-byte load at a time, then every FMA reading both operands from shared memory;
//    the new kernel's scores must be BIT-EQUAL to it (same summation order), F32 and F16 keys;
//  - a double-precision CPU reference of sum_h (w_h * w_scale) * relu(q_h . k) + mask (relative error);
// and, where it applies (key rows of <= 128 bytes: F16 keys of D <= 64, F32 of D 32), the direct-load form of the same
// kernel (p.direct, where it applies), which must be BIT-EQUAL too, and its packed form (p.packed, F16 keys, 1 / 2 / 4
// heads), BIT-EQUAL as well; and, for F16 keys, the tensor-core kernel (p.mma; F16 q, so not bit-equal to the FP32
// kernels: its error against the double-precision reference relative to sum_h |w_h| |q_h| |k| must stay <= 1e-3,
// masked cells exact); and times them at 4K / 32K / 128K keys, D 32 / 64 / 128, H 4 (and H 8 / 16), 1 and 2 streams: back to back (the
// keys stay in L2 from call to call) and with a cold L2 (time_us_cold: as in a model, where each layer's keys come
// from HBM).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I<dir with dsa-lightning-indexer-decode.cuh> lid_check.cu
// Exit status 0 iff every case passes.
#include "check_common.cuh"
#include "dsa-lightning-indexer-decode.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

// ---------------------------------------------------------------- the earlier decode kernel (copy)
#define OLD_KPB(D) ((D) <= 64 ? 128 : 64)
template <typename T> __device__ __forceinline__ float old_f32(T x);
template <> __device__ __forceinline__ float old_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float old_f32<half>(half x) { return __half2float(x); }

template <int D, typename TK, typename TM>
__global__ void __launch_bounds__(OLD_KPB(D)) old_staged(const dsa_lid_params p) {
    constexpr int KPB = OLD_KPB(D);
    constexpr int EPV = 16/sizeof(TK);
    extern __shared__ float old_smem[];
    float * k_sh = old_smem;               // [KPB][D+1]
    float * q_sh = k_sh + KPB*(D + 1);     // [n_head][D]
    float * w_sh = q_sh + p.n_head*D;      // [n_head]
    const int tid = threadIdx.x;
    const int64_t s = blockIdx.z;
    const int64_t kv0 = (int64_t) blockIdx.x*KPB;
    const int n_k = (int) min((int64_t) KPB, p.n_kv - kv0);
    for (int i = tid; i < p.n_head*D; i += KPB) q_sh[i] = *(const float *) (p.q + (i % D)*4 + (i / D)*p.nbq1 + s*p.nbq3);
    for (int i = tid; i < p.n_head; i += KPB) w_sh[i] = *(const float *) (p.w + i*4 + s*p.nbw3) * p.w_scale;
    const char * kt = p.k + kv0*D*sizeof(TK) + s*p.nbk3;
    for (int i = tid; i < n_k*(D/EPV); i += KPB) {
        const uint4 u = *(const uint4 *) (kt + (size_t) i*16);
        float * row = k_sh + (i/(D/EPV))*(D + 1) + EPV*(i % (D/EPV));
        if constexpr (EPV == 4) {
            row[0] = __uint_as_float(u.x); row[1] = __uint_as_float(u.y); row[2] = __uint_as_float(u.z); row[3] = __uint_as_float(u.w);
        } else {
            const half2 * h2 = (const half2 *) &u;
            for (int j = 0; j < 4; ++j) { const float2 f = __half22float2(h2[j]); row[2*j] = f.x; row[2*j + 1] = f.y; }
        }
    }
    __syncthreads();
    if (tid >= n_k) return;
    const float * kr = k_sh + tid*(D + 1);
    float acc = 0.0f;
    for (int h = 0; h < p.n_head; ++h) {
        const float * qh = q_sh + h*D;
        float dot = 0.0f;
#pragma unroll 16
        for (int e = 0; e < D; ++e) dot += qh[e]*kr[e];
        acc += fmaxf(dot, 0.0f)*w_sh[h];
    }
    const int64_t i_kv = kv0 + tid;
    const TM m = ((const TM *) (p.m + (s % p.n_mask_streams)*p.nbm3))[i_kv];
    ((float *) (p.dst + s*p.nb3))[i_kv] = acc + old_f32<TM>(m);
}

template <typename TK, typename TM, int D>
static void launch_old(const dsa_lid_params & p, int n_stream, cudaStream_t st) {
    constexpr int KPB = OLD_KPB(D);
    const size_t smem = ((size_t) KPB*(D + 1) + (size_t) p.n_head*(D + 1))*4;
    old_staged<D, TK, TM><<<dim3((p.n_kv + KPB - 1)/KPB, 1, n_stream), KPB, smem, st>>>(p);
}
template <typename TK, typename TM>
static void run_old(const dsa_lid_params & p, int D, int n_stream, cudaStream_t st) {
    if (D == 32) launch_old<TK, TM, 32>(p, n_stream, st);
    else if (D == 64) launch_old<TK, TM, 64>(p, n_stream, st);
    else launch_old<TK, TM, 128>(p, n_stream, st);
}

static float to_float(float x) { return x; }
static float to_float(__half x) { return __half2float(x); }

// a DSA-like indexer mask value of cell j for a token at position p1: causal tail -INF, forced cells (4 sinks, a local
// window of 64) the bonus (1e30; 60000 for an F16 mask), else the position tie-break (0 for an F16 mask)
static float dsa_like_mask(const int j, const int p1, const bool mask_f16) {
    if (j > p1) {
        return -INFINITY;
    }
    const bool forced = j < 4 || j > p1 - 64;
    return mask_f16 ? (forced ? 60000.0f : 0.0f) : (forced ? 1e30f : -1e-30f*(float) j);
}

template <typename TK>
static int check(int D, int H, int N, int S, bool mask_f16) {
    std::vector<float> q((size_t) S*H*D), w((size_t) S*H), mf((size_t) S*N);
    std::vector<TK> k((size_t) S*N*D);
    for (auto & x : q) x = nrand();
    for (auto & x : k) x = (TK) nrand();
    for (auto & x : w) x = nrand();
    const float w_scale = 1.0f/std::sqrt((float) (H*D));
    for (int s = 0; s < S; ++s) for (int j = 0; j < N; ++j) {
        mf[(size_t) s*N + j] = dsa_like_mask(j, N - 1 - 3*s, mask_f16);
    }
    std::vector<__half> mh(mf.size());
    for (size_t i = 0; i < mf.size(); ++i) mh[i] = __float2half(mf[i]);

    char *dq, *dk, *dw, *dm, *d0, *d1, *d2;
    CK(cudaMalloc(&dq, q.size()*4)); CK(cudaMalloc(&dk, k.size()*sizeof(TK))); CK(cudaMalloc(&dw, w.size()*4));
    CK(cudaMalloc(&dm, mf.size()*4)); CK(cudaMalloc(&d0, (size_t) S*N*4)); CK(cudaMalloc(&d1, (size_t) S*N*4));
    CK(cudaMalloc(&d2, (size_t) S*N*4));
    CK(cudaMemcpy(dq, q.data(), q.size()*4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, k.data(), k.size()*sizeof(TK), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dw, w.data(), w.size()*4, cudaMemcpyHostToDevice));
    if (mask_f16) CK(cudaMemcpy(dm, mh.data(), mh.size()*2, cudaMemcpyHostToDevice));
    else          CK(cudaMemcpy(dm, mf.data(), mf.size()*4, cudaMemcpyHostToDevice));

    dsa_lid_params p = {};
    p.q = dq; p.k = dk; p.w = dw; p.m = dm; p.dst = d1;
    p.n_head = H; p.n_kv = N; p.n_mask_streams = S;
    p.nbq1 = (size_t) D*4; p.nbq3 = (size_t) H*D*4; p.nbk3 = (size_t) N*D*sizeof(TK); p.nbw3 = (size_t) H*4;
    p.nbm3 = (size_t) N*(mask_f16 ? 2 : 4); p.nb3 = (size_t) N*4; p.w_scale = w_scale;
    dsa_lid_params p_old = p; p_old.dst = d0;
    dsa_lid_params p_dir = p; p_dir.dst = d2; p_dir.direct = true;
    const bool direct = dsa_lid_direct_applies(D, sizeof(TK));
    char * d3;
    CK(cudaMalloc(&d3, (size_t) S*N*4));
    dsa_lid_params p_pk = p_dir; p_pk.dst = d3; p_pk.packed = true;
    const bool packed = direct && sizeof(TK) == 2 && dsa_lid_packed_heads(H);
    char * d4;
    CK(cudaMalloc(&d4, (size_t) S*N*4));
    dsa_lid_params p_mma = p; p_mma.dst = d4; p_mma.mma = true;
    const bool mma = dsa_lid_mma_applies(p_mma, D, sizeof(TK));

    cudaStream_t st; CK(cudaStreamCreate(&st));
    auto launch = [&](const dsa_lid_params & pp) {
        cudaError_t e = mask_f16 ? dsa_lid_launch<TK, __half>(pp, D, S, st) : dsa_lid_launch<TK, float>(pp, D, S, st);
        if (e != cudaSuccess) { fprintf(stderr, "launch: %s\n", cudaGetErrorString(e)); exit(2); }
    };
    auto run_new  = [&]() { launch(p); };
    auto run_dir  = [&]() { launch(p_dir); };
    auto run_pk   = [&]() { launch(p_pk); };
    auto run_mma  = [&]() { launch(p_mma); };
    auto run_o = [&]() { if (mask_f16) run_old<TK, __half>(p_old, D, S, st); else run_old<TK, float>(p_old, D, S, st); };
    CK(cudaMemset(d0, 0xff, (size_t) S*N*4)); CK(cudaMemset(d1, 0xff, (size_t) S*N*4)); CK(cudaMemset(d2, 0xff, (size_t) S*N*4));
    CK(cudaMemset(d3, 0xff, (size_t) S*N*4)); CK(cudaMemset(d4, 0xff, (size_t) S*N*4));
    run_o(); run_new(); if (direct) run_dir(); if (packed) run_pk(); if (mma) run_mma();
    CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
    std::vector<float> o0((size_t) S*N), o1((size_t) S*N), o2((size_t) S*N), o3((size_t) S*N), o4((size_t) S*N);
    CK(cudaMemcpy(o4.data(), d4, o4.size()*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o3.data(), d3, o3.size()*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o0.data(), d0, o0.size()*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o1.data(), d1, o1.size()*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o2.data(), d2, o2.size()*4, cudaMemcpyDeviceToHost));
    const bool same     = memcmp(o0.data(), o1.data(), o0.size()*4) == 0;
    const bool same_dir = !direct || memcmp(o0.data(), o2.data(), o0.size()*4) == 0;
    const bool same_pk  = !packed || memcmp(o0.data(), o3.data(), o0.size()*4) == 0;
    int bad = (same ? 0 : 1) + (same_dir ? 0 : 1) + (same_pk ? 0 : 1);
    double err = 0, err_mma = 0;
    int bad_mma = 0;
    for (int s = 0; s < S; ++s) for (int j = 0; j < N; j += 7) {
        double acc = 0, scale = 0;
        for (int h = 0; h < H; ++h) {
            double dot = 0, qq = 0, kk = 0;
            for (int e = 0; e < D; ++e) {
                const double qe = q[((size_t) s*H + h)*D + e], ke = to_float(k[((size_t) s*N + j)*D + e]);
                dot += qe*ke; qq += qe*qe; kk += ke*ke;
            }
            acc += std::max(dot, 0.0)*(double) (w[(size_t) s*H + h]*w_scale);
            scale += std::fabs((double) (w[(size_t) s*H + h]*w_scale))*std::sqrt(qq*kk);
        }
        const double m = mask_f16 ? (double) __half2float(mh[(size_t) s*N + j]) : mf[(size_t) s*N + j];
        const double ref = acc + m, got = o1[(size_t) s*N + j], got_mma = o4[(size_t) s*N + j];
        if (std::isinf(ref) || std::fabs(m) > 1e4) {
            if (!(got == ref || std::fabs(got - ref) <= 1e-6*std::fabs(ref))) ++bad;
            if (mma && !(got_mma == ref || std::fabs(got_mma - ref) <= 1e-6*std::fabs(ref))) ++bad_mma;
            continue;
        }
        const double e = std::fabs(got - ref)/(1e-3 + std::fabs(acc));
        err = std::max(err, e);
        if (e > 1e-3) ++bad;   // as li_check.cu: FP32 sums of D*H products (the old kernel, bit-equal, has the same error)
        if (mma) {
            // F16 q (relative rounding <= 2^-11 per element) and the tensor cores' F32 sums: the error of a dot is at most
            // ~2^-11 |q| |k| (Cauchy-Schwarz), so the score's is bounded relative to sum_h |w_h| |q_h| |k|
            const double em = std::fabs(got_mma - ref)/(1e-30 + scale);
            err_mma = std::max(err_mma, em);
            if (!(em <= 1e-3)) ++bad_mma;
        }
    }
    bad += bad_mma;
    auto time_it = [&](auto f) { return (float) time_us(st, 5, 100, f); };
    auto time_cold = [&](auto f) { return (float) time_us_cold(st, 2, 50, f); };
    const float us[2] = {time_it(run_o), time_it(run_new)};
    const float cold[2] = {time_cold(run_o), time_cold(run_new)};
    const double gb = (double) S*N*(D*sizeof(TK) + (mask_f16 ? 2 : 4) + 4)/1e9;   // keys + mask read, scores written
    const float us_dir   = direct ? time_it(run_dir) : 0.0f;
    const float cold_dir = direct ? time_cold(run_dir) : 0.0f;
    printf("%-4d %-3d %-2d %-7d %-4s %-4s %9.2f %9.2f %7.2fx %8.0f | %9.2f %9.2f %8.0f | %9.2e %s", D, H, S, N,
           sizeof(TK) == 4 ? "f32" : "f16", mask_f16 ? "f16" : "f32", us[0], us[1], us[0]/us[1], gb/(us[1]*1e-6),
           cold[0], cold[1], gb/(cold[1]*1e-6), err, same ? "bit-equal" : "NOT BIT-EQUAL");
    if (direct) {
        printf(" | direct %9.2f cold %9.2f %s", us_dir, cold_dir, same_dir ? "bit-equal" : "NOT BIT-EQUAL");
    }
    if (packed) {
        printf(" | packed %9.2f cold %9.2f %s", time_it(run_pk), time_cold(run_pk), same_pk ? "bit-equal" : "NOT BIT-EQUAL");
    }
    if (mma) {
        printf(" | mma %9.2f cold %9.2f err/scale %8.2e %s", time_it(run_mma), time_cold(run_mma), err_mma,
               bad_mma ? "FAIL" : "ok");
    }
    printf("\n");
    CK(cudaFree(dq)); CK(cudaFree(dk)); CK(cudaFree(dw)); CK(cudaFree(dm)); CK(cudaFree(d0)); CK(cudaFree(d1)); CK(cudaFree(d2));
    CK(cudaFree(d3)); CK(cudaFree(d4)); CK(cudaStreamDestroy(st));
    return bad;
}

int main(int argc, char ** argv) {
    const bool quick = argc > 1 && !strcmp(argv[1], "--quick");
    int bad = 0;
    printf("%-4s %-3s %-2s %-7s %-4s %-4s %9s %9s %8s %8s | %9s %9s %8s | %9s %s\n", "D", "H", "S", "n_kv", "K", "mask",
           "old_us", "new_us", "speedup", "GB/s", "old_cold", "new_cold", "GB/s", "rel_err", "new vs old");
    for (int N : quick ? std::vector<int>{32768, 131072} : std::vector<int>{4096, 32768, 131072}) {
        for (int D : {64, 128, 32}) {
            bad += check<float>(D, 4, N, 1, false);
            bad += check<__half>(D, 4, N, 1, false);
        }
    }
    bad += check<float>(64, 4, 1000, 1, false);     // partial last tile
    bad += check<float>(128, 4, 777, 2, false);     // partial tile, 2 streams
    bad += check<__half>(64, 8, 32768, 2, true);    // 8 heads, 2 streams, F16 mask
    bad += check<__half>(64, 4, 33000, 2, true);    // packed: 2 streams, F16 mask, partial last tile
    bad += check<__half>(64, 2, 5000, 1, false);    // packed: 2 heads
    bad += check<__half>(32, 1, 4096, 1, false);    // packed: 1 head, D 32
    bad += check<float>(64, 16, 32768, 1, false);   // 16 heads
    bad += check<__half>(64, 16, 32768, 1, false);  // mma: 16 heads (rows g + 8 of the fragment)
    bad += check<__half>(128, 8, 777, 2, true);     // mma: D 128, 8 heads, partial block, 2 streams, F16 mask
    bad += check<__half>(64, 4, 1001, 1, false);    // mma: odd tail (the last group's second key)
    printf(bad ? "MISMATCHES: %d\n" : "ALL OK\n", bad);
    return bad ? 1 : 0;
}
