/* Modules: names, the flat parameter buffer, Linear (forward, gradcheck), train/eval,
 * PyTorch's default initialisation (fixture: tests/fixtures/gen_init.py), errors. */
#include <stdlib.h>
#include <string.h>

#include "gradcheck.h"
#include "tandem/models.h"
#include "core/core.h"
#include "fixtures/init_fixtures.h"

static float *host_copy(const tdm_tensor *t) {
    int64_t n = tdm_numel(t);
    float *v = malloc((size_t)n * sizeof *v);
    tdm_to_host(t, v, (size_t)n * sizeof *v);
    return v;
}

/* ---- names and the flat buffer ---------------------------------------------------------- */

static void test_names(void) {
    tdm_rng r = tdm_rng_make(1);
    tdm_module *mods[3] = {tdm_linear_new(4, 3, true, tdm_cpu(0), &r), tdm_relu_new(),
                           tdm_linear_new(3, 2, false, tdm_cpu(0), &r)};
    tdm_module *seq = tdm_sequential_new(3, mods);
    CHECK(seq != NULL, "%s", tdm_last_error());
    tdm_paramset *ps = tdm_module_parameters(seq);
    CHECK(ps && ps->n == 3, "n %d: %s", ps ? ps->n : -1, tdm_last_error());
    if (ps && ps->n == 3) {
        CHECK(!strcmp(ps->names[0], "0.weight"), "%s", ps->names[0]);
        CHECK(!strcmp(ps->names[1], "0.bias"), "%s", ps->names[1]);
        CHECK(!strcmp(ps->names[2], "2.weight"), "%s", ps->names[2]);
        CHECK(ps->total == 12 + 3 + 6, "total %lld", (long long)ps->total);
        CHECK(ps->offsets[0] == 0 && ps->offsets[1] == 12 && ps->offsets[2] == 15,
              "offsets %lld %lld %lld", (long long)ps->offsets[0], (long long)ps->offsets[1],
              (long long)ps->offsets[2]);
        CHECK(tdm_module_find(seq, "2.weight") == ps->params[2], "find 2.weight");
    }
    CHECK(tdm_module_find(seq, "2.bias") == NULL, "2.bias should not exist");
    CHECK(tdm_module_find(seq, "1.weight") == NULL, "ReLU has no weight");
    tdm_module_free(seq);

    /* nested: model.features.3.bias, model.classifier.weight; buffers of BatchNorm */
    tdm_module *feat[4] = {
        tdm_conv2d_new(1, 4, 3, 3, NULL, true, tdm_cpu(0), &r),
        tdm_batch_norm2d_new(4, 1e-5f, 0.1f, tdm_cpu(0)),
        tdm_relu_new(),
        tdm_conv2d_new(4, 2, 3, 3, &(tdm_conv2d_opts){.pad_h = 1, .pad_w = 1}, true, tdm_cpu(0),
                       &r),
    };
    tdm_module *model =
        tdm_module_new(&(const tdm_module_ops){"Net", NULL, NULL}, tdm_cpu(0), NULL);
    CHECK(tdm_module_add(model, "features", tdm_sequential_new(4, feat)) == TDM_OK, "%s",
          tdm_last_error());
    CHECK(tdm_module_add(model, "classifier", tdm_linear_new(8, 3, true, tdm_cpu(0), &r)) == TDM_OK,
          "%s", tdm_last_error());
    ps = tdm_module_parameters(model);
    const char *want[] = {"features.0.weight", "features.0.bias",   "features.1.weight",
                          "features.1.bias",   "features.3.weight", "features.3.bias",
                          "classifier.weight", "classifier.bias"};
    CHECK(ps && ps->n == 8, "n %d", ps ? ps->n : -1);
    for (int i = 0; ps && i < ps->n && i < 8; i++)
        CHECK(!strcmp(ps->names[i], want[i]), "param %d: %s, expected %s", i, ps->names[i],
              want[i]);
    CHECK(ps && tdm_module_find(model, "features.3.bias") == ps->params[5], "find");
    tdm_bufferset *bs = tdm_module_buffers(model);
    CHECK(bs && bs->n == 3, "buffers %d", bs ? bs->n : -1);
    if (bs && bs->n == 3) {
        CHECK(!strcmp(bs->names[0], "features.1.running_mean"), "%s", bs->names[0]);
        CHECK(!strcmp(bs->names[2], "features.1.num_batches_tracked"), "%s", bs->names[2]);
        CHECK(bs->buffers[2]->dtype == TDM_I64 && bs->buffers[2]->ndim == 0,
              "num_batches_tracked must be an i64 scalar");
        CHECK(tdm_module_find(model, "features.1.running_var") == bs->buffers[1], "find buf");
    }
    CHECK(tdm_module_buffers(model) == bs && tdm_module_parameters(model) == ps, "same sets");
    tdm_module_free(model);
}

