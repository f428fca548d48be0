/* All-reduce over MPI, Tandem's (tdm_mpi_init) against plain MPI_Allreduce, with the method of
 * /work/shared/baseline/README.md section 3: float sum, per size 5 warm-up + 10 estimate
 * calls then about `seconds` of back-to-back calls, time per call = the slowest rank's (a
 * barrier ends the timed loop), busbw = bytes * 2(n-1)/n / time.
 *   mpirun -np 2 bench_mpi_allreduce [seconds per size (0.2)] [max MiB (256)]   Tandem
 *   mpirun -np 2 bench_mpi_allreduce --mpi [seconds] [max MiB]                  MPI_Allreduce
 * The --mpi mode calls MPI itself and never tdm_mpi_init (Tandem's communication thread
 * owns MPI in the other mode). Each mode allocates one buffer of the largest size once and
 * reduces its first bytes; results are verified once at the largest size. */
#include "tandem/tandem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef TANDEM_HAVE_MPI
#include <mpi.h>
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* The two implementations behind one interface. */
typedef struct {
    int rank, size;
    tdm_group *g;
    tdm_tensor *buf; /* Tandem: the whole buffer */
    float *raw;      /* MPI: the whole buffer */
} ctx;

static int reduce(ctx *c, int64_t floats) {
    if (c->g) {
        tdm_tensor *t = tdm_slice(c->buf, 0, 0, floats, 1);
        int rc = tdm_work_wait(tdm_all_reduce(c->g, t, TDM_SUM));
        tdm_tensor_free(t);
        return rc;
    }
#ifdef TANDEM_HAVE_MPI
    return MPI_Allreduce(MPI_IN_PLACE, c->raw, (int)floats, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
#else
    return -1;
#endif
}

static int barrier(ctx *c) {
    if (c->g) return tdm_work_wait(tdm_barrier(c->g));
#ifdef TANDEM_HAVE_MPI
    return MPI_Barrier(MPI_COMM_WORLD);
#else
    return -1;
#endif
}

/* Rank 0's repetition count, the same on every rank. */
static int agree(ctx *c, int reps) {
    if (c->g) {
        tdm_tensor *t = tdm_full(TDM_SHAPE(1), (float)reps, TDM_F32, tdm_cpu(0));
        tdm_work_wait(tdm_broadcast(c->g, t, 0));
        reps = (int)tdm_item(t);
        tdm_tensor_free(t);
        return reps;
    }
#ifdef TANDEM_HAVE_MPI
    MPI_Bcast(&reps, 1, MPI_INT, 0, MPI_COMM_WORLD);
#endif
    return reps;
}

static float *data_of(ctx *c) {
    return c->g ? tdm_data_ptr(c->buf) : c->raw;
}

int main(int argc, char **argv) {
    bool mpi = argc > 1 && !strcmp(argv[1], "--mpi");
    int a = mpi ? 2 : 1;
    double seconds = argc > a ? atof(argv[a]) : 0.2;
    int64_t max_bytes = (argc > a + 1 ? atoll(argv[a + 1]) : 256) << 20;
    ctx c = {0};
    if (mpi) {
#ifdef TANDEM_HAVE_MPI
        MPI_Init(&argc, &argv);
        MPI_Comm_rank(MPI_COMM_WORLD, &c.rank);
        MPI_Comm_size(MPI_COMM_WORLD, &c.size);
        c.raw = aligned_alloc(1 << 21, (size_t)max_bytes);
        if (!c.raw) return 1;
        memset(c.raw, 0, (size_t)max_bytes);
#else
        fprintf(stderr, "bench_mpi_allreduce: built without MPI\n");
        return 1;
#endif
    } else {
        c.g = tdm_mpi_init(&argc, &argv);
        if (!c.g) {
            fprintf(stderr, "bench_mpi_allreduce: %s\n", tdm_last_error());
            return 1;
        }
        c.rank = tdm_group_rank(c.g);
        c.size = tdm_group_size(c.g);
        c.buf = tdm_zeros(TDM_SHAPE(max_bytes / 4), TDM_F32, tdm_cpu(0));
        if (!c.buf) return 1;
    }
    int n = c.size;
    /* correctness once, at the largest size: rank r holds r + 1 everywhere */
    float *p = data_of(&c);
    for (int64_t i = 0; i < max_bytes / 4; i++) p[i] = (float)(c.rank + 1);
    int bad = reduce(&c, max_bytes / 4) != 0;
    for (int64_t i = 0; i < max_bytes / 4; i += 4093) bad += p[i] != (float)(n * (n + 1) / 2);
    memset(p, 0, (size_t)max_bytes);
    if (c.rank == 0) {
        printf("# %s all_reduce, f32 sum, %d ranks; results %s\n",
               mpi ? "plain MPI_Allreduce" : "tandem mpi", n, bad ? "WRONG" : "verified");
        printf("%12s %12s %12s %12s\n", "bytes", "latency_us", "algbw_GB/s", "busbw_GB/s");
    }
    for (int64_t bytes = 4096; bytes <= max_bytes; bytes *= 2) {
        int64_t f = bytes / 4;
        for (int i = 0; i < 5; i++) reduce(&c, f);
        double t0 = now();
        for (int i = 0; i < 10; i++) reduce(&c, f);
        int reps = agree(&c, (int)(seconds / ((now() - t0) / 10)));
        reps = reps < 3 ? 3 : reps;
        barrier(&c);
        t0 = now();
        for (int i = 0; i < reps; i++) reduce(&c, f);
        barrier(&c);
        double t = (now() - t0) / reps, algbw = (double)bytes / t;
        if (c.rank == 0)
            printf("%12lld %12.1f %12.2f %12.2f\n", (long long)bytes, t * 1e6, algbw / 1e9,
                   algbw * 2.0 * (n - 1) / n / 1e9);
        fflush(stdout);
    }
    if (mpi) {
#ifdef TANDEM_HAVE_MPI
        free(c.raw);
        MPI_Finalize();
#endif
    } else {
        tdm_tensor_free(c.buf);
        tdm_mpi_finalize();
    }
    return bad ? 1 : 0;
}
