/* The MPI backend, run by CTest under `mpirun -np 2` and `-np 3` (one rank per process):
 * every collective against a serial reference computed on each rank (sums in rank order in
 * float, so results must match bit for bit, and be identical on every rank), handles in
 * flight at once, DDP across processes ending with the parameters of one process trained
 * on the same global batches, and ZeRO stage 1 (the optimizer state sharded over the
 * processes, and over every device of every process on the two-level group) ending with the
 * unsharded run's parameters and state bit for bit; ZeRO stage 2 (the gradients sharded too)
 * the same, bit for bit with one micro-batch a step and to float rounding when accumulating.
 *
 * `test_mpi --faults MPIRUN` (its own CTest entry) launches `MPIRUN -np 3 test_mpi --fault
 * CASE` for each fault case and checks that the job exits nonzero, quickly, with a message
 * naming the failing rank: a rank killed mid-epoch, a rank that hangs (timeout), a rank that
 * aborts, the same killed or aborting rank while the others exchange a sharded optimizer's
 * ranges or (stage 2) reduce gradient buckets, ranks built with different models, ranks that
 * call different collectives or sizes (over TCP too, freeing their tensors after the error);
 * no case may leave a sanitizer report. */
#include "check.h"
#include "core/core.h"
#include "parallel/group.h"

#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static tdm_group *G;
static int R, N;

#include "collective_lowp.h"

static tdm_tensor *filled(int r, int64_t m, int salt) {
    tdm_tensor *t = tdm_empty(TDM_SHAPE(m), TDM_F32, tdm_cpu(0));
    float *p = tdm_data_ptr(t);
    for (int64_t i = 0; i < m; i++) p[i] = value(r, i, salt);
    return t;
}

/* Elements of t [m] that differ from the reference for elements off .. off + m. */
static int64_t count_wrong(const tdm_tensor *t, int salt, tdm_reduce_kind op, int64_t off) {
    const float *p = tdm_data_ptr(t);
    int64_t wrong = 0;
    for (int64_t i = 0; i < tdm_numel(t); i++) wrong += p[i] != reference(N, off + i, salt, op);
    return wrong;
}

static uint64_t digest(const void *data, size_t bytes) { /* FNV-1a */
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < bytes; i++)
        h = (h ^ ((const unsigned char *)data)[i]) * 1099511628211ull;
    return h;
}

/* True when every rank passes the same digest (an all-gather of one i64 per rank). */
static bool same_everywhere(uint64_t d) {
    tdm_tensor *in = tdm_from_data(TDM_SHAPE(1), TDM_I64, tdm_cpu(0), &d);
    tdm_tensor *all = tdm_zeros(TDM_SHAPE(N), TDM_I64, tdm_cpu(0));
    bool ok = tdm_work_wait(tdm_all_gather(G, all, in)) == TDM_OK;
    const uint64_t *p = tdm_data_ptr(all);
    for (int k = 0; ok && k < N; k++) ok = p[k] == d;
    tdm_tensor_free(in);
    tdm_tensor_free(all);
    return ok;
}

/* ---- collectives -------------------------------------------------------------------------- */

/* 0, 1, odd, around a cache line, > 1 MiB, and > several 1 MiB segments of the backend */
static const int64_t sizes[] = {0, 1, 7, 17, 1000, 4097, (1 << 18) + 5, 2500003};
#define N_SIZES ((int)(sizeof sizes / sizeof sizes[0]))

static void ops_one_size(int64_t m, int salt) {
    for (int op = TDM_SUM; op <= TDM_AVG; op++) {
        tdm_tensor *t = filled(R, m, salt + op);
        CHECK(tdm_work_wait(tdm_all_reduce(G, t, (tdm_reduce_kind)op)) == TDM_OK,
              "all_reduce m=%lld: %s", (long long)m, tdm_last_error());
        int64_t wrong = count_wrong(t, salt + op, (tdm_reduce_kind)op, 0);
        CHECK(wrong == 0, "all_reduce op %d m=%lld on rank %d: %lld wrong", op, (long long)m, R,
              (long long)wrong);
        CHECK(same_everywhere(digest(tdm_data_ptr(t), (size_t)m * 4)),
              "all_reduce op %d m=%lld: ranks differ", op, (long long)m);
    }
    /* broadcast from a root that moves with the size, f32 and i32 */
    int root = (int)(m % N);
    tdm_tensor *b = filled(R, m, salt + 2);
    CHECK(tdm_work_wait(tdm_broadcast(G, b, root)) == TDM_OK, "broadcast: %s", tdm_last_error());
    const float *pb = tdm_data_ptr(b);
    int64_t wrong = 0;
    for (int64_t i = 0; i < m; i++) wrong += pb[i] != value(root, i, salt + 2);
    CHECK(wrong == 0, "broadcast m=%lld root %d on rank %d: %lld wrong", (long long)m, root, R,
          (long long)wrong);
    tdm_tensor *bi = tdm_full(TDM_SHAPE(m), (float)(R * 10 + 3), TDM_I32, tdm_cpu(0));
    CHECK(tdm_work_wait(tdm_broadcast(G, bi, root)) == TDM_OK, "broadcast i32: %s",
          tdm_last_error());
    const int32_t *pbi = tdm_data_ptr(bi);
    wrong = 0;
    for (int64_t i = 0; i < m; i++) wrong += pbi[i] != root * 10 + 3;
    CHECK(wrong == 0, "broadcast i32 m=%lld: %lld wrong", (long long)m, (long long)wrong);
    /* all-gather: out [N * m] holds every rank's in, in rank order */
    tdm_tensor *in = filled(R, m, salt + 3);
    tdm_tensor *out = tdm_full(TDM_SHAPE(N * m), -7.0f, TDM_F32, tdm_cpu(0));
    CHECK(tdm_work_wait(tdm_all_gather(G, out, in)) == TDM_OK, "all_gather: %s", tdm_last_error());
    const float *po = tdm_data_ptr(out);
    wrong = 0;
    for (int k = 0; k < N; k++)
        for (int64_t i = 0; i < m; i++) wrong += po[k * m + i] != value(k, i, salt + 3);
    CHECK(wrong == 0, "all_gather m=%lld on rank %d: %lld wrong", (long long)m, R,
          (long long)wrong);
    /* reduce-scatter: rank R gets chunk R of the reduction of in [N * m] */
    for (int op = TDM_SUM; op <= TDM_AVG; op++) {
        tdm_tensor *big = filled(R, N * m, salt + 4 + op);
        tdm_tensor *part = tdm_full(TDM_SHAPE(m), -7.0f, TDM_F32, tdm_cpu(0));
        CHECK(tdm_work_wait(tdm_reduce_scatter(G, part, big, (tdm_reduce_kind)op)) == TDM_OK,
              "reduce_scatter: %s", tdm_last_error());
        wrong = count_wrong(part, salt + 4 + op, (tdm_reduce_kind)op, R * m);
        CHECK(wrong == 0, "reduce_scatter op %d m=%lld on rank %d: %lld wrong", op, (long long)m, R,
              (long long)wrong);
    }
    /* reduce to a root that moves with the size: all_reduce's bits there; others keep theirs */
    for (int op = TDM_SUM; op <= TDM_AVG; op++) {
        int to = (int)((m + 1) % N);
        tdm_tensor *t = filled(R, m, salt + 6 + op);
        CHECK(tdm_work_wait(tdm_reduce(G, t, to, (tdm_reduce_kind)op)) == TDM_OK, "reduce: %s",
              tdm_last_error());
        const float *pt = tdm_data_ptr(t);
        wrong = 0;
        for (int64_t i = 0; R != to && i < m; i++) wrong += pt[i] != value(R, i, salt + 6 + op);
        if (R == to) wrong = count_wrong(t, salt + 6 + op, (tdm_reduce_kind)op, 0);
        CHECK(wrong == 0, "reduce op %d m=%lld to %d on rank %d: %lld wrong", op, (long long)m, to,
              R, (long long)wrong);
    }
    CHECK(tdm_work_wait(tdm_barrier(G)) == TDM_OK, "barrier: %s", tdm_last_error());
}

