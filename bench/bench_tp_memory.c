/* The largest GPT that trains on CPU devices capped like GPUs (issue 40): each device's pool
 * limited to CAP (tdm_device_set_memory_limit, the trainer's --device-memory), the deepest GPT
 * of GPT-2 small's width (768 channels, 12 heads, context 256, byte vocabulary, fp32, AdamW,
 * batch 2) that takes two steps without running out, on one device and split over two
 * (tdm_gpt_parallelize with sequence parallelism). A binary search over the layers; each try
 * builds the whole GPT on every device first (then splits it), as a user's program would.
 *   bench_tp_memory [cap in GiB (4)] */
#include "tandem/tandem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define T 256

typedef struct {
    int layers;
    int64_t cap;
} trial;

static tdm_gpt_config config(int layers) {
    return (tdm_gpt_config){
        .layers = layers, .heads = 12, .channels = 768, .context = T, .vocab = 256};
}

static int try_rank(tdm_rank_ctx *ctx, void *arg) {
    trial *t = arg;
    tdm_device dev = ctx->device;
    tdm_device_set_memory_limit(dev, t->cap);
    tdm_gpt_config cfg = config(t->layers);
    tdm_rng rng = tdm_rng_make(1);
    tdm_module *m = tdm_gpt_new(&cfg, dev, &rng);
    tdm_gpt_tp_plan plan = {true, false};
    int rc = m ? 0 : tdm_last_status();
    if (!rc && ctx->size > 1) rc = tdm_gpt_parallelize(m, ctx->group, &plan);
    tdm_adam_opts o = tdm_adamw_defaults();
    tdm_optim *opt = rc ? NULL : tdm_gpt_adamw_new(tdm_module_parameters(m), &o);
    if (!rc && !opt) rc = tdm_last_status();
    int64_t tok[2 * T];
    for (int i = 0; i < 2 * T; i++) tok[i] = (i * 7) % 256;
    for (int s = 0; s < 2 && !rc; s++) {
        tdm_scope_begin();
        tdm_tensor *idx = tdm_from_data(TDM_SHAPE(2, T), TDM_I64, dev, tok);
        tdm_tensor *l = idx ? tdm_gpt_loss_of(m, tdm_gpt_forward(m, idx), idx) : NULL;
        rc = l ? tdm_optim_zero_grad(opt) : tdm_last_status();
        if (!rc) rc = tdm_backward(l);
        if (!rc) rc = tdm_optim_step(opt);
        tdm_scope_end();
    }
    tdm_optim_free(opt);
    tdm_module_free(m);
    return rc;
}

/* The whole model's parameters (built on a device of no cap, then freed). */
static int64_t params_of(int layers) {
    tdm_gpt_config cfg = config(layers);
    tdm_module *m = tdm_gpt_new(&cfg, tdm_cpu(2), NULL);
    int64_t n = m ? tdm_module_parameters(m)->total : 0;
    tdm_module_free(m);
    return n;
}

/* Whether `layers` train on n devices capped at cap. */
static bool fits(int n, int layers, int64_t cap) {
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    trial t = {layers, cap};
    int rc = n == 1 ? try_rank(&(tdm_rank_ctx){0, 1, devs[0], NULL}, &t)
                    : tdm_spawn(n, devs, try_rank, &t);
    printf("  %d device%s, %3d layers: %s\n", n, n > 1 ? "s" : "", layers,
           rc ? tdm_last_error() : "trains");
    fflush(stdout);
    return rc == 0;
}

int main(int argc, char **argv) {
    double gib = argc > 1 ? atof(argv[1]) : 4.0;
    int64_t cap = (int64_t)(gib * 1073741824.0);
    if (cap <= 0) {
        fprintf(stderr, "usage: bench_tp_memory [cap in GiB (4)]\n");
        return 2;
    }
    int best[3] = {0};
    for (int n = 1; n <= 2; n++) {
        int lo = 0, hi = 256; /* lo trains (0: nothing yet), hi does not */
        while (hi - lo > 1) {
            int mid = (lo + hi) / 2;
            if (fits(n, mid, cap))
                lo = mid;
            else
                hi = mid;
        }
        best[n] = lo;
    }
    int64_t p1 = params_of(best[1]), p2 = params_of(best[2]);
    printf("# cap %.2f GiB a device: one device trains %d layers (%.1f M parameters), two with "
           "tensor and sequence parallelism %d layers (%.1f M): %.2fx the parameters\n",
           gib, best[1], (double)p1 / 1e6, best[2], (double)p2 / 1e6,
           p1 ? (double)p2 / (double)p1 : 0.0);
    return 0;
}