static void test_flat_buffer(void) {
    tdm_rng r = tdm_rng_make(2);
    tdm_module *mods[2] = {tdm_linear_new(5, 4, true, tdm_cpu(0), &r),
                           tdm_linear_new(4, 3, true, tdm_cpu(0), &r)};
    tdm_module *seq = tdm_sequential_new(2, mods);
    /* values before flattening */
    float *before[4];
    for (int i = 0; i < 4; i++)
        before[i] = host_copy(i < 2 ? mods[0]->params[i] : mods[1]->params[i - 2]);
    tdm_tensor *w0 = mods[0]->params[0];
    tdm_paramset *ps = tdm_module_parameters(seq);
    CHECK(ps != NULL, "%s", tdm_last_error());
    if (!ps) return;
    CHECK(ps->params[0] == w0, "parameters keep their headers");
    float *flat = host_copy(ps->flat);
    for (int i = 0; i < ps->n; i++) {
        tdm_tensor *p = ps->params[i];
        CHECK(p->storage == ps->flat->storage, "param %d shares the flat storage", i);
        CHECK(p->grad && p->grad->storage == ps->flat_grad->storage, "grad %d is a view", i);
        CHECK(tdm_is_contiguous(p) && p->offset == ps->flat->offset + ps->offsets[i],
              "param %d offset %lld", i, (long long)p->offset);
        check_tensor_close(p, before[i], 0, 0, "values kept after flattening");
        CHECK(!memcmp(flat + ps->offsets[i], before[i], (size_t)tdm_numel(p) * sizeof(float)),
              "flat holds param %d", i);
        free(before[i]);
    }
    free(flat);
    /* changing the flat buffer changes the parameters */
    tdm_fill_(ps->flat, 0.5f);
    float half[20];
    for (int i = 0; i < 20; i++) half[i] = 0.5f;
    check_tensor_close(ps->params[2], half, 0, 0, "param after filling flat");
    /* backward writes into the flat gradient buffer: d(sum(y))/d(bias of the last layer) is
     * the number of rows */
    tdm_rng rx = tdm_rng_make(3);
    tdm_scope_begin();
    tdm_tensor *x = tdm_randn(TDM_SHAPE(6, 5), 0, 1, tdm_cpu(0), &rx);
    tdm_tensor *loss = tdm_sum_all(tdm_module_forward(seq, x));
    CHECK(loss && tdm_backward(loss) == TDM_OK, "backward: %s", tdm_last_error());
    tdm_scope_end();
    float *g = host_copy(ps->flat_grad);
    for (int j = 0; j < 3; j++) CHECK_CLOSE(g[ps->offsets[3] + j], 6.0, 1e-6, 0);
    float *gw = host_copy(ps->params[2]->grad);
    CHECK(!memcmp(gw, g + ps->offsets[2], 12 * sizeof(float)), "grad view reads flat_grad");
    free(gw);
    free(g);
    tdm_module_free(seq);

    /* a module with a gradient already present keeps it when flattened */
    tdm_module *lin = tdm_linear_new(2, 2, true, tdm_cpu(0), &r);
    tdm_scope_begin();
    tdm_tensor *xi = tdm_ones(TDM_SHAPE(3, 2), TDM_F32, tdm_cpu(0));
    tdm_backward(tdm_sum_all(tdm_module_forward(lin, xi)));
    tdm_scope_end();
    float *gb = host_copy(lin->params[1]->grad);
    ps = tdm_module_parameters(lin);
    CHECK(ps && !memcmp(gb, (float[]){3, 3}, sizeof(float) * 2), "bias grad before");
    if (ps) check_tensor_close(lin->params[1]->grad, gb, 0, 0, "grad carried into flat_grad");
    free(gb);
    tdm_module_free(lin);
}

/* ---- Linear ----------------------------------------------------------------------------- */

static void test_linear_forward(void) {
    tdm_rng r = tdm_rng_make(4);
    tdm_module *lin = tdm_linear_new(3, 2, true, tdm_cpu(0), &r);
    const float w[6] = {1, 2, 3, -1, 0.5f, 0}, b[2] = {0.25f, -2};
    tdm_tensor *wt = tdm_from_data(TDM_SHAPE(2, 3), TDM_F32, tdm_cpu(0), w);
    tdm_tensor *bt = tdm_from_data(TDM_SHAPE(2), TDM_F32, tdm_cpu(0), b);
    tdm_copy_(lin->params[0], wt);
    tdm_copy_(lin->params[1], bt);
    /* x [2, 2, 3]: a 3-D input */
    float x[12], y[8];
    for (int i = 0; i < 12; i++) x[i] = 0.3f * (float)i - 1.0f;
    for (int r0 = 0; r0 < 4; r0++)
        for (int o = 0; o < 2; o++) {
            double s = b[o];
            for (int k = 0; k < 3; k++) s += (double)x[r0 * 3 + k] * w[o * 3 + k];
            y[r0 * 2 + o] = (float)s;
        }
    tdm_scope_begin();
    tdm_tensor *xt = tdm_from_data(TDM_SHAPE(2, 2, 3), TDM_F32, tdm_cpu(0), x);
    tdm_tensor *yt = tdm_module_forward(lin, xt);
    CHECK(yt && yt->ndim == 3 && yt->shape[2] == 2, "linear output shape");
    if (yt) check_tensor_close(yt, y, 1e-6, 1e-6, "linear forward");
    /* no bias, 1-D input */
    tdm_tensor *y1 = tdm_linear(tdm_from_data(TDM_SHAPE(3), TDM_F32, tdm_cpu(0), x), wt, NULL);
    float y1e[2] = {y[0] - b[0], y[1] - b[1]};
    CHECK(y1 && y1->ndim == 1 && y1->shape[0] == 2, "1-D linear shape");
    if (y1) check_tensor_close(y1, y1e, 1e-6, 1e-6, "linear forward 1-D, no bias");
    tdm_scope_end();
    tdm_tensor_free(wt);
    tdm_tensor_free(bt);
    tdm_module_free(lin);
}