/* Several all-reduces in flight at once while the rank computes, waited out of order. */
static void outstanding(void) {
    const int64_t ms[4] = {1000, 7, 1 << 20, 1};
    tdm_tensor *t[4];
    tdm_work *w[4];
    for (int j = 0; j < 4; j++) {
        t[j] = filled(R, ms[j], 100 + j);
        w[j] = tdm_all_reduce(G, t[j], j % 2 ? TDM_AVG : TDM_SUM);
    }
    tdm_tensor *x = tdm_ones(TDM_SHAPE(64, 64), TDM_F32, tdm_cpu(0));
    CHECK(tdm_matmul(x, x) != NULL, "matmul: %s", tdm_last_error());
    const int order[4] = {3, 1, 0, 2};
    for (int j = 0; j < 4; j++)
        CHECK(tdm_work_wait(w[order[j]]) == TDM_OK, "wait %d: %s", order[j], tdm_last_error());
    for (int j = 0; j < 4; j++)
        CHECK(count_wrong(t[j], 100 + j, j % 2 ? TDM_AVG : TDM_SUM, 0) == 0,
              "outstanding tensor %d wrong", j);
}

static void test_collectives(void) {
    CHECK(tdm_group_rank(G) == R && tdm_group_size(G) == N && N >= 1, "rank %d size %d", R, N);
    const char *env = getenv("OMPI_COMM_WORLD_SIZE");
    CHECK(!env || atoi(env) == N, "size %d, mpirun says %s", N, env);
    for (int s = 0; s < N_SIZES; s++) {
        tdm_scope_begin();
        ops_one_size(sizes[s], 10 * s);
        tdm_scope_end();
    }
    tdm_scope_begin();
    outstanding();
    tdm_scope_end();
    /* bad arguments fail on the calling rank before anything is sent */
    tdm_scope_begin();
    tdm_tensor *i32 = tdm_zeros(TDM_SHAPE(4), TDM_I32, tdm_cpu(0));
    CHECK_ERROR(tdm_all_reduce(G, i32, TDM_SUM) == NULL, "all_reduce: tensor must be f32");
    CHECK_ERROR(tdm_broadcast(G, i32, N) == NULL, "root");
    tdm_scope_end();
    CHECK(tdm_mpi_init(NULL, NULL) == G, "a second tdm_mpi_init returns the same group");
}

/* Every collective in bf16 and f16 across the processes (sizes past one scratch segment):
 * reductions equal to the ranks' values summed in f32 in rank order and rounded once. */
/* ---- sub-groups (a mesh's dimensions over MPI) ---------------------------------------------- */

/* The world's ranks in reverse (group rank k is world rank N - 1 - k), and the pair {N - 1, 0}
 * (every other rank making a group of itself alone, as a mesh's other groups are made at
 * once): collectives on each, bit for bit against sums in the group's rank order, with a
 * world all-reduce in flight between a pair's collectives (the one communication thread runs
 * both groups' in launch order, under their own tags). */
static void test_subgroups(void) {
    int rev[64], pair[2] = {N - 1, 0}, alone = R;
    for (int k = 0; k < N; k++) rev[k] = N - 1 - k;
    tdm_group *g = tdm_mpi_subgroup(G, N, rev);
    bool in_pair = R == 0 || R == N - 1;
    tdm_group *p = in_pair ? tdm_mpi_subgroup(G, 2, pair) : tdm_mpi_subgroup(G, 1, &alone);
    CHECK(g && p, "mpi_subgroup: %s", tdm_last_error());
    if (!g || !p) return;
    CHECK(tdm_group_rank(g) == N - 1 - R && tdm_group_size(g) == N, "reversed: rank %d of %d",
          tdm_group_rank(g), tdm_group_size(g));
    const int64_t ms[] = {1, 4097, (1 << 18) + 5};
    for (int j = 0; j < 3; j++) {
        int64_t m = ms[j], wrong = 0;
        tdm_tensor *t = filled(R, m, 40 + j), *w = filled(R, m, 50 + j);
        tdm_tensor *q = filled(R, m, 60 + j);
        tdm_work *wq = tdm_all_reduce(p, q, TDM_SUM);
        tdm_work *ww = tdm_all_reduce(G, w, TDM_SUM); /* the world's, between the pair's */
        CHECK(tdm_work_wait(tdm_all_reduce(g, t, TDM_SUM)) == TDM_OK && tdm_work_wait(wq) == 0 &&
                  tdm_work_wait(ww) == TDM_OK,
              "sub-group all_reduce of %lld: %s", (long long)m, tdm_last_error());
        const float *pt = tdm_data_ptr(t), *pq = tdm_data_ptr(q);
        for (int64_t i = 0; i < m; i++) {
            float ref = value(N - 1, i, 40 + j) + value(N - 2, i, 40 + j);
            for (int k = N - 3; k >= 0; k--) ref += value(k, i, 40 + j);
            float pref =
                in_pair ? value(N - 1, i, 60 + j) + value(0, i, 60 + j) : value(R, i, 60 + j);
            wrong += pt[i] != ref || pq[i] != pref;
        }
        wrong += count_wrong(w, 50 + j, TDM_SUM, 0);
        /* all-gather in the group's order; broadcast from group rank 0 (world rank N - 1) */
        tdm_tensor *all = tdm_zeros(TDM_SHAPE(N * m), TDM_F32, tdm_cpu(0));
        CHECK(tdm_work_wait(tdm_all_gather(g, all, q)) == TDM_OK &&
                  tdm_work_wait(tdm_broadcast(g, t, 0)) == TDM_OK,
              "sub-group all_gather, broadcast: %s", tdm_last_error());
        const float *pa = tdm_data_ptr(all);
        for (int k = 0; k < N; k++) {
            int wr = N - 1 - k; /* its q: the pair's sum, or its own value */
            bool pr = wr == 0 || wr == N - 1;
            for (int64_t i = 0; i < m; i++) {
                float ref =
                    pr ? value(N - 1, i, 60 + j) + value(0, i, 60 + j) : value(wr, i, 60 + j);
                wrong += pa[k * m + i] != ref;
            }
        }
        CHECK(wrong == 0, "sub-groups, %lld elements, rank %d: %lld wrong", (long long)m, R,
              (long long)wrong);
        tdm_tensor_free(t), tdm_tensor_free(w), tdm_tensor_free(q), tdm_tensor_free(all);
    }
    /* bad members */
    CHECK_ERROR(tdm_mpi_subgroup(G, 2, (int[]){0, 0}) == NULL, "rank 0 listed twice");
    CHECK_ERROR(tdm_mpi_subgroup(G, 1, (int[]){N}) == NULL, "rank");
    CHECK(tdm_work_wait(tdm_barrier(G)) == TDM_OK, "barrier: %s", tdm_last_error());
    tdm_mpi_subgroup_free(g);
    tdm_mpi_subgroup_free(p);
}

static void test_lowp_collectives(void) {
    for (int d = 0; d < 2; d++) {
        tdm_dtype dt = d ? TDM_F16 : TDM_BF16;
        lowp_result res = {0};
        for (int s = 0; s < N_SIZES && !res.err[0]; s++) {
            tdm_scope_begin();
            lowp_ops(G, tdm_cpu(0), N, dt, sizes[s], 10 * s, &res);
            tdm_scope_end();
        }
        CHECK(!res.err[0], "%s", res.err);
        CHECK(res.wrong == 0, "%s collectives: %lld elements wrong", tdm_dtype_name(dt),
              (long long)res.wrong);
    }
}

/* ---- DDP across processes (as tests/test_ddp.c does with threads) -------------------------- */

#include "ddp_common.h"

static tdm_optim *make_sgd(tdm_paramset *ps) {
    tdm_sgd_opts o = tdm_sgd_defaults(0.1f);
    o.momentum = 0.9f;
    return tdm_sgd_new(ps, &o);
}

static tdm_optim *make_adam(tdm_paramset *ps) {
    tdm_adam_opts o = tdm_adam_defaults();
    o.lr = 0.01f;
    return tdm_adam_new(ps, &o);
}

/* One process on the first `rows` rows of every batch: the reference parameters. */
static float *one_process(tdm_optim *(*make)(tdm_paramset *), int64_t rows) {
    tdm_module *m = make_mlp(1, HID);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *opt = make(ps);
    float x[B * IN];
    int64_t y[B];
    for (int s = 0; s < STEPS; s++) {
        tdm_optim_zero_grad(opt);
        batch_of(s, x, y);
        tdm_scope_begin();
        tdm_backward(tdm_cross_entropy(
            tdm_module_forward(m, tdm_from_data(TDM_SHAPE(rows, IN), TDM_F32, tdm_cpu(0), x)),
            tdm_from_data(TDM_SHAPE(rows), TDM_I64, tdm_cpu(0), y), NULL));
        tdm_scope_end();
        tdm_optim_step(opt);
    }
    return take_weights(m, ps, opt);
}

