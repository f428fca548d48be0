/* ResNet-18, -34 and -50 (include/tandem/models.h) against torchvision's
 * (tests/fixtures/gen_resnet.py; torch 2.15 and torchvision 0.29 from PyPI):
 *   - parameter and buffer names and shapes, in order, are torchvision's state_dict keys for
 *     all three depths; the CIFAR stem changes only conv1's kernel, one input channel only
 *     conv1's input channels;
 *   - every tensor set by resnet_fill (gen_resnet.py's fill(), bit for bit), saved by
 *     tdm_weights_save, zeroed and loaded back by tdm_weights_load, so the names are
 *     exercised: eval and train logits, the parameter gradients of a cross-entropy and the
 *     running statistics after the train forward equal torchvision's;
 *   - DataParallel on 2 CPU devices ends 2 SGD steps where one device does;
 *   - bad input and options fail naming what is wrong;
 *   - AdaptiveAvgPool2d: values against PyTorch's, gradients against finite differences.
 *
 * Tolerances (float32 on both sides, summed in other orders by other kernels): logits
 * 1e-4 * (1 + |want|) after 18-50 layers; running statistics 1e-5 of their sum of magnitudes.
 * Gradient sums are compared with float64 PyTorch's, relative to the tensor's sum of |g| (a
 * sum of terms of either sign cancels, so the scale is the magnitudes', not the result), within
 * 4x float32 PyTorch's own worst error on that model + 1e-6 (gen_resnet.py writes it). In eval
 * mode that is ~1e-6. In training mode the gradient through 20-50 batch norms, each of which
 * removes its gradient's mean, and ReLUs whose masks flip with the last bit of their input is
 * ill-conditioned: float32 PyTorch is 1.5e-3 (resnet18) and 2.4e-3 (resnet50) off float64;
 * Tandem 1.4e-6 and 7.1e-3 (forward logits as close to float64 as PyTorch's: 9e-5 vs 1.3e-4).
 * Each model prints where it stands. DataParallel as test_ddp.c: 1e-5 absolute + 1e-4
 * relative, with 16x16 inputs so that layer4's batch norm sees 16 values per channel (at 8x8,
 * 4 values, float rounding alone moved weights by 0.1 in two steps). */
#include "check.h"
#include "gradcheck.h"
#include "testdir.h"

#include "fixtures/resnet_fixtures.h"

#define CPU    tdm_cpu(0)
#define LEN(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* ---- gen_resnet.py's fill(), bit for bit ------------------------------------------------- */

