// What a kernel boundary costs on this GPU, against a barrier inside one persistent kernel (issue 6, docs/history §4q
// "Next": the sparse decode's DSA chain is ~6 dependent kernels per layer, and the goals leave ~16 us per layer).
//
//   bash scripts/gpu/cuda/run_cuda_check.sh latency OUTDIR   (or: nvcc -O3 -std=c++17 -arch=sm_90 -I<ggml-cuda dir> latency_check.cu)
//
// 1. A chain of N dependent kernels (each reads what the previous one wrote), captured in one CUDA graph and replayed:
//    the cost of one more kernel is the slope (t(N=64) - t(N=32)) / 32, for grids of 1, 132 and 1,056 blocks of 128
//    threads, plain launches or with programmatic dependent launch (PDL: griddepcontrol, as ggml's and the patch's
//    kernels use it), and with a 64 KiB memset node between the kernels (the persistent top-k's scratch reset).
// 2. One persistent kernel of 132 (resp. 264) co-resident blocks with R grid barriers (the patch's own
//    topk_radix_row_barrier, top-k-radix-persist.cuh: an arrival counter in global memory): the cost of one more
//    barrier is the slope (t(R=64) - t(R=16)) / 48.
// A measurement, not a pass/fail check: it exits 0 unless CUDA reports an error (then 2), or a chain's result is wrong
// (1: the dependency through memory was not kept).
#include "check_common.cuh"
#include "top-k-radix-persist.cuh" // topk_radix_row_barrier: the barrier measured in part 2

#define LAT_THREADS 128

static __device__ __forceinline__ void lat_pdl_begin(const bool pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (pdl) {
        asm volatile("griddepcontrol.launch_dependents;");
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
#endif
}

// out[i] = in[i] + 1 for this block's threads: the next kernel of the chain reads it (a real dependency)
static __global__ void lat_step(const int * in, int * out, const bool pdl) {
    lat_pdl_begin(pdl);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = in[i] + 1;
}

static __global__ void lat_persistent(unsigned int * arrive, int * acc, const int rounds) {
    for (int r = 0; r < rounds; ++r) {
        topk_radix_row_barrier(arrive, (unsigned int) gridDim.x * (r + 1));
        if (threadIdx.x == 0) {
            acc[blockIdx.x] += 1;
        }
    }
}

static void launch_step(cudaStream_t s, const int blocks, const int * in, int * out, const bool pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(LAT_THREADS);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = pdl ? attr : nullptr;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, lat_step, in, out, pdl));
}

// a graph of n chained kernels (ping-pong between a and b), with a memset of `memset_bytes` of m before each kernel
static cudaGraphExec_t chain_graph(cudaStream_t s, const int n, const int blocks, int * a, int * b, const bool pdl,
                                   void * m, const size_t memset_bytes) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; ++i) {
        if (memset_bytes) {
            CK(cudaMemsetAsync(m, 0, memset_bytes, s));
        }
        launch_step(s, blocks, (i % 2) ? b : a, (i % 2) ? a : b, pdl);
    }
    CK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t e;
    CK(cudaGraphInstantiate(&e, g, 0));
    CK(cudaGraphDestroy(g));
    return e;
}

static double time_graph(cudaStream_t s, cudaGraphExec_t e) {
    return time_us(s, 20, 200, [&] { CK(cudaGraphLaunch(e, s)); });
}

