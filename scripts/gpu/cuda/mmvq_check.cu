// How fast can a batch-1 Q4_K x Q8_1 mat-vec go on this GPU for the 1B / 8B matrix shapes, and does the work layout
// matter? A measurement for issue 6 (docs/history §4ad: the weights' mat-vec, upstream's mul_mat_vec_q, takes
// ~690 of ~1,300 us of a 1B sparse token at 128K, ~1.2 TB/s). Standalone: its own Q4_K / Q8_1 blocks (ggml's layout:
// 144-byte super-blocks of 256 weights, 36-byte blocks of 32 activations) and its own kernels, not ggml's code.
//
//   layout "W x R (v)": W warps per row, R rows per thread block, v pieces of 8 weight bytes per load. "4x1 (1)" is
//   upstream's layout for one column on NVIDIA (4 warps per row, one row per block, 8 bytes per thread and step: its
//   vdr 2 for Q4_K); the others put one warp on a row and several rows in a block.
//   Each case: the kernel checked against a double-precision CPU dot product (error < 1e-4 of the largest |result|
//   of the matrix), then timed over 400 launches in one CUDA graph that cycle through enough copies of the matrix to miss
//   the L2 (kernel to kernel as in llama.cpp's decode graphs), next to a
//   plain read of the same bytes (the "read" line: what the memory gives to a kernel of this size).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 scripts/gpu/cuda/mmvq_check.cu -o mmvq_check && ./mmvq_check
// Exit status 0 when every layout matches the CPU reference.
// The work split (which thread takes which bytes) is transcribed in numpy and checked without a GPU by
// scripts/gpu/cuda/emulate_mmvq_pieces.py.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(2); } } while (0)

struct block_q4_K { half2 dm; uint8_t scales[12]; uint8_t qs[128]; };   // 144 bytes, 256 weights
struct block_q8_1 { half2 ds; int8_t qs[32]; };                          // 36 bytes, 32 activations
static_assert(sizeof(block_q4_K) == 144, "q4_K");
static_assert(sizeof(block_q8_1) == 36, "q8_1");