static tdm_tensor *fn_linear(tdm_tensor **in, void *ctx) {
    return tdm_linear(in[0], in[1], in[2]);
}
/* x stored [in, rows] and w stored [in, out]: both used through transposed views */
static tdm_tensor *fn_linear_t(tdm_tensor **in, void *ctx) {
    return tdm_linear(tdm_transpose(in[0], 0, 1), tdm_transpose(in[1], 0, 1), in[2]);
}

static void test_linear_grad(void) {
    tdm_tensor *x = gradcheck_input(TDM_SHAPE(3, 4), 10), *w = gradcheck_input(TDM_SHAPE(5, 4), 11),
               *b = gradcheck_input(TDM_SHAPE(5), 12);
    gradcheck("linear 2-D", fn_linear, 3, (tdm_tensor *[]){x, w, b}, NULL, 1e-2, 1e-3, 1e-2);
    tdm_tensor *x3 = gradcheck_input(TDM_SHAPE(2, 3, 4), 13);
    gradcheck("linear 3-D", fn_linear, 3, (tdm_tensor *[]){x3, w, b}, NULL, 1e-2, 1e-3, 1e-2);
    gradcheck("linear no bias", fn_linear, 3, (tdm_tensor *[]){x3, w, NULL}, NULL, 1e-2, 1e-3,
              1e-2);
    tdm_tensor *x1 = gradcheck_input(TDM_SHAPE(4), 14);
    gradcheck("linear 1-D", fn_linear, 3, (tdm_tensor *[]){x1, w, b}, NULL, 1e-2, 1e-3, 1e-2);
    tdm_tensor *xt = gradcheck_input(TDM_SHAPE(4, 3), 15),
               *wt = gradcheck_input(TDM_SHAPE(4, 5), 16);
    gradcheck("linear transposed views", fn_linear_t, 3, (tdm_tensor *[]){xt, wt, b}, NULL, 1e-2,
              1e-3, 1e-2);
    /* only the weight and bias need gradients */
    tdm_requires_grad_(x, false);
    gradcheck("linear weight only", fn_linear, 3, (tdm_tensor *[]){x, w, b}, NULL, 1e-2, 1e-3,
              1e-2);
    /* and only the bias (the kernel's bias-only path) */
    tdm_requires_grad_(w, false);
    gradcheck("linear bias only", fn_linear, 3, (tdm_tensor *[]){x, w, b}, NULL, 1e-2, 1e-3, 1e-2);
    tdm_tensor *all[] = {x, w, b, x3, x1, xt, wt};
    for (int i = 0; i < 7; i++) tdm_tensor_free(all[i]);
}

static tdm_tensor *fn_linear_gelu(tdm_tensor **in, void *ctx) {
    (void)ctx;
    return tdm_linear_gelu(in[0], in[1], in[2]);
}
static tdm_tensor *fn_linear_then_gelu(tdm_tensor **in, void *ctx) {
    (void)ctx;
    return tdm_gelu(tdm_linear(in[0], in[1], in[2]), true);
}

static tdm_tensor *fn_linear_gelu_linear(tdm_tensor **in, void *ctx) {
    (void)ctx;
    return tdm_linear_gelu_linear(in[0], in[1], in[2], in[3], in[4]);
}
static tdm_tensor *fn_linear_gelu_then_linear(tdm_tensor **in, void *ctx) {
    (void)ctx;
    return tdm_linear(tdm_linear_gelu(in[0], in[1], in[2]), in[3], in[4]);
}
static tdm_tensor *fn_linear_gelu_linear_no_b2(tdm_tensor **in, void *ctx) {
    (void)ctx;
    return tdm_linear_gelu_linear(in[0], in[1], in[2], in[3], NULL);
}

