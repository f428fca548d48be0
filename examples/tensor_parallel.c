/* Tensor parallelism two ways, on two CPU devices (cpu:0 and cpu:1):
 *
 *  1. A model of one's own from the tensor-parallel layers, under tdm_spawn: every rank builds
 *     the same MLP (a column-parallel Linear, ReLU, a row-parallel Linear) from the same
 *     generator state, keeping half of each matrix, and steps its own optimizer over its half;
 *     the layers' collectives join the ranks, so each gets the one-device model's loss.
 *  2. A GPT split by tdm_gpt_parallelize, under tdm_strategy_tensor_parallel: the library runs
 *     one thread per device, splits a clone of the model on each (sequence and vocabulary
 *     parallel too), and gathers the trained weights back into the whole model.
 *
 * Each part trains the same model on one device alongside and exits 1 if a step's loss
 * differs by more than 1e-4 (float rounding: the row-parallel layers add their partial products
 * in another order).
 *   tensor_parallel */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "tandem/tandem.h"

#define STEPS 5
#define BOUND 1e-4f

/* ---- 1. an MLP of the tensor-parallel layers ---------------------------------------------- */

#define IN   16
#define HID  64 /* split over the ranks: 32 each */
#define OUT  4
#define ROWS 8

/* The same batch for every rank and for the one-device model: inputs and class targets. */
static void batch(int step, float *x, int64_t *y) {
    for (int i = 0; i < ROWS * IN; i++) x[i] = sinf(0.37f * (float)(i + 13 * step));
    for (int i = 0; i < ROWS; i++) y[i] = (i + step) % OUT;
}

/* fc1 and fc2 (tensor-parallel over tp, or whole when tp is NULL) trained STEPS steps of SGD;
 * each step's loss into loss[]. */
static int train_mlp(tdm_module *fc1, tdm_module *fc2, tdm_device dev, float *loss) {
    tdm_module *m = tdm_sequential_new(3, (tdm_module *[]){fc1, tdm_relu_new(), fc2});
    tdm_sgd_opts so = tdm_sgd_defaults(0.1f);
    tdm_optim *opt = m ? tdm_sgd_new(tdm_module_parameters(m), &so) : NULL;
    int rc = opt ? TDM_OK : tdm_last_status();
    for (int s = 0; s < STEPS && !rc; s++) {
        float x[ROWS * IN];
        int64_t y[ROWS];
        batch(s, x, y);
        tdm_scope_begin();
        tdm_tensor *xt = tdm_from_data(TDM_SHAPE(ROWS, IN), TDM_F32, dev, x);
        tdm_tensor *yt = tdm_from_data(TDM_SHAPE(ROWS), TDM_I64, dev, y);
        tdm_tensor *l = tdm_cross_entropy(tdm_module_forward(m, xt), yt, NULL);
        rc = l ? tdm_optim_zero_grad(opt) : tdm_last_status();
        if (!rc) rc = tdm_backward(l);
        if (!rc) rc = tdm_optim_step(opt);
        if (!rc) loss[s] = tdm_item(l);
        tdm_scope_end();
    }
    tdm_optim_free(opt);
    tdm_module_free(m);
    return rc;
}

static int mlp_rank(tdm_rank_ctx *ctx, void *arg) {
    float *loss = arg; /* rank r's losses at loss + r * STEPS */
    tdm_rng rng = tdm_rng_make(7);
    /* each draws the whole layer from rng, as tdm_linear_new would, and keeps its part */
    tdm_module *fc1 = tdm_column_linear_new(IN, HID, true, false, ctx->group, ctx->device, &rng);
    tdm_module *fc2 = tdm_row_linear_new(HID, OUT, true, true, ctx->group, ctx->device, &rng);
    if (!fc1 || !fc2) return tdm_last_status();
    return train_mlp(fc1, fc2, ctx->device, loss + ctx->rank * STEPS);
}