__host__ __device__ inline void scale_min_k4(int j, const uint8_t * q, int & d, int & m) {
    if (j < 4) { d = q[j] & 63; m = q[j + 4] & 63; }
    else { d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

__device__ inline int ld_i32(const int8_t * p) {          // q8_1 quants are 4-byte aligned
    return *reinterpret_cast<const int *>(p);
}

// One "piece": 8 bytes of a super-block's qs (16 weights: 8 of sub-block 2c from the low nibbles, 8 of 2c+1 from the
// high ones), against the matching 2 x 8 activations.
template <int V>
__device__ inline float dot_pieces(const block_q4_K * __restrict__ x, const block_q8_1 * __restrict__ y, int p) {
    const int b = p / 16, t = p % 16, c = t / 4, u = t % 4;    // V pieces p..p+V-1 stay in one chunk (u % V == 0)
    const block_q4_K & bx = x[b];
    const float2 dm = __half22float2(bx.dm);
    int sc_lo, m_lo, sc_hi, m_hi;
    scale_min_k4(2 * c, bx.scales, sc_lo, m_lo);
    scale_min_k4(2 * c + 1, bx.scales, sc_hi, m_hi);
    const block_q8_1 & ylo = y[b * 8 + 2 * c];
    const block_q8_1 & yhi = y[b * 8 + 2 * c + 1];
    int q4[2 * V];
    if constexpr (V == 2) {
        const int4 v = *reinterpret_cast<const int4 *>(bx.qs + 32 * c + 8 * u);
        q4[0] = v.x; q4[1] = v.y; q4[2] = v.z; q4[3] = v.w;
    } else {
        const int2 v = *reinterpret_cast<const int2 *>(bx.qs + 32 * c + 8 * u);
        q4[0] = v.x; q4[1] = v.y;
    }
    int dl = 0, dh = 0, sl = 0, sh = 0;
#pragma unroll
    for (int i = 0; i < 2 * V; ++i) {
        const int a = ld_i32(ylo.qs + 8 * u + 4 * i), h = ld_i32(yhi.qs + 8 * u + 4 * i);
        dl = __dp4a(q4[i] & 0x0F0F0F0F, a, dl);
        dh = __dp4a((q4[i] >> 4) & 0x0F0F0F0F, h, dh);
        sl = __dp4a(0x01010101, a, sl);
        sh = __dp4a(0x01010101, h, sh);
    }
    const float d8l = __low2float(ylo.ds), d8h = __low2float(yhi.ds);
    return dm.x * (sc_lo * d8l * dl + sc_hi * d8h * dh) - dm.y * (m_lo * d8l * sl + m_hi * d8h * sh);
}

template <int W, int R, int V>
__global__ void __launch_bounds__(32 * W * R) mmvq_q4k(const block_q4_K * __restrict__ x,
        const block_q8_1 * __restrict__ y, float * __restrict__ dst, int nrows, int ncols) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r_in_block = warp / W, w_in_row = warp % W;
    const int row = blockIdx.x * R + r_in_block;
    const int nsb = ncols / 256;
    float acc = 0.0f;
    if (row < nrows) {
        const block_q4_K * xr = x + (size_t) row * nsb;
        const int npieces = ncols / 16;
        for (int p = (w_in_row * 32 + lane) * V; p < npieces; p += 32 * W * V) {
            acc += dot_pieces<V>(xr, y, p);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
    if constexpr (W == 1) {
        if (lane == 0 && row < nrows) dst[row] = acc;
    } else {
        __shared__ float part[R][W];
        if (lane == 0) part[r_in_block][w_in_row] = acc;
        __syncthreads();
        if (w_in_row == 0 && lane == 0 && row < nrows) {
            float s = 0.0f;
            for (int w = 0; w < W; ++w) s += part[r_in_block][w];
            dst[row] = s;
        }
    }
}

// the bytes alone: every block reads its slice with 16-byte loads (what a streaming kernel of this grid can get)
__global__ void read_bytes(const int4 * __restrict__ p, size_t n16, float * __restrict__ out) {
    int s = 0;
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n16; i += (size_t) gridDim.x * blockDim.x) {
        const int4 v = p[i];
        s ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (s == 0x7fffffff) out[0] = 1.0f;   // keeps the loads
}

static double cpu_row(const block_q4_K * x, const std::vector<float> & a, int row, int ncols) {
    const int nsb = ncols / 256;
    double s = 0.0;
    for (int b = 0; b < nsb; ++b) {
        const block_q4_K & bx = x[(size_t) row * nsb + b];
        const float d = __half2float(bx.dm.x), dmin = __half2float(bx.dm.y);
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            scale_min_k4(j, bx.scales, sc, m);
            for (int l = 0; l < 32; ++l) {
                const uint8_t byte = bx.qs[32 * (j / 2) + l];
                const int q = (j % 2) ? (byte >> 4) : (byte & 0xF);
                s += (double) (d * sc * q - dmin * m) * a[b * 256 + j * 32 + l];
            }
        }
    }
    return s;
}

struct Shape { const char * name; int rows, cols; };

// us per launch of `launch(i, stream)` for i < n, captured in one CUDA graph (as llama.cpp's decode runs): the graph
// is launched once to warm up, then timed
template <typename F>
static double time_graph(F launch, int n = 400) {
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; ++i) launch(i, st);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, st)); CK(cudaStreamSynchronize(st));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0, st)); CK(cudaGraphLaunch(ge, st)); CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0; CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
    CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g)); CK(cudaStreamDestroy(st));
    return 1000.0 * ms / n;
}