/* Forward and gradients of the n inputs through fn (the caller's scope). */
static tdm_tensor *grads_run(gradcheck_fn fn, int n, tdm_tensor **in, tdm_tensor **g) {
    for (int i = 0; i < n; i++) tdm_zero_grad(in[i]);
    tdm_tensor *y = fn(in, NULL);
    int rc = y ? tdm_backward(tdm_sum_all(tdm_mul(y, y))) : -1;
    for (int i = 0; i < n; i++) g[i] = rc ? NULL : tdm_clone(in[i]->grad);
    return y;
}

/* fn and ref's outputs and gradients of the n inputs the same bits. */
static void check_same_run(const char *what, gradcheck_fn fn, gradcheck_fn ref, int n,
                           tdm_tensor **in) {
    tdm_tensor *g1[5], *g2[5];
    tdm_tensor *y1 = grads_run(fn, n, in, g1), *y2 = grads_run(ref, n, in, g2);
    CHECK(y1 && y2 && tdm_numel(y1) == tdm_numel(y2) &&
              !memcmp(tdm_data_ptr(y1), tdm_data_ptr(y2), sizeof(float) * (size_t)tdm_numel(y1)),
          "%s: the forward differs on the CPU", what);
    for (int i = 0; i < n; i++)
        CHECK(g1[i] && g2[i] &&
                  !memcmp(tdm_data_ptr(g1[i]), tdm_data_ptr(g2[i]),
                          sizeof(float) * (size_t)tdm_numel(in[i])),
              "%s: gradient %d differs on the CPU", what, i);
}

/* tdm_linear_gelu_linear: gradchecks (with and without the second bias, the first's input not
 * needing a gradient); on the CPU the bits of tdm_linear_gelu then tdm_linear; operands that
 * do not chain refused naming them. */
static void test_linear_gelu_linear(void) {
    tdm_tensor *in[5] = {gradcheck_input(TDM_SHAPE(2, 3, 4), 23),
                         gradcheck_input(TDM_SHAPE(8, 4), 24), gradcheck_input(TDM_SHAPE(8), 25),
                         gradcheck_input(TDM_SHAPE(5, 8), 26), gradcheck_input(TDM_SHAPE(5), 27)};
    gradcheck("linear_gelu_linear", fn_linear_gelu_linear, 5, in, NULL, 1e-2, 1e-3, 1e-2);
    gradcheck("linear_gelu_linear without b2", fn_linear_gelu_linear_no_b2, 4, in, NULL, 1e-2, 1e-3,
              1e-2);
    tdm_scope_begin();
    check_same_run("linear_gelu_linear against linear_gelu then linear", fn_linear_gelu_linear,
                   fn_linear_gelu_then_linear, 5, in);
    tdm_requires_grad_(in[0], false); /* the weights' gradients alone */
    check_same_run("linear_gelu_linear, x without a gradient", fn_linear_gelu_linear,
                   fn_linear_gelu_then_linear, 5, in);
    tdm_tensor *w_bad = tdm_zeros(TDM_SHAPE(5, 7), TDM_F32, tdm_cpu(0));
    CHECK(!tdm_linear_gelu_linear(in[0], in[1], in[2], w_bad, in[4]) &&
              strstr(tdm_last_error(), "in_features 7"),
          "linear_gelu_linear with a second weight of 7 inputs for 8: %s", tdm_last_error());
    tdm_clear_error(); /* a NULL operand keeps an earlier error, which may have made it */
    CHECK(!tdm_linear_gelu_linear(in[0], in[1], NULL, in[3], in[4]) &&
              strstr(tdm_last_error(), "first bias is NULL"),
          "linear_gelu_linear without its first bias: %s", tdm_last_error());
    tdm_scope_end();
    for (int i = 0; i < 5; i++) tdm_tensor_free(in[i]);
}

/* tdm_linear_gelu: gradcheck; on the CPU the bits of tdm_linear then tanh tdm_gelu (the same
 * kernels), forward and gradients; a NULL bias refused. */
static void test_linear_gelu(void) {
    tdm_tensor *x = gradcheck_input(TDM_SHAPE(2, 3, 4), 20),
               *w = gradcheck_input(TDM_SHAPE(5, 4), 21), *b = gradcheck_input(TDM_SHAPE(5), 22);
    tdm_tensor *in[3] = {x, w, b};
    gradcheck("linear_gelu", fn_linear_gelu, 3, in, NULL, 1e-2, 1e-3, 1e-2);
    tdm_scope_begin();
    check_same_run("linear_gelu against linear then gelu", fn_linear_gelu, fn_linear_then_gelu, 3,
                   in);
    CHECK(!tdm_linear_gelu(x, w, NULL) && strstr(tdm_last_error(), "bias"),
          "linear_gelu without a bias: %s", tdm_last_error());
    tdm_scope_end();
    for (int i = 0; i < 3; i++) tdm_tensor_free(in[i]);
}

/* Sequential runs ReLU -> MaxPool2d as MaxPool2d -> ReLU (sequential_forward): outputs and
 * input gradients must be bit for bit those of the literal order, with negative windows,
 * zeros and ties in the input, for plain, padded and ceil-mode pooling. */
