// Standalone check + timing of the decode lightning-indexer kernel of the patched ggml (issue #6), to run on a GPU.
//
// Includes ggml/src/ggml-cuda/dsa-lightning-indexer-decode.cuh (scripts/gpu/cuda/run_cuda_check.sh lid extracts it from
// patches/llama.cpp/*.patch) and compares it, for one query token per stream, with
//  - "staged": a copy of the decode kernel the patch had before (sessions 5-7): the tile of keys staged in padded
//    shared memory one 16-byte load at a time, then every FMA reading both operands from shared memory;
//    the new kernel's scores must be BIT-EQUAL to it (same summation order), F32 and F16 keys;
//  - a double-precision CPU reference of sum_h (w_h * w_scale) * relu(q_h . k) + mask (relative error);
// and, where it applies (key rows of <= 128 bytes: F16 keys of D <= 64, F32 of D 32), the direct-load form of the same
// kernel (p.direct, the patch's default; LLAMA_DSA_LID_DIRECT=0 turns it off), which must be BIT-EQUAL too, and its
// packed form (p.packed, F16 keys, 1 / 2 / 4 heads; LLAMA_DSA_LID_PACKED=0 turns it off), BIT-EQUAL as well;
// and, for F16 keys, the tensor-core kernel in both key-load layouts (p.mma 1 / 2; the op: LLAMA_DSA_LID_MMA, default
// 2; F16 q, so not bit-equal to the FP32 kernels: its error against the double-precision reference relative to
// sum_h |w_h| |q_h| |k| must stay <= 1e-3 in each layout, masked cells exact; the layouts map the dims onto the mma's
// k index differently, so their sums round differently: bit-equal to each other only at D 32, where they coincide);
// and times them at 4K / 32K / 128K keys, D 32 / 64 / 128, H 4 (and H 8 / 16), 1 and 2 streams: back to back (the
// keys stay in L2 from call to call) and with a cold L2 (time_us_cold: as in a model, where each layer's keys come
// from HBM).
//
// and the tensor-core kernel's key block (LLAMA_DSA_LID_KFOLD; check_kfold below says what it checks).
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
    dsa_lid_params p_mma = p; p_mma.dst = d4; p_mma.mma = 1;
    const bool mma = dsa_lid_mma_applies(p_mma, D, sizeof(TK));
    char * d5;
    CK(cudaMalloc(&d5, (size_t) S*N*4));
    dsa_lid_params p_mma2 = p_mma; p_mma2.dst = d5; p_mma2.mma = 2;

    cudaStream_t st; CK(cudaStreamCreate(&st));
    auto launch = [&](const dsa_lid_params & pp) {
        cudaError_t e = mask_f16 ? dsa_lid_launch<TK, __half>(pp, D, S, st) : dsa_lid_launch<TK, float>(pp, D, S, st);
        if (e != cudaSuccess) { fprintf(stderr, "launch: %s\n", cudaGetErrorString(e)); exit(2); }
    };
    auto run_new  = [&]() { launch(p); };
    auto run_dir  = [&]() { launch(p_dir); };
    auto run_pk   = [&]() { launch(p_pk); };
    auto run_mma  = [&]() { launch(p_mma); };
    auto run_mma2 = [&]() { launch(p_mma2); };
    auto run_o = [&]() { if (mask_f16) run_old<TK, __half>(p_old, D, S, st); else run_old<TK, float>(p_old, D, S, st); };
    CK(cudaMemset(d0, 0xff, (size_t) S*N*4)); CK(cudaMemset(d1, 0xff, (size_t) S*N*4)); CK(cudaMemset(d2, 0xff, (size_t) S*N*4));
    CK(cudaMemset(d3, 0xff, (size_t) S*N*4)); CK(cudaMemset(d4, 0xff, (size_t) S*N*4)); CK(cudaMemset(d5, 0xee, (size_t) S*N*4));
    run_o(); run_new(); if (direct) run_dir(); if (packed) run_pk(); if (mma) { run_mma(); run_mma2(); }
    CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
    std::vector<float> o0((size_t) S*N), o1((size_t) S*N), o2((size_t) S*N), o3((size_t) S*N), o4((size_t) S*N), o5((size_t) S*N);
    CK(cudaMemcpy(o4.data(), d4, o4.size()*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o5.data(), d5, o5.size()*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o3.data(), d3, o3.size()*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o0.data(), d0, o0.size()*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o1.data(), d1, o1.size()*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o2.data(), d2, o2.size()*4, cudaMemcpyDeviceToHost));
    const bool same     = memcmp(o0.data(), o1.data(), o0.size()*4) == 0;
    const bool same_dir = !direct || memcmp(o0.data(), o2.data(), o0.size()*4) == 0;
    const bool same_pk  = !packed || memcmp(o0.data(), o3.data(), o0.size()*4) == 0;
    const bool same_mma = !mma || memcmp(o4.data(), o5.data(), o4.size()*4) == 0;
    int bad = (same ? 0 : 1) + (same_dir ? 0 : 1) + (same_pk ? 0 : 1) + (mma && D == 32 && !same_mma ? 1 : 0);
    double err = 0, err_mma = 0, err_mma2 = 0;
    int bad_mma = 0, bad_mma2 = 0;
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
        const double ref = acc + m, got = o1[(size_t) s*N + j], got_mma = o4[(size_t) s*N + j], got_mma2 = o5[(size_t) s*N + j];
        if (std::isinf(ref) || std::fabs(m) > 1e4) {
            if (!(got == ref || std::fabs(got - ref) <= 1e-6*std::fabs(ref))) ++bad;
            if (mma && !(got_mma == ref || std::fabs(got_mma - ref) <= 1e-6*std::fabs(ref))) ++bad_mma;
            if (mma && !(got_mma2 == ref || std::fabs(got_mma2 - ref) <= 1e-6*std::fabs(ref))) ++bad_mma2;
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
            const double em2 = std::fabs(got_mma2 - ref)/(1e-30 + scale);
            err_mma2 = std::max(err_mma2, em2);
            if (!(em2 <= 1e-3)) ++bad_mma2;
        }
    }
    bad += bad_mma + bad_mma2;
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
        printf(" | mma %9.2f cold %9.2f err/scale %8.2e %s | mma2 %9.2f cold %9.2f err/scale %8.2e %s (%s)",
               time_it(run_mma), time_cold(run_mma), err_mma, bad_mma ? "FAIL" : "ok", time_it(run_mma2),
               time_cold(run_mma2), err_mma2, bad_mma2 ? "FAIL" : "ok", same_mma ? "= mma" : "!= mma");
    }
    printf("\n");
    CK(cudaFree(dq)); CK(cudaFree(dk)); CK(cudaFree(dw)); CK(cudaFree(dm)); CK(cudaFree(d0)); CK(cudaFree(d1)); CK(cudaFree(d2));
    CK(cudaFree(d3)); CK(cudaFree(d4)); CK(cudaFree(d5)); CK(cudaStreamDestroy(st));
    return bad;
}

