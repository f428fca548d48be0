/* Pipelines: a Sequential split into 2 or 3 stages on CPU devices, 1 to 8 micro-batches,
 * GPipe and 1F1B, alone and with 2 data-parallel replicas per stage, ends with the parameters
 * of the same model trained unsplit on one device on the same batches (dropout included:
 * the masks are the unsplit batch's). Batch norm matches its documented meaning (statistics
 * per micro-batch, as torch's Pipe). The allocator's peak shows 1F1B holding at most
 * `stages` micro-batches of activations per stage while GPipe holds all M. Bad input fails
 * with a message naming it.
 *
 * Tolerance: a pipeline sums each micro-batch's gradient into the flat buffer, while one
 * device reduces the whole batch inside one GEMM, so the sums are rounded in another order:
 * float32 rounding (~1e-7 relative per add over a few dozen rows), carried through 3 SGD
 * steps with momentum. 1e-5 absolute + 1e-4 relative on parameters of order 0.1-1 is two
 * orders above what is observed and far below what a wrong mask, a missed micro-batch or a
 * wrong loss weight causes (1e-3 and up). */
#include "check.h"
#include "core/core.h"
#include "tandem/gpt.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#define B     17 /* uneven over 2 replicas and 2..8 micro-batches */
#define IN    6
#define HID   12
#define OUT   4
#define STEPS 3