static void relu_pool_run(bool module, const tdm_pool2d_opts *po, const float *xd, float *y,
                          float *gx, int64_t *ny) {
    tdm_scope_begin();
    tdm_tensor *x = tdm_from_data(TDM_SHAPE(2, 3, 7, 7), TDM_F32, tdm_cpu(0), xd);
    tdm_requires_grad_(x, true);
    tdm_module *l[2] = {tdm_relu_new(), tdm_max_pool2d_new(po)};
    tdm_module *seq = module ? tdm_sequential_new(2, l) : NULL;
    tdm_tensor *out = module ? tdm_module_forward(seq, x) : tdm_max_pool2d(tdm_relu(x), po);
    *ny = out ? tdm_numel(out) : 0;
    tdm_rng r = tdm_rng_make(5);
    tdm_tensor *w = out ? tdm_randn(tdm_shape_of(out), 0, 1, tdm_cpu(0), &r) : NULL;
    CHECK(out && tdm_backward(tdm_sum_all(tdm_mul(out, w))) == 0, "relu/pool: %s",
          tdm_last_error());
    if (out) tdm_to_host(out, y, sizeof(float) * (size_t)*ny);
    if (x->grad) tdm_to_host(x->grad, gx, sizeof(float) * 2 * 3 * 7 * 7);
    if (seq)
        tdm_module_free(seq);
    else
        for (int i = 0; i < 2; i++) tdm_module_free(l[i]);
    tdm_tensor_free(x->grad);
    tdm_scope_end();
}

static void test_relu_pool_order(void) {
    enum { N = 2 * 3 * 7 * 7 };
    static const float levels[5] = {-2.0f, -1.0f, 0.0f, 0.5f, 1.0f};
    float xd[N];
    for (int i = 0; i < N; i++) xd[i] = levels[(i * 7 + i / 5) % 5];
    xd[0] = xd[1] = xd[7] = xd[8] = -1.0f; /* an all-negative 2x2 window */
    tdm_pool2d_opts opts[3] = {
        {.kernel_h = 2, .kernel_w = 2},
        {.kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1},
        {.kernel_h = 2, .kernel_w = 2, .ceil_mode = true}};
    for (int k = 0; k < 3; k++) {
        float y[2][N], gx[2][N];
        int64_t ny[2];
        memset(gx, 0, sizeof gx);
        for (int m = 0; m < 2; m++) relu_pool_run(m == 1, &opts[k], xd, y[m], gx[m], &ny[m]);
        CHECK(ny[0] == ny[1] && ny[0] > 0, "case %d: %lld vs %lld outputs", k, (long long)ny[0],
              (long long)ny[1]);
        CHECK(memcmp(y[0], y[1], sizeof(float) * (size_t)ny[0]) == 0, "case %d: outputs differ", k);
        CHECK(memcmp(gx[0], gx[1], sizeof gx[0]) == 0, "case %d: input gradients differ", k);
    }
}

/* ---- train / eval ----------------------------------------------------------------------- */

static void test_train_eval(void) {
    tdm_rng r = tdm_rng_make(5);
    tdm_module *inner[2] = {tdm_dropout_new(0.5f, &r),
                            tdm_batch_norm1d_new(3, 1e-5f, 0.1f, tdm_cpu(0))};
    tdm_module *mods[2] = {tdm_linear_new(3, 3, true, tdm_cpu(0), &r),
                           tdm_sequential_new(2, inner)};
    tdm_module *seq = tdm_sequential_new(2, mods);
    CHECK(seq->training && inner[0]->training && inner[1]->training, "training by default");
    tdm_module_train(seq, false);
    CHECK(!seq->training && !mods[1]->training && !inner[0]->training && !inner[1]->training,
          "eval reaches every descendant");
    /* eval: dropout is the identity and batch norm does not count batches */
    tdm_scope_begin();
    tdm_tensor *x = tdm_randn(TDM_SHAPE(4, 3), 0, 1, tdm_cpu(0), &r);
    tdm_tensor *y = tdm_module_forward(inner[0], x);
    float *xv = host_copy(x);
    CHECK(y != NULL, "%s", tdm_last_error());
    if (y) check_tensor_close(y, xv, 0, 0, "dropout in eval is the identity");
    free(xv);
    CHECK(tdm_module_forward(seq, x) != NULL, "eval forward: %s", tdm_last_error());
    tdm_tensor *nbt = tdm_module_find(seq, "1.1.num_batches_tracked");
    CHECK(nbt && tdm_item(nbt) == 0, "no batch counted in eval");
    tdm_module_train(seq, true);
    CHECK(tdm_module_forward(seq, x) && tdm_module_forward(seq, x), "train forward: %s",
          tdm_last_error());
    CHECK(nbt && tdm_item(nbt) == 2, "two batches counted, got %g", nbt ? tdm_item(nbt) : -1);
    /* running_mean moved towards the batch mean with momentum 0.1 */
    tdm_tensor *rm = tdm_module_find(seq, "1.1.running_mean");
    float *rmv = rm ? host_copy(rm) : NULL;
    CHECK(rmv && (rmv[0] != 0 || rmv[1] != 0), "running_mean updated in training");
    free(rmv);
    tdm_scope_end();
    tdm_module_free(seq);
}