static uint32_t fnv1a(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

/* n values in [-1, 1), exact floats: a 32-bit hash of (name, index) -> 24 bits. */
static void pattern(const char *name, int64_t n, float *v) {
    uint32_t hn = fnv1a(name);
    for (int64_t i = 0; i < n; i++) {
        uint32_t h = (uint32_t)i * 2654435761u + hn;
        h ^= h >> 16;
        h *= 0x45d9f3bu;
        h ^= h >> 16;
        v[i] = 2.0f * ((float)(h >> 8) * (1.0f / 16777216.0f)) - 1.0f;
    }
}

/* The values of tensor `name` of shape s (malloc'd): the pattern scaled by what it is. Every
 * product is exact or one rounding, as numpy's float32 arithmetic does it. */
static float *fill_values(const char *name, tdm_shape s) {
    int64_t n = tdm_shape_numel(s);
    float *v = malloc(sizeof(float) * (size_t)n);
    pattern(name, n, v);
    const char *dot = strrchr(name, '.'), *leaf = dot ? dot + 1 : name;
    bool weight = !strcmp(leaf, "weight"), bias = !strcmp(leaf, "bias");
    float scale = 1, shift = 0;
    if (weight && s.ndim == 4) /* conv: Kaiming's variance 2 / fan_in */
        scale = (float)sqrt(6.0 / (double)(n / s.d[0]));
    else if (weight && s.ndim == 2) /* fc */
        scale = (float)(1.0 / sqrt((double)s.d[1]));
    else if (bias || !strcmp(leaf, "running_mean"))
        scale = 0.1f;
    else if (weight) /* batch norm */
        shift = 1, scale = 0.25f;
    else if (!strcmp(leaf, "running_var"))
        shift = 1, scale = 0.5f;
    for (int64_t i = 0; i < n; i++) v[i] = shift + v[i] * scale;
    return v;
}

static tdm_tensor *fill_tensor(const char *name, tdm_shape s) {
    float *v = fill_values(name, s);
    tdm_tensor *t = tdm_from_data(s, TDM_F32, CPU, v);
    free(v);
    return t;
}

static void set_values(tdm_tensor *t, const char *name) {
    if (t->dtype == TDM_I64) { /* num_batches_tracked */
        CHECK(tdm_fill_(t, 5) == 0, "%s: %s", name, tdm_last_error());
        return;
    }
    tdm_scope_begin();
    CHECK(tdm_copy_(t, fill_tensor(name, tdm_shape_of(t))) == 0, "%s: %s", name, tdm_last_error());
    tdm_scope_end();
}

/* Sets every parameter and buffer of m as gen_resnet.py's set_formula does. */
static void resnet_fill(tdm_module *m) {
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_bufferset *bs = tdm_module_buffers(m);
    for (int i = 0; i < ps->n; i++) set_values(ps->params[i], ps->names[i]);
    for (int i = 0; i < bs->n; i++) set_values(bs->buffers[i], bs->names[i]);
}

static tdm_module *resnet(int depth, bool small_input, int channels, uint64_t seed) {
    tdm_resnet_opts o = tdm_resnet_defaults(depth);
    o.num_classes = 10;
    o.small_input = small_input;
    o.in_channels = channels;
    tdm_rng r = tdm_rng_make(seed);
    tdm_module *m = tdm_resnet_new(&o, CPU, &r);
    CHECK(m, "resnet%d: %s", depth, tdm_last_error());
    return m;
}

/* ---- names and shapes -------------------------------------------------------------------- */

static bool shape_eq(tdm_shape a, tdm_shape b) {
    if (a.ndim != b.ndim) return false;
    for (int i = 0; i < a.ndim; i++)
        if (a.d[i] != b.d[i]) return false;
    return true;
}

/* names[i] and ts[i]'s shapes against torchvision's keys; conv1.weight's against conv1. */
static void check_keys(const char *what, int n, char **names, tdm_tensor **ts,
                       const resnet_key *want, int n_want, tdm_shape conv1) {
    CHECK(n == n_want, "%s: %d tensors, torchvision has %d", what, n, n_want);
    for (int i = 0; i < n && i < n_want; i++) {
        tdm_shape w = strcmp(want[i].name, "conv1.weight") ? want[i].shape : conv1;
        char a[96], b[96];
        CHECK(!strcmp(names[i], want[i].name) && shape_eq(tdm_shape_of(ts[i]), w),
              "%s %d: %s %s, torchvision's %s %s", what, i, names[i],
              tdm_shape_str(tdm_shape_of(ts[i]), a), want[i].name, tdm_shape_str(w, b));
    }
}

/* The models of the test, built once (a ResNet-50's initialisation draws 25M numbers). */
typedef struct {
    tdm_module *r18, *r18s, *r18_grey, *r34, *r50;
} zoo;

static void test_names(const zoo *z) {
    struct {
        const char *what;
        tdm_module *m;
        const resnet_key *params, *buffers;
        int np, nb;
        tdm_shape conv1;
    } c[5] = {
        {"resnet18", z->r18, resnet18_params, resnet18_buffers, LEN(resnet18_params),
         LEN(resnet18_buffers), TDM_SHAPE(64, 3, 7, 7)},
        {"resnet18 small_input", z->r18s, resnet18_params, resnet18_buffers, LEN(resnet18_params),
         LEN(resnet18_buffers), TDM_SHAPE(64, 3, 3, 3)},
        {"resnet18, 1 channel", z->r18_grey, resnet18_params, resnet18_buffers,
         LEN(resnet18_params), LEN(resnet18_buffers), TDM_SHAPE(64, 1, 7, 7)},
        {"resnet34", z->r34, resnet34_params, resnet34_buffers, LEN(resnet34_params),
         LEN(resnet34_buffers), TDM_SHAPE(64, 3, 7, 7)},
        {"resnet50", z->r50, resnet50_params, resnet50_buffers, LEN(resnet50_params),
         LEN(resnet50_buffers), TDM_SHAPE(64, 3, 7, 7)},
    };
    for (int i = 0; i < 5; i++) {
        if (!c[i].m) continue;
        tdm_paramset *ps = tdm_module_parameters(c[i].m);
        tdm_bufferset *bs = tdm_module_buffers(c[i].m);
        check_keys(c[i].what, ps->n, ps->names, ps->params, c[i].params, c[i].np, c[i].conv1);
        check_keys(c[i].what, bs->n, bs->names, bs->buffers, c[i].buffers, c[i].nb, c[i].conv1);
    }
}

/* torchvision's resnet18() with its defaults has 11,689,512 parameters; zero_init_residual
 * starts every block's last batch norm with weight 0. */
static void test_defaults(void) {
    tdm_resnet_opts o = tdm_resnet_defaults(18);
    CHECK(o.num_classes == 1000 && o.in_channels == 3 && !o.small_input && !o.zero_init_residual,
          "defaults");
    o.zero_init_residual = true;
    tdm_module *m = tdm_resnet_new(&o, CPU, NULL);
    tdm_paramset *ps = m ? tdm_module_parameters(m) : NULL;
    CHECK(ps && ps->total == 11689512, "resnet18: %lld parameters",
          ps ? (long long)ps->total : -1LL);
    tdm_tensor *w2 = m ? tdm_module_find(m, "layer3.1.bn2.weight") : NULL;
    tdm_tensor *w1 = m ? tdm_module_find(m, "layer3.1.bn1.weight") : NULL;
    tdm_scope_begin();
    bool prev = tdm_set_grad_enabled(false);
    float s2 = w2 ? tdm_item(tdm_sum_all(w2)) : -1, s1 = w1 ? tdm_item(tdm_sum_all(w1)) : -1;
    tdm_set_grad_enabled(prev);
    tdm_scope_end();
    CHECK(s2 == 0 && s1 == 256, "zero_init_residual: bn2 weight sums %g, bn1 %g", s2, s1);
    tdm_module_free(m);
}

/* ---- against torchvision ----------------------------------------------------------------- */

/* One mode's gradients: sum(g) and sum(g * pattern) against float64 PyTorch's, relative to
 * each tensor's sum of |g|, within `factor` times float32 PyTorch's own worst error. */
typedef struct {
    const char *mode;
    const float *want; /* per parameter: sum, weighted sum, sum of |g| */
    double torch_f32_err, factor;
} grad_ref;

typedef struct {
    const char *name;
    int hw; /* input [2, 3, hw, hw] */
    const float *eval, *train, *buffers;
    grad_ref eval_grads, train_grads;
} parity_case;

static tdm_tensor *input(int hw) {
    return fill_tensor("input", TDM_SHAPE(2, 3, hw, hw));
}

/* The weighted sum of t with the pattern of name + "#", and the sums of t and of |t|. */
static void sums(const tdm_tensor *t, const char *name, double out[3]) {
    int64_t n = tdm_numel(t);
    float *v = malloc(sizeof(float) * (size_t)n), *w = malloc(sizeof(float) * (size_t)n);
    char key[160];
    snprintf(key, sizeof key, "%s#", name);
    pattern(key, n, w);
    tdm_to_host(t, v, sizeof(float) * (size_t)n);
    out[0] = out[1] = out[2] = 0;
    for (int64_t i = 0; i < n; i++) {
        out[0] += v[i];
        out[1] += (double)v[i] * w[i];
        out[2] += fabs(v[i]);
    }
    free(v);
    free(w);
}

static void check_grads(const char *name, const grad_ref *r, tdm_paramset *ps) {
    int bad = 0;
    double worst = 0, bound = r->factor * r->torch_f32_err + 1e-6;
    for (int i = 0; i < ps->n; i++) {
        double got[3];
        const float *want = r->want + 3 * i;
        sums(ps->params[i]->grad, ps->names[i], got);
        for (int k = 0; k < 2; k++) {
            double err = fabs(got[k] - want[k]) / want[2];
            if (err > worst) worst = err;
            if (!(err <= bound) && bad++ < 5)
                fprintf(stderr, "%s %s: %s grad sum %d = %.8g, float64 PyTorch %.8g (scale %.3g)\n",
                        name, r->mode, ps->names[i], k, got[k], want[k], want[2]);
        }
    }
    CHECK(bad == 0, "%s %s: %d gradient sums off float64 PyTorch's by more than %.3g", name,
          r->mode, bad, bound);
    printf("%s, %s: gradient sums within %.2g of float64 PyTorch's (float32 PyTorch: %.2g)\n", name,
           r->mode, worst, r->torch_f32_err);
}

/* Running statistics after one train forward, and num_batches_tracked 5 -> 6. */
static void check_buffers(const parity_case *c, tdm_bufferset *bs) {
    int bad = 0, f = 0;
    for (int i = 0; i < bs->n; i++) {
        tdm_tensor *b = bs->buffers[i];
        if (b->dtype != TDM_F32) {
            if (tdm_item(b) != 6 && bad++ < 5) fprintf(stderr, "%s: %s\n", c->name, bs->names[i]);
            continue;
        }
        double got[3];
        const float *want = c->buffers + 2 * f++;
        sums(b, bs->names[i], got);
        for (int k = 0; k < 2; k++)
            if (!(fabs(got[k] - want[k]) <= 1e-5 * got[2] + 1e-6) && bad++ < 5)
                fprintf(stderr, "%s: %s sum %d = %.8g, torchvision %.8g\n", c->name, bs->names[i],
                        k, got[k], want[k]);
    }
    CHECK(bad == 0, "%s: %d buffers differ from torchvision's after a train forward", c->name, bad);
}

/* The model c describes with fill()'s weights, by way of a safetensors file. */
/* m with fill()'s values by way of a safetensors file: filled, saved, zeroed, loaded. */
static bool load_filled(const parity_case *c, tdm_module *m) {
    resnet_fill(m);
    char path[128];
    snprintf(path, sizeof path, "%s/%s.safetensors", tmpdir, c->name);
    CHECK(tdm_weights_save(path, m, NULL, 0) == 0, "%s: save: %s", c->name, tdm_last_error());
    tdm_bufferset *bs = tdm_module_buffers(m);
    tdm_fill_(tdm_module_parameters(m)->flat, 0);
    for (int i = 0; i < bs->n; i++) tdm_fill_(bs->buffers[i], 0);
    int rc = tdm_weights_load(path, m);
    CHECK(rc == 0, "%s: load: %s", c->name, tdm_last_error());
    remove(path);
    return rc == 0;
}

/* Forward in the current mode, logits against want, backward of cross_entropy(y, [3, 7]). */
static void forward_backward(const parity_case *c, tdm_module *m, const float *want,
                             const char *mode) {
    tdm_scope_begin();
    tdm_tensor *y = tdm_module_forward(m, input(c->hw));
    CHECK(y && check_tensor_close(y, want, 1e-4, 1e-4, c->name) == 0, "%s: %s logits: %s", c->name,
          mode, tdm_last_error());
    int64_t target[2] = {3, 7};
    tdm_tensor *loss = tdm_cross_entropy(y, i64(TDM_SHAPE(2), target), NULL);
    CHECK(loss && tdm_backward(loss) == 0, "%s: backward: %s", c->name, tdm_last_error());
    tdm_scope_end();
}

static void test_parity(const parity_case *c, tdm_module *m) {
    if (!m || !load_filled(c, m)) return;
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_module_train(m, false);
    forward_backward(c, m, c->eval, "eval");
    check_grads(c->name, &c->eval_grads, ps);
    tdm_fill_(ps->flat_grad, 0);
    tdm_module_train(m, true);
    forward_backward(c, m, c->train, "train");
    check_grads(c->name, &c->train_grads, ps);
    check_buffers(c, tdm_module_buffers(m));
}

/* ---- DataParallel ------------------------------------------------------------------------ */

#define DP_B     4 /* global batch: 2 rows per device */
#define DP_HW    16
#define DP_STEPS 2

static tdm_optim *make_sgd(tdm_paramset *ps, void *arg) {
    (void)arg;
    tdm_sgd_opts o = tdm_sgd_defaults(0.05f);
    o.momentum = 0.9f;
    return tdm_sgd_new(ps, &o);
}

static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0, (void)arg;
    return tdm_cross_entropy(out, target, NULL);
}