/* This rank's rows [lo, hi) of a global batch of B split over N ranks (uneven splits). */
static void rows_of(int64_t *lo, int64_t *hi) {
    *lo = R * (B / N) + (R < B % N ? R : B % N);
    *hi = *lo + B / N + (R < B % N);
}

/* One DDP step on this rank's rows of step s's batch; the loss is weighted by the rank's
 * share so that the average over ranks is the mean over the global batch. */
/* A fault of rank 1 at step 3 after its backward (the gradients' all-reduce done), before the
 * sharded optimizer's exchange of ranges: "kill_shard" or "abort_shard" (fault_child). */
static const char *update_fault;

static int update_fault_now(int s) {
    if (!update_fault || s != 3) return TDM_OK;
    /* every rank past its backward's last all-reduce first: a rank still waiting for it
     * would meet rank 1's end there, not in the exchange (CI saw it under load) */
    int rc = tdm_work_wait(tdm_barrier(G));
    if (rc || R != 1) return rc;
    if (!strcmp(update_fault, "kill_shard")) raise(SIGKILL);
    tdm_group_abort(G, "its update failed");
    return tdm_raise(TDM_ERR_STATE, "its update failed");
}

static int ddp_step(tdm_ddp *d, tdm_module *m, tdm_optim *opt, int s) {
    float x[B * IN];
    int64_t y[B], lo, hi;
    batch_of(s, x, y);
    rows_of(&lo, &hi);
    tdm_optim_zero_grad(opt);
    tdm_scope_begin();
    tdm_tensor *out =
        tdm_ddp_forward(d, tdm_from_data(TDM_SHAPE(hi - lo, IN), TDM_F32, tdm_cpu(0), x + lo * IN));
    tdm_tensor *l = tdm_cross_entropy(
        out, tdm_from_data(TDM_SHAPE(hi - lo), TDM_I64, tdm_cpu(0), y + lo), NULL);
    int rc = tdm_ddp_backward(d, tdm_mul_scalar(l, (float)((double)(hi - lo) * N / B)));
    tdm_scope_end();
    if (!rc) rc = update_fault_now(s);
    return rc ? rc : tdm_optim_step(opt);
}

static void test_ddp(void) {
    tdm_optim *(*makes[2])(tdm_paramset *) = {make_sgd, make_adam};
    for (int k = 0; k < 2; k++) {
        float *want = one_process(makes[k], B);
        tdm_module *m = make_mlp(1 + (uint64_t)R, HID); /* rank 0's weights are broadcast */
        tdm_ddp_opts o = tdm_ddp_defaults();
        o.bucket_cap_bytes = o.first_bucket_cap_bytes = k ? 64 : 25 << 20;
        tdm_ddp *d = tdm_ddp_new(m, G, &o);
        CHECK(d, "ddp_new: %s", tdm_last_error());
        if (!d) return;
        tdm_paramset *ps = tdm_module_parameters(m);
        tdm_optim *opt = makes[k](ps);
        int rc = 0;
        for (int s = 0; s < STEPS && !rc; s++) rc = ddp_step(d, m, opt, s);
        CHECK(rc == 0, "ddp step: %s", tdm_last_error());
        const float *p = tdm_data_ptr(ps->flat);
        int bad = 0;
        for (int64_t i = 0; i < ps->total; i++)
            bad += !(fabsf(p[i] - want[i]) <= 1e-5f + 1e-4f * fabsf(want[i]));
        CHECK(bad == 0, "ddp optimizer %d, %d processes, rank %d: %d parameters off one process", k,
              N, R, bad);
        CHECK(same_everywhere(digest(p, sizeof(float) * (size_t)ps->total)),
              "ddp optimizer %d: ranks' parameters differ", k);
        tdm_optim_free(opt);
        tdm_ddp_free(d);
        tdm_module_free(m);
        free(want);
    }
}

/* ---- two devices per process: the two-level group ------------------------------------------ */

#define L 2 /* devices (threads) per process */

/* What every rank of the two-level group must get: each process's inputs added in local rank
 * order, then the processes' sums in rank order (the MPI backend's order), / N*L for AVG. */
static float two_level_reference(int64_t i, int salt, tdm_reduce_kind op) {
    float s = 0;
    for (int p = 0; p < N; p++) {
        float sp = value(p * L, i, salt);
        for (int l = 1; l < L; l++) sp += value(p * L + l, i, salt);
        s = p ? s + sp : sp;
    }
    return op == TDM_AVG ? s / (float)(N * L) : s;
}

typedef struct {
    tdm_group *g;
    int64_t wrong; /* elements that differ from the reference, over every collective */
    char err[256];
    lowp_result lowp; /* the same in bf16 and f16 */
} level_rank;

/* Every collective of one rank of the two-level group on size m, counted into a->wrong. */
static void two_level_ops(level_rank *a, int64_t m, int salt) {
    tdm_group *g = a->g;
    int r = tdm_group_rank(g), n = tdm_group_size(g);
    for (int op = TDM_SUM; op <= TDM_AVG; op++) {
        tdm_tensor *t = filled(r, m, salt + op);
        if (tdm_work_wait(tdm_all_reduce(g, t, (tdm_reduce_kind)op))) goto fail;
        const float *p = tdm_data_ptr(t);
        for (int64_t i = 0; i < m; i++)
            a->wrong += p[i] != two_level_reference(i, salt + op, (tdm_reduce_kind)op);
        tdm_tensor *big = filled(r, n * m, salt + 4 + op),
                   *part = tdm_zeros(TDM_SHAPE(m), TDM_F32, tdm_cpu(0));
        if (tdm_work_wait(tdm_reduce_scatter(g, part, big, (tdm_reduce_kind)op))) goto fail;
        p = tdm_data_ptr(part);
        for (int64_t i = 0; i < m; i++)
            a->wrong += p[i] != two_level_reference(r * m + i, salt + 4 + op, (tdm_reduce_kind)op);
        /* reduce to a root that moves with m (the others' values are not specified) */
        int to = (int)((m + 2 + op) % n);
        t = filled(r, m, salt + 6 + op);
        if (tdm_work_wait(tdm_reduce(g, t, to, (tdm_reduce_kind)op))) goto fail;
        p = tdm_data_ptr(t);
        for (int64_t i = 0; r == to && i < m; i++)
            a->wrong += p[i] != two_level_reference(i, salt + 6 + op, (tdm_reduce_kind)op);
    }
    int root = (int)((m + 1) % n);
    tdm_tensor *b = filled(r, m, salt + 2);
    if (tdm_work_wait(tdm_broadcast(g, b, root))) goto fail;
    const float *pb = tdm_data_ptr(b);
    for (int64_t i = 0; i < m; i++) a->wrong += pb[i] != value(root, i, salt + 2);
    tdm_tensor *in = filled(r, m, salt + 3),
               *out = tdm_zeros(TDM_SHAPE(n * m), TDM_F32, tdm_cpu(0));
    if (tdm_work_wait(tdm_all_gather(g, out, in))) goto fail;
    const float *po = tdm_data_ptr(out);
    for (int k = 0; k < n; k++)
        for (int64_t i = 0; i < m; i++) a->wrong += po[k * m + i] != value(k, i, salt + 3);
    if (tdm_work_wait(tdm_barrier(g))) goto fail;
    return;
fail:
    snprintf(a->err, sizeof a->err, "%s", tdm_last_error());
}

static void *two_level_main(void *arg) {
    level_rank *a = arg;
    const int64_t ms[] = {0, 1, 17, 4097, (1 << 18) + 5};
    for (int s = 0; s < 5 && !a->err[0]; s++) {
        tdm_scope_begin();
        two_level_ops(a, ms[s], 7 * s);
        for (int d = 0; d < 2 && !a->lowp.err[0]; d++)
            lowp_ops(a->g, tdm_cpu(0), L, d ? TDM_F16 : TDM_BF16, ms[s], 7 * s, &a->lowp);
        tdm_scope_end();
    }
    /* a mesh whose tp groups would hold 2 devices of one process and 1 of another (3 x 2
     * ranks, tp 3) is refused on every rank before any collective (none hangs) */
    if (N == 3 && !a->err[0]) {
        tdm_mesh *m = tdm_mesh_new(a->g, 2, (int[]){2, 3}, (const char *[]){"dp", "tp"});
        if (m || !strstr(tdm_last_error(), "groups of \"tp\" would hold different numbers"))
            snprintf(a->err, sizeof a->err, "uneven mesh: %s", m ? "made" : tdm_last_error());
        tdm_mesh_free(m);
    }
    tdm_thread_release();
    return NULL;
}