/* momentum NAN is PyTorch's momentum=None: running stats are the plain average of the batch
 * statistics (factor 1/num_batches_tracked). */
static void test_batch_norm_cumulative(void) {
    tdm_module *bn = tdm_batch_norm1d_new(2, 1e-5f, NAN, tdm_cpu(0));
    CHECK(bn != NULL, "%s", tdm_last_error());
    if (!bn) return;
    const float x1[6] = {1, 10, 2, 20, 3, 30}, x2[6] = {-1, 0, -3, 4, -5, 8};
    tdm_scope_begin();
    CHECK(tdm_module_forward(bn, tdm_from_data(TDM_SHAPE(3, 2), TDM_F32, tdm_cpu(0), x1)) &&
              tdm_module_forward(bn, tdm_from_data(TDM_SHAPE(3, 2), TDM_F32, tdm_cpu(0), x2)),
          "%s", tdm_last_error());
    tdm_scope_end();
    /* batch means (2, 20) and (-3, 4): their average */
    float expect[2] = {(2.0f - 3.0f) / 2, (20.0f + 4.0f) / 2};
    check_tensor_close(tdm_module_find(bn, "running_mean"), expect, 1e-5, 1e-5,
                       "cumulative running_mean");
    tdm_module_free(bn);
}

/* ---- initialisation --------------------------------------------------------------------- */

static void check_init(const tdm_tensor *t, const initf_stats *f) {
    int64_t n = tdm_numel(t);
    CHECK(n == f->numel, "%s: numel %lld, torch %lld", f->name, (long long)n, (long long)f->numel);
    float *v = host_copy(t);
    double lo = INFINITY, hi = -INFINITY, s = 0, s2 = 0;
    for (int64_t i = 0; i < n; i++) {
        lo = fmin(lo, v[i]);
        hi = fmax(hi, v[i]);
        s += v[i];
    }
    double mean = s / (double)n;
    for (int64_t i = 0; i < n; i++) s2 += (v[i] - mean) * (v[i] - mean);
    double std = sqrt(s2 / (double)(n - 1));
    free(v);
    /* expected moments: U(-b, b) has std b/sqrt(3); N(0, 1) std 1 */
    double sigma = f->bound > 0 ? f->bound / sqrt(3.0) : 1.0;
    double se_mean = sigma / sqrt((double)n), se_std = sigma / sqrt(2.0 * (double)n);
    if (f->bound > 0) {
        float b = (float)f->bound;
        CHECK(lo >= -b && hi <= b, "%s: range [%g, %g] outside torch's bound %g", f->name, lo, hi,
              f->bound);
        /* n uniform draws come within bound*6/n of each end with probability > 1 - 2e-3 */
        double slack = f->bound * fmax(6.0 / (double)n, 1e-3) * 2;
        if (n >= 1000)
            CHECK(lo < -b + slack && hi > b - slack, "%s: range [%g, %g] too narrow for %g",
                  f->name, lo, hi, f->bound);
    } else {
        CHECK(lo < -3 && hi > 3, "%s: N(0,1) range [%g, %g] too narrow", f->name, lo, hi);
    }
    CHECK(fabs(mean) < 5 * se_mean, "%s: mean %g (torch %g), sampling error %g", f->name, mean,
          f->mean, se_mean);
    CHECK(fabs(std - sigma) < 5 * se_std + 1e-3 * sigma, "%s: std %g, expected %g (torch %g)",
          f->name, std, sigma, f->std);
    CHECK(fabs(f->std - sigma) < 5 * se_std + 1e-3 * sigma, "%s: fixture std %g vs %g", f->name,
          f->std, sigma);
}

