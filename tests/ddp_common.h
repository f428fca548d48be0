/* The model and batches the data-parallel equivalence tests share (threads in test_ddp.c,
 * processes in test_mpi.c): a small MLP and a global batch per step, the same on every rank
 * and for the one-device reference. */
#ifndef TDM_DDP_COMMON_H
#define TDM_DDP_COMMON_H

#include "check.h"

#define B     10 /* global batch: not divisible by 3 or 4 */
#define IN    6
#define HID   8
#define OUT   3
#define STEPS 3

static inline tdm_module *make_mlp(uint64_t seed, int64_t hidden) {
    tdm_rng r = tdm_rng_make(seed);
    tdm_module *l[3] = {tdm_linear_new(IN, hidden, true, tdm_cpu(0), &r), tdm_relu_new(),
                        tdm_linear_new(hidden, OUT, true, tdm_cpu(0), &r)};
    return tdm_sequential_new(3, l);
}

/* Step s's global batch. */
/* The trained weights (ps's flat buffer, copied to the host; the caller frees them), after
 * which the model and its optimizer are freed: how a reference run ends. */
static inline float *take_weights(tdm_module *m, tdm_paramset *ps, tdm_optim *opt) {
    float *p = malloc(sizeof(float) * (size_t)ps->total);
    if (p) tdm_to_host(ps->flat, p, sizeof(float) * (size_t)ps->total);
    tdm_optim_free(opt);
    tdm_module_free(m);
    return p;
}

static inline void batch_of(int s, float *x, int64_t *y) {
    tdm_rng r = tdm_rng_make(100 + (uint64_t)s);
    tdm_scope_begin();
    tdm_to_host(tdm_randn(TDM_SHAPE(B, IN), 0, 1, tdm_cpu(0), &r), x, sizeof(float) * B * IN);
    tdm_scope_end();
    for (int i = 0; i < B; i++) y[i] = (i * 7 + s) % OUT;
}

#endif