int main() {
    int dev = 0;
    CK(cudaSetDevice(dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    const int max_blocks = 1056;
    int * a, * b;
    void * m;
    CK(cudaMalloc(&a, max_blocks * LAT_THREADS * sizeof(int)));
    CK(cudaMalloc(&b, max_blocks * LAT_THREADS * sizeof(int)));
    CK(cudaMalloc(&m, 1 << 16));
    int rc = 0;

    printf("\n1. chain of dependent kernels in one CUDA graph: us per kernel = (t(64) - t(32)) / 32; t(1) = one graph of one kernel\n");
    printf("%-8s %-5s %-8s | %9s %9s %9s | %12s\n", "blocks", "PDL", "memset", "t(1) us", "t(32) us", "t(64) us", "us/kernel");
    const int grids[3] = { 1, prop.multiProcessorCount, max_blocks };
    for (const int blocks : grids) {
        for (int pdl = 0; pdl < 2; ++pdl) {
            for (int ms = 0; ms < 2; ++ms) {
                double t[3];
                const int ns[3] = { 1, 32, 64 };
                for (int j = 0; j < 3; ++j) {
                    CK(cudaMemset(a, 0, max_blocks * LAT_THREADS * sizeof(int)));
                    cudaGraphExec_t e = chain_graph(s, ns[j], blocks, a, b, pdl, m, ms ? (1 << 16) : 0);
                    t[j] = time_graph(s, e);
                    // correctness of the dependency: one more launch from zeros gives n at every thread of the output
                    CK(cudaMemset(a, 0, max_blocks * LAT_THREADS * sizeof(int)));
                    CK(cudaGraphLaunch(e, s));
                    CK(cudaStreamSynchronize(s));
                    std::vector<int> h(blocks * LAT_THREADS);
                    CK(cudaMemcpy(h.data(), (ns[j] % 2) ? b : a, h.size() * sizeof(int), cudaMemcpyDeviceToHost));
                    for (const int v : h) {
                        if (v != ns[j]) {
                            printf("  WRONG: chain of %d gave %d\n", ns[j], v);
                            rc = 1;
                            break;
                        }
                    }
                    CK(cudaGraphExecDestroy(e));
                }
                printf("%-8d %-5s %-8s | %9.2f %9.2f %9.2f | %12.3f\n", blocks, pdl ? "on" : "off", ms ? "64 KiB" : "-",
                       t[0], t[1], t[2], (t[2] - t[1]) / 32.0);
            }
        }
    }

    printf("\n2. one persistent kernel with R grid barriers (arrival counter): us per barrier = (t(64) - t(16)) / 48\n");
    printf("%-8s | %9s %9s %9s | %12s\n", "blocks", "t(0) us", "t(16) us", "t(64) us", "us/barrier");
    unsigned int * arrive;
    int * acc;
    CK(cudaMalloc(&arrive, sizeof(unsigned int)));
    CK(cudaMalloc(&acc, max_blocks * sizeof(int)));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, lat_persistent, LAT_THREADS, 0));
    const int pgrids[2] = { prop.multiProcessorCount, 2 * prop.multiProcessorCount };
    for (const int blocks : pgrids) {
        if (blocks > per_sm * prop.multiProcessorCount) {
            continue;   // not all co-resident: the barrier would hang
        }
        double t[3];
        const int rs[3] = { 0, 16, 64 };
        for (int j = 0; j < 3; ++j) {
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            CK(cudaMemsetAsync(arrive, 0, sizeof(unsigned int), s));
            lat_persistent<<<blocks, LAT_THREADS, 0, s>>>(arrive, acc, rs[j]);
            CK(cudaGetLastError());
            CK(cudaStreamEndCapture(s, &g));
            cudaGraphExec_t e;
            CK(cudaGraphInstantiate(&e, g, 0));
            CK(cudaGraphDestroy(g));
            CK(cudaMemset(acc, 0, max_blocks * sizeof(int)));
            t[j] = time_graph(s, e);
            std::vector<int> h(blocks);
            CK(cudaMemcpy(h.data(), acc, blocks * sizeof(int), cudaMemcpyDeviceToHost));
            for (const int v : h) {
                if (v != 220 * rs[j]) {   // 20 warm-up + 200 timed launches
                    printf("  WRONG: %d barriers gave %d rounds in a block (expected %d)\n", rs[j], v, 220 * rs[j]);
                    rc = 1;
                    break;
                }
            }
            CK(cudaGraphExecDestroy(e));
        }
        printf("%-8d | %9.2f %9.2f %9.2f | %12.3f\n", blocks, t[0], t[1], t[2], (t[2] - t[1]) / 48.0);
    }
    CK(cudaFree(a)); CK(cudaFree(b)); CK(cudaFree(m)); CK(cudaFree(arrive)); CK(cudaFree(acc));
    CK(cudaStreamDestroy(s));
    printf("\n%s\n", rc == 0 ? "DONE" : "WRONG RESULTS");
    return rc;
}