static void test_init(void) {
    tdm_rng r = tdm_rng_make(6);
    tdm_module *lin = tdm_linear_new(784, 256, true, tdm_cpu(0), &r);
    tdm_module *conv = tdm_conv2d_new(32, 64, 3, 3, NULL, true, tdm_cpu(0), &r);
    tdm_module *emb = tdm_embedding_new(1000, 64, tdm_cpu(0), &r);
    CHECK(lin && conv && emb, "constructors: %s", tdm_last_error());
    if (!lin || !conv || !emb) return;
    check_init(lin->params[0], &initf[0]);
    check_init(lin->params[1], &initf[1]);
    check_init(conv->params[0], &initf[2]);
    check_init(conv->params[1], &initf[3]);
    check_init(emb->params[0], &initf[4]);
    CHECK(conv->params[0]->ndim == 4 && conv->params[0]->shape[1] == 32 &&
              conv->params[0]->shape[3] == 3,
          "conv weight shape");
    /* the same seed gives the same weights; another seed others */
    tdm_rng r1 = tdm_rng_make(7), r2 = tdm_rng_make(7), r3 = tdm_rng_make(8);
    tdm_module *a = tdm_linear_new(4, 4, true, tdm_cpu(0), &r1);
    tdm_module *b = tdm_linear_new(4, 4, true, tdm_cpu(0), &r2);
    tdm_module *c = tdm_linear_new(4, 4, true, tdm_cpu(0), &r3);
    float *va = host_copy(a->params[0]), *vb = host_copy(b->params[0]),
          *vc = host_copy(c->params[0]);
    CHECK(!memcmp(va, vb, 16 * sizeof(float)), "same seed, same init");
    CHECK(memcmp(va, vc, 16 * sizeof(float)), "other seed, other init");
    free(va), free(vb), free(vc);
    /* BatchNorm / LayerNorm: weight 1, bias 0, running stats 0 and 1 */
    tdm_module *bn = tdm_batch_norm2d_new(3, 1e-5f, 0.1f, tdm_cpu(0));
    tdm_module *ln = tdm_layer_norm_new(3, 1e-5f, true, tdm_cpu(0));
    float one[3] = {1, 1, 1}, zero[3] = {0, 0, 0};
    check_tensor_close(tdm_module_find(bn, "weight"), one, 0, 0, "bn weight");
    check_tensor_close(tdm_module_find(bn, "bias"), zero, 0, 0, "bn bias");
    check_tensor_close(tdm_module_find(bn, "running_mean"), zero, 0, 0, "bn running_mean");
    check_tensor_close(tdm_module_find(bn, "running_var"), one, 0, 0, "bn running_var");
    check_tensor_close(tdm_module_find(ln, "weight"), one, 0, 0, "ln weight");
    tdm_module *ln2 = tdm_layer_norm_new(3, 1e-5f, false, tdm_cpu(0));
    CHECK(ln2 && ln2->n_params == 0, "LayerNorm without affine has no parameters");
    tdm_module *all[] = {lin, conv, emb, a, b, c, bn, ln, ln2};
    for (int i = 0; i < 9; i++) tdm_module_free(all[i]);
}

/* ---- errors ----------------------------------------------------------------------------- */

