/* Trains an MLP (784-256-128-10) on Fashion-MNIST with SGD + momentum on one CPU device and
 * reports test accuracy after each epoch: the smallest real training the core library does.
 *
 *   train_mlp [DATA_DIR] [EPOCHS]     (default /usr/share/datasets/fashion-mnist, 1)
 *
 * The IDX reader here is deliberately small; the library's datasets and DataLoader (with
 * validation, shuffling workers and augmentation) replace it in `tandem train`. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zlib.h>

#include "tandem/tandem.h"

typedef struct {
    int64_t n, rows, cols;
    uint8_t *pixels; /* [n, rows*cols] */
    uint8_t *labels; /* [n] */
} dataset;

static uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Reads a gzipped IDX file whole; checks its magic and that the payload matches the dims. */
static uint8_t *idx_read(const char *path, uint32_t magic, int ndim, int64_t *dims) {
    gzFile f = gzopen(path, "rb");
    if (!f) {
        fprintf(stderr, "error: cannot open %s\n", path);
        return NULL;
    }
    uint8_t head[16];
    int hn = 4 + 4 * ndim;
    if (gzread(f, head, (unsigned)hn) != hn || be32(head) != magic) {
        fprintf(stderr, "error: %s: not an IDX file with magic 0x%08x\n", path, magic);
        gzclose(f);
        return NULL;
    }
    int64_t total = 1;
    for (int i = 0; i < ndim; i++) total *= (dims[i] = be32(head + 4 + 4 * i));
    if (total <= 0 || total > ((int64_t)1 << 32)) {
        fprintf(stderr, "error: %s: implausible dimensions\n", path);
        gzclose(f);
        return NULL;
    }
    uint8_t *data = malloc((size_t)total);
    if (!data || gzread(f, data, (unsigned)total) != total) {
        fprintf(stderr, "error: %s: truncated (expected %lld bytes of data)\n", path,
                (long long)total);
        free(data);
        data = NULL;
    }
    gzclose(f);
    return data;
}