static int part_one(void) {
    float one[STEPS], split[2 * STEPS];
    tdm_rng rng = tdm_rng_make(7);
    tdm_module *fc1 = tdm_linear_new(IN, HID, true, tdm_cpu(0), &rng);
    tdm_module *fc2 = tdm_linear_new(HID, OUT, true, tdm_cpu(0), &rng);
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    if (train_mlp(fc1, fc2, tdm_cpu(0), one) || tdm_spawn(2, devs, mlp_rank, split)) {
        fprintf(stderr, "tensor_parallel: the MLP: %s\n", tdm_last_error());
        return 1;
    }
    float worst = 0;
    for (int s = 0; s < STEPS; s++) {
        printf("mlp  step %d  loss %.6f one device, %.6f and %.6f on the two ranks\n", s + 1,
               one[s], split[s], split[STEPS + s]);
        worst = fmaxf(worst, fmaxf(fabsf(split[s] - one[s]), fabsf(split[STEPS + s] - one[s])));
    }
    return worst <= BOUND ? 0 : 1;
}

/* ---- 2. a GPT under the tensor-parallel strategy ------------------------------------------- */

static const tdm_gpt_config CFG = {
    .layers = 2, .heads = 4, .channels = 32, .context = 16, .vocab = 64, .padded_vocab = 64};

static int split_gpt(tdm_module *replica, tdm_group *tp, void *arg) {
    (void)arg;
    tdm_gpt_tp_plan plan = {.sequence_parallel = true, .vocab_parallel = true};
    return tdm_gpt_parallelize(replica, tp, &plan);
}

static tdm_optim *adamw(tdm_paramset *ps, void *arg) {
    (void)arg;
    tdm_adam_opts o = tdm_adamw_defaults();
    return tdm_gpt_adamw_new(ps, &o);
}

/* The loss of a step: from each rank's columns of the logits where the strategy hands over the
 * rank's split model (vocabulary parallelism), else from whole logits (one device). */
static tdm_tensor *gpt_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0, (void)arg;
    tdm_module *part = tdm_strategy_loss_module();
    return part ? tdm_gpt_loss_of(part, out, target) : tdm_gpt_loss(out, target);
}

static int train_gpt(tdm_strategy *st, float *loss) {
    int rc = TDM_OK;
    for (int s = 0; s < STEPS && !rc; s++) {
        int64_t tok[2][4 * 16];
        for (int i = 0; i < 4 * 16; i++)
            tok[0][i] = (i * 7 + s) % 64, tok[1][i] = (i * 7 + s + 1) % 64;
        tdm_scope_begin();
        tdm_tensor *x = tdm_from_data(TDM_SHAPE(4, 16), TDM_I64, tdm_cpu(0), tok[0]);
        tdm_tensor *y = tdm_from_data(TDM_SHAPE(4, 16), TDM_I64, tdm_cpu(0), tok[1]);
        rc = tdm_strategy_step(st, x, y, gpt_loss, NULL, &loss[s]);
        tdm_scope_end();
    }
    return rc;
}

static int part_two(void) {
    tdm_rng r1 = tdm_rng_make(3), r2 = tdm_rng_make(3);
    tdm_module *whole = tdm_gpt_new(&CFG, tdm_cpu(0), &r1),
               *ref = tdm_gpt_new(&CFG, tdm_cpu(0), &r2);
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    tdm_tp_strategy_opts o = {.tp = 2, .parallelize = split_gpt};
    tdm_strategy *tp = whole ? tdm_strategy_tensor_parallel(whole, devs, 2, &o, adamw, NULL) : NULL;
    tdm_strategy *one = ref ? tdm_strategy_one_device(ref, adamw, NULL) : NULL;
    float a[STEPS], b[STEPS];
    int rc = tp && one ? train_gpt(tp, a) : tdm_last_status();
    if (!rc) rc = train_gpt(one, b);
    char how[128];
    if (!rc) printf("gpt  %s\n", tdm_strategy_describe(tp, 4, how, sizeof how));
    /* the trained weights back in the whole model: what a checkpoint or llm.c's file takes */
    if (!rc) rc = tdm_strategy_sync_model(tp);
    if (rc) fprintf(stderr, "tensor_parallel: the GPT: %s\n", tdm_last_error());
    float worst = rc ? INFINITY : 0;
    for (int s = 0; !rc && s < STEPS; s++) {
        printf("gpt  step %d  loss %.6f one device, %.6f split over two\n", s + 1, b[s], a[s]);
        worst = fmaxf(worst, fabsf(a[s] - b[s]));
    }
    tdm_strategy_free(tp), tdm_strategy_free(one);
    tdm_module_free(whole), tdm_module_free(ref);
    return worst <= BOUND ? 0 : 1;
}

int main(void) {
    int bad = part_one() | part_two();
    printf("%s\n", bad ? "the split models' losses differ from one device's" : "ok");
    return bad;
}