// The key block of the tensor-core kernel (LLAMA_DSA_LID_KFOLD: p.key set): the indexer keys of this ubatch (one row
// per stream, at its own position, a forced cell of the DSA mask) normed, rotated and stored while the other blocks
// score. Checks: (1) the scores equal, bit for bit, the plain tensor-core kernel's run afterwards on the cache the key
// block wrote (the forced cell scores 1e30 whatever key it read: old, new or half-written); (2) the stored rows against
// a CPU reference of LayerNorm * w + b, NEOX RoPE (the first n_dims dims; the angle rounded to F32 as the kernel and
// ggml's RoPE form it), rounded to F16: within 2 F16 ulps at the row's scale (max(|value|, 1)); (3) no other cache row changed. Then both timed back to back. An F32 mask, as the
// op requires for the fold: an F16 mask's forced value (60000 at most) does not absorb the score.
static int check_kfold(int D, int H, int N, int S, int n_dims) {
    std::vector<float> q((size_t) S*H*D), w((size_t) S*H), mf((size_t) S*N), x((size_t) S*D), lw(D), lb(D);
    std::vector<__half> k((size_t) S*N*D);
    for (auto & v : q) v = nrand();
    for (auto & v : k) v = __float2half(nrand());
    for (auto & v : w) v = nrand();
    for (auto & v : x) v = 3.0f*nrand() + 0.5f;
    for (int e = 0; e < D; ++e) { lw[e] = 1.0f + 0.1f*nrand(); lb[e] = 0.1f*nrand(); }
    std::vector<int32_t> pos(S);
    std::vector<int64_t> rows(S);
    for (int s = 0; s < S; ++s) {
        const int p1 = N - 1 - 3*s;                       // the stream's token: its cell is its position
        pos[s] = p1; rows[s] = (int64_t) s*N + p1;        // the cache as one [S*N, D] row array
        for (int j = 0; j < N; ++j) {
            mf[(size_t) s*N + j] = dsa_like_mask(j, p1, false);
        }
    }
    char *dq, *dk, *dw, *dm, *dA, *dB, *dx, *dlw, *dlb, *dpos, *drows;
    CK(cudaMalloc(&dq, q.size()*4)); CK(cudaMalloc(&dk, k.size()*2)); CK(cudaMalloc(&dw, w.size()*4));
    CK(cudaMalloc(&dm, mf.size()*4)); CK(cudaMalloc(&dA, (size_t) S*N*4)); CK(cudaMalloc(&dB, (size_t) S*N*4));
    CK(cudaMalloc(&dx, x.size()*4)); CK(cudaMalloc(&dlw, D*4)); CK(cudaMalloc(&dlb, D*4)); CK(cudaMalloc(&dpos, S*4));
    CK(cudaMalloc(&drows, S*8));
    CK(cudaMemcpy(dq, q.data(), q.size()*4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, k.data(), k.size()*2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dw, w.data(), w.size()*4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dm, mf.data(), mf.size()*4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dx, x.data(), x.size()*4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dlw, lw.data(), D*4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dlb, lb.data(), D*4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dpos, pos.data(), S*4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(drows, rows.data(), S*8, cudaMemcpyHostToDevice));

    dsa_lid_params p = {};
    p.q = dq; p.k = dk; p.w = dw; p.m = dm; p.dst = dB;
    p.n_head = H; p.n_kv = N; p.n_mask_streams = S;
    p.nbq1 = (size_t) D*4; p.nbq3 = (size_t) H*D*4; p.nbk3 = (size_t) N*D*2; p.nbw3 = (size_t) H*4;
    p.nbm3 = (size_t) N*4; p.nb3 = (size_t) N*4; p.w_scale = 1.0f/std::sqrt((float) (H*D)); p.mma = 2;
    const float freq_base = 10000.0f;
    dsa_lid_params pk = p; pk.dst = dA;
    dsa_lid_key & kf = pk.key;
    kf.x = (const float *) dx; kf.s01 = D; kf.ncols = D; kf.eps = 1e-6f; kf.w = (const float *) dlw;
    kf.b = (const float *) dlb; kf.n_dims = n_dims; kf.pos = (const int32_t *) dpos; kf.freq_scale = 1.0f;
    kf.ext_factor = 0.0f; kf.attn_factor = 1.0f; kf.theta_scale = powf(freq_base, -2.0f/n_dims);
    kf.corr_low = 0.0f; kf.corr_high = 0.0f; kf.row_idx = (const int64_t *) drows; kf.dst = (half *) dk; kf.dst_stride = D;
    if (!dsa_lid_mma_applies(pk, D, 2)) { printf("kfold D %d H %d: the tensor-core kernel does not apply\n", D, H); return 1; }
    cudaStream_t st; CK(cudaStreamCreate(&st));
    auto launch = [&](const dsa_lid_params & pp) {
        cudaError_t e = dsa_lid_launch<__half, float>(pp, D, S, st);
        if (e != cudaSuccess) { fprintf(stderr, "launch: %s\n", cudaGetErrorString(e)); exit(2); }
    };
    CK(cudaMemset(dA, 0xff, (size_t) S*N*4)); CK(cudaMemset(dB, 0xee, (size_t) S*N*4));
    launch(pk);                      // scores + the key rows stored
    CK(cudaStreamSynchronize(st));
    launch(p);                       // the plain kernel on the cache as the key block left it
    CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
    std::vector<float> oA((size_t) S*N), oB((size_t) S*N);
    std::vector<__half> k2(k.size());
    CK(cudaMemcpy(oA.data(), dA, oA.size()*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(oB.data(), dB, oB.size()*4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(k2.data(), dk, k2.size()*2, cudaMemcpyDeviceToHost));
    const bool same = memcmp(oA.data(), oB.data(), oA.size()*4) == 0;
    int bad = same ? 0 : 1;
    double key_err = 0;   // in F16 ulps of the reference
    int other_changed = 0;
    for (int s = 0; s < S; ++s) {
        // CPU reference: LayerNorm (float sums as the kernel's order does not matter at this tolerance), * w + b, RoPE
        double mean = 0, sq = 0;
        for (int e = 0; e < D; ++e) { mean += x[(size_t) s*D + e]; sq += (double) x[(size_t) s*D + e]*x[(size_t) s*D + e]; }
        mean /= D; const double var = sq/D - mean*mean, inv = 1.0/std::sqrt(var + 1e-6);
        std::vector<double> y(D), r(D);
        for (int e = 0; e < D; ++e) y[e] = (x[(size_t) s*D + e] - mean)*inv*lw[e] + lb[e];
        for (int e = 0; e < D; ++e) r[e] = y[e];
        for (int i0 = 0; i0 < n_dims; i0 += 2) {
            // the angle as the kernel forms it, in F32 (pos * theta_scale^(i0/2)); at 128K positions its F32 rounding
            // alone moves a value by ~1e-2 from the exact angle's (the first run of this check, docs/history §4u)
            const double th = (double) ((float) pos[s]*powf(kf.theta_scale, i0/2.0f));
            const double x0 = y[i0/2], x1 = y[i0/2 + n_dims/2];
            r[i0/2] = x0*std::cos(th) - x1*std::sin(th); r[i0/2 + n_dims/2] = x0*std::sin(th) + x1*std::cos(th);
        }
        for (int e = 0; e < D; ++e) {
            const double got = __half2float(k2[(size_t) rows[s]*D + e]);
            // F16 ulps at the row's scale (LayerNorm output, ~1): a value near 0 is a difference of two such products
            const double ulp = std::ldexp(1.0, std::max(-24, (int) std::floor(std::log2(std::max(std::fabs(r[e]), 1.0))) - 10));
            key_err = std::max(key_err, std::fabs(got - r[e])/ulp);
        }
    }
    for (size_t i = 0; i < k.size(); ++i) {
        const int64_t row = (int64_t) (i/D);
        bool is_new = false;
        for (int s = 0; s < S; ++s) is_new = is_new || row == rows[s];
        if (!is_new && memcmp(&k[i], &k2[i], 2) != 0) ++other_changed;
    }
    bad += (key_err <= 2.0 ? 0 : 1) + (other_changed ? 1 : 0);
    auto time_it = [&](auto f) { return (float) time_us(st, 5, 100, f); };
    const float us_k = time_it([&]() { launch(pk); }), us_p = time_it([&]() { launch(p); });
    printf("kfold D %-3d H %-2d S %d n_kv %-7d rope %-3d: scores %s the plain kernel's, key rows within %.2f F16 "
           "ulps of the CPU reference, %d other cache elements changed -> %s | key block %8.2f us, plain %8.2f us\n",
           D, H, S, N, n_dims, same ? "bit-equal to" : "DIFFERENT FROM", key_err,
           other_changed, bad ? "FAIL" : "OK", us_k, us_p);
    CK(cudaFree(dq)); CK(cudaFree(dk)); CK(cudaFree(dw)); CK(cudaFree(dm)); CK(cudaFree(dA)); CK(cudaFree(dB));
    CK(cudaFree(dx)); CK(cudaFree(dlw)); CK(cudaFree(dlb)); CK(cudaFree(dpos)); CK(cudaFree(drows)); CK(cudaStreamDestroy(st));
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
    bad += check_kfold(64, 4, 131072, 1, 64);   // the 1B shape's indexer, rope on every dim
    bad += check_kfold(64, 4, 4096, 2, 32);     // 2 streams, rope on half the dims
    bad += check_kfold(128, 8, 33000, 2, 64);   // D 128, 8 heads, partial last block
    bad += check_kfold(32, 16, 1001, 1, 32);    // D 32, 16 heads, odd tail
    printf(bad ? "MISMATCHES: %d\n" : "ALL OK\n", bad);
    return bad ? 1 : 0;
}
