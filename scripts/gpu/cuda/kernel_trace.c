// A kernel timeline without Nsight Systems (which does not run on the project's GPU machines): a CUPTI injection
// library that records every kernel, memset and memcpy the process runs on the GPU, with the GPU's own start / end
// timestamps and the stream, inside the windows the program opens with cuProfilerStart / cuProfilerStop (what
// scripts/bench/profile_decode.py --profile does around its measured decode steps). Kernels of CUDA graphs are recorded
// one by one (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: concurrent kernels stay concurrent).
//
//   nvcc -shared -Xcompiler -fPIC -o libktrace.so scripts/gpu/cuda/kernel_trace.c -lcupti   (-I/-L: CUPTI's include/lib)
//   CUDA_INJECTION64_PATH=$PWD/libktrace.so KTRACE_OUT=trace.csv python3 scripts/bench/profile_decode.py F --profile ...
//   python3 scripts/bench/trace_summary.py trace.csv
//
// Output (KTRACE_OUT, CSV, appended at exit): "window,I,START,END" for each window, then one line per record inside a
// window: kind (K kernel, S memset, C memcpy), start, end (ns, GPU clock), stream, correlation id (the API call that
// launched it: all kernels of one graph launch share it; a graph's memset nodes get ids of their own), graph node id,
// grid size (memcpy: CUPTI's copy kind; memset: 0), block size (0 for both), name (kernels: mangled) or byte count.
// Records outside every window are dropped as the buffers arrive, so a long prefill before the window costs only
// CUPTI's own overhead.
#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

#define KT_MAX_WINDOWS 64
#define KT_BUF_BYTES   (8u << 20)

static uint64_t        kt_win_start[KT_MAX_WINDOWS];
static uint64_t        kt_win_end[KT_MAX_WINDOWS];
static volatile int    kt_n_win = 0;
static FILE          * kt_out   = NULL;
static pthread_mutex_t kt_lock  = PTHREAD_MUTEX_INITIALIZER;
static size_t          kt_kept = 0, kt_dropped = 0;

static int kt_in_window(uint64_t t) {
    for (int i = 0; i < kt_n_win; ++i) {
        if (t >= kt_win_start[i] && (kt_win_end[i] == 0 || t <= kt_win_end[i])) {
            return 1;
        }
    }
    return 0;
}

static void CUPTIAPI kt_buffer_requested(uint8_t ** buffer, size_t * size, size_t * max_records) {
    void * p = NULL;
    if (posix_memalign(&p, 8, KT_BUF_BYTES) != 0) {
        p = NULL;
    }
    *buffer      = (uint8_t *) p;
    *size        = p ? KT_BUF_BYTES : 0;
    *max_records = 0;
}

// one CSV line for a record inside a window (counted as kept), else counted as dropped; last: the kernel's name or
// the byte count as text
static void kt_emit(const char kind, const uint64_t start, const uint64_t end, const uint32_t stream,
                    const uint32_t corr, const uint64_t node, const int grid, const int block, const char * last) {
    if (!kt_in_window(start)) {
        kt_dropped++;
        return;
    }
    kt_kept++;
    fprintf(kt_out, "%c,%llu,%llu,%u,%u,%llu,%d,%d,%s\n", kind, (unsigned long long) start, (unsigned long long) end,
            stream, corr, (unsigned long long) node, grid, block, last);
}

