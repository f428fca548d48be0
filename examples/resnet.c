/* Builds a CIFAR-style ResNet-18 in C, trains it for a few steps and saves its weights as
 * safetensors with torchvision's names:
 *
 *   resnet [STEPS] [OUT.safetensors]     (default 20, resnet18.safetensors)
 *
 * The data is Fashion-MNIST (Debian's /usr/share/datasets/fashion-mnist) when it is there,
 * grey 28x28 images, so the model takes 1 channel; otherwise random 3-channel 32x32 images
 * with random labels, so the example runs anywhere. The saved file loads in PyTorch:
 *
 *   m = torchvision.models.resnet18(num_classes=10)
 *   m.conv1 = torch.nn.Conv2d(C, 64, 3, 1, 1, bias=False); m.maxpool = torch.nn.Identity()
 *   m.load_state_dict(safetensors.torch.load_file("resnet18.safetensors"))
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "tandem/tandem.h"

#define BATCH 32

/* One SGD step on x [B, C, H, W], y [B]: forward, loss, backward, update (inside the
 * caller's step scope). Returns the loss, or NAN after printing the error. */
static float train_step(tdm_module *m, tdm_optim *opt, tdm_tensor *x, tdm_tensor *y) {
    tdm_optim_zero_grad(opt);
    tdm_tensor *loss = tdm_cross_entropy(tdm_module_forward(m, x), y, NULL); /* x -> [B, 10] */
    if (loss && tdm_backward(loss) == 0 && tdm_optim_step(opt) == 0) return tdm_item(loss);
    fprintf(stderr, "error: %s\n", tdm_last_error());
    return NAN;
}

/* The next batch: Fashion-MNIST's (a new epoch when one ends), or x [B, 3, 32, 32] ~ N(0, 1)
 * with random labels, made in the current scope. */
static int next_batch(tdm_loader *loader, int64_t *epoch, tdm_rng *rng, tdm_tensor **x,
                      tdm_tensor **y) {
    tdm_batch b;
    if (!loader) {
        int64_t labels[BATCH];
        for (int i = 0; i < BATCH; i++) labels[i] = rand() % 10;
        *x = tdm_randn(TDM_SHAPE(BATCH, 3, 32, 32), 0, 1, tdm_cpu(0), rng);
        *y = tdm_from_data(TDM_SHAPE(BATCH), TDM_I64, tdm_cpu(0), labels);
        return *x && *y ? 0 : -1;
    }
    int rc = tdm_loader_next(loader, &b);
    if (rc == 0 && tdm_loader_start_epoch(loader, ++*epoch) == 0) rc = tdm_loader_next(loader, &b);
    *x = b.x, *y = b.y;
    return rc == 1 ? 0 : -1;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 20;
    const char *out = argc > 2 ? argv[2] : "resnet18.safetensors";
    tdm_dataset *ds = tdm_fashion_mnist(NULL, true);
    if (!ds) tdm_clear_error(); /* no Fashion-MNIST: random data */

    tdm_resnet_opts o = tdm_resnet_defaults(18);
    o.num_classes = 10;
    o.in_channels = ds ? 1 : 3;
    o.small_input = true; /* 3x3 stem, no max-pool: for 28x28 and 32x32 images */
    tdm_rng rng = tdm_rng_make(0);
    tdm_module *m = tdm_resnet_new(&o, tdm_cpu(0), &rng);
    tdm_sgd_opts so = tdm_sgd_defaults(0.05f);
    so.momentum = 0.9f;
    tdm_optim *opt = m ? tdm_sgd_new(tdm_module_parameters(m), &so) : NULL;
    tdm_loader_opts lo = tdm_loader_defaults(BATCH);
    lo.shuffle = true;
    tdm_loader *loader = ds && opt ? tdm_loader_new(ds, &lo) : NULL;
    if (!opt || (ds && (!loader || tdm_loader_start_epoch(loader, 0)))) {
        fprintf(stderr, "error: %s\n", tdm_last_error());
        return 1;
    }
    printf("resnet18 (CIFAR stem, %d channel%s) on %s, %lld parameters\n", o.in_channels,
           o.in_channels > 1 ? "s" : "", ds ? "Fashion-MNIST" : "random data",
           (long long)tdm_module_parameters(m)->total);

    int64_t epoch = 0;
    for (int s = 1; s <= steps; s++) {
        tdm_scope_begin();
        tdm_tensor *x, *y;
        float loss = NAN;
        if (next_batch(loader, &epoch, &rng, &x, &y))
            fprintf(stderr, "error: %s\n", tdm_last_error());
        else
            loss = train_step(m, opt, x, y);
        tdm_scope_end();
        if (isnan(loss)) return 1;
        printf("step %3d  loss %.4f\n", s, loss);
    }

    int rc = tdm_weights_save(out, m, NULL, 0);
    if (rc)
        fprintf(stderr, "error: %s\n", tdm_last_error());
    else
        printf("saved %s\n", out);
    tdm_loader_free(loader);
    tdm_dataset_free(ds);
    tdm_optim_free(opt);
    tdm_module_free(m);
    return rc ? 1 : 0;
}