/* Step s's global batch: x [DP_B, 3, 8, 8], y [DP_B]. */
static void dp_batch(int s, tdm_tensor **x, tdm_tensor **y) {
    char name[16];
    snprintf(name, sizeof name, "batch%d", s);
    *x = fill_tensor(name, TDM_SHAPE(DP_B, 3, DP_HW, DP_HW));
    int64_t t[DP_B];
    for (int i = 0; i < DP_B; i++) t[i] = (i * 3 + s) % 10;
    *y = i64(TDM_SHAPE(DP_B), t);
}

/* Parameters then float buffers of m, as one host array of *n floats. */
static float *state_of(tdm_module *m, int64_t *n) {
    tdm_paramset *ps = tdm_module_parameters(m);
    tdm_bufferset *bs = tdm_module_buffers(m);
    int64_t total = ps->total;
    for (int i = 0; i < bs->n; i++)
        if (bs->buffers[i]->dtype == TDM_F32) total += tdm_numel(bs->buffers[i]);
    float *v = malloc(sizeof(float) * (size_t)total);
    tdm_to_host(ps->flat, v, sizeof(float) * (size_t)ps->total);
    int64_t at = ps->total;
    for (int i = 0; i < bs->n; i++) {
        tdm_tensor *b = bs->buffers[i];
        if (b->dtype != TDM_F32) continue;
        tdm_to_host(b, v + at, sizeof(float) * (size_t)tdm_numel(b));
        at += tdm_numel(b);
    }
    *n = total;
    return v;
}