static void CUPTIAPI kt_buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t * buffer, size_t size,
                                         size_t valid) {
    (void) ctx; (void) stream_id; (void) size;
    CUpti_Activity * rec = NULL;
    char bytes[32];
    pthread_mutex_lock(&kt_lock);
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            const CUpti_ActivityKernel10 * k = (const CUpti_ActivityKernel10 *) rec;
            kt_emit('K', k->start, k->end, k->streamId, k->correlationId, k->graphNodeId, k->gridX * k->gridY * k->gridZ,
                    k->blockX * k->blockY * k->blockZ, k->name ? k->name : "?");
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const CUpti_ActivityMemset4 * m = (const CUpti_ActivityMemset4 *) rec;
            snprintf(bytes, sizeof(bytes), "%llu", (unsigned long long) m->bytes);
            kt_emit('S', m->start, m->end, m->streamId, m->correlationId, m->graphNodeId, 0, 0, bytes);
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 * m = (const CUpti_ActivityMemcpy6 *) rec;
            snprintf(bytes, sizeof(bytes), "%llu", (unsigned long long) m->bytes);
            kt_emit('C', m->start, m->end, m->streamId, m->correlationId, m->graphNodeId, (int) m->copyKind, 0, bytes);
        }
    }
    pthread_mutex_unlock(&kt_lock);
    free(buffer);
}

static void CUPTIAPI kt_callback(void * user, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void * data) {
    (void) user;
    const CUpti_CallbackData * cb = (const CUpti_CallbackData *) data;
    if (domain != CUPTI_CB_DOMAIN_DRIVER_API) {
        return;
    }
    uint64_t t = 0;
    if (cbid == CUPTI_DRIVER_TRACE_CBID_cuProfilerStart && cb->callbackSite == CUPTI_API_ENTER) {
        cuptiGetTimestamp(&t);
        pthread_mutex_lock(&kt_lock);
        if (kt_n_win < KT_MAX_WINDOWS) {
            kt_win_start[kt_n_win] = t;
            kt_win_end[kt_n_win]   = 0;
            kt_n_win++;
        }
        pthread_mutex_unlock(&kt_lock);
    } else if (cbid == CUPTI_DRIVER_TRACE_CBID_cuProfilerStop && cb->callbackSite == CUPTI_API_EXIT) {
        cuptiGetTimestamp(&t);
        pthread_mutex_lock(&kt_lock);
        if (kt_n_win > 0 && kt_win_end[kt_n_win - 1] == 0) {
            kt_win_end[kt_n_win - 1] = t;
        }
        pthread_mutex_unlock(&kt_lock);
    }
}

static void kt_at_exit(void) {
    cuptiActivityFlushAll(1);
    pthread_mutex_lock(&kt_lock);
    for (int i = 0; i < kt_n_win; ++i) {
        fprintf(kt_out, "window,%d,%llu,%llu\n", i, (unsigned long long) kt_win_start[i],
                (unsigned long long) kt_win_end[i]);
    }
    fprintf(stderr, "ktrace: %d window(s), %zu records kept, %zu dropped\n", kt_n_win, kt_kept, kt_dropped);
    fclose(kt_out);
    kt_out = NULL;
    pthread_mutex_unlock(&kt_lock);
}

#define KT_CHECK(call) do { CUptiResult r_ = (call); if (r_ != CUPTI_SUCCESS) { const char * s_ = NULL; \
    cuptiGetResultString(r_, &s_); fprintf(stderr, "ktrace: %s failed: %s\n", #call, s_ ? s_ : "?"); return 1; } } while (0)

// called by the CUDA driver at cuInit when CUDA_INJECTION64_PATH names this library
int InitializeInjection(void) {
    const char * path = getenv("KTRACE_OUT");
    kt_out = fopen(path ? path : "ktrace.csv", "w");
    if (!kt_out) {
        fprintf(stderr, "ktrace: cannot open %s\n", path ? path : "ktrace.csv");
        return 1;
    }
    CUpti_SubscriberHandle sub;
    KT_CHECK(cuptiSubscribe(&sub, (CUpti_CallbackFunc) kt_callback, NULL));
    KT_CHECK(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuProfilerStart));
    KT_CHECK(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuProfilerStop));
    KT_CHECK(cuptiActivityRegisterCallbacks(kt_buffer_requested, kt_buffer_completed));
    KT_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    KT_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
    KT_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
    atexit(kt_at_exit);
    fprintf(stderr, "ktrace: tracing kernels to %s\n", path ? path : "ktrace.csv");
    return 1;
}