static void test_two_level_collectives(void) {
    tdm_device devs[L] = {tdm_cpu(0), tdm_cpu(1)};
    tdm_threads_world *tw = tdm_threads_world_new(L, devs);
    tdm_hier_world *hw = tw ? tdm_hier_world_new(tw, L, G) : NULL;
    CHECK(hw, "two-level world: %s", tdm_last_error());
    if (!hw) return;
    level_rank a[L] = {{0}};
    pthread_t th[L];
    for (int l = 0; l < L; l++) {
        a[l].g = tdm_hier_world_group(hw, l);
        CHECK(tdm_group_rank(a[l].g) == R * L + l && tdm_group_size(a[l].g) == N * L,
              "two-level rank %d of %d", tdm_group_rank(a[l].g), tdm_group_size(a[l].g));
        pthread_create(&th[l], NULL, two_level_main, &a[l]);
    }
    for (int l = 0; l < L; l++) {
        pthread_join(th[l], NULL);
        CHECK(!a[l].err[0], "two-level collective on device %d of process %d: %s", l, R, a[l].err);
        CHECK(a[l].wrong == 0, "two-level collectives, device %d of process %d: %lld wrong", l, R,
              (long long)a[l].wrong);
        CHECK(!a[l].lowp.err[0], "two-level, device %d of process %d: %s", l, R, a[l].lowp.err);
        CHECK(a[l].lowp.wrong == 0, "two-level bf16/f16, device %d of process %d: %lld wrong", l, R,
              (long long)a[l].lowp.wrong);
    }
    tdm_hier_world_free(hw);
    tdm_threads_world_free(tw);
}

static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    return tdm_cross_entropy(out, target, NULL);
}

static tdm_optim *dp_factory(tdm_paramset *ps, void *make) {
    return ((tdm_optim * (*)(tdm_paramset *)) make)(ps);
}

/* DataParallel over 2 devices in each of N processes equals one process on the same rows. */
static void test_dp_two_level(void) {
    tdm_optim *(*makes[2])(tdm_paramset *) = {make_sgd, make_adam};
    const int64_t k = B / N; /* rows per process: equal shares */
    for (int o = 0; o < 2; o++) {
        float *want = one_process(makes[o], k * N);
        tdm_module *m = make_mlp(1 + (uint64_t)R, HID); /* rank 0's weights reach everyone */
        tdm_device devs[L] = {tdm_cpu(0), tdm_cpu(1)};
        tdm_dp *dp = tdm_dp_new_distributed(m, devs, L, G, dp_factory, (void *)makes[o]);
        CHECK(dp, "dp_new_distributed: %s", tdm_last_error());
        if (!dp) return;
        float x[B * IN], loss = NAN;
        int64_t y[B];
        int rc = 0;
        for (int s = 0; s < STEPS && !rc; s++) {
            batch_of(s, x, y);
            tdm_scope_begin();
            rc = tdm_dp_step(
                dp, tdm_from_data(TDM_SHAPE(k, IN), TDM_F32, tdm_cpu(0), x + R * k * IN),
                tdm_from_data(TDM_SHAPE(k), TDM_I64, tdm_cpu(0), y + R * k), ce_loss, NULL, &loss);
            tdm_scope_end();
        }
        CHECK(rc == 0 && isfinite(loss), "two-level dp step: %s", tdm_last_error());
        for (int r = 0; r < L; r++) {
            tdm_paramset *ps = tdm_module_parameters(tdm_dp_replica(dp, r));
            const float *p = tdm_data_ptr(ps->flat);
            int bad = 0;
            for (int64_t i = 0; i < ps->total; i++)
                bad += !(fabsf(p[i] - want[i]) <= 1e-5f + 1e-4f * fabsf(want[i]));
            CHECK(bad == 0,
                  "two-level dp optimizer %d, %d x %d devices, device %d of process %d: "
                  "%d parameters off one process",
                  o, N, L, r, R, bad);
            CHECK(same_everywhere(digest(p, sizeof(float) * (size_t)ps->total)),
                  "two-level dp optimizer %d: processes' parameters differ", o);
        }
        tdm_dp_free(dp);
        tdm_module_free(m);
        free(want);
    }
}

/* ---- ZeRO stage 1 across processes ---------------------------------------------------------- */

static tdm_optim *make_adam_zero(tdm_paramset *ps) {
    tdm_adam_opts o = tdm_adam_defaults();
    o.lr = 0.01f;
    o.weight_decay = 0.05f;
    o.amsgrad = true;
    return tdm_adam_new(ps, &o);
}

static tdm_optim *make_sgd_zero(tdm_paramset *ps) {
    tdm_sgd_opts o = tdm_sgd_defaults(0.1f);
    o.momentum = 0.9f;
    o.weight_decay = 1e-3f;
    return tdm_sgd_new(ps, &o);
}

#define ZERO_CLIP 0.05f /* below the gradients' norm: every step clips */

/* What a run leaves on a rank (or a replica): its parameters, a digest of the whole optimizer
 * state gathered, its shard and the elements of its state buffers. */
typedef struct {
    float *params;
    uint64_t state;
    int64_t total, lo, hi, numel;
} zero_result;

/* o's shard and state size, and a digest of its whole state (whole: gathered, or NULL to
 * gather it here, a collective over o's group). */
static int zero_describe(tdm_optim *o, tdm_optim *whole, zero_result *z) {
    tdm_optim *w = whole ? whole : tdm_optim_gather(o);
    if (!w) return tdm_last_status();
    tdm_tensor *st[3];
    int n = tdm_optim_state(w, NULL, st, 3);
    int64_t total = n ? tdm_numel(st[0]) : 0;
    float *all = malloc(sizeof(float) * (size_t)(n * total + 1));
    for (int k = 0; all && k < n; k++)
        tdm_to_host(st[k], all + k * total, sizeof(float) * (size_t)total);
    z->state = all ? digest(all, sizeof(float) * (size_t)(n * total)) : 0;
    free(all);
    if (w != whole) tdm_optim_free(w);
    tdm_optim_shard_range(o, &z->lo, &z->hi);
    n = tdm_optim_state(o, NULL, st, 3);
    z->numel = n ? tdm_numel(st[0]) : 0;
    for (int k = 1; k < n; k++)
        if (tdm_numel(st[k]) != z->numel) z->numel = -1;
    return TDM_OK;
}

/* DDP over the processes, `micro` micro-batches a step (all but the last without sync), the
 * averaged gradient clipped, the optimizer (kind: and the gradients) sharded over the
 * processes when asked; buckets of 16 floats, so that several cross the shards' bounds. */
static int zero_ddp(tdm_optim *(*make)(tdm_paramset *), tdm_shard_kind kind, int micro,
                    zero_result *z) {
    tdm_module *m = make_mlp(1 + (uint64_t)R, HID);
    tdm_ddp_opts o = tdm_ddp_defaults();
    o.bucket_cap_bytes = o.first_bucket_cap_bytes = 64;
    tdm_ddp *d = tdm_ddp_new(m, G, &o);
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_optim *opt = d ? make(ps) : NULL;
    int rc = !opt ? tdm_last_status() : tdm_ddp_set_shard(d, opt, kind);
    if (!rc && kind >= TDM_SHARD_GRADIENTS && ps->flat_grad) rc = TDM_ERR_STATE; /* kept whole */
    float x[B * IN];
    int64_t y[B], lo, hi;
    rows_of(&lo, &hi);
    for (int s = 0; s < STEPS && !rc; s++) {
        tdm_optim_zero_grad(opt);
        for (int a = 0; a < micro && !rc; a++) {
            batch_of(s * 10 + a, x, y);
            tdm_ddp_set_sync(d, a == micro - 1);
            tdm_scope_begin();
            tdm_tensor *out = tdm_ddp_forward(
                d, tdm_from_data(TDM_SHAPE(hi - lo, IN), TDM_F32, tdm_cpu(0), x + lo * IN));
            tdm_tensor *l = tdm_cross_entropy(
                out, tdm_from_data(TDM_SHAPE(hi - lo), TDM_I64, tdm_cpu(0), y + lo), NULL);
            rc = tdm_ddp_backward(d, tdm_mul_scalar(l, (float)((double)(hi - lo) * N / B / micro)));
            tdm_scope_end();
        }
        if (!rc) rc = tdm_ddp_clip_grad_norm(d, ZERO_CLIP, NULL);
        if (!rc) rc = tdm_optim_step(opt);
    }
    if (!rc) {
        z->total = ps->total;
        z->params = malloc(sizeof(float) * (size_t)ps->total);
        rc = tdm_ddp_gather_params(d); /* stage 3: the whole model again, in ps->flat */
        if (!rc) rc = tdm_to_host(ps->flat, z->params, sizeof(float) * (size_t)ps->total);
        if (!rc) rc = tdm_ddp_release_params(d);
        if (!rc) rc = zero_describe(opt, NULL, z);
    }
    tdm_optim_free(opt);
    tdm_ddp_free(d);
    tdm_module_free(m);
    return rc;
}