/* CIFAR-style resnet18, DP_STEPS SGD steps on `devices` CPU devices; its state. */
static float *dp_run(int devices, int64_t *n) {
    tdm_module *m = resnet(18, true, 3, 7);
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    tdm_dp *dp = m ? tdm_dp_new(m, devs, devices, make_sgd, NULL) : NULL;
    CHECK(dp, "dp_new on %d devices: %s", devices, tdm_last_error());
    float *state = NULL;
    for (int s = 0; dp && s < DP_STEPS; s++) {
        tdm_scope_begin();
        tdm_tensor *x, *y;
        dp_batch(s, &x, &y);
        float loss = NAN;
        CHECK(tdm_dp_step(dp, x, y, ce_loss, NULL, &loss) == 0 && isfinite(loss),
              "dp step %d on %d devices: %s", s, devices, tdm_last_error());
        tdm_scope_end();
    }
    if (dp) state = state_of(tdm_dp_replica(dp, devices - 1), n);
    tdm_dp_free(dp);
    tdm_module_free(m);
    return state;
}

/* Two devices (synchronised batch norm over them) end where one device does on the same
 * global batches: parameters and running statistics. The last replica is read, so it is a
 * clone (tdm_module_clone of the blocks) that is compared. */
static void test_data_parallel(void) {
    int64_t n1 = 0, n2 = 0;
    float *one = dp_run(1, &n1), *two = dp_run(2, &n2);
    int bad = 0;
    double worst = 0;
    for (int64_t i = 0; one && two && n1 == n2 && i < n1; i++) {
        double d = fabs((double)two[i] - one[i]);
        if (d > worst) worst = d;
        if (!(d <= 1e-5 + 1e-4 * fabs(one[i]))) bad++;
    }
    CHECK(one && two && n1 == n2 && bad == 0,
          "DataParallel resnet18: %d of %lld values differ from one device (worst %.3g)", bad,
          (long long)n1, worst);
    free(one);
    free(two);
}

