/* All-reduce bandwidth of the threads group, to compare with MPI and gloo in
 * /work/shared/baseline/README.md (same method: float sum, time per call = max over ranks,
 * busbw = bytes * 2(n-1)/n / time) and with one-thread memcpy measured here.
 *   bench_allreduce [ranks (default 2)] [seconds per size (default 0.2)]
 * Every rank allocates one buffer of the largest size once (the caching allocator, huge
 * pages) and reduces its first bytes, so no size pays this VM's first-touch page faults. */
#include "tandem/tandem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_BYTES (64LL << 20)

typedef struct {
    double seconds;
    double per_call[32]; /* rank 0's time per call, per size */
    int bad;
} bench;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static int reduce(tdm_group *g, tdm_tensor *t) {
    return tdm_work_wait(tdm_all_reduce(g, t, TDM_SUM));
}

static int rank_fn(tdm_rank_ctx *ctx, void *arg) {
    bench *b = arg;
    int n = ctx->size;
    tdm_tensor *buf = tdm_zeros(TDM_SHAPE(MAX_BYTES / 4), TDM_F32, ctx->device);
    if (!buf) return tdm_last_status();
    /* correctness once: rank r holds r + 1 everywhere */
    tdm_fill_(buf, (float)(ctx->rank + 1));
    if (reduce(ctx->group, buf)) return tdm_last_status();
    float want = (float)(n * (n + 1) / 2), *p = tdm_data_ptr(buf);
    for (int64_t i = 0; i < MAX_BYTES / 4; i += 4093) b->bad += p[i] != want;
    tdm_fill_(buf, 0.0f);
    int s = 0;
    for (int64_t bytes = 4096; bytes <= MAX_BYTES; bytes *= 2, s++) {
        tdm_tensor *t = tdm_slice(buf, 0, 0, bytes / 4, 1);
        for (int i = 0; i < 5; i++)
            if (reduce(ctx->group, t)) return tdm_last_status();
        /* every rank runs the same number of calls: rank 0 decides from a timed estimate */
        double t0 = now();
        for (int i = 0; i < 10; i++)
            if (reduce(ctx->group, t)) return tdm_last_status();
        tdm_tensor *iters =
            tdm_full(TDM_SHAPE(1), (float)(b->seconds / ((now() - t0) / 10)), TDM_F32, ctx->device);
        if (tdm_work_wait(tdm_broadcast(ctx->group, iters, 0))) return tdm_last_status();
        int reps = (int)tdm_item(iters);
        reps = reps < 3 ? 3 : reps;
        tdm_tensor_free(iters);
        if (tdm_work_wait(tdm_barrier(ctx->group))) return tdm_last_status();
        t0 = now();
        for (int i = 0; i < reps; i++)
            if (reduce(ctx->group, t)) return tdm_last_status();
        /* the barrier makes rank 0's time the slowest rank's */
        if (tdm_work_wait(tdm_barrier(ctx->group))) return tdm_last_status();
        if (ctx->rank == 0) b->per_call[s] = (now() - t0) / reps;
        tdm_tensor_free(t);
    }
    tdm_tensor_free(buf);
    return 0;
}

/* One thread copying 64 MiB between two warm buffers: bytes copied per second. */
static double memcpy_bw(void) {
    tdm_tensor *a = tdm_zeros(TDM_SHAPE(MAX_BYTES / 4), TDM_F32, tdm_cpu(0));
    tdm_tensor *c = tdm_zeros(TDM_SHAPE(MAX_BYTES / 4), TDM_F32, tdm_cpu(0));
    memcpy(tdm_data_ptr(c), tdm_data_ptr(a), MAX_BYTES);
    double best = 1e30;
    for (int i = 0; i < 10; i++) {
        double t0 = now();
        memcpy(tdm_data_ptr(c), tdm_data_ptr(a), MAX_BYTES);
        double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    tdm_tensor_free(a);
    tdm_tensor_free(c);
    return MAX_BYTES / best;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 2;
    bench b = {.seconds = argc > 2 ? atof(argv[2]) : 0.2};
    if (n < 1 || n > 64 || !(b.seconds > 0)) {
        fprintf(stderr, "usage: bench_allreduce [ranks 1..64] [seconds per size]\n");
        return 2;
    }
    double mc = memcpy_bw();
    tdm_device devs[64];
    for (int r = 0; r < n; r++) devs[r] = tdm_cpu(r);
    if (tdm_spawn(n, devs, rank_fn, &b) != TDM_OK) {
        fprintf(stderr, "bench_allreduce: %s\n", tdm_last_error());
        return 1;
    }
    printf("# tandem threads all_reduce, f32 sum, %d ranks; memcpy (1 thread, 64 MiB, best of "
           "10) %.2f GB/s; results %s\n",
           n, mc / 1e9, b.bad ? "WRONG" : "verified");
    printf("%12s %12s %12s %12s %10s\n", "bytes", "latency_us", "algbw_GB/s", "busbw_GB/s",
           "%memcpy");
    int s = 0;
    for (int64_t bytes = 4096; bytes <= MAX_BYTES; bytes *= 2, s++) {
        double t = b.per_call[s], algbw = bytes / t, busbw = algbw * 2.0 * (n - 1) / n;
        printf("%12lld %12.1f %12.2f %12.2f %9.0f%%\n", (long long)bytes, t * 1e6, algbw / 1e9,
               busbw / 1e9, 100.0 * busbw / mc);
    }
    return b.bad ? 1 : 0;
}