/* Parameters off want's beyond float rounding (1e-5 absolute + 1e-4 relative, as test_ddp). */
static int count_off(const float *got, const float *want, int64_t n) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += !(fabsf(got[i] - want[i]) <= 1e-5f + 1e-4f * fabsf(want[i]));
    return bad;
}

/* Rank r of n's shard is tdm_chunk_of's, its state buffers that size, and the shards of every
 * rank add up to the flat buffer (an all-reduce of the sizes). */
static void check_shard(const zero_result *z, int r, int n, const char *what) {
    int64_t lo, hi;
    tdm_chunk_of(z->total, sizeof(float), n, r, &lo, &hi);
    CHECK(z->lo == lo && z->hi == hi && z->numel == hi - lo,
          "%s: rank %d of %d has shard [%lld, %lld) and %lld state elements, expected [%lld, "
          "%lld)",
          what, r, n, (long long)z->lo, (long long)z->hi, (long long)z->numel, (long long)lo,
          (long long)hi);
}

static void check_shard_sum(int64_t numel, int64_t total, const char *what) {
    tdm_tensor *t = tdm_full(TDM_SHAPE(1), (float)numel, TDM_F32, tdm_cpu(0));
    float sum = -1;
    if (tdm_work_wait(tdm_all_reduce(G, t, TDM_SUM)) == TDM_OK) tdm_to_host(t, &sum, sizeof sum);
    tdm_tensor_free(t);
    CHECK(sum == (float)total, "%s: the ranks' shards hold %g elements of %lld", what, sum,
          (long long)total);
}

/* Sharded DDP over N processes ends with the unsharded run's parameters and state, bit for
 * bit, with clipping, with Adam (weight decay, amsgrad) and SGD momentum: stage 1 with
 * accumulation, stages 2 and 3 with one micro-batch a step; stages 2 and 3 accumulating 2
 * micro-batches (each one's average added into the shard) to float rounding, and stage 3
 * always bit for bit stage 2's (its gathers move values only). */
static void test_zero_ddp(void) {
    tdm_optim *(*makes[2])(tdm_paramset *) = {make_adam_zero, make_sgd_zero};
    struct {
        tdm_shard_kind kind;
        int micro;
        bool exact;
        const char *name;
    } runs[3] = {{TDM_SHARD_OPTIMIZER, 2, true, "zero ddp"},
                 {TDM_SHARD_GRADIENTS, 1, true, "zero-2 ddp"},
                 {TDM_SHARD_GRADIENTS, 2, false, "zero-2 ddp, accumulating"}};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 3; i++) {
            const char *what = runs[i].name;
            zero_result plain = {0}, sharded = {0};
            CHECK(zero_ddp(makes[k], TDM_SHARD_NONE, runs[i].micro, &plain) == 0, "ddp: %s",
                  tdm_last_error());
            CHECK(zero_ddp(makes[k], runs[i].kind, runs[i].micro, &sharded) == 0, "%s: %s", what,
                  tdm_last_error());
            if (!plain.params || !sharded.params) return;
            size_t bytes = sizeof(float) * (size_t)plain.total;
            if (runs[i].kind == TDM_SHARD_GRADIENTS) {
                zero_result stage3 = {0};
                CHECK(zero_ddp(makes[k], TDM_SHARD_PARAMETERS, runs[i].micro, &stage3) == 0,
                      "zero-3 ddp: %s", tdm_last_error());
                CHECK(stage3.params && memcmp(stage3.params, sharded.params, bytes) == 0 &&
                          stage3.state == sharded.state,
                      "%s optimizer %d, %d processes, rank %d: stage 3 differs from stage 2", what,
                      k, N, R);
                check_shard(&stage3, R, N, "zero-3 ddp");
                free(stage3.params);
            }
            if (runs[i].exact) {
                CHECK(memcmp(sharded.params, plain.params, bytes) == 0,
                      "%s optimizer %d, %d processes, rank %d: parameters differ from unsharded",
                      what, k, N, R);
                CHECK(sharded.state == plain.state,
                      "%s optimizer %d, rank %d: the gathered state differs from unsharded", what,
                      k, R);
            } else {
                CHECK(count_off(sharded.params, plain.params, plain.total) == 0,
                      "%s optimizer %d, %d processes, rank %d: parameters off the unsharded run's",
                      what, k, N, R);
            }
            CHECK(same_everywhere(digest(sharded.params, bytes)),
                  "%s optimizer %d: ranks' parameters differ", what, k);
            check_shard(&sharded, R, N, what);
            check_shard_sum(sharded.numel, sharded.total, what);
            free(plain.params);
            free(sharded.params);
        }
}

/* The loss of one of a step's 2 micro-batches. */
static tdm_tensor *ce_loss_half(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    return tdm_mul_scalar(tdm_cross_entropy(out, target, NULL), 0.5f);
}

/* DataParallel over L devices in each of N processes, `micro` (1 or 2) micro-batches a step
 * and clipping, the optimizers (kind: and gradients) sharded over all N * L replicas when
 * asked: each replica's result in z[l]. */
static int zero_dp(tdm_optim *(*make)(tdm_paramset *), tdm_shard_kind kind, int micro,
                   zero_result *z) {
    const int64_t k = B / N; /* rows per process: equal shares */
    tdm_module *m = make_mlp(1 + (uint64_t)R, HID);
    tdm_device devs[L] = {tdm_cpu(0), tdm_cpu(1)};
    tdm_strategy *dp = tdm_strategy_data_parallel(m, devs, L, G, dp_factory, (void *)make);
    int rc = dp ? tdm_strategy_set_clip_grad_norm(dp, ZERO_CLIP) : tdm_last_status();
    if (!rc) rc = tdm_strategy_set_shard(dp, kind, NULL);
    float x[B * IN];
    int64_t y[B];
    for (int s = 0; s < STEPS * micro && !rc; s++) {
        batch_of(s, x, y);
        tdm_scope_begin();
        tdm_tensor *tx = tdm_from_data(TDM_SHAPE(k, IN), TDM_F32, tdm_cpu(0), x + R * k * IN);
        tdm_tensor *ty = tdm_from_data(TDM_SHAPE(k), TDM_I64, tdm_cpu(0), y + R * k);
        tdm_loss_fn fn = micro == 2 ? ce_loss_half : ce_loss;
        rc = s % micro == micro - 1 ? tdm_strategy_step(dp, tx, ty, fn, NULL, NULL)
                                    : tdm_strategy_accumulate(dp, tx, ty, fn, NULL, NULL);
        tdm_scope_end();
    }
    tdm_optim *whole = rc ? NULL : tdm_strategy_optim_gather(dp);
    if (!rc && !whole) rc = tdm_last_status();
    if (!rc) rc = tdm_strategy_gather_params(dp); /* stage 3: every replica whole again */
    for (int l = 0; l < L && !rc; l++) {
        tdm_paramset *ps = tdm_module_parameters(tdm_strategy_replica(dp, l));
        z[l].total = ps->total;
        z[l].params = malloc(sizeof(float) * (size_t)ps->total);
        tdm_to_host(ps->flat, z[l].params, sizeof(float) * (size_t)ps->total);
        rc = zero_describe(tdm_strategy_optim(dp, l), whole, &z[l]);
    }
    if (!rc) rc = tdm_strategy_release_params(dp);
    tdm_optim_free(whole);
    tdm_strategy_free(dp);
    tdm_module_free(m);
    return rc;
}

/* The same on the two-level group: sharded over every device of every process; stage 2 bit
 * for bit with one micro-batch a step, to float rounding with 2; stage 3 stage 2's bits. */