/* ---- errors ------------------------------------------------------------------------------ */

static void test_errors(const zoo *z) {
    tdm_resnet_opts o = tdm_resnet_defaults(19);
    CHECK_ERROR(tdm_resnet_new(&o, CPU, NULL) == NULL, "depth 19 is not one of 18, 34, 50");
    o = tdm_resnet_defaults(18);
    o.num_classes = 0;
    CHECK_ERROR(tdm_resnet_new(&o, CPU, NULL) == NULL, "num_classes 0");
    CHECK_ERROR(tdm_resnet_new(NULL, CPU, NULL) == NULL, "options are NULL");
    tdm_scope_begin();
    tdm_tensor *grey = tdm_zeros(TDM_SHAPE(2, 1, 16, 16), TDM_F32, CPU);
    CHECK_ERROR(tdm_module_forward(z->r18s, grey) == NULL,
                "expects 3 input channels, but input [2, 1, 16, 16] has 1");
    tdm_tensor *flat = tdm_zeros(TDM_SHAPE(2, 768), TDM_F32, CPU);
    CHECK_ERROR(tdm_module_forward(z->r18s, flat) == NULL, "got [2, 768]");
    /* a grey model takes grey images */
    tdm_module_train(z->r18_grey, false);
    tdm_tensor *y = tdm_module_forward(z->r18_grey, grey);
    CHECK(y && y->ndim == 2 && y->shape[0] == 2 && y->shape[1] == 10, "grey resnet18: %s",
          tdm_last_error());
    tdm_scope_end();
    CHECK_ERROR(tdm_adaptive_avg_pool2d_new(0, 1) == NULL, "output size (0, 1)");
    tdm_scope_begin();
    CHECK_ERROR(tdm_adaptive_avg_pool2d(tdm_zeros(TDM_SHAPE(2, 3, 4), TDM_F32, CPU), 1, 1) == NULL,
                "adaptive_avg_pool2d: input must be 4-D [N, C, H, W], got [2, 3, 4]");
    tdm_scope_end();
}