static int dataset_load(dataset *d, const char *dir, const char *split) {
    char p[1024];
    int64_t idims[3], ldims[1];
    snprintf(p, sizeof p, "%s/%s-images-idx3-ubyte.gz", dir, split);
    d->pixels = idx_read(p, 0x803, 3, idims);
    snprintf(p, sizeof p, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    d->labels = idx_read(p, 0x801, 1, ldims);
    if (!d->pixels || !d->labels) return -1;
    if (ldims[0] != idims[0]) {
        fprintf(stderr, "error: %s: %lld images but %lld labels\n", split, (long long)idims[0],
                (long long)ldims[0]);
        return -1;
    }
    d->n = idims[0], d->rows = idims[1], d->cols = idims[2];
    return 0;
}

/* Fills x [B, 784] (pixels scaled to [0, 1]) and y [B] with samples order[at .. at+B). */
static void batch_fill(const dataset *d, const int64_t *order, int64_t at, int64_t b, float *x,
                       int64_t *y) {
    int64_t px = d->rows * d->cols;
    for (int64_t i = 0; i < b; i++) {
        const uint8_t *src = d->pixels + order[at + i] * px;
        for (int64_t j = 0; j < px; j++) x[i * px + j] = src[j] * (1.0f / 255.0f);
        y[i] = d->labels[order[at + i]];
    }
}

/* Fisher-Yates with a Philox stream, so the order depends only on (seed, epoch). */
static void shuffle(int64_t *order, int64_t n, uint64_t seed, int epoch) {
    for (int64_t i = 0; i < n; i++) order[i] = i;
    for (int64_t i = n - 1; i > 0; i--) {
        uint32_t w[4];
        tdm_philox(seed, (uint64_t)i, (uint64_t)epoch, w);
        int64_t j = (int64_t)((((uint64_t)w[0] << 32) | w[1]) % (uint64_t)(i + 1));
        int64_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

#define TRY(x)                                                                                     \
    do {                                                                                           \
        if (!(x)) {                                                                                \
            fprintf(stderr, "error: %s\n", tdm_last_error());                                      \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* Test-set loss and accuracy, in eval mode without autograd. */
static int evaluate(tdm_module *model, const dataset *d, float *x, int64_t *y, int64_t *order,
                    double *loss, double *acc) {
    const int64_t B = 1000;
    tdm_ce_opts sum = tdm_ce_defaults();
    sum.reduction = TDM_REDUCE_SUM;
    int64_t correct = 0;
    double total = 0;
    for (int64_t i = 0; i < d->n; i++) order[i] = i;
    tdm_module_train(model, false);
    bool prev = tdm_set_grad_enabled(false);
    for (int64_t at = 0; at < d->n; at += B) {
        int64_t b = d->n - at < B ? d->n - at : B;
        batch_fill(d, order, at, b, x, y);
        tdm_scope_begin();
        tdm_tensor *xt = tdm_from_data(TDM_SHAPE(b, 784), TDM_F32, tdm_cpu(0), x);
        tdm_tensor *yt = tdm_from_data(TDM_SHAPE(b), TDM_I64, tdm_cpu(0), y);
        tdm_tensor *logits = tdm_module_forward(model, xt), *pred;
        tdm_tensor *l = tdm_cross_entropy(logits, yt, &sum);
        TRY(l && tdm_max(logits, 1, false, &pred));
        int64_t p[1000];
        tdm_to_host(pred, p, sizeof(int64_t) * (size_t)b);
        for (int64_t i = 0; i < b; i++) correct += p[i] == y[i];
        total += tdm_item(l);
        tdm_scope_end();
    }
    tdm_set_grad_enabled(prev);
    tdm_module_train(model, true);
    *loss = total / (double)d->n;
    *acc = (double)correct / (double)d->n;
    return 0;
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "/usr/share/datasets/fashion-mnist";
    int epochs = argc > 2 ? atoi(argv[2]) : 1;
    const int64_t B = 64;
    dataset train, test;
    if (dataset_load(&train, dir, "train") || dataset_load(&test, dir, "t10k")) return 1;

    tdm_device dev = tdm_cpu(0);
    tdm_rng init = tdm_rng_make(42);
    tdm_module *layers[5] = {tdm_linear_new(784, 256, true, dev, &init), tdm_relu_new(),
                             tdm_linear_new(256, 128, true, dev, &init), tdm_relu_new(),
                             tdm_linear_new(128, 10, true, dev, &init)};
    tdm_module *model = tdm_sequential_new(5, layers);
    TRY(model);
    tdm_paramset *ps = tdm_module_parameters(model);
    TRY(ps);
    tdm_sgd_opts so = tdm_sgd_defaults(0.1f);
    so.momentum = 0.9f;
    tdm_optim *opt = tdm_sgd_new(ps, &so);
    TRY(opt);
    printf("mlp 784-256-128-10 (%lld parameters) on cpu:0, SGD lr 0.1 momentum 0.9, batch %lld\n",
           (long long)ps->total, (long long)B);

    float *x = malloc(sizeof(float) * 1000 * 784);
    int64_t *y = malloc(sizeof(int64_t) * 1000);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)train.n);
    for (int epoch = 0; epoch < epochs; epoch++) {
        shuffle(order, train.n, 1234, epoch);
        double t0 = now(), loss_sum = 0;
        int64_t steps = train.n / B;
        for (int64_t s = 0; s < steps; s++) {
            batch_fill(&train, order, s * B, B, x, y);
            tdm_scope_begin();
            tdm_tensor *xt = tdm_from_data(TDM_SHAPE(B, 784), TDM_F32, dev, x);
            tdm_tensor *yt = tdm_from_data(TDM_SHAPE(B), TDM_I64, dev, y);
            tdm_tensor *loss = tdm_cross_entropy(tdm_module_forward(model, xt), yt, NULL);
            TRY(loss && tdm_optim_zero_grad(opt) == 0 && tdm_backward(loss) == 0 &&
                tdm_optim_step(opt) == 0);
            loss_sum += tdm_item(loss);
            tdm_scope_end();
            if ((s + 1) % 100 == 0 || s + 1 == steps)
                printf("\repoch %d  step %4lld/%lld  loss %.4f  %.0f img/s", epoch + 1,
                       (long long)s + 1, (long long)steps, loss_sum / (double)(s + 1),
                       (double)(s + 1) * (double)B / (now() - t0));
            fflush(stdout);
        }
        double tl, ta;
        if (evaluate(model, &test, x, y, order, &tl, &ta)) return 1;
        printf("\nepoch %d: train loss %.4f  test loss %.4f  test accuracy %.4f  (%.1f s)\n",
               epoch + 1, loss_sum / (double)steps, tl, ta, now() - t0);
    }
    free(x), free(y), free(order);
    free(train.pixels), free(train.labels), free(test.pixels), free(test.labels);
    tdm_optim_free(opt);
    tdm_module_free(model);
    return 0;
}