static void test_errors(void) {
    tdm_rng r = tdm_rng_make(9);
    CHECK_ERROR(tdm_linear_new(0, 3, true, tdm_cpu(0), &r) == NULL, "Linear");
    CHECK_ERROR(tdm_conv2d_new(3, 4, 3, 3, &(tdm_conv2d_opts){.groups = 2}, true, tdm_cpu(0), &r) ==
                    NULL,
                "groups 2");
    CHECK_ERROR(tdm_dropout_new(1.5f, NULL) == NULL, "Dropout: probability 1.5");
    CHECK_ERROR(tdm_batch_norm2d_new(0, 1e-5f, 0.1f, tdm_cpu(0)) == NULL, "BatchNorm2d");
    CHECK_ERROR(tdm_max_pool2d_new(&(tdm_pool2d_opts){.kernel_h = 0, .kernel_w = 2}) == NULL,
                "MaxPool2d");
    /* a failed child makes Sequential fail and frees the others */
    tdm_module *mods[2] = {tdm_relu_new(), tdm_linear_new(-1, 2, true, tdm_cpu(0), &r)};
    CHECK_ERROR(tdm_sequential_new(2, mods) == NULL, "Linear: sizes must be positive");

    tdm_module *lin = tdm_linear_new(4, 3, true, tdm_cpu(0), &r);
    tdm_scope_begin();
    tdm_tensor *x = tdm_zeros(TDM_SHAPE(2, 5), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(tdm_module_forward(lin, x) == NULL, "linear: input [2, 5]");
    tdm_tensor *w = tdm_zeros(TDM_SHAPE(3, 5), TDM_F32, tdm_cpu(0));
    tdm_tensor *b = tdm_zeros(TDM_SHAPE(4), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(tdm_linear(x, w, b) == NULL, "linear: bias [4]");
    tdm_tensor *xi = tdm_zeros(TDM_SHAPE(2, 5), TDM_I64, tdm_cpu(0));
    CHECK_ERROR(tdm_linear(xi, w, NULL) == NULL, "linear");
    CHECK_ERROR(tdm_linear(NULL, w, NULL) == NULL, "linear: input is NULL");
    /* BatchNorm2d wants 4-D */
    tdm_module *bn = tdm_batch_norm2d_new(5, 1e-5f, 0.1f, tdm_cpu(0));
    CHECK_ERROR(tdm_module_forward(bn, x) == NULL, "BatchNorm2d: expected a 4D input, got [2, 5]");
    tdm_scope_end();
    /* duplicate names, adding after flattening */
    tdm_tensor *extra = tdm_zeros(TDM_SHAPE(2), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(tdm_module_add_param(lin, "bias", extra) != TDM_OK, "already has a member named");
    tdm_module_parameters(lin);
    CHECK_ERROR(tdm_module_add_param(lin, "extra", extra) != TDM_OK, "after module_parameters");
    CHECK_ERROR(tdm_module_add_param(lin, "a.b", extra) != TDM_OK, "invalid name");
    tdm_tensor_free(extra);
    /* parameters on two devices */
    tdm_module *pair[2] = {tdm_linear_new(2, 2, true, tdm_cpu(0), &r),
                           tdm_linear_new(2, 2, true, tdm_cpu(1), &r)};
    tdm_module *seq = tdm_sequential_new(2, pair);
    CHECK_ERROR(tdm_module_parameters(seq) == NULL, "all parameters must be on one device");
    /* flattening a child first, then its parent */
    tdm_module *kids[1] = {tdm_linear_new(2, 2, true, tdm_cpu(0), &r)};
    tdm_module *parent = tdm_sequential_new(1, kids);
    tdm_module_parameters(kids[0]);
    CHECK_ERROR(tdm_module_parameters(parent) == NULL, "root only");
    CHECK_ERROR(tdm_module_parameters(NULL) == NULL, "module is NULL");
    tdm_module_free(parent);
    tdm_module_free(seq);
    tdm_module_free(bn);
    tdm_module_free(lin);
}

/* Modules built while a step scope is open are still caller-owned and outlive it. */
static void test_built_in_scope(void) {
    tdm_rng r = tdm_rng_make(10);
    tdm_scope_begin();
    tdm_module *lin = tdm_linear_new(3, 2, true, tdm_cpu(0), &r);
    tdm_paramset *ps = tdm_module_parameters(lin);
    tdm_scope_end();
    CHECK(lin && ps && !tdm_book(lin->params[0])->owner && !tdm_book(ps->flat)->owner &&
              !tdm_book(ps->params[1]->grad)->owner,
          "module tensors are caller-owned");
    tdm_scope_begin();
    tdm_tensor *y = tdm_module_forward(lin, tdm_ones(TDM_SHAPE(2, 3), TDM_F32, tdm_cpu(0)));
    CHECK(y && tdm_backward(tdm_sum_all(y)) == TDM_OK, "%s", tdm_last_error());
    tdm_scope_end();
    float two[2] = {2, 2};
    check_tensor_close(ps->params[1]->grad, two, 0, 0, "bias grad of a scope-built module");
    tdm_module_free(lin);
}

/* cnn-bn has the state_dict of its nn.Sequential in PyTorch (bench/torch_recipe.py): the
 * same names, shapes and buffers, and maps [N, 1, 28, 28] to logits [N, 10]. */
static void test_cnn_bn(void) {
    tdm_rng r = tdm_rng_make(3);
    tdm_module *m = tdm_model_new("cnn-bn", tdm_cpu(0), &r);
    CHECK(m != NULL, "cnn-bn: %s", tdm_last_error());
    if (!m) return;
    const char *names[] = {"0.weight", "2.weight", "2.bias", "4.weight",  "6.weight",
                           "6.bias",   "9.weight", "9.bias", "11.weight", "11.bias"};
    const int64_t numel[] = {16 * 9, 16, 16, 32 * 16 * 9, 32, 32, 256 * 1568, 256, 2560, 10};
    tdm_paramset *ps = tdm_module_parameters(m);
    CHECK(ps && ps->n == 10, "cnn-bn: %d parameters", ps ? ps->n : -1);
    for (int i = 0; ps && i < ps->n && i < 10; i++)
        CHECK(!strcmp(ps->names[i], names[i]) && tdm_numel(ps->params[i]) == numel[i],
              "cnn-bn parameter %d: %s of %lld, want %s of %lld", i, ps->names[i],
              (long long)tdm_numel(ps->params[i]), names[i], (long long)numel[i]);
    tdm_bufferset *bs = tdm_module_buffers(m);
    CHECK(bs && bs->n == 6 && !strcmp(bs->names[0], "2.running_mean") &&
              !strcmp(bs->names[5], "6.num_batches_tracked"),
          "cnn-bn buffers: %d, %s ... %s", bs ? bs->n : -1, bs ? bs->names[0] : "",
          bs && bs->n ? bs->names[bs->n - 1] : "");
    tdm_scope_begin();
    tdm_tensor *y = tdm_module_forward(m, tdm_randn(TDM_SHAPE(3, 1, 28, 28), 0, 1, tdm_cpu(0), &r));
    CHECK(y && y->ndim == 2 && y->shape[0] == 3 && y->shape[1] == 10, "cnn-bn output: %s",
          tdm_last_error());
    tdm_scope_end();
    tdm_module_free(m);
}

int main(void) {
    test_names();
    test_cnn_bn();
    test_flat_buffer();
    test_linear_forward();
    test_linear_grad();
    test_linear_gelu();
    test_linear_gelu_linear();
    test_relu_pool_order();
    test_train_eval();
    test_batch_norm_cumulative();
    test_init();
    test_errors();
    test_built_in_scope();
    return check_summary();
}