/* ---- AdaptiveAvgPool2d --------------------------------------------------------------------- */

typedef struct {
    int64_t oh, ow;
} pool_ctx;

static tdm_tensor *pool_fn(tdm_tensor **in, void *ctx) {
    const pool_ctx *c = ctx;
    return tdm_adaptive_avg_pool2d(in[0], c->oh, c->ow);
}

static void test_adaptive_pool(void) {
    /* against PyTorch: unequal overlapping bins, an output larger than the input */
    tdm_module *pools[2] = {tdm_adaptive_avg_pool2d_new(3, 4), tdm_adaptive_avg_pool2d_new(7, 9)};
    const float *want[2] = {pool_3x4, pool_7x9};
    for (int i = 0; i < 2; i++) {
        tdm_scope_begin();
        tdm_tensor *y = tdm_module_forward(pools[i], fill_tensor("pool", TDM_SHAPE(2, 3, 5, 7)));
        CHECK(y && check_tensor_close(y, want[i], 1e-6, 1e-5, "adaptive_avg_pool2d") == 0,
              "adaptive pool %d: %s", i, tdm_last_error());
        tdm_scope_end();
        tdm_module_free(pools[i]);
    }
    /* outside a scope the temporaries of the general case are the op's own */
    tdm_tensor *x = fill_tensor("pool", TDM_SHAPE(2, 3, 5, 7));
    tdm_tensor *y = tdm_adaptive_avg_pool2d(x, 3, 4);
    CHECK(y && check_tensor_close(y, pool_3x4, 1e-6, 1e-5, "unscoped") == 0, "unscoped pool");
    tdm_tensor_free(y);
    /* gradients: general bins, upsampling, equal bins (avg_pool2d) and the global pool */
    tdm_requires_grad_(x, true);
    pool_ctx cases[4] = {{3, 4}, {7, 9}, {5, 1}, {1, 1}};
    for (int i = 0; i < 4; i++) {
        char what[64];
        snprintf(what, sizeof what, "adaptive_avg_pool2d 5x7 -> %lldx%lld", (long long)cases[i].oh,
                 (long long)cases[i].ow);
        CHECK(gradcheck(what, pool_fn, 1, &x, &cases[i], 1e-2, 1e-3, 1e-3) == 0, "%s", what);
    }
    tdm_tensor_free(x);
}

int main(void) {
    if (tmpdir_make("resnet")) return 1;
    test_adaptive_pool();
    zoo z = {resnet(18, false, 3, 1), resnet(18, true, 3, 2), resnet(18, false, 1, 3),
             resnet(34, false, 3, 4), resnet(50, false, 3, 5)};
    test_errors(&z);
    test_names(&z);
    test_defaults();
#define GRADS(p)                                                                                   \
    {"eval", p##_eval_grads, p##_eval_grads_torch_f32_err, 4},                                     \
        {"train", p##_grads, p##_grads_torch_f32_err, 4}
    parity_case cases[3] = {
        {"resnet18", 64, r18_eval, r18_train, r18_buffers, GRADS(r18)},
        {"resnet18_small_input", 16, r18s_eval, r18s_train, r18s_buffers, GRADS(r18s)},
        {"resnet50", 64, r50_eval, r50_train, r50_buffers, GRADS(r50)},
    };
    test_parity(&cases[0], z.r18);
    test_parity(&cases[1], z.r18s);
    test_parity(&cases[2], z.r50);
    tdm_module *all[5] = {z.r18, z.r18s, z.r18_grey, z.r34, z.r50};
    for (int i = 0; i < 5; i++) tdm_module_free(all[i]);
    test_data_parallel();
    tmpdir_remove();
    return check_summary();
}