static void test_zero_two_level(void) {
    tdm_optim *(*makes[2])(tdm_paramset *) = {make_adam_zero, make_sgd_zero};
    struct {
        tdm_shard_kind kind;
        int micro;
        const char *name;
    } runs[3] = {{TDM_SHARD_OPTIMIZER, 2, "zero two-level"},
                 {TDM_SHARD_GRADIENTS, 1, "zero-2 two-level"},
                 {TDM_SHARD_GRADIENTS, 2, "zero-2 two-level, accumulating"}};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 3; i++) {
            const char *what = runs[i].name;
            bool exact = runs[i].kind == TDM_SHARD_OPTIMIZER || runs[i].micro == 1;
            zero_result plain[L] = {{0}}, sharded[L] = {{0}};
            CHECK(zero_dp(makes[k], TDM_SHARD_NONE, runs[i].micro, plain) == 0, "two-level dp: %s",
                  tdm_last_error());
            CHECK(zero_dp(makes[k], runs[i].kind, runs[i].micro, sharded) == 0, "%s: %s", what,
                  tdm_last_error());
            int64_t held = 0;
            for (int l = 0; l < L && plain[0].params && sharded[l].params; l++) {
                size_t bytes = sizeof(float) * (size_t)plain[0].total;
                CHECK(exact ? memcmp(sharded[l].params, plain[0].params, bytes) == 0
                            : count_off(sharded[l].params, plain[0].params, plain[0].total) == 0,
                      "%s optimizer %d, device %d of process %d: parameters %s unsharded", what, k,
                      l, R, exact ? "differ from" : "off");
                CHECK(!exact || sharded[l].state == plain[0].state,
                      "%s optimizer %d, process %d: the gathered state differs", what, k, R);
                check_shard(&sharded[l], R * L + l, N * L, what);
                held += sharded[l].numel;
            }
            check_shard_sum(held, plain[0].total, what);
            if (runs[i].kind == TDM_SHARD_GRADIENTS) { /* stage 3: stage 2's bits */
                zero_result stage3[L] = {{0}};
                CHECK(zero_dp(makes[k], TDM_SHARD_PARAMETERS, runs[i].micro, stage3) == 0,
                      "zero-3 two-level: %s", tdm_last_error());
                for (int l = 0; l < L && sharded[l].params; l++) {
                    CHECK(stage3[l].params &&
                              memcmp(stage3[l].params, sharded[l].params,
                                     sizeof(float) * (size_t)plain[0].total) == 0 &&
                              stage3[l].state == sharded[l].state,
                          "%s optimizer %d, device %d of process %d: stage 3 differs from "
                          "stage 2",
                          what, k, l, R);
                    check_shard(&stage3[l], R * L + l, N * L, "zero-3 two-level");
                    free(stage3[l].params);
                }
            }
            for (int l = 0; l < L; l++) free(plain[l].params), free(sharded[l].params);
        }
}

/* ---- fault cases (one mpirun each) -------------------------------------------------------- */

/* Rank 0 gives up (tdm_group_abort) while rank 1 broadcasts 16 MiB to it over TCP, as soon as
 * the first bytes are in, and then, as DDP does when its backward fails, leaves without
 * waiting for the broadcast: from then on nothing may write into its tensor (its caller may
 * free it). The others' broadcasts fail, and nothing writes into their tensors after that.
 * Ends the process with 1, saying on stderr whether the tensor held still. */
static int still_child(void) {
    int64_t m = (int64_t)1 << 22;
    tdm_tensor *t = tdm_full(TDM_SHAPE(m), R == 1 ? 2.0f : 1.0f, TDM_F32, tdm_cpu(0));
    volatile const float *p = tdm_data_ptr(t);
    tdm_work *wk = tdm_broadcast(G, t, 1);
    int rc = TDM_OK;
    if (R == 0) {
        while (p[0] != 2.0f && !tdm_work_done(wk)) sched_yield(); /* a segment under way */
        tdm_group_abort(G, "it gave up");
    } else {
        rc = tdm_work_wait(wk);
        fprintf(stderr, "test_mpi rank %d: %s\n", R, rc ? tdm_last_error() : "no error");
    }
    float *before = malloc((size_t)m * 4);
    for (int64_t i = 0; i < m; i++) before[i] = p[i];
    nanosleep(&(struct timespec){0, 500000000}, NULL); /* a transfer still under way lands */
    int64_t changed = 0;
    for (int64_t i = 0; i < m; i++) changed += p[i] != before[i];
    if (R == 0) {
        rc = tdm_work_wait(wk);
        fprintf(stderr, "test_mpi rank %d: %s\n", R, rc ? tdm_last_error() : "no error");
    }
    if (changed)
        fprintf(stderr, "rank %d: %lld elements changed after the error\n", R, (long long)changed);
    else
        fprintf(stderr, "rank %d: the tensor held still after the error\n", R);
    fflush(stderr);
    free(before);
    tdm_tensor_free(t);
    /* mpirun ends the job when the first process exits: rank 0 has the most to say */
    if (R != 0) nanosleep(&(struct timespec){3, 0}, NULL);
    tdm_mpi_finalize();
    return 1;
}

/* Rank 2 all-gathers twice as many elements as ranks 0 and 1 (as a rank whose copy of the
 * data differs would): every rank must fail naming the mismatch, then free its tensors and go
 * on working (allocating over them, another collective, the abort the trainer makes) with no
 * transfer of the failed collective still writing into them or past them. Ends the process
 * with 1 and its error on stderr. */
static int sizes_child(void) {
    int64_t m = (R == 2 ? 2 : 1) * ((int64_t)1 << 17);
    tdm_tensor *in = tdm_full(TDM_SHAPE(m), 2.0f, TDM_F32, tdm_cpu(0));
    tdm_tensor *out = tdm_zeros(TDM_SHAPE(m * N), TDM_F32, tdm_cpu(0));
    int rc = tdm_work_wait(tdm_all_gather(G, out, in));
    fprintf(stderr, "test_mpi rank %d: %s\n", R, rc ? tdm_last_error() : "no error");
    fflush(stderr);
    tdm_tensor_free(out);
    tdm_tensor_free(in);
    tdm_tensor *t = tdm_ones(TDM_SHAPE(m * N), TDM_F32, tdm_cpu(0));
    if (tdm_work_wait(tdm_all_reduce(G, t, TDM_SUM)) != TDM_ERR_COMM)
        fprintf(stderr, "rank %d: a collective after the failure passed\n", R);
    tdm_group_abort(G, "its collective failed");
    nanosleep(&(struct timespec){2, 0}, NULL); /* what was in flight would land meanwhile */
    tdm_tensor_free(t);
    tdm_mpi_finalize();
    return 1;
}

/* Each of L devices of this process all-reduces over the two-level group, process 1's under
 * another site: the devices of a process agree, the processes do not. */
typedef struct {
    tdm_group *g;
    int rc;
    char err[512];
} site_rank;

static void *hier_site_main(void *arg) {
    site_rank *a = arg;
    tdm_tensor *t = tdm_ones(TDM_SHAPE(10), TDM_F32, tdm_cpu(0));
    if (R == 1)
        tdm_collective_label("the trainer's loss read-back");
    else
        tdm_collective_label("DDP bucket 3");
    a->rc = tdm_work_wait(tdm_all_reduce(a->g, t, TDM_SUM));
    snprintf(a->err, sizeof a->err, "%s", tdm_last_error());
    tdm_tensor_free(t);
    tdm_thread_release();
    return NULL;
}

static int hier_site(void) {
    tdm_device devs[L] = {tdm_cpu(0), tdm_cpu(1)};
    tdm_threads_world *tw = tdm_threads_world_new(L, devs);
    tdm_hier_world *hw = tw ? tdm_hier_world_new(tw, L, G) : NULL;
    if (!hw) return tdm_last_status();
    site_rank a[L] = {{0}};
    pthread_t th[L];
    for (int l = 0; l < L; l++) a[l].g = tdm_hier_world_group(hw, l);
    for (int l = 0; l < L; l++) pthread_create(&th[l], NULL, hier_site_main, &a[l]);
    int rc = 0;
    for (int l = 0; l < L; l++) {
        pthread_join(th[l], NULL);
        if (a[l].rc && !rc) rc = tdm_raise(a[l].rc, "%s", a[l].err);
    }
    tdm_hier_world_free(hw);
    tdm_threads_world_free(tw);
    return rc;
}

