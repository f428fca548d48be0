/* Collectives of the threads group, launched with tdm_spawn: every op against a serial
 * reference computed here (sums in rank order in float, so results must match bit for bit),
 * asynchronous handles waited in and out of order, failures (a rank's error, a timeout, ranks
 * that disagree, named with the sites tdm_collective_label gives) that end in errors instead of
 * hangs, the flight recorder's file, and device lists; and the MPI transport's sizes, which
 * tdm_mpi_tune_tcp sets only where the user did not. */
#include "check.h"
#include "parallel/group.h"
#include "parallel/lines.h"
#include "backend/backend.h" /* the GEMM's threads */

#include <pthread.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <time.h>

#define MAX_RANKS 4

/* Rank threads must not touch check.h's counters (they are plain ints): they count their own
 * failures here and main reports them. */
typedef struct {
    int n;
    int bad[MAX_RANKS];
    char first[MAX_RANKS][256];
    uint64_t digest[MAX_RANKS]; /* of the largest all-reduce result */
    int status[MAX_RANKS];
    char msg[MAX_RANKS][512];
    atomic_int flag;
} shared;

#define RCHECK(sh, r, cond, fmt, ...)                                                              \
    do {                                                                                           \
        if (!(cond) && !(sh)->bad[r]++)                                                            \
            snprintf((sh)->first[r], sizeof(sh)->first[r], "line %d: " fmt, __LINE__,              \
                     ##__VA_ARGS__);                                                               \
    } while (0)

static const int64_t sizes[] = {0, 1, 7, 1000, (1 << 20) + 3};
#define N_SIZES ((int)(sizeof sizes / sizeof sizes[0]))

#include "collective_lowp.h"

/* Writes rank r's inputs into t (a contiguous f32 tensor) and returns t. */
static tdm_tensor *fill_values(tdm_tensor *t, int r, int salt) {
    float *p = tdm_data_ptr(t);
    int64_t m = tdm_numel(t);
    for (int64_t i = 0; i < m; i++) p[i] = value(r, i, salt);
    return t;
}

static tdm_tensor *filled(int r, int64_t m, int salt) {
    return fill_values(tdm_empty(TDM_SHAPE(m), TDM_F32, tdm_cpu(r)), r, salt);
}

/* The first m elements of a buffer allocated once per rank: fresh pages cost ~11 us each to
 * fault in on this kind of VM, so the test reuses the same memory for every size. */
static tdm_tensor *head(tdm_tensor *buf, int64_t m) {
    return tdm_slice(buf, 0, 0, m, 1);
}

typedef struct {
    tdm_tensor *big; /* f32 [MAX_RANKS * max size] */
    tdm_tensor *f;   /* f32 [max size] */
    tdm_tensor *out; /* f32 [max size] */
    tdm_tensor *i;   /* i32 [max size] */
} buffers;

/* Elements of t that differ in any bit from the expected reduction. */
static int64_t count_wrong(const tdm_tensor *t, int n, int salt, tdm_reduce_kind op,
                           int64_t first) {
    const float *p = tdm_data_ptr(t);
    int64_t wrong = 0, m = tdm_numel(t);
    for (int64_t i = 0; i < m; i++) {
        float want = reference(n, first + i, salt, op);
        uint32_t got_bits, want_bits; /* bit for bit: -0 and +0 differ */
        memcpy(&got_bits, &p[i], 4);
        memcpy(&want_bits, &want, 4);
        wrong += got_bits != want_bits;
    }
    return wrong;
}

static uint64_t digest(const tdm_tensor *t) {
    const unsigned char *p = tdm_data_ptr(t);
    uint64_t h = 1469598103934665603ull;
    int64_t bytes = tdm_numel(t) * 4;
    for (int64_t i = 0; i < bytes; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static void ops_one_size(shared *sh, const buffers *bu, tdm_group *g, int r, int n, int64_t m,
                         int salt) {
    /* all-reduce, SUM and AVG */
    for (int op = TDM_SUM; op <= TDM_AVG; op++) {
        tdm_tensor *t = fill_values(head(bu->f, m), r, salt + op);
        int st = tdm_work_wait(tdm_all_reduce(g, t, (tdm_reduce_kind)op));
        RCHECK(sh, r, st == TDM_OK, "all_reduce m=%lld: %s", (long long)m, tdm_last_error());
        int64_t wrong = count_wrong(t, n, salt + op, (tdm_reduce_kind)op, 0);
        RCHECK(sh, r, wrong == 0, "all_reduce op %d m=%lld n=%d: %lld wrong", op, (long long)m, n,
               (long long)wrong);
        if (op == TDM_SUM && m == sizes[N_SIZES - 1]) sh->digest[r] = digest(t);
    }
    /* broadcast from a root that moves with the size, f32 and i32 */
    int root = (int)(m % n);
    tdm_tensor *b = fill_values(head(bu->f, m), r, salt + 2);
    RCHECK(sh, r, tdm_work_wait(tdm_broadcast(g, b, root)) == TDM_OK, "broadcast: %s",
           tdm_last_error());
    const float *pb = tdm_data_ptr(b);
    int64_t wrong = 0;
    for (int64_t i = 0; i < m; i++) wrong += pb[i] != value(root, i, salt + 2);
    RCHECK(sh, r, wrong == 0, "broadcast m=%lld root %d: %lld wrong", (long long)m, root,
           (long long)wrong);
    tdm_tensor *bi = head(bu->i, m);
    tdm_fill_(bi, (float)(r * 10 + 3));
    RCHECK(sh, r, tdm_work_wait(tdm_broadcast(g, bi, root)) == TDM_OK, "broadcast i32: %s",
           tdm_last_error());
    const int32_t *pbi = tdm_data_ptr(bi);
    wrong = 0;
    for (int64_t i = 0; i < m; i++) wrong += pbi[i] != root * 10 + 3;
    RCHECK(sh, r, wrong == 0, "broadcast i32 m=%lld: %lld wrong", (long long)m, (long long)wrong);
    /* all-gather: out [n * m] holds every rank's in, in rank order */
    tdm_tensor *in = fill_values(head(bu->f, m), r, salt + 3);
    tdm_tensor *out = head(bu->big, n * m);
    tdm_fill_(out, -7.0f);
    RCHECK(sh, r, tdm_work_wait(tdm_all_gather(g, out, in)) == TDM_OK, "all_gather: %s",
           tdm_last_error());
    const float *po = tdm_data_ptr(out);
    wrong = 0;
    for (int k = 0; k < n; k++)
        for (int64_t i = 0; i < m; i++) wrong += po[k * m + i] != value(k, i, salt + 3);
    RCHECK(sh, r, wrong == 0, "all_gather m=%lld: %lld wrong", (long long)m, (long long)wrong);
    /* reduce-scatter: rank r gets chunk r of the reduction of in [n * m] */
    for (int op = TDM_SUM; op <= TDM_AVG; op++) {
        tdm_tensor *big = fill_values(head(bu->big, n * m), r, salt + 4 + op);
        tdm_tensor *part = head(bu->out, m);
        tdm_fill_(part, -7.0f);
        RCHECK(sh, r, tdm_work_wait(tdm_reduce_scatter(g, part, big, (tdm_reduce_kind)op)) == 0,
               "reduce_scatter: %s", tdm_last_error());
        wrong = count_wrong(part, n, salt + 4 + op, (tdm_reduce_kind)op, r * m);
        RCHECK(sh, r, wrong == 0, "reduce_scatter op %d m=%lld: %lld wrong", op, (long long)m,
               (long long)wrong);
    }
    /* reduce to a root that moves with the size: all_reduce's bits there; others keep theirs */
    for (int op = TDM_SUM; op <= TDM_AVG; op++) {
        int to = (int)((m + 1) % n);
        tdm_tensor *t = fill_values(head(bu->f, m), r, salt + 6 + op);
        RCHECK(sh, r, tdm_work_wait(tdm_reduce(g, t, to, (tdm_reduce_kind)op)) == TDM_OK,
               "reduce: %s", tdm_last_error());
        const float *pt = tdm_data_ptr(t);
        wrong = 0;
        for (int64_t i = 0; r != to && i < m; i++) wrong += pt[i] != value(r, i, salt + 6 + op);
        if (r == to) wrong = count_wrong(t, n, salt + 6 + op, (tdm_reduce_kind)op, 0);
        RCHECK(sh, r, wrong == 0, "reduce op %d m=%lld to %d, rank %d: %lld wrong", op,
               (long long)m, to, r, (long long)wrong);
    }
    RCHECK(sh, r, tdm_work_wait(tdm_barrier(g)) == TDM_OK, "barrier: %s", tdm_last_error());
}

/* Several all-reduces in flight at once, waited in launch order and then out of order. */
static void outstanding(shared *sh, tdm_group *g, int r, int n) {
    const int64_t ms[4] = {1000, 7, 1 << 16, 1};
    for (int round = 0; round < 2; round++) {
        tdm_tensor *t[4];
        tdm_work *w[4];
        for (int j = 0; j < 4; j++) {
            t[j] = filled(r, ms[j], 100 + 10 * round + j);
            w[j] = tdm_all_reduce(g, t[j], j % 2 ? TDM_AVG : TDM_SUM);
        }
        /* the rank keeps computing while its collectives run */
        tdm_tensor *x = tdm_ones(TDM_SHAPE(32, 32), TDM_F32, tdm_cpu(r));
        RCHECK(sh, r, tdm_matmul(x, x) != NULL, "matmul: %s", tdm_last_error());
        const int order[2][4] = {{0, 1, 2, 3}, {3, 1, 0, 2}};
        for (int j = 0; j < 4; j++) {
            int k = order[round][j];
            RCHECK(sh, r, tdm_work_wait(w[k]) == TDM_OK, "wait %d: %s", k, tdm_last_error());
        }
        for (int j = 0; j < 4; j++) {
            int64_t wrong =
                count_wrong(t[j], n, 100 + 10 * round + j, j % 2 ? TDM_AVG : TDM_SUM, 0);
            RCHECK(sh, r, wrong == 0, "outstanding round %d tensor %d: %lld wrong", round, j,
                   (long long)wrong);
        }
    }
}

static int rank_all_ops(tdm_rank_ctx *ctx, void *arg) {
    shared *sh = arg;
    int r = ctx->rank, n = ctx->size;
    RCHECK(sh, r, tdm_group_rank(ctx->group) == r && tdm_group_size(ctx->group) == n,
           "group rank %d size %d", tdm_group_rank(ctx->group), tdm_group_size(ctx->group));
    RCHECK(sh, r, tdm_device_equal(tdm_group_device(ctx->group), tdm_cpu(r)), "group device");
    int64_t max = sizes[N_SIZES - 1];
    buffers bu = {tdm_empty(TDM_SHAPE(MAX_RANKS * max), TDM_F32, tdm_cpu(r)),
                  tdm_empty(TDM_SHAPE(max), TDM_F32, tdm_cpu(r)),
                  tdm_empty(TDM_SHAPE(max), TDM_F32, tdm_cpu(r)),
                  tdm_empty(TDM_SHAPE(max), TDM_I32, tdm_cpu(r))};
    for (int s = 0; s < N_SIZES; s++) {
        tdm_scope_begin();
        ops_one_size(sh, &bu, ctx->group, r, n, sizes[s], 10 * s);
        tdm_scope_end();
    }
    tdm_tensor_free(bu.big);
    tdm_tensor_free(bu.f);
    tdm_tensor_free(bu.out);
    tdm_tensor_free(bu.i);
    tdm_scope_begin();
    outstanding(sh, ctx->group, r, n);
    tdm_scope_end();
    return 0;
}

static void report(const shared *sh, int n, const char *what) {
    for (int r = 0; r < n; r++)
        CHECK(sh->bad[r] == 0, "%s, rank %d of %d: %d failures, first: %s", what, r, n, sh->bad[r],
              sh->first[r]);
}

static tdm_device devs[MAX_RANKS];

static void test_all_ops(void) {
    for (int n = 1; n <= MAX_RANKS; n++) {
        shared sh = {.n = n};
        int st = tdm_spawn(n, devs, rank_all_ops, &sh);
        CHECK(st == TDM_OK, "spawn %d ranks: %s", n, tdm_last_error());
        report(&sh, n, "all ops");
        for (int r = 1; r < n; r++)
            CHECK(sh.digest[r] == sh.digest[0], "all_reduce of %d ranks: rank %d differs from 0", n,
                  r);
    }
}

static void sleep_s(double s) {
    struct timespec t = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&t, NULL);
}

/* tdm_threads_barrier: no rank passes it before every rank reached it (the ranks count
 * themselves in before, and check every count after); a rank with an all-reduce still queued
 * (launched, not waited) gets the barrier after it, in order, and its sum is right. */
static int direct_barriers(tdm_rank_ctx *ctx, void *arg) {
    shared *sh = arg;
    int r = ctx->rank, n = sh->n;
    for (int round = 1; round <= 50; round++) {
        if (r == round % n) sleep_s(0.001); /* a different rank arrives last each time */
        atomic_fetch_add(&sh->flag, 1);
        int rc = tdm_threads_barrier(ctx->group);
        int seen = atomic_load(&sh->flag);
        RCHECK(sh, r, rc == TDM_OK && seen >= round * n, "round %d: rc %d, %d arrivals of %d",
               round, rc, seen, round * n);
        if (tdm_threads_barrier(ctx->group)) return tdm_last_status(); /* nobody counts on */
    }
    tdm_tensor *t = tdm_full(TDM_SHAPE(1000), (double)(r + 1), TDM_F32, tdm_cpu(r));
    tdm_work *w = tdm_all_reduce(ctx->group, t, TDM_SUM);
    int rc = tdm_threads_barrier(ctx->group);
    if (!rc) rc = tdm_work_wait(w);
    float want = (float)(n * (n + 1) / 2);
    RCHECK(sh, r, rc == TDM_OK && ((float *)tdm_data_ptr(t))[999] == want,
           "all-reduce queued before a direct barrier: rc %d, %g (want %g)", rc,
           (double)((float *)tdm_data_ptr(t))[999], (double)want);
    tdm_tensor_free(t);
    return rc;
}

static void test_direct_barrier(void) {
    for (int n = 2; n <= 3; n++) {
        shared sh = {.n = n};
        int st = tdm_spawn(n, devs, direct_barriers, &sh);
        CHECK(st == TDM_OK, "direct barriers on %d ranks: spawn returned %d: %s", n, st,
              tdm_last_error());
        report(&sh, n, "direct barrier");
    }
}

/* tdm_lines_*: the plain loops' results (tdm_reduce_ranks' sums, bit for bit) at lengths
 * around their blocks (64 floats) and their prefetch distance (512), from offsets inside a
 * buffer, with one source also the destination. */
static void test_lines(void) {
    enum { MAX = 2100 };
    static float a[MAX], b[MAX], c[MAX], dst[MAX], want[MAX];
    const int64_t lens[] = {0, 1, 15, 16, 63, 64, 65, 511, 512, 513, 2000};
    for (int i = 0; i < MAX; i++) {
        a[i] = (float)i * 0.37f - 11.0f;
        b[i] = 1.0f / (float)(i + 3);
        c[i] = (float)(i % 17) * -0.61f;
    }
    for (size_t t = 0; t < sizeof lens / sizeof lens[0]; t++) {
        int64_t len = lens[t], lo = 37, hi = lo + len;
        const float *src[3] = {a, b, c};
        memcpy(dst, c, sizeof dst);
        tdm_lines_reduce(dst, src, 3, lo, hi);
        memcpy(want, c, sizeof want);
        if (len) tdm_reduce_ranks(want + lo, src, 3, lo, (int)len, true);
        CHECK(memcmp(dst, want, sizeof dst) == 0, "lines_reduce of %lld floats", (long long)len);
        memcpy(dst, b, sizeof dst); /* the destination is source 0 */
        const float *into[2] = {dst, a}, *plain[2] = {b, a};
        tdm_lines_reduce(dst, into, 2, lo, hi);
        memcpy(want, b, sizeof want);
        if (len) tdm_reduce_ranks(want + lo, plain, 2, lo, (int)len, true);
        CHECK(memcmp(dst, want, sizeof dst) == 0, "lines_reduce into a source, %lld floats",
              (long long)len);
        memcpy(dst, c, sizeof dst);
        tdm_lines_copy(dst + lo, a + 5, len);
        bool ok = memcmp(dst + lo, a + 5, sizeof(float) * (size_t)len) == 0 &&
                  memcmp(dst, c, sizeof(float) * (size_t)lo) == 0 &&
                  memcmp(dst + hi, c + hi, sizeof(float) * (size_t)(MAX - hi)) == 0;
        CHECK(ok, "lines_copy of %lld floats", (long long)len);
    }
}

/* Rank 1 fails while the others wait in an all-reduce: they fail too, naming rank 1. */
static int rank_fails(tdm_rank_ctx *ctx, void *arg) {
    shared *sh = arg;
    int r = ctx->rank;
    tdm_group_set_timeout(ctx->group, 30.0); /* the abort, not the timeout, must end the wait */
    if (r == 1) {
        sleep_s(0.05); /* let the others reach the collective first */
        return tdm_raise(TDM_ERR_ARG, "boom");
    }
    tdm_tensor *t = tdm_ones(TDM_SHAPE(1000), TDM_F32, tdm_cpu(r));
    sh->status[r] = tdm_work_wait(tdm_all_reduce(ctx->group, t, TDM_SUM));
    snprintf(sh->msg[r], sizeof sh->msg[r], "%s", tdm_last_error());
    /* and every later collective fails at once */
    int later = tdm_work_wait(tdm_barrier(ctx->group));
    RCHECK(sh, r, later == TDM_ERR_COMM && strstr(tdm_last_error(), "rank 1 failed: boom"),
           "later barrier: %d %s", later, tdm_last_error());
    later = tdm_threads_barrier(ctx->group); /* the direct one too */
    RCHECK(sh, r, later == TDM_ERR_COMM && strstr(tdm_last_error(), "rank 1 failed: boom"),
           "later direct barrier: %d %s", later, tdm_last_error());
    tdm_tensor_free(t);
    return sh->status[r];
}

static void test_rank_error(void) {
    shared sh = {.n = 3};
    int st = tdm_spawn(3, devs, rank_fails, &sh);
    CHECK(st == TDM_ERR_ARG, "spawn returned %d", st);
    CHECK(strstr(tdm_last_error(), "rank 1: boom") != NULL, "spawn message: %s", tdm_last_error());
    for (int r = 0; r < 3; r += 2) {
        CHECK(sh.status[r] == TDM_ERR_COMM, "rank %d status %d", r, sh.status[r]);
        CHECK(strstr(sh.msg[r], "rank 1 failed: boom") != NULL, "rank %d message: %s", r,
              sh.msg[r]);
    }
    report(&sh, 3, "rank error");
}

/* Rank 1 never joins rank 0's all-reduce: rank 0 times out naming it, and rank 1's own
 * collective, launched later, fails with the same cause. */
static int rank_late(tdm_rank_ctx *ctx, void *arg) {
    shared *sh = arg;
    int r = ctx->rank;
    tdm_group_set_timeout(ctx->group, 0.2);
    if (r == 0) {
        tdm_tensor *t = tdm_ones(TDM_SHAPE(10), TDM_F32, tdm_cpu(0));
        sh->status[0] = tdm_work_wait(tdm_all_reduce(ctx->group, t, TDM_SUM));
        snprintf(sh->msg[0], sizeof sh->msg[0], "%s", tdm_last_error());
        tdm_tensor_free(t);
        atomic_store(&sh->flag, 1);
    } else {
        while (!atomic_load(&sh->flag)) sleep_s(0.01);
        sh->status[1] = tdm_work_wait(tdm_barrier(ctx->group));
        snprintf(sh->msg[1], sizeof sh->msg[1], "%s", tdm_last_error());
    }
    return 0;
}

static void test_timeout(void) {
    shared sh = {.n = 2};
    CHECK(tdm_spawn(2, devs, rank_late, &sh) == TDM_OK, "spawn: %s", tdm_last_error());
    for (int r = 0; r < 2; r++) {
        CHECK(sh.status[r] == TDM_ERR_COMM, "rank %d status %d", r, sh.status[r]);
        CHECK(strstr(sh.msg[r], "timed out after 0.2 s waiting for rank 1") != NULL,
              "rank %d message: %s", r, sh.msg[r]);
    }
}

/* Ranks that call collectives of different sizes get an error, not corrupted memory. */
static int rank_mismatch(tdm_rank_ctx *ctx, void *arg) {
    shared *sh = arg;
    int r = ctx->rank;
    tdm_tensor *t = tdm_ones(TDM_SHAPE(10 + r), TDM_F32, tdm_cpu(r));
    sh->status[r] = tdm_work_wait(tdm_all_reduce(ctx->group, t, TDM_SUM));
    snprintf(sh->msg[r], sizeof sh->msg[r], "%s", tdm_last_error());
    tdm_tensor_free(t);
    return 0;
}

static void test_mismatch(void) {
    shared sh = {.n = 2};
    CHECK(tdm_spawn(2, devs, rank_mismatch, &sh) == TDM_OK, "spawn: %s", tdm_last_error());
    for (int r = 0; r < 2; r++) {
        CHECK(sh.status[r] == TDM_ERR_COMM, "rank %d status %d", r, sh.status[r]);
        CHECK(strstr(sh.msg[r], "ranks disagree on the element count") != NULL,
              "rank %d message: %s", r, sh.msg[r]);
    }
}

/* ---- bf16 and f16 ---------------------------------------------------------------------------- */

typedef struct {
    tdm_dtype dt;
    lowp_result res[MAX_RANKS];
} lowp_shared;

static int rank_lowp(tdm_rank_ctx *ctx, void *arg) {
    lowp_shared *sh = arg;
    const int64_t ms[] = {0, 1, 7, 1000, (1 << 20) + 3};
    for (int s = 0; s < 5; s++) {
        tdm_scope_begin();
        lowp_ops(ctx->group, tdm_cpu(ctx->rank), ctx->size, sh->dt, ms[s], 10 * s,
                 &sh->res[ctx->rank]);
        tdm_scope_end();
    }
    return 0;
}

/* Every collective in bf16 and f16 over 2 and 3 ranks: reductions equal to the ranks' values
 * summed in f32 in rank order and rounded once, bit for bit on every rank. */
static void test_lowp(void) {
    for (int n = 2; n <= 3; n++)
        for (int d = 0; d < 2; d++) {
            lowp_shared sh = {.dt = d ? TDM_F16 : TDM_BF16};
            CHECK(tdm_spawn(n, devs, rank_lowp, &sh) == TDM_OK, "spawn: %s", tdm_last_error());
            for (int r = 0; r < n; r++) {
                CHECK(!sh.res[r].err[0], "%d ranks, rank %d: %s", n, r, sh.res[r].err);
                CHECK(sh.res[r].wrong == 0, "%s over %d ranks, rank %d: %lld elements wrong",
                      tdm_dtype_name(sh.dt), n, r, (long long)sh.res[r].wrong);
            }
        }
}

/* Ranks that reduce the same count in different dtypes: rank 0 bf16, rank 1 f16 (the same
 * size) or f32 (another size), by salt. */
static int rank_dtype_mismatch(tdm_rank_ctx *ctx, void *arg) {
    shared *sh = arg;
    int r = ctx->rank;
    tdm_dtype dt = r == 0 ? TDM_BF16 : atomic_load(&sh->flag) ? TDM_F32 : TDM_F16;
    tdm_tensor *t = tdm_ones(TDM_SHAPE(10), dt, tdm_cpu(r));
    sh->status[r] = tdm_work_wait(tdm_all_reduce(ctx->group, t, TDM_SUM));
    snprintf(sh->msg[r], sizeof sh->msg[r], "%s", tdm_last_error());
    tdm_tensor_free(t);
    return 0;
}

static void test_dtype_mismatch(void) {
    const char *other[2] = {"10 f16, sum)", "10 f32, sum)"};
    for (int k = 0; k < 2; k++) {
        shared sh = {.n = 2};
        atomic_store(&sh.flag, k);
        CHECK(tdm_spawn(2, devs, rank_dtype_mismatch, &sh) == TDM_OK, "spawn: %s",
              tdm_last_error());
        for (int r = 0; r < 2; r++) {
            CHECK(sh.status[r] == TDM_ERR_COMM, "rank %d status %d", r, sh.status[r]);
            CHECK(strstr(sh.msg[r], "ranks disagree on the dtype: rank 0 is in all_reduce #1 "
                                    "(unnamed: 10 bf16, sum) while rank 1 is in all_reduce #1 "
                                    "(unnamed: 10 ") &&
                      strstr(sh.msg[r], other[k]),
                  "rank %d message: %s", r, sh.msg[r]);
        }
    }
    tdm_threads_world *w = tdm_threads_world_new(2, devs);
    tdm_group *g = tdm_threads_world_group(w, 0);
    tdm_scope_begin();
    tdm_tensor *bf = tdm_zeros(TDM_SHAPE(4), TDM_BF16, tdm_cpu(0));
    tdm_tensor *h8 = tdm_zeros(TDM_SHAPE(8), TDM_F16, tdm_cpu(0));
    tdm_tensor *i64 = tdm_zeros(TDM_SHAPE(4), TDM_I64, tdm_cpu(0));
    CHECK_ERROR(tdm_all_reduce(g, i64, TDM_SUM) == NULL,
                "all_reduce: tensor must be f32, bf16 or f16, got i64 [4]");
    CHECK_ERROR(tdm_reduce(g, i64, 0, TDM_SUM) == NULL, "reduce: tensor must be f32, bf16 or f16");
    CHECK_ERROR(tdm_reduce_scatter(g, bf, h8, TDM_SUM) == NULL,
                "reduce_scatter: out is bf16 but in is f16");
    CHECK_ERROR(tdm_all_gather(g, h8, bf) == NULL, "all_gather: out is f16 but in is bf16");
    tdm_scope_end();
    tdm_threads_world_free(w);
}

/* Bad arguments fail on the calling rank before anything starts (no peer needed). */
static void test_bad_arguments(void) {
    tdm_threads_world *w = tdm_threads_world_new(2, devs);
    CHECK(w != NULL, "world: %s", tdm_last_error());
    tdm_group *g = tdm_threads_world_group(w, 0);
    tdm_scope_begin();
    tdm_tensor *i32 = tdm_zeros(TDM_SHAPE(4), TDM_I32, tdm_cpu(0));
    tdm_tensor *m = tdm_zeros(TDM_SHAPE(3, 4), TDM_F32, tdm_cpu(0));
    tdm_tensor *v5 = tdm_zeros(TDM_SHAPE(5), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(tdm_all_reduce(g, i32, TDM_SUM) == NULL, "all_reduce: tensor must be f32");
    CHECK_ERROR(tdm_all_reduce(g, tdm_transpose(m, 0, 1), TDM_SUM) == NULL,
                "all_reduce: tensor [4, 3] must be contiguous");
    CHECK_ERROR(tdm_all_reduce(g, m, (tdm_reduce_kind)7) == NULL, "unknown reduction 7");
    CHECK_ERROR(tdm_broadcast(g, m, 2) == NULL, "broadcast: root 2 out of range for 2 ranks");
    CHECK_ERROR(tdm_all_gather(g, v5, m) == NULL, "all_gather: out [5] must hold 2 x in [3, 4]");
    CHECK_ERROR(tdm_all_gather(g, i32, v5) == NULL, "all_gather: out is i32 but in is f32");
    CHECK_ERROR(tdm_reduce_scatter(g, v5, m, TDM_SUM) == NULL,
                "reduce_scatter: in [3, 4] must hold 2 x out [5]");
    CHECK_ERROR(tdm_all_reduce(NULL, m, TDM_SUM) == NULL, "all_reduce: NULL group");
    tdm_raise(TDM_ERR_SHAPE, "earlier failure");
    CHECK(tdm_work_wait(NULL) == TDM_ERR_SHAPE, "wait(NULL) gives the launch error");
    tdm_clear_error();
    CHECK_ERROR(tdm_threads_world_group(w, 2) == NULL, "rank 2 out of range");
    tdm_scope_end();
    tdm_threads_world_free(w);
    CHECK_ERROR(tdm_spawn(0, devs, rank_all_ops, NULL) != TDM_OK, "spawn: 0 ranks");
}

static void test_devices(void) {
    tdm_device d[8];
    int cores = tdm_device_count(TDM_CPU);
    CHECK(cores >= 1, "device count %d", cores);
    int gpus = tdm_device_count(TDM_CUDA);
    CHECK(gpus >= 0, "GPU count %d", gpus);
    CHECK(tdm_devices_parse("cpu:0,cpu:1", d, 8) == 2 && d[0].index == 0 && d[1].index == 1 &&
              d[1].type == TDM_CPU,
          "cpu:0,cpu:1: %s", tdm_last_error());
    CHECK(tdm_devices_parse("cpu:2, cpu:0", d, 8) == 2 && d[0].index == 2 && d[1].index == 0,
          "blanks: %s", tdm_last_error());
    tdm_device all[64];
    int na = tdm_devices_parse("cpu:all", all, 64);
    CHECK(na == cores, "cpu:all gave %d, expected %d", na, cores);
    for (int i = 0; i < na && i < 64; i++) CHECK(all[i].index == i, "cpu:all entry %d", i);
    CHECK(tdm_devices_parse("3", d, 8) == 3 && d[2].index == 2 && d[2].type == TDM_CPU, "3");
    CHECK(tdm_devices_parse("cpu", d, 8) == 1 && d[0].index == 0, "cpu");
    CHECK_ERROR(tdm_devices_parse("cpu:0,cpu:0", d, 8) < 0, "cpu:0 is listed twice");
    CHECK_ERROR(tdm_devices_parse("gpu:0", d, 8) < 0, "unknown device \"gpu:0\"");
    char beyond[16]; /* the first GPU this machine does not have */
    snprintf(beyond, sizeof beyond, "cuda:%d", gpus);
    CHECK_ERROR(tdm_devices_parse(beyond, d, 8) < 0, "is not available");
    /* cuda:local: GPU <local rank> as a launcher sets it, an error past this machine's GPUs */
    char rank[16];
    snprintf(rank, sizeof rank, "%d", gpus);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", rank, 1);
    CHECK_ERROR(tdm_devices_parse("cuda:local", d, 8) < 0, "cuda:local is GPU");
    CHECK_ERROR(tdm_devices_parse("cuda", d, 8) < 0, "cuda is GPU");
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
    if (gpus > 0)
        CHECK(tdm_devices_parse("cuda:local", d, 8) == 1 && d[0].type == TDM_CUDA &&
                  d[0].index == 0,
              "cuda:local at local rank 0");
    if (gpus == 0)
        CHECK_ERROR(tdm_devices_parse("cuda:all", d, 8) < 0, "no GPU");
    else
        CHECK(tdm_devices_parse("cuda:all", d, 8) == gpus, "cuda:all");
    unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
    CHECK_ERROR(tdm_devices_parse("cpu:0,,cpu:1", d, 8) < 0, "empty entry");
    CHECK_ERROR(tdm_devices_parse("4", d, 2) < 0, "4 devices but room for 2");
    CHECK_ERROR(tdm_devices_parse("cpu:0,cpu:1,cpu:2", d, 2) < 0, "more than 2 devices");
    CHECK_ERROR(tdm_devices_parse("0", d, 8) < 0, "count 0 out of range");
    CHECK_ERROR(tdm_devices_parse("", d, 8) < 0, "empty device list");
}

/* ---- fingerprints with sites, and the flight recorder ------------------------------------ */

/* One collective that agrees, then rank 0 in a labelled all-reduce while rank 1 is in a
 * labelled broadcast (flag 0), or both in all-reduces of the same size from different sites
 * (flag 1); each rank then writes its flight recorder to dir/flight-R.jsonl. */
static char flight_dir[64];

static int rank_site_mismatch(tdm_rank_ctx *ctx, void *arg) {
    shared *sh = arg;
    int r = ctx->rank;
    tdm_tensor *t = tdm_ones(TDM_SHAPE(10), TDM_F32, tdm_cpu(r));
    tdm_collective_label("warm-up");
    int rc = tdm_work_wait(tdm_all_reduce(ctx->group, t, TDM_SUM));
    if (r == 0 || atomic_load(&sh->flag)) {
        tdm_collective_label("DDP bucket %d", 3 + r);
        sh->status[r] = rc ? rc : tdm_work_wait(tdm_all_reduce(ctx->group, t, TDM_SUM));
    } else {
        tdm_collective_label("stage-3 gather of unit %d", 5);
        sh->status[r] = rc ? rc : tdm_work_wait(tdm_broadcast(ctx->group, t, 0));
    }
    snprintf(sh->msg[r], sizeof sh->msg[r], "%s", tdm_last_error());
    char path[128];
    snprintf(path, sizeof path, "%s/flight-%d.jsonl", flight_dir, r);
    if (tdm_group_dump_flight(ctx->group, path)) sh->bad[r]++;
    tdm_tensor_free(t);
    return 0;
}

static void test_site_mismatch(void) {
    snprintf(flight_dir, sizeof flight_dir, "/tmp/tandem_flight_XXXXXX");
    CHECK(mkdtemp(flight_dir), "mkdtemp");
    const char *want[2] = {"ranks disagree on the collective: rank 0 is in all_reduce #2 (DDP "
                           "bucket 3: 10 f32, sum) while rank 1 is in broadcast #2 (stage-3 "
                           "gather of unit 5: 10 f32, root 0)",
                           "ranks disagree on the caller: rank 0 is in all_reduce #2 (DDP bucket "
                           "3: 10 f32, sum) while rank 1 is in all_reduce #2 (DDP bucket 4: 10 "
                           "f32, sum)"};
    for (int k = 0; k < 2; k++) {
        shared sh = {.n = 2};
        atomic_store(&sh.flag, k);
        CHECK(tdm_spawn(2, devs, rank_site_mismatch, &sh) == TDM_OK, "spawn: %s", tdm_last_error());
        for (int r = 0; r < 2; r++) {
            CHECK(sh.status[r] == TDM_ERR_COMM && strstr(sh.msg[r], want[k]),
                  "rank %d status %d, message: %s", r, sh.status[r], sh.msg[r]);
            CHECK(sh.bad[r] == 0, "rank %d could not write its flight recorder: %s", r,
                  tdm_last_error());
        }
    }
    /* the last case's files: the rank's line with the failure, then both collectives */
    char path[128];
    snprintf(path, sizeof path, "%s/flight-1.jsonl", flight_dir);
    FILE *f = fopen(path, "r");
    char line[3][1024] = {{0}};
    for (int i = 0; f && i < 3 && fgets(line[i], sizeof line[i], f); i++) {
    }
    if (f) fclose(f);
    CHECK(strstr(line[0], "\"rank\":1,\"size\":2,\"backend\":\"threads\"") &&
              strstr(line[0], "\"launched\":2") && strstr(line[0], "ranks disagree on the caller"),
          "the rank's line: %s", line[0]);
    CHECK(strstr(line[1], "\"seq\":1,\"op\":\"all_reduce\",\"site\":\"warm-up\"") &&
              strstr(line[1], "\"state\":\"done\""),
          "the first collective: %s", line[1]);
    CHECK(strstr(line[2], "\"seq\":2,\"op\":\"all_reduce\",\"site\":\"DDP bucket 4\"") &&
              strstr(line[2], "\"count\":10,\"dtype\":\"f32\"") &&
              strstr(line[2], "\"state\":\"failed\""),
          "the second: %s", line[2]);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", flight_dir);
    if (check_failed == 0 && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", flight_dir);
}

/* A file at dir/name holding text. */
static void put_file(const char *dir, const char *name, const char *text) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (f) fputs(text, f), fclose(f);
    CHECK(f != NULL, "cannot write %s", path);
}

static const char *eager(void) {
    const char *v = getenv("OMPI_MCA_btl_tcp_eager_limit");
    return v ? v : "(unset)";
}

/* tdm_mpi_tune_tcp: both sizes set where the user set neither, in the environment or in an MCA
 * parameter file; neither where the user set one; a longer name or a comment is not the name. */
static void test_mpi_tune(void) {
    char dir[] = "/tmp/tandem_mpitune_XXXXXX", list[160], home[80];
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp %s", dir);
        return;
    }
    const char *vars[] = {"OMPI_MCA_btl_tcp_eager_limit", "OMPI_MCA_btl_tcp_max_send_size"};
    char *saved_home = getenv("HOME") ? strdup(getenv("HOME")) : NULL;
    put_file(dir, "near.conf", "# btl_tcp_eager_limit = 5\nbtl_tcp_eager_limit_x = 9\n");
    put_file(dir, "sets.conf", "  btl_tcp_max_send_size=8192\n");
    snprintf(list, sizeof list, "%s/none.conf:%s/near.conf", dir, dir);
    for (int i = 0; i < 2; i++) unsetenv(vars[i]);
    setenv("OMPI_MCA_mca_base_param_files", list, 1);
    CHECK(tdm_mpi_tune_tcp(1 << 20) == 2, "nothing set by the user: both set");
    CHECK(!strcmp(eager(), "1052672"), "eager limit %s, expected 1 MiB + 4096", eager());
    const char *frag = getenv(vars[1]);
    CHECK(frag && !strcmp(frag, "1052672"), "largest fragment %s", frag ? frag : "(unset)");

    unsetenv(vars[0]);
    setenv(vars[1], "8192", 1); /* mpirun --mca btl_tcp_max_send_size 8192 */
    CHECK(tdm_mpi_tune_tcp(1 << 20) == 0 && !strcmp(eager(), "(unset)"),
          "one size set in the environment: the eager limit became %s", eager());
    unsetenv(vars[1]);
    snprintf(list, sizeof list, "%s/near.conf:%s/sets.conf", dir, dir);
    setenv("OMPI_MCA_mca_base_param_files", list, 1);
    CHECK(tdm_mpi_tune_tcp(1 << 20) == 0 && !strcmp(eager(), "(unset)"),
          "one size set in a listed file: the eager limit became %s", eager());
    /* without a list, the user's own file is one Open MPI reads */
    unsetenv("OMPI_MCA_mca_base_param_files");
    snprintf(home, sizeof home, "%s/.openmpi", dir);
    CHECK(mkdir(home, 0700) == 0, "mkdir %s", home);
    put_file(home, "mca-params.conf", "btl_tcp_eager_limit = 70000\n");
    setenv("HOME", dir, 1);
    CHECK(tdm_mpi_tune_tcp(1 << 20) == 0 && !strcmp(eager(), "(unset)"),
          "the eager limit set in ~/.openmpi/mca-params.conf: it became %s", eager());
    if (saved_home) setenv("HOME", saved_home, 1);
    free(saved_home);
    char cmd[96];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0, "%s", cmd);
}

/* tdm_mpi_share_cores: a rank sharing its machine with another gets half its cores (at least
 * one, at most its affinity's) for the GEMM, in OMP_NUM_THREADS and the calling thread; nothing
 * when alone, or when the user set OMP_NUM_THREADS. The thread's count is restored after. */
static void test_share_cores(void) {
    int before = tdm_cpu_gemm_threads(), cores = tdm_device_count(TDM_CPU);
    unsetenv("OMP_NUM_THREADS");
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1", 1);
    CHECK(tdm_mpi_share_cores() == 0 && !getenv("OMP_NUM_THREADS"), "alone: nothing set");
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    int want = cores / 2 > 0 ? cores / 2 : 1, got = tdm_mpi_share_cores();
    const char *v = getenv("OMP_NUM_THREADS");
    CHECK(got >= 1 && got <= want && v && atoi(v) == got && tdm_cpu_gemm_threads() == got,
          "two ranks on %d cores: %d threads (OMP_NUM_THREADS %s, the thread's %d)", cores, got,
          v ? v : "unset", tdm_cpu_gemm_threads());
    setenv("OMP_NUM_THREADS", "7", 1); /* the user's */
    CHECK(tdm_mpi_share_cores() == 0 && !strcmp(getenv("OMP_NUM_THREADS"), "7"),
          "OMP_NUM_THREADS given: left as it is");
    unsetenv("OMP_NUM_THREADS");
    unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    tdm_cpu_gemm_set_threads(before);
}

int main(void) {
    for (int r = 0; r < MAX_RANKS; r++) devs[r] = tdm_cpu(r);
    test_share_cores();
    test_devices();
    test_bad_arguments();
    test_all_ops();
    test_direct_barrier();
    test_lines();
    test_rank_error();
    test_timeout();
    test_mismatch();
    test_lowp();
    test_dtype_mismatch();
    test_site_mismatch();
    test_mpi_tune();
    return check_summary();
}