/* Linear, ReLU, Dropout, Linear, Tanh, Linear: 6 layers, so 3 stages fit. */
static tdm_module *make_model(uint64_t seed, bool dropout) {
    tdm_rng r = tdm_rng_make(seed);
    tdm_module *l[6] = {tdm_linear_new(IN, HID, true, tdm_cpu(0), &r),
                        tdm_relu_new(),
                        dropout ? tdm_dropout_new(0.3f, &r) : tdm_gelu_new(false),
                        tdm_linear_new(HID, HID, true, tdm_cpu(0), &r),
                        tdm_tanh_new(),
                        tdm_linear_new(HID, OUT, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(6, l);
}

/* Linear, BatchNorm1d, ReLU, Linear. */
static tdm_module *make_bn_model(uint64_t seed) {
    tdm_rng r = tdm_rng_make(seed);
    tdm_module *l[4] = {tdm_linear_new(IN, HID, true, tdm_cpu(0), &r),
                        tdm_batch_norm1d_new(HID, 1e-5f, 0.1f, tdm_cpu(0)), tdm_relu_new(),
                        tdm_linear_new(HID, OUT, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(4, l);
}

static tdm_optim *make_sgd(tdm_paramset *ps, void *arg) {
    tdm_sgd_opts o = tdm_sgd_defaults(0.1f);
    o.momentum = 0.9f;
    return tdm_sgd_new(ps, &o);
}

static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    return tdm_cross_entropy(out, target, NULL);
}

/* Step s's batch, caller-owned. */
static void batch_of(int s, int64_t b, tdm_tensor **x, tdm_tensor **y) {
    tdm_rng r = tdm_rng_make(100 + (uint64_t)s);
    *x = tdm_randn(TDM_SHAPE(b, IN), 0, 1, tdm_cpu(0), &r);
    int64_t t[256];
    for (int64_t i = 0; i < b; i++) t[i] = (i * 7 + s) % OUT;
    *y = tdm_from_data(TDM_SHAPE(b), TDM_I64, tdm_cpu(0), t);
}

/* All parameters and buffers of m, in order, as host floats (i64 buffers converted). */
static int64_t state_of(tdm_module *m, float *out, int64_t cap) {
    int64_t n = 0;
    for (int i = 0; i < m->n_params + m->n_buffers; i++) {
        tdm_tensor *t = i < m->n_params ? m->params[i] : m->buffers[i - m->n_params];
        tdm_tensor *f = tdm_cast(t, TDM_F32);
        int64_t k = tdm_numel(t);
        if (n + k <= cap) tdm_to_host(f, out + n, sizeof(float) * (size_t)k);
        tdm_tensor_free(f);
        n += k;
    }
    for (int c = 0; c < m->n_children; c++) n += state_of(m->children[c], out + n, cap - n);
    return n;
}

/* One device: STEPS steps on whole batches (or `micro` batches accumulated in sequence). */
static int64_t reference(tdm_module *m, int micro, float *out, int64_t cap) {
    tdm_optim *opt = make_sgd(tdm_module_parameters(m), NULL);
    for (int s = 0; s < STEPS; s++) {
        tdm_tensor *x, *y;
        batch_of(s, B, &x, &y);
        tdm_optim_zero_grad(opt);
        for (int k = 0; k < micro; k++) {
            int64_t lo = k * (B / micro) + (k < B % micro ? k : B % micro);
            int64_t hi = lo + B / micro + (k < B % micro);
            tdm_scope_begin();
            tdm_tensor *l = tdm_cross_entropy(tdm_module_forward(m, tdm_slice(x, 0, lo, hi, 1)),
                                              tdm_slice(y, 0, lo, hi, 1), NULL);
            tdm_backward(tdm_mul_scalar(l, (float)(hi - lo) / B));
            tdm_scope_end();
        }
        tdm_optim_step(opt);
        tdm_tensor_free(x);
        tdm_tensor_free(y);
    }
    tdm_optim_free(opt);
    return state_of(m, out, cap);
}

static int compare(const float *got, const float *want, int64_t n, const char *what) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!(fabsf(got[i] - want[i]) <= 1e-5f + 1e-4f * fabsf(want[i])) && bad++ < 3)
            fprintf(stderr, "%s: value %lld = %.8g, unsplit %.8g\n", what, (long long)i, got[i],
                    want[i]);
    return bad;
}

/* Trains a pipeline built from a fresh model for STEPS steps; the result lands in out. */
static int train_pipe(tdm_module *m, const tdm_pipe_opts *o, float *out, int64_t cap,
                      tdm_pipe **keep) {
    tdm_pipe *p = tdm_pipe_new(m, o, make_sgd, NULL);
    if (!p) return -1;
    int rc = 0;
    for (int s = 0; s < STEPS && !rc; s++) {
        tdm_tensor *x, *y;
        batch_of(s, B, &x, &y);
        float loss;
        rc = tdm_pipe_step(p, x, y, ce_loss, NULL, &loss);
        if (!rc && !isfinite(loss)) rc = -1;
        tdm_tensor_free(x);
        tdm_tensor_free(y);
    }
    if (!rc) rc = tdm_pipe_copy_to(p, m);
    if (!rc) state_of(m, out, cap);
    if (keep)
        *keep = p;
    else
        tdm_pipe_free(p);
    return rc;
}

/* ---- equivalence --------------------------------------------------------------------------- */

static void test_equivalence(void) {
    float want[1024], got[1024];
    tdm_module *ref = make_model(1, true);
    int64_t n = reference(ref, 1, want, 1024);
    tdm_module_free(ref);
    for (int stages = 2; stages <= 3; stages++)
        for (int sched = 0; sched < 2; sched++)
            for (int M = 1; M <= 8; M++) {
                tdm_module *m = make_model(1, true);
                tdm_pipe_opts o = tdm_pipe_defaults(stages, M);
                o.schedule = (tdm_pipe_schedule)sched;
                int rc = train_pipe(m, &o, got, 1024, NULL);
                char what[64];
                snprintf(what, sizeof what, "%d stages, %s, M %d", stages, sched ? "1F1B" : "GPipe",
                         M);
                CHECK(rc == 0, "%s: %s", what, tdm_last_error());
                CHECK(rc || compare(got, want, n, what) == 0,
                      "%s: parameters differ from "
                      "unsplit training",
                      what);
                tdm_module_free(m);
            }
}

/* An explicit map with a parameter-free middle stage (the Dropout alone): no optimizer
 * there, and the gradient still flows through it. */
static void test_explicit_map(void) {
    float want[1024], got[1024];
    tdm_module *ref = make_model(1, true);
    int64_t n = reference(ref, 1, want, 1024);
    tdm_module_free(ref);
    int map[6] = {0, 0, 1, 2, 2, 2};
    tdm_module *m = make_model(1, true);
    tdm_pipe_opts o = tdm_pipe_defaults(0, 4);
    o.layer_stage = map;
    o.devices = "cpu:2,cpu:0,cpu:1";
    tdm_pipe *p = NULL;
    int rc = train_pipe(m, &o, got, 1024, &p);
    CHECK(rc == 0, "explicit map: %s", tdm_last_error());
    CHECK(rc || compare(got, want, n, "explicit map") == 0, "explicit map differs from unsplit");
    CHECK(p && tdm_pipe_stages(p) == 3 && !tdm_pipe_stage_optim(p, 1, 0) &&
              tdm_pipe_stage_optim(p, 2, 0) &&
              tdm_device_equal(tdm_pipe_stage_module(p, 0, 0)->children[0]->device, tdm_cpu(2)),
          "stage 0 on cpu:2, stage 1 without an optimizer");
    tdm_pipe_free(p);
    tdm_module_free(m);
}

/* Two replicas per stage: every replica ends like unsplit training, replicas identical. */
static void test_with_data_parallel(void) {
    float want[1024], got[1024];
    tdm_module *ref = make_model(1, true);
    int64_t n = reference(ref, 1, want, 1024);
    tdm_module_free(ref);
    int micro[3] = {1, 3, 8};
    for (int sched = 0; sched < 2; sched++)
        for (int i = 0; i < 3; i++) {
            tdm_module *m = make_model(1, true);
            tdm_pipe_opts o = tdm_pipe_defaults(2, micro[i]);
            o.schedule = (tdm_pipe_schedule)sched;
            o.replicas = 2;
            o.devices = "cpu:0,cpu:1,cpu:2,cpu:3"; /* stage 0: cpu:0, cpu:1; stage 1: ... */
            tdm_pipe *p = NULL;
            int rc = train_pipe(m, &o, got, 1024, &p);
            char what[64];
            snprintf(what, sizeof what, "2 stages x 2 replicas, %s, M %d", sched ? "1F1B" : "GPipe",
                     micro[i]);
            CHECK(rc == 0, "%s: %s", what, tdm_last_error());
            CHECK(rc || compare(got, want, n, what) == 0, "%s: differs from unsplit", what);
            for (int s = 0; p && s < 2; s++) {
                tdm_paramset *a = tdm_pipe_stage_module(p, s, 0)->paramset;
                tdm_paramset *b = tdm_pipe_stage_module(p, s, 1)->paramset;
                CHECK(memcmp(tdm_data_ptr(a->flat), tdm_data_ptr(b->flat),
                             sizeof(float) * (size_t)a->total) == 0,
                      "%s: stage %d's replicas differ", what, s);
            }
            tdm_pipe_free(p);
            tdm_module_free(m);
        }
}

/* Batch norm: per micro-batch statistics, running statistics updated per micro-batch; the
 * reference runs the same micro-batches in sequence on one device. */
static void test_batch_norm(void) {
    float want[1024], got[1024];
    for (int M = 1; M <= 4; M += 3) {
        tdm_module *ref = make_bn_model(3);
        int64_t n = reference(ref, M, want, 1024);
        tdm_module_free(ref);
        for (int sched = 0; sched < 2; sched++) {
            tdm_module *m = make_bn_model(3);
            tdm_pipe_opts o = tdm_pipe_defaults(2, M);
            o.schedule = (tdm_pipe_schedule)sched;
            o.split_by = TDM_SPLIT_LAYERS; /* BatchNorm on stage 0 */
            int rc = train_pipe(m, &o, got, 1024, NULL);
            CHECK(rc == 0, "batch norm, M %d: %s", M, tdm_last_error());
            CHECK(rc || compare(got, want, n, "batch norm") == 0,
                  "batch norm, M %d, %s: parameters or running statistics differ from the "
                  "micro-batched reference",
                  M, sched ? "1F1B" : "GPipe");
            tdm_module_free(m);
        }
    }
}

/* ---- the cross-thread copy on its own ------------------------------------------------------ */

static void keep_grad(tdm_tensor *g, void *arg) {
    *(tdm_tensor **)arg = g;
}

/* y = recv(x * 3) on cpu:1, loss = sum(y * y): dL/dx = 18 x, through the sink and
 * tdm_backward_from on the "sending" side (one thread here, two tapes' worth of work). */
static void test_recv(void) {
    float xv[4] = {1, -2, 0.5f, 4};
    tdm_tensor *x = tdm_from_data(TDM_SHAPE(4), TDM_F32, tdm_cpu(0), xv);
    tdm_requires_grad_(x, true);
    tdm_scope_begin();
    int mark = tdm_tape_size();
    tdm_tensor *h = tdm_mul_scalar(x, 3);
    tdm_tensor *g = NULL;
    int mark1 = tdm_tape_size();
    tdm_tensor *y = tdm_device_recv(h, tdm_cpu(1), keep_grad, &g);
    CHECK(y && tdm_device_equal(y->device, tdm_cpu(1)), "recv copies onto cpu:1");
    CHECK(tdm_backward_from(tdm_sum_all(tdm_mul(y, y)), NULL, mark1) == 0, "%s", tdm_last_error());
    CHECK(g && tdm_device_equal(g->device, tdm_cpu(0)), "the gradient comes back on cpu:0");
    CHECK(tdm_backward_from(h, g, mark) == 0, "%s", tdm_last_error());
    float want[4];
    for (int i = 0; i < 4; i++) want[i] = 18 * xv[i];
    check_tensor_close(x->grad, want, 1e-6, 1e-6, "dL/dx through device_recv");
    CHECK_ERROR(tdm_backward_from(h, g, mark1 + 1) != 0, "not recorded");
    tdm_tensor *wrong = tdm_ones(TDM_SHAPE(3), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(tdm_backward_from(tdm_mul_scalar(x, 2), wrong, mark) != 0, "gradient of shape");
    tdm_tensor_free(g);
    tdm_scope_end();
    CHECK_ERROR(tdm_device_recv(x, tdm_cpu(1), NULL, NULL) == NULL, "open step scope");
    tdm_tensor_free(x);
}

/* ---- activations in bf16 -------------------------------------------------------------------- */

/* test_recv with a bf16 activation: it crosses as bf16 (the same bits), and its gradient comes
 * back to the sender as bf16 too, for the sender's cast node to widen. */
static void test_recv_bf16(void) {
    float xv[4] = {1, -2, 0.5f, 4};
    tdm_tensor *x = tdm_from_data(TDM_SHAPE(4), TDM_F32, tdm_cpu(0), xv);
    tdm_requires_grad_(x, true);
    tdm_scope_begin();
    int mark = tdm_tape_size();
    tdm_tensor *h = tdm_to_dtype(tdm_mul_scalar(x, 3), TDM_BF16);
    tdm_tensor *g = NULL;
    int mark1 = tdm_tape_size();
    tdm_tensor *y = tdm_device_recv(h, tdm_cpu(1), keep_grad, &g);
    CHECK(y && y->dtype == TDM_BF16 && tdm_device_equal(y->device, tdm_cpu(1)),
          "recv keeps bf16: %s", y ? tdm_dtype_name(y->dtype) : tdm_last_error());
    CHECK(y && !memcmp(tdm_data_ptr(y), tdm_data_ptr(h), 4 * 2), "recv moves the bf16 bits");
    tdm_tensor *loss = tdm_sum_all(tdm_mul(tdm_to_dtype(y, TDM_F32), tdm_to_dtype(y, TDM_F32)));
    CHECK(tdm_backward_from(loss, NULL, mark1) == 0, "%s", tdm_last_error());
    CHECK(g && g->dtype == TDM_BF16 && tdm_device_equal(g->device, tdm_cpu(0)),
          "the gradient comes back on cpu:0 in bf16: %s", g ? tdm_dtype_name(g->dtype) : "none");
    CHECK(tdm_backward_from(h, g, mark) == 0, "%s", tdm_last_error());
    float want[4]; /* exact: 3x and 6x are bf16 numbers */
    for (int i = 0; i < 4; i++) want[i] = 18 * xv[i];
    check_tensor_close(x->grad, want, 0, 0, "dL/dx through a bf16 device_recv");
    tdm_tensor_free(g);
    tdm_scope_end();
    tdm_tensor_free(x);
}

static atomic_int casts_in, casts_in_bf16; /* ToF32's inputs, and those of them in bf16 */

static tdm_tensor *to_bf16_forward(tdm_module *m, tdm_tensor *x) {
    return tdm_to_dtype(x, TDM_BF16);
}

static tdm_tensor *to_f32_forward(tdm_module *m, tdm_tensor *x) {
    atomic_fetch_add(&casts_in, 1);
    if (x && x->dtype == TDM_BF16) atomic_fetch_add(&casts_in_bf16, 1);
    return tdm_to_dtype(x, TDM_F32);
}

static const tdm_module_ops to_bf16_ops = {"ToBF16", to_bf16_forward, NULL};
static const tdm_module_ops to_f32_ops = {"ToF32", to_f32_forward, NULL};

/* Linear, ReLU, ToBF16 | ToF32, Linear: the activation between the stages is bf16. */
static tdm_module *make_bf16_cut(uint64_t seed) {
    tdm_rng r = tdm_rng_make(seed);
    tdm_module *l[5] = {tdm_linear_new(IN, HID, true, tdm_cpu(0), &r), tdm_relu_new(),
                        tdm_module_new(&to_bf16_ops, tdm_cpu(0), NULL),
                        tdm_module_new(&to_f32_ops, tdm_cpu(0), NULL),
                        tdm_linear_new(HID, OUT, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(5, l);
}

/* A pipeline whose stages exchange bf16 activations (as under autocast) trains as the unsplit
 * model does: the next stage receives every micro-batch in bf16, and the parameters end as
 * unsplit training's (the bf16 roundings are the same ones, row by row). */
static void test_bf16_activations(void) {
    float want[1024], got[1024];
    tdm_module *ref = make_bf16_cut(1);
    int64_t n = reference(ref, 1, want, 1024);
    tdm_module_free(ref);
    int map[5] = {0, 0, 0, 1, 1};
    for (int sched = 0; sched < 2; sched++) {
        tdm_module *m = make_bf16_cut(1);
        tdm_pipe_opts o = tdm_pipe_defaults(0, 4);
        o.layer_stage = map;
        o.schedule = (tdm_pipe_schedule)sched;
        atomic_store(&casts_in, 0);
        atomic_store(&casts_in_bf16, 0);
        int rc = train_pipe(m, &o, got, 1024, NULL);
        CHECK(rc == 0, "bf16 activations: %s", tdm_last_error());
        CHECK(rc || compare(got, want, n, "bf16 activations") == 0,
              "bf16 activations: parameters differ from unsplit training");
        CHECK(atomic_load(&casts_in) == STEPS * 4 && atomic_load(&casts_in_bf16) == STEPS * 4,
              "stage 1 received %d micro-batches, %d of them in bf16 (want %d)",
              atomic_load(&casts_in), atomic_load(&casts_in_bf16), STEPS * 4);
        tdm_module_free(m);
    }
}

/* ---- splitting and errors ------------------------------------------------------------------ */

static void test_split(void) {
    tdm_module *m = make_model(1, false); /* params: 84, 0, 0, 156, 0, 52 */
    int first[4];
    CHECK(tdm_pipe_split(m, 2, TDM_SPLIT_LAYERS, first) == 0 && first[1] == 3 && first[2] == 6,
          "by layers: 3 + 3");
    CHECK(tdm_pipe_split(m, 3, TDM_SPLIT_LAYERS, first) == 0 && first[1] == 2 && first[2] == 4,
          "by layers: 2 + 2 + 2");
    /* by parameters the largest stage is the middle Linear alone (156) */
    CHECK(tdm_pipe_split(m, 3, TDM_SPLIT_PARAMS, first) == 0 && first[3] == 6, "%s",
          tdm_last_error());
    int64_t per[3] = {0};
    for (int s = 0; s < 3; s++)
        for (int i = first[s]; i < first[s + 1]; i++)
            per[s] += m->children[i]->n_params ? tdm_numel(m->children[i]->params[0]) +
                                                     tdm_numel(m->children[i]->params[1])
                                               : 0;
    CHECK(per[0] <= 156 && per[1] <= 156 && per[2] <= 156 && first[1] >= 1 && first[2] > first[1],
          "by parameters: stages %lld, %lld, %lld", (long long)per[0], (long long)per[1],
          (long long)per[2]);
    CHECK_ERROR(tdm_pipe_split(m, 7, TDM_SPLIT_PARAMS, first) != 0,
                "7 stages for a Sequential of 6 layers");
    tdm_module_free(m);
}

static tdm_tensor *failing_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    return row0 > 0 ? tdm_raise_null(TDM_ERR_NUMERIC, "loss went bad at row %lld", (long long)row0)
                    : tdm_cross_entropy(out, target, NULL);
}

static void test_errors(void) {
    tdm_module *m = make_model(1, false);
    tdm_pipe_opts o = tdm_pipe_defaults(7, 2);
    CHECK_ERROR(tdm_pipe_new(m, &o, make_sgd, NULL) == NULL,
                "7 stages for a Sequential of 6 layers");
    o = tdm_pipe_defaults(2, 2);
    o.devices = "cpu:0,gpu:1";
    CHECK_ERROR(tdm_pipe_new(m, &o, make_sgd, NULL) == NULL, "unknown device \"gpu:1\"");
    o.devices = "cpu:0,cpu:0";
    CHECK_ERROR(tdm_pipe_new(m, &o, make_sgd, NULL) == NULL, "cpu:0 is listed twice");
    o.devices = "cpu:0,cpu:1,cpu:2";
    CHECK_ERROR(tdm_pipe_new(m, &o, make_sgd, NULL) == NULL, "lists 3 devices, 2 stages x 1");
    int bad_map[6] = {0, 0, 2, 2, 2, 2};
    o = tdm_pipe_defaults(0, 2);
    o.layer_stage = bad_map;
    CHECK_ERROR(tdm_pipe_new(m, &o, make_sgd, NULL) == NULL, "layer_stage[2] is 2 after 0");
    o.micro_batches = 0;
    CHECK_ERROR(tdm_pipe_new(m, &o, make_sgd, NULL) == NULL, "0 micro-batches");
    tdm_module *relu = tdm_relu_new();
    CHECK_ERROR(tdm_pipe_new(relu, &o, make_sgd, NULL) == NULL, "non-empty Sequential");
    tdm_module_free(relu);

    int map[6] = {0, 0, 0, 1, 1, 1};
    o = tdm_pipe_defaults(0, 8);
    o.layer_stage = map;
    tdm_pipe *p = tdm_pipe_new(m, &o, make_sgd, NULL);
    CHECK(p && tdm_pipe_stages(p) == 2 && tdm_pipe_stage_first_layer(p, 1) == 3, "map: %s",
          tdm_last_error());
    tdm_pipe_set_lr(p, 0.05f);
    CHECK(tdm_optim_lr(tdm_pipe_stage_optim(p, 0, 0)) == 0.05f &&
              tdm_optim_lr(tdm_pipe_stage_optim(p, 1, 0)) == 0.05f,
          "set_lr reaches every stage");
    tdm_tensor *x, *y;
    batch_of(0, 4, &x, &y);
    CHECK_ERROR(tdm_pipe_step(p, x, y, ce_loss, NULL, NULL) != 0,
                "a batch of 4 rows cannot be cut into 8 micro-batches");
    tdm_tensor_free(x);
    tdm_tensor_free(y);
    batch_of(0, B, &x, &y);
    tdm_tensor *y3 = tdm_slice(y, 0, 0, 3, 1);
    CHECK_ERROR(tdm_pipe_step(p, x, y3, ce_loss, NULL, NULL) != 0, "differ in batch size");
    tdm_tensor_free(y3);
    /* a stage that fails: its message names it; the others stop; the pipeline stays failed */
    CHECK_ERROR(tdm_pipe_step(p, x, y, failing_loss, NULL, NULL) != 0,
                "stage 1, replica 0 (cpu:1): loss went bad at row 3");
    CHECK_ERROR(tdm_pipe_step(p, x, y, ce_loss, NULL, NULL) != 0, "a previous step failed");
    tdm_pipe_free(p);
    tdm_tensor_free(x);
    tdm_tensor_free(y);
    tdm_module_free(m);
}

/* ---- memory and trace ---------------------------------------------------------------------- */

#define MB_ROWS 16
#define WIDE    256

static tdm_module *make_wide(void) {
    tdm_rng r = tdm_rng_make(5);
    tdm_module *l[6] = {tdm_linear_new(IN, WIDE, true, tdm_cpu(0), &r),
                        tdm_relu_new(),
                        tdm_linear_new(WIDE, WIDE, true, tdm_cpu(0), &r),
                        tdm_relu_new(),
                        tdm_linear_new(WIDE, WIDE, true, tdm_cpu(0), &r),
                        tdm_linear_new(WIDE, OUT, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(6, l);
}

/* The stats of one step of a 2-stage pipeline over M micro-batches of MB_ROWS rows. */
static tdm_pipe_stats one_step(tdm_pipe_schedule sched, int M) {
    tdm_module *m = make_wide();
    tdm_pipe_opts o = tdm_pipe_defaults(2, M);
    o.schedule = sched;
    o.split_by = TDM_SPLIT_LAYERS;
    tdm_pipe *p = tdm_pipe_new(m, &o, make_sgd, NULL);
    tdm_pipe_stats st = {0};
    tdm_tensor *x, *y;
    batch_of(0, (int64_t)M * MB_ROWS, &x, &y);
    /* the second step: the first also allocates the optimizer's state */
    for (int i = 0; i < 2 && p; i++)
        CHECK(tdm_pipe_step(p, x, y, ce_loss, NULL, NULL) == 0, "%s", tdm_last_error());
    tdm_pipe_get_stats(p, &st);
    tdm_pipe_free(p);
    tdm_tensor_free(x);
    tdm_tensor_free(y);
    tdm_module_free(m);
    return st;
}

static void test_memory(void) {
    const int M = 8, S = 2;
    tdm_pipe_stats one = one_step(TDM_PIPE_1F1B, 1);
    tdm_pipe_stats gp = one_step(TDM_PIPE_GPIPE, M);
    tdm_pipe_stats ff = one_step(TDM_PIPE_1F1B, M);
    for (int s = 0; s < S; s++) {
        int64_t a = one.peak_bytes[s]; /* one micro-batch: forward, backward, gradients */
        printf("stage %d peak: 1 micro-batch %lld B, GPipe x%d %lld B, 1F1B x%d %lld B\n", s,
               (long long)a, M, (long long)gp.peak_bytes[s], M, (long long)ff.peak_bytes[s]);
        CHECK(gp.max_in_flight[s] == M, "GPipe holds all %d micro-batches on stage %d (got %d)", M,
              s, gp.max_in_flight[s]);
        CHECK(ff.max_in_flight[s] == S - s, "1F1B holds %d on stage %d (got %d)", S - s, s,
              ff.max_in_flight[s]);
        /* every micro-batch's activations alive at once: more than M/2 single footprints */
        CHECK(gp.peak_bytes[s] > a * M / 2, "GPipe peak %lld on stage %d, one micro-batch %lld",
              (long long)gp.peak_bytes[s], s, (long long)a);
        /* slack: tensors a forward makes that no tape node holds (cross-entropy's per-row
         * weight sums, 256 B here) are not released early and live until the step ends */
        CHECK(ff.peak_bytes[s] <= a * (S - s) + 1024 * M,
              "1F1B peak %lld on stage %d above %d x %lld", (long long)ff.peak_bytes[s], s, S - s,
              (long long)a);
    }
}

static void test_trace(void) {
    char path[] = "/tmp/tandem_pipe_traceXXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "temp file");
    close(fd);
    CHECK(tdm_trace_start(path, 0) == 0, "%s", tdm_last_error());
    tdm_pipe_stats st = one_step(TDM_PIPE_GPIPE, 4);
    CHECK(tdm_trace_stop() == 0, "%s", tdm_last_error());
    FILE *f = fopen(path, "r");
    static char buf[1 << 20];
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    buf[n] = '\0';
    if (f) fclose(f);
    unlink(path);
    CHECK(strstr(buf, "\"name\":\"F 3\"") && strstr(buf, "\"name\":\"B 0\"") &&
              strstr(buf, "stage 1 replica 0 (cpu:1)"),
          "trace holds per-stage forward and backward spans");
    CHECK(st.step_us > 0 && st.busy_us[0] > 0 && st.busy_us[1] > 0 && st.bubble >= 0 &&
              st.bubble < 1,
          "stats: step %.0f us, bubble %.3f", st.step_us, st.bubble);
    CHECK(fabs(tdm_pipe_ideal_bubble(2, 4) - 0.2) < 1e-12, "ideal bubble");
}

/* ---- the GPT (tdm_gpt_pipeline_model) ------------------------------------------------------ */

static const tdm_gpt_config GPT_CFG = {
    .layers = 3, .heads = 2, .channels = 16, .context = 8, .vocab = 40, .padded_vocab = 48};
#define GPT_B 4

static tdm_optim *gpt_adamw(tdm_paramset *ps, void *arg) {
    (void)arg;
    tdm_adam_opts o = tdm_adamw_defaults();
    o.lr = 1e-3f;
    return tdm_gpt_adamw_new(ps, &o);
}

/* From the last stage's module: under the vocabulary split the logits are this rank's
 * columns (tdm_gpt_loss_of over the stage). */
static tdm_tensor *gpt_loss_fn(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0, (void)arg;
    tdm_module *stage = tdm_strategy_loss_module();
    return stage ? tdm_gpt_loss_of(stage, out, target) : tdm_gpt_loss(out, target);
}

/* Step s's tokens and targets [GPT_B, T] (in the caller's scope). */
static void gpt_batch(int s, tdm_tensor **x, tdm_tensor **y) {
    int64_t tok[2][GPT_B * 8];
    uint32_t lcg = 7u + 1000u * (uint32_t)s;
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < GPT_B * 8; i++)
            lcg = lcg * 1664525u + 1013904223u, tok[k][i] = (lcg >> 8) % GPT_CFG.vocab;
    *x = tdm_from_data(TDM_SHAPE(GPT_B, 8), TDM_I64, tdm_cpu(0), tok[0]);
    *y = tdm_from_data(TDM_SHAPE(GPT_B, 8), TDM_I64, tdm_cpu(0), tok[1]);
}

static float flat_max_diff(tdm_module *a, tdm_module *b) {
    tdm_paramset *pa = tdm_module_parameters(a), *pb = tdm_module_parameters(b);
    if (!pa || !pb || pa->total != pb->total) return INFINITY;
    float *x = malloc(sizeof(float) * (size_t)pa->total),
          *y = malloc(sizeof(float) * (size_t)pa->total);
    tdm_to_host(pa->flat, x, sizeof(float) * (size_t)pa->total);
    tdm_to_host(pb->flat, y, sizeof(float) * (size_t)pb->total);
    float d = 0;
    for (int64_t i = 0; i < pa->total; i++) d = fmaxf(d, fabsf(x[i] - y[i]));
    free(x), free(y);
    return d;
}

/* Whether the stage modules' copies of wte (the embeddings' and the head's) are equal. */
static bool ties_equal(tdm_pipe *p, int stages, int replica) {
    tdm_module *first = tdm_pipe_stage_module(p, 0, replica);
    tdm_module *last = tdm_pipe_stage_module(p, stages - 1, replica);
    tdm_tensor *a = first->children[0]->children[0]->params[0];
    tdm_tensor *b = last->children[last->n_children - 1]->children[1]->params[0];
    int64_t n = tdm_numel(a);
    float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n);
    bool same = tdm_numel(b) == n && !tdm_to_host(a, x, sizeof(float) * (size_t)n) &&
                !tdm_to_host(b, y, sizeof(float) * (size_t)n) &&
                !memcmp(x, y, sizeof(float) * (size_t)n);
    free(x), free(y);
    return same;
}

/* Bound: micro-batches sum their gradients in another order than the whole batch's GEMMs, and
 * AdamW's normalised updates turn gradients that are rounding (the key bias's, whose true
 * value is 0) into steps of ~lr: tests/test_tensor_parallel.c derives 3e-5 for 3 steps. A
 * missing tie (the head's gradient never reaching the embeddings) moves wte by ~lr, 1e-3. */
#define GPT_PIPE_BOUND 3e-5f

static int split_stage(tdm_module *stage, tdm_group *tp, void *arg) {
    return tdm_gpt_parallelize_stage(stage, tp, arg); /* arg: the plan, or NULL */
}

static tdm_gpt_tp_plan sequence_split = {.sequence_parallel = true};
static tdm_gpt_tp_plan both_split = {.sequence_parallel = true, .vocab_parallel = true};

/* A GPT of GPT_CFG drawn from seed (*gpt) and its pipeline model (*seq), cut by layers into
 * stages x replicas, each stage over tp ranks split by plan (NULL: blocks only), 2
 * micro-batches, optimizers from make: the pipeline, or NULL and an error. */
static tdm_pipe *gpt_pipe(uint64_t seed, int stages, int replicas, int tp, tdm_gpt_tp_plan *plan,
                          tdm_optim_factory make, tdm_module **gpt, tdm_module **seq) {
    tdm_rng rng = tdm_rng_make(seed);
    static tdm_pipe_tie tie; /* read by tdm_pipe_new only */
    *gpt = tdm_gpt_new(&GPT_CFG, tdm_cpu(0), &rng);
    *seq = *gpt ? tdm_gpt_pipeline_model(*gpt, &tie) : NULL;
    tdm_pipe_opts o = tdm_pipe_defaults(stages, 2);
    o.replicas = replicas, o.ties = &tie, o.n_ties = 1, o.split_by = TDM_SPLIT_LAYERS;
    o.tp = tp, o.parallelize = split_stage, o.parallelize_arg = plan;
    return *seq ? tdm_pipe_new(*seq, &o, make, NULL) : NULL;
}

/* The GPT cut into its pipeline model: 1 stage (both copies of wte in it), 2 and 3 stages,
 * 2 stages x 2 replicas, and with tensor parallelism in the stages (3-D: 2 stages x tp 2, and
 * 2 stages x 2 replicas x tp 2 on 8 devices with the sequence split too, the stages handing
 * on each rank's tokens), 2 micro-batches, against the GPT on one device
 * after STEPS steps of AdamW: every loss, the weights written back (gathered whole under TP,
 * then tdm_gpt_from_pipeline_model), the two copies of wte equal bit for bit. */
static void test_gpt(void) {
    tdm_rng rng = tdm_rng_make(3);
    tdm_module *ref = tdm_gpt_new(&GPT_CFG, tdm_cpu(0), &rng);
    tdm_optim *opt = gpt_adamw(tdm_module_parameters(ref), NULL);
    float ref_loss[STEPS];
    for (int s = 0; s < STEPS; s++) {
        tdm_scope_begin();
        tdm_tensor *x, *y;
        gpt_batch(s, &x, &y);
        tdm_tensor *l = tdm_gpt_loss(tdm_module_forward(ref, x), y);
        CHECK(l && !tdm_optim_zero_grad(opt) && !tdm_backward(l) && !tdm_optim_step(opt),
              "one device: %s", tdm_last_error());
        ref_loss[s] = l ? tdm_item(l) : NAN;
        tdm_scope_end();
    }
    const int stages[7] = {1, 2, 3, 2, 2, 2, 2}, replicas[7] = {1, 1, 1, 2, 1, 2, 1};
    const int tps[7] = {1, 1, 1, 1, 2, 2, 2};
    for (int c = 0; c < 7; c++) {
        tdm_module *gpt, *seq;
        tdm_gpt_tp_plan *plan = c == 5 ? &sequence_split : c == 6 ? &both_split : NULL;
        tdm_pipe *p = gpt_pipe(3, stages[c], replicas[c], tps[c], plan, gpt_adamw, &gpt, &seq);
        CHECK(p != NULL, "GPT pipeline of %d stages: %s", stages[c], tdm_last_error());
        float dl = 0;
        for (int s = 0; p && s < STEPS; s++) {
            tdm_scope_begin();
            tdm_tensor *x, *y;
            gpt_batch(s, &x, &y);
            float l = NAN;
            CHECK(tdm_pipe_step(p, x, y, gpt_loss_fn, NULL, &l) == TDM_OK, "step: %s",
                  tdm_last_error());
            dl = fmaxf(dl, fabsf(l - ref_loss[s]));
            tdm_scope_end();
        }
        bool tied = p && ties_equal(p, stages[c], replicas[c] - 1);
        /* under TP a rank's stages hold its parts: fewer parameters than the whole layers */
        int64_t held = 0, whole = seq ? tdm_module_parameters(seq)->total : 0;
        for (int st = 0; p && st < stages[c]; st++)
            held += tdm_module_parameters(tdm_pipe_stage_module(p, st, 0))->total;
        CHECK(tps[c] > 1 ? held < whole : held == whole,
              "%d stages x tp %d: rank 0's stages hold %lld parameters of the layers' %lld",
              stages[c], tps[c], (long long)held, (long long)whole);
        int rc = p ? tdm_pipe_copy_to(p, seq) : -1;
        if (!rc) rc = tdm_gpt_from_pipeline_model(gpt, seq);
        float dw = rc ? INFINITY : flat_max_diff(gpt, ref);
        CHECK(!rc && tied && dw <= GPT_PIPE_BOUND && dl <= 1e-5f,
              "GPT, %d stages x %d replicas x tp %d: %s; weights off by %g, losses by %g, wte's "
              "copies %s",
              stages[c], replicas[c], tps[c], rc ? tdm_last_error() : "ran", dw, dl,
              tied ? "equal" : "differ");
        printf("GPT (3 layers) in %d stages x %d replicas x tp %d%s, 2 micro-batches: weights "
               "within %.3g, losses within %.3g of one device after %d AdamW steps; wte's two "
               "copies equal\n",
               stages[c], replicas[c], tps[c],
               c == 5   ? " (sequence-parallel)"
               : c == 6 ? " (sequence- and vocabulary-parallel)"
                        : "",
               dw, dl, STEPS);
        tdm_pipe_free(p);
        tdm_module_free(seq);
        tdm_module_free(gpt);
    }
    /* a tie that names no parameter, or two of different shapes */
    tdm_rng r3 = tdm_rng_make(3);
    tdm_module *gpt = tdm_gpt_new(&GPT_CFG, tdm_cpu(0), &r3);
    tdm_pipe_tie tie;
    tdm_module *seq = tdm_gpt_pipeline_model(gpt, &tie);
    tdm_pipe_opts o = tdm_pipe_defaults(2, 1);
    o.ties = &(tdm_pipe_tie){0, "wte.weight", 4, "wpe.weight"}, o.n_ties = 1;
    CHECK_ERROR(tdm_pipe_new(seq, &o, gpt_adamw, NULL) == NULL,
                "layer 4 (GPTHead) has no parameter wpe.weight");
    o.ties = &(tdm_pipe_tie){0, "wte.weight", 0, "wpe.weight"};
    CHECK_ERROR(tdm_pipe_new(seq, &o, gpt_adamw, NULL) == NULL, "are not two copies of one shape");
    CHECK_ERROR(tdm_gpt_pipeline_model(seq, &tie) == NULL, "not a GPT");
    tdm_module_free(seq);
    tdm_module_free(gpt);
    tdm_optim_free(opt);
    tdm_module_free(ref);
}

/* A first stage (the embeddings and a block) split with the sequence split hands on each
 * rank's half of the tokens, [B, T/2, C]; without it, all of them. */
static int stage_rank(tdm_rank_ctx *ctx, void *arg) {
    int64_t *tokens = arg;
    tdm_rng rng = tdm_rng_make(3);
    tdm_module *gpt = tdm_gpt_new(&GPT_CFG, tdm_cpu(0), &rng);
    tdm_pipe_tie tie;
    tdm_module *seq = gpt ? tdm_gpt_pipeline_model(gpt, &tie) : NULL;
    int rc = seq ? TDM_OK : tdm_last_status();
    for (int k = 0; k < 2 && !rc; k++) {
        tdm_module *kids[2] = {tdm_module_clone(seq->children[0], tdm_cpu(0)),
                               tdm_module_clone(seq->children[1], tdm_cpu(0))};
        tdm_module *stage = tdm_sequential_new(2, kids);
        rc = stage ? tdm_gpt_parallelize_stage(stage, ctx->group, k ? &sequence_split : NULL)
                   : tdm_last_status();
        tdm_scope_begin();
        tdm_tensor *x, *y;
        gpt_batch(0, &x, &y);
        tdm_tensor *out = rc ? NULL : tdm_module_forward(stage, x);
        if (!rc && !out) rc = tdm_last_status();
        if (out) tokens[2 * ctx->rank + k] = out->shape[1];
        tdm_scope_end();
        tdm_module_free(stage);
    }
    tdm_module_free(seq);
    tdm_module_free(gpt);
    return rc;
}

static void test_gpt_stage_split(void) {
    int64_t tokens[4] = {0};
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    CHECK(tdm_spawn(2, devs, stage_rank, tokens) == TDM_OK, "%s", tdm_last_error());
    for (int r = 0; r < 2; r++)
        CHECK(tokens[2 * r] == 8 && tokens[2 * r + 1] == 4,
              "rank %d's first stage hands on %lld tokens, %lld with the sequence split", r,
              (long long)tokens[2 * r], (long long)tokens[2 * r + 1]);
    CHECK_ERROR(tdm_gpt_parallelize_stage(NULL, NULL, NULL) != 0, "NULL group");
}

/* --clip with the GPT's pipeline model: SGD (whose update is the gradient itself, where
 * Adam's would normalise a clip's factor away) clipped at GPT_CLIP, in 1 stage (the tie inside
 * it), 2 stages (the tie across them) and 2 stages x 2 replicas x tp 2 (sequence-parallel: the
 * head's ln_f sees each rank's tokens), against one device
 * clipping its whole gradient. The norm must count the tie's copy once and a tensor-parallel
 * stage's whole parameters once. */
#define GPT_CLIP 0.05f

static tdm_optim *gpt_sgd(tdm_paramset *ps, void *arg) {
    (void)arg;
    tdm_sgd_opts o = tdm_sgd_defaults(0.5f);
    return tdm_sgd_new(ps, &o);
}

static void test_gpt_clip(void) {
    tdm_rng rng = tdm_rng_make(4);
    tdm_module *ref = tdm_gpt_new(&GPT_CFG, tdm_cpu(0), &rng);
    tdm_paramset *rps = tdm_module_parameters(ref);
    tdm_optim *opt = gpt_sgd(rps, NULL);
    float norm0 = 0;
    for (int s = 0; s < STEPS; s++) {
        tdm_scope_begin();
        tdm_tensor *x, *y;
        gpt_batch(s, &x, &y);
        tdm_tensor *l = tdm_gpt_loss(tdm_module_forward(ref, x), y);
        float norm = 0;
        CHECK(l && !tdm_optim_zero_grad(opt) && !tdm_backward(l) &&
                  !tdm_clip_grad_norm(rps, GPT_CLIP, false, &norm) && !tdm_optim_step(opt),
              "one device: %s", tdm_last_error());
        if (s == 0) norm0 = norm;
        tdm_scope_end();
    }
    CHECK(norm0 > 4 * GPT_CLIP, "the clip is not active: the first norm is %g", norm0);
    const int stages[3] = {1, 2, 2}, replicas[3] = {1, 1, 2}, tps[3] = {1, 1, 2};
    for (int c = 0; c < 3; c++) {
        tdm_module *gpt, *seq;
        tdm_pipe *p =
            gpt_pipe(4, stages[c], replicas[c], tps[c], &sequence_split, gpt_sgd, &gpt, &seq);
        int rc = p ? tdm_pipe_set_clip_grad_norm(p, GPT_CLIP) : -1;
        for (int s = 0; !rc && s < STEPS; s++) {
            tdm_scope_begin();
            tdm_tensor *x, *y;
            gpt_batch(s, &x, &y);
            rc = tdm_pipe_step(p, x, y, gpt_loss_fn, NULL, NULL);
            tdm_scope_end();
        }
        if (!rc) rc = tdm_pipe_copy_to(p, seq);
        if (!rc) rc = tdm_gpt_from_pipeline_model(gpt, seq);
        float dw = rc ? INFINITY : flat_max_diff(gpt, ref);
        CHECK(!rc && dw <= 1e-6f,
              "clipped GPT, %d stages x %d replicas x tp %d: %s; weights off "
              "by %g",
              stages[c], replicas[c], tps[c], rc ? tdm_last_error() : "ran", dw);
        printf("GPT clipped at %g (first norm %.3g), %d stages x %d replicas x tp %d, SGD: "
               "weights within %.3g of one device after %d steps\n",
               (double)GPT_CLIP, (double)norm0, stages[c], replicas[c], tps[c], dw, STEPS);
        tdm_pipe_free(p);
        tdm_module_free(seq);
        tdm_module_free(gpt);
    }
    CHECK_ERROR(tdm_pipe_set_clip_grad_norm(NULL, 1.0f) != 0, "NULL");
    tdm_optim_free(opt);
    tdm_module_free(ref);
}

int main(void) {
    test_gpt();
    test_gpt_stage_split();
    test_gpt_clip();
    test_recv();
    test_recv_bf16();
    test_bf16_activations();
    test_split();
    test_errors();
    test_equivalence();
    test_explicit_map();
    test_with_data_parallel();
    test_batch_norm();
    test_memory();
    test_trace();
    return check_summary();
}