template <int W, int R, int V>
static bool run_layout(const Shape & sh, const block_q4_K * dx, size_t copies, const block_q8_1 * dy,
                       float * dd, const std::vector<double> & ref, double scale, double bytes) {
    const int nsb = sh.cols / 256;
    const dim3 grid((sh.rows + R - 1) / R), block(32 * W * R);
    mmvq_q4k<W, R, V><<<grid, block>>>(dx, dy, dd, sh.rows, sh.cols);
    CK(cudaGetLastError());
    std::vector<float> got(sh.rows);
    CK(cudaMemcpy(got.data(), dd, sh.rows * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0.0;
    for (int r = 0; r < sh.rows; ++r) worst = std::fmax(worst, std::fabs(got[r] - ref[r]) / scale);
    const double us = time_graph([&](int i, cudaStream_t st) {
        mmvq_q4k<W, R, V><<<grid, block, 0, st>>>(dx + (i % copies) * (size_t) sh.rows * nsb, dy, dd, sh.rows, sh.cols);
    });
    const bool ok = worst < 1e-4;
    printf("  %-11s %dx%d (%d)  %8.2f us  %6.2f TB/s   max err %.1e %s\n", sh.name, W, R, V, us, bytes / us * 1e-6,
           worst, ok ? "ok" : "FAIL");
    return ok;
}

int main() {
    const Shape shapes[] = {
        {"1B q/o",    2048, 2048}, {"1B k/v",   512, 2048}, {"1B up",    8192, 2048}, {"1B down",  2048, 8192},
        {"8B q/o",    4096, 4096}, {"8B k/v",  1024, 4096}, {"8B up",   14336, 4096}, {"8B down",  4096, 14336},
    };
    cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs, L2 %d MiB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    std::mt19937 rng(1234);
    bool all = true;
    for (const Shape & sh : shapes) {
        const int nsb = sh.cols / 256;
        const size_t mat = (size_t) sh.rows * nsb;                    // super-blocks per copy
        const double bytes = (double) mat * sizeof(block_q4_K);
        const size_t copies = std::max<size_t>(2, (size_t) std::ceil(400e6 / bytes));   // >> L2
        std::vector<block_q4_K> hx(mat);
        std::uniform_int_distribution<int> byte(0, 255);
        for (auto & b : hx) {
            b.dm = __floats2half2_rn(std::ldexp(1.0f, -10) * (1 + byte(rng) / 256.0f),
                                     std::ldexp(1.0f, -12) * (1 + byte(rng) / 256.0f));
            for (auto & s : b.scales) s = (uint8_t) byte(rng);
            for (auto & q : b.qs) q = (uint8_t) byte(rng);
        }
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<float> a(sh.cols);
        std::vector<block_q8_1> hy(sh.cols / 32);
        for (int i = 0; i < sh.cols / 32; ++i) {       // quantize a normal vector to q8_1; `a` holds what the blocks say
            float v[32], amax = 0.0f;
            for (int l = 0; l < 32; ++l) { v[l] = nd(rng); amax = std::fmax(amax, std::fabs(v[l])); }
            const float d = amax / 127.0f;
            int sum = 0;
            for (int l = 0; l < 32; ++l) {
                const int q = (int) std::lround(v[l] / d);
                hy[i].qs[l] = (int8_t) q; sum += q;
            }
            hy[i].ds = __floats2half2_rn(d, d * sum);
            const float dq = __half2float(__low2half(hy[i].ds));
            for (int l = 0; l < 32; ++l) a[i * 32 + l] = dq * hy[i].qs[l];
        }
        std::vector<double> ref(sh.rows);
        double scale = 0.0;
        for (int r = 0; r < sh.rows; ++r) { ref[r] = cpu_row(hx.data(), a, r, sh.cols); scale = std::fmax(scale, std::fabs(ref[r])); }
        block_q4_K * dx; block_q8_1 * dy; float * dd;
        CK(cudaMalloc(&dx, copies * mat * sizeof(block_q4_K)));
        for (size_t c = 0; c < copies; ++c) CK(cudaMemcpy(dx + c * mat, hx.data(), mat * sizeof(block_q4_K), cudaMemcpyHostToDevice));
        CK(cudaMalloc(&dy, hy.size() * sizeof(block_q8_1)));
        CK(cudaMemcpy(dy, hy.data(), hy.size() * sizeof(block_q8_1), cudaMemcpyHostToDevice));
        CK(cudaMalloc(&dd, sh.rows * sizeof(float)));
        printf("%s: %d x %d, %.2f MB per copy, %zu copies\n", sh.name, sh.rows, sh.cols, bytes / 1e6, copies);
        all &= run_layout<4, 1, 1>(sh, dx, copies, dy, dd, ref, scale, bytes);   // upstream's layout
        all &= run_layout<4, 1, 2>(sh, dx, copies, dy, dd, ref, scale, bytes);
        all &= run_layout<2, 2, 1>(sh, dx, copies, dy, dd, ref, scale, bytes);
        all &= run_layout<1, 4, 1>(sh, dx, copies, dy, dd, ref, scale, bytes);
        all &= run_layout<1, 4, 2>(sh, dx, copies, dy, dd, ref, scale, bytes);
        all &= run_layout<1, 8, 1>(sh, dx, copies, dy, dd, ref, scale, bytes);
        all &= run_layout<1, 8, 2>(sh, dx, copies, dy, dd, ref, scale, bytes);
        {   // the bytes alone, same number of thread blocks as upstream's layout (one per row), 128 threads
            const size_t n16 = (size_t) bytes / 16;
            const double us = time_graph([&](int i, cudaStream_t st) {
                read_bytes<<<sh.rows, 128, 0, st>>>(reinterpret_cast<const int4 *>(dx + (i % copies) * mat), n16, dd);
            });
            printf("  %-11s read        %8.2f us  %6.2f TB/s\n", sh.name, us, bytes / us * 1e-6);
        }
        CK(cudaFree(dx)); CK(cudaFree(dy)); CK(cudaFree(dd));
    }
    printf("%s\n", all ? "PASS" : "FAIL");
    return all ? 0 : 1;
}