/* The side channel of a group that cannot compare fingerprints itself (NCCL across processes):
 * G watches a group of this process alone standing in for it. Bucket 0 everywhere, an MPI
 * read-back that must pass, then bucket 1 where rank 1 reduces bucket 2: the next read-back
 * fails naming both sides. */
static int watched_desync(void) {
    tdm_device d0 = tdm_cpu(0);
    tdm_threads_world *tw = tdm_threads_world_new(1, &d0);
    tdm_group *local = tw ? tdm_threads_world_group(tw, 0) : NULL;
    tdm_tensor *t = tdm_ones(TDM_SHAPE(4), TDM_F32, tdm_cpu(0));
    if (!local || !t) return tdm_last_status();
    tdm_group_watch(G, local);
    int rc = 0;
    for (int b = 0; b < 2 && !rc; b++) {
        tdm_collective_label("DDP bucket %d", b == 1 && R == 1 ? 2 : b);
        rc = tdm_work_wait(tdm_all_reduce(local, t, TDM_SUM));
        tdm_collective_label("the trainer's loss read-back");
        if (!rc) rc = tdm_work_wait(tdm_all_reduce(G, t, TDM_SUM));
    }
    tdm_group_watch(G, NULL);
    tdm_tensor_free(t);
    tdm_threads_world_free(tw);
    return rc;
}

/* Trains with DDP; rank 1 misbehaves at step 3 as `what` says (the *_shard cases with the
 * optimizer sharded, between backward and the exchange of the shards). Ends the process: 0 if
 * all steps passed, 1 with "test_mpi rank R: error" on stderr otherwise. */
static int fault_child(const char *what) {
    bool timeout_case = !strcmp(what, "hang") || !strcmp(what, "kill") ||
                        !strcmp(what, "kill_shard") || !strcmp(what, "kill_grads") ||
                        !strcmp(what, "kill_gather");
    if (strstr(what, "_shard")) update_fault = what;
    tdm_group_set_timeout(G, timeout_case ? 1.0 : 30.0);
    int rc = 0;
    if (!strcmp(what, "hier_site")) {
        rc = hier_site();
    } else if (!strcmp(what, "tp_abort")) {
        /* a mesh's pair {2, 0} (rank 1 alone): rank 2 gives up before the pair's reduction (a
         * tensor-parallel layer's); rank 0, in it, and rank 1, at the world's barrier, stop at
         * once naming it */
        int pair[2] = {2, 0}, alone = 1;
        tdm_group *tp = R == 1 ? tdm_mpi_subgroup(G, 1, &alone) : tdm_mpi_subgroup(G, 2, pair);
        tdm_tensor *t = tdm_ones(TDM_SHAPE(10), TDM_F32, tdm_cpu(0));
        if (!tp) {
            rc = tdm_last_status();
        } else if (R == 2) {
            tdm_group_abort(tp, "its layer failed");
            rc = tdm_raise(TDM_ERR_STATE, "its layer failed");
        } else {
            rc = tdm_work_wait(R == 0 ? tdm_all_reduce(tp, t, TDM_SUM) : tdm_barrier(G));
        }
        tdm_tensor_free(t);
        tdm_mpi_subgroup_free(tp);
    } else if (!strcmp(what, "watched")) {
        rc = watched_desync();
    } else if (!strcmp(what, "mismatch")) {
        tdm_tensor *t = tdm_ones(TDM_SHAPE(10 + (R == 1)), TDM_F32, tdm_cpu(0));
        rc = tdm_work_wait(tdm_all_reduce(G, t, TDM_SUM));
    } else if (!strcmp(what, "dtype")) { /* the same count and element size, not dtype */
        tdm_tensor *t = tdm_ones(TDM_SHAPE(10), R == 1 ? TDM_F16 : TDM_BF16, tdm_cpu(0));
        rc = tdm_work_wait(tdm_all_reduce(G, t, TDM_SUM));
    } else {
        tdm_module *m = make_mlp(1, !strcmp(what, "model") && R == 1 ? HID + 1 : HID);
        tdm_ddp *d = tdm_ddp_new(m, G, NULL);
        rc = d ? 0 : tdm_last_status();
        tdm_optim *opt = d ? make_sgd(tdm_module_parameters(m)) : NULL;
        if (opt && update_fault) rc = tdm_optim_shard(opt, G);
        if (opt && strstr(what, "_grads")) rc = tdm_ddp_set_shard(d, opt, TDM_SHARD_GRADIENTS);
        if (opt && strstr(what, "_gather")) rc = tdm_ddp_set_shard(d, opt, TDM_SHARD_PARAMETERS);
        for (int s = 0; s < 20 && !rc; s++) {
            /* stage 3: every rank done with the step before (its last buckets' reductions
             * included), so that the others meet rank 1's end in their next forward's gather */
            if (strstr(what, "_gather")) rc = tdm_work_wait(tdm_barrier(G));
            if (s == 3 && R == 1) {
                /* the others are then in step 3's backward, reducing gradient buckets */
                if (!strcmp(what, "kill") || !strcmp(what, "kill_grads") ||
                    !strcmp(what, "kill_gather"))
                    raise(SIGKILL);
                if (!strcmp(what, "abort_gather")) { /* the others gather its first unit */
                    tdm_group_abort(G, "its forward failed");
                    rc = tdm_raise(TDM_ERR_STATE, "its forward failed");
                    break;
                }
                if (!strcmp(what, "abort_grads")) {
                    tdm_group_abort(G, "its backward failed");
                    rc = tdm_raise(TDM_ERR_STATE, "its backward failed");
                    break;
                }
                if (!strcmp(what, "hang")) sleep(60);
                if (!strcmp(what, "extra")) { /* a read-back the others do not make */
                    tdm_tensor *t = tdm_ones(TDM_SHAPE(1), TDM_F32, tdm_cpu(0));
                    tdm_collective_label("the trainer's loss read-back");
                    rc = tdm_work_wait(tdm_all_reduce(G, t, TDM_SUM));
                    tdm_tensor_free(t);
                    if (rc) break;
                }
                if (!strcmp(what, "abort")) {
                    tdm_group_abort(G, "out of data");
                    rc = tdm_raise(TDM_ERR_STATE, "out of data");
                    break;
                }
            }
            rc = ddp_step(d, m, opt, s);
        }
    }
    if (rc) fprintf(stderr, "test_mpi rank %d: %s\n", R, tdm_last_error());
    fflush(stderr);
    tdm_mpi_finalize();
    return rc ? 1 : 0;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* Runs `mpirun -np 3 this --fault what`; the job must fail within max_s, its output holding
 * every string of want (NULL-terminated). */
static void expect_job_fails(const char *mpirun, const char *what, double max_s,
                             const char *const *want) {
    char self[4096], cmd[8192];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        CHECK(false, "cannot find this executable");
        return;
    }
    self[n] = '\0';
    snprintf(cmd, sizeof cmd, "%s -np 3 %s --fault %s 2>&1", mpirun, self, what);
    double t0 = now();
    FILE *f = popen(cmd, "r");
    CHECK(f != NULL, "popen %s", cmd);
    if (!f) return;
    static char out[1 << 16];
    size_t len = fread(out, 1, sizeof out - 1, f);
    out[len] = '\0';
    int st = pclose(f);
    double dt = now() - t0;
    bool failed = st != -1 && WIFEXITED(st) && WEXITSTATUS(st) != 0;
    CHECK(failed, "%s: the job exited with status %d", what, st);
    CHECK(dt < max_s, "%s: the job took %.1f s (limit %.0f s)", what, dt, max_s);
    for (int i = 0; want[i]; i++) { /* "A||B||...": any of them */
        char alt[1024];
        snprintf(alt, sizeof alt, "%s", want[i]);
        bool found = false;
        for (char *a = alt, *bar; a && !found; a = bar ? bar + 2 : NULL) {
            if ((bar = strstr(a, "||"))) *bar = '\0';
            found = strstr(out, a) != NULL;
        }
        CHECK(found, "%s: no \"%s\" in the output:\n%s", what, want[i], out);
    }
    /* a failure is no excuse for memory errors: ASan's and UBSan's reports, glibc's aborts */
    const char *bad[] = {"ERROR: AddressSanitizer", "runtime error: ", "free(): ", "double free"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK(!strstr(out, bad[i]), "%s: \"%s\" in the output:\n%s", what, bad[i], out);
    printf("fault case %s: failed in %.2f s as expected\n", what, dt);
}

static void test_faults(const char *mpirun) {
    /* killed mid-epoch: mpirun notices the death; a survivor that gets there first times out */
    expect_job_fails(mpirun, "kill", 20,
                     (const char *[]){"timed out after 1.0 s waiting for rank 1||"
                                      "process rank 1 with PID",
                                      NULL});
    /* alive but silent: ranks 0 and 2 time out naming it (1 s), mpirun ends rank 1 */
    expect_job_fails(mpirun, "hang", 20,
                     (const char *[]){"timed out after 1.0 s waiting for rank 1", NULL});
    /* A rank that gives up: the others learn at once (their timeout is 30 s). Once the
     * first process exits non-zero mpirun ends the rest, so only some of them get to print:
     * the message must appear from at least one survivor. */
    expect_job_fails(mpirun, "abort", 15,
                     (const char *[]){"on rank 0: rank 1 failed: out of data||"
                                      "on rank 2: rank 1 failed: out of data",
                                      NULL});
    /* the same inside a sub-group's collective (a mesh's tensor-parallel pair): the rank
     * waiting in it and the one outside it, at a barrier of the world */
    expect_job_fails(mpirun, "tp_abort", 15,
                     (const char *[]){"all_reduce on rank 0: rank 2 failed: its layer failed||"
                                      "barrier on rank 1: rank 2 failed: its layer failed",
                                      NULL});
    /* the same two while the others exchange the sharded optimizer's ranges (ZeRO stage 1):
     * they wait for rank 1's range, which never comes */
    expect_job_fails(mpirun, "kill_shard", 20,
                     (const char *[]){"timed out after 1.0 s waiting for rank 1||"
                                      "process rank 1 with PID",
                                      NULL});
    expect_job_fails(
        mpirun, "abort_shard", 15,
        (const char *[]){"optimizer step (sharded): ", "rank 1 failed: its update failed", NULL});
    /* ZeRO stage 2: rank 1 dies or gives up while the others reduce gradient buckets */
    expect_job_fails(mpirun, "kill_grads", 20,
                     (const char *[]){"timed out after 1.0 s waiting for rank 1||"
                                      "process rank 1 with PID",
                                      NULL});
    expect_job_fails(mpirun, "abort_grads", 15,
                     (const char *[]){"rank 1 failed: its backward failed", NULL});
    /* ZeRO stage 3: rank 1 dies or gives up while the others gather a unit it owns part of */
    expect_job_fails(mpirun, "kill_gather", 20,
                     (const char *[]){"timed out after 1.0 s waiting for rank 1||"
                                      "process rank 1 with PID",
                                      NULL});
    expect_job_fails(mpirun, "abort_gather", 15,
                     (const char *[]){"gathering the parameters of unit ",
                                      "rank 1 failed: its forward failed", NULL});
    expect_job_fails(mpirun, "model", 15,
                     (const char *[]){"ddp: parameter \"0.weight\" has shape [9, 6] on rank 1 "
                                      "but [8, 6] on rank 0",
                                      NULL});
    expect_job_fails(
        mpirun, "watched", 15,
        (const char *[]){"ranks disagree on the collectives of the group this one watches, before "
                         "all_reduce #",
                         "rank 0 had launched 2 there, the last all_reduce #2 (DDP bucket 1: 4 "
                         "f32, sum), while rank 1 had launched 2, the last all_reduce #2 (DDP "
                         "bucket 2: 4 f32, sum)||rank 1 had launched 2 there, the last "
                         "all_reduce #2 (DDP bucket 2: 4 f32, sum), while rank 2 had launched 2, "
                         "the last all_reduce #2 (DDP bucket 1: 4 f32, sum)",
                         NULL});
    expect_job_fails(mpirun, "mismatch", 15,
                     (const char *[]){"ranks disagree on the element count: ",
                                      "is in all_reduce #1 (unnamed: 11 f32, sum)", NULL});
    /* rank 1 reads a loss back while the others start step 3's first bucket: the first
     * collective that differs names both sides, sites included */
    expect_job_fails(mpirun, "extra", 15,
                     (const char *[]){"ranks disagree on the ",
                                      "(the trainer's loss read-back: 1 f32, sum)",
                                      "is in all_reduce #", "(DDP bucket 0: ", NULL});
    /* the two-level group: its parts carry the site of the collective they make up, so the
     * processes' sites are compared across MPI (process 1 differs) */
    expect_job_fails(
        mpirun, "hier_site", 15,
        /* whichever rank finds it first names its pair (ranks 0 and 2 agree) */
        (const char *[]){"ranks disagree on the caller: rank 0 is in all_reduce #1 (DDP "
                         "bucket 3: 10 f32, sum) while rank 1 is in all_reduce #1 (the "
                         "trainer's loss read-back: 10 f32, sum)||ranks disagree on the caller: "
                         "rank 1 is in all_reduce #1 (the trainer's loss read-back: 10 f32, sum) "
                         "while rank 2 is in all_reduce #1 (DDP bucket 3: 10 f32, sum)",
                         NULL});
    expect_job_fails(mpirun, "dtype", 15,
                     (const char *[]){"ranks disagree on the dtype: ",
                                      "is in all_reduce #1 (unnamed: 10 f16, sum)", NULL});
    /* the same with 1 MiB messages over TCP (as between nodes), where Open MPI wrote a larger
     * message than a rank expected past the end of its tensor: every rank names the mismatch,
     * and (under ASan) nothing writes into or past a freed tensor */
    setenv("OMPI_MCA_btl", "self,tcp", 1);
    expect_job_fails(
        mpirun, "sizes", 15,
        /* each rank finds it, or hears it first from a peer that did */
        (const char *[]){"rank 0: all_gather on rank 0: ranks disagree on the element||"
                         "rank 0: all_gather on rank 0: rank 1 stopped: ranks disagree "
                         "on the element||rank 0: all_gather on rank 0: rank 2 stopped: "
                         "ranks disagree on the element",
                         "rank 1: all_gather on rank 1: ranks disagree on the element||"
                         "rank 1: all_gather on rank 1: rank 0 stopped: ranks disagree "
                         "on the element||rank 1: all_gather on rank 1: rank 2 stopped: "
                         "ranks disagree on the element",
                         "rank 2: all_gather on rank 2: ranks disagree on the element||"
                         "rank 2: all_gather on rank 2: rank 0 stopped: ranks disagree "
                         "on the element||rank 2: all_gather on rank 2: rank 1 stopped: "
                         "ranks disagree on the element",
                         "rank 2 is in all_gather #1 (unnamed: 262144 ", NULL});
    /* a rank that gives up while a broadcast's data stream in over TCP (small fragments: a
     * segment takes many of them): once its broadcast has failed nothing writes into its
     * tensor; twice, since the abort may fall between two segments */
    setenv("OMPI_MCA_btl_tcp_max_send_size", "8192", 1);
    setenv("OMPI_MCA_btl_tcp_rdma_pipeline_frag_size", "8192", 1);
    for (int i = 0; i < 2; i++)
        expect_job_fails(mpirun, "still", 15,
                         (const char *[]){"broadcast on rank 0: rank 0 failed: it gave up",
                                          "rank 0: the tensor held still after the error", NULL});
    unsetenv("OMPI_MCA_btl_tcp_rdma_pipeline_frag_size");
    unsetenv("OMPI_MCA_btl_tcp_max_send_size");
    unsetenv("OMPI_MCA_btl");
}

int main(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[1], "--faults")) {
        test_faults(argv[2]);
        return check_summary();
    }
    G = tdm_mpi_init(&argc, &argv);
    if (!G) {
        fprintf(stderr, "test_mpi: %s\n", tdm_last_error());
        return 1;
    }
    R = tdm_group_rank(G);
    N = tdm_group_size(G);
    if (argc >= 3 && !strcmp(argv[1], "--fault") && !strcmp(argv[2], "sizes")) return sizes_child();
    if (argc >= 3 && !strcmp(argv[1], "--fault") && !strcmp(argv[2], "still")) return still_child();
    if (argc >= 3 && !strcmp(argv[1], "--fault")) return fault_child(argv[2]);
    test_collectives();
    test_subgroups();
    test_lowp_collectives();
    test_ddp();
    test_two_level_collectives();
    test_dp_two_level();
    test_zero_ddp();
    test_zero_two_level();
    tdm_mpi_finalize();
    CHECK_ERROR(tdm_mpi_init(NULL, NULL) == NULL, "cannot be initialized again");
    if (R != 0) printf("rank %d: ", R);
    return check_summary();
}
