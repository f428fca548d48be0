/* Issue 18's "same accuracy after the same steps": the CIFAR ResNet-18 trained for a few steps
 * by Tandem (DataParallel over cpu:0,cpu:1, the configuration bench_resnet times) and by
 * PyTorch + torchvision (bench/torch_resnet_steps.py, run by this program) from the same
 * initial weights (Tandem's, saved as safetensors) on the same batches, with the same SGD
 * (lr 0.05, momentum 0.9): prints both losses at every step and their largest difference.
 *
 *   build/bench_resnet_steps [--steps 20] [--batch 128] [--batches 4] [--dir /tmp]
 *                            [--script bench/torch_resnet_steps.py]
 *
 * The data: `batches` batches of standard normal 3x32x32 images with labels drawn from 10
 * classes, used in turn (step s trains on batch s mod batches): random labels, so the loss
 * falls only as the network memorises them, which any difference in the arithmetic changes.
 * TANDEM_BENCH_PYTHON names the python with torch and torchvision, as for bench_resnet. */
#include "tandem/tandem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_STEPS 64

static tdm_tensor *ce_loss(tdm_tensor *out, tdm_tensor *target, int64_t row0, void *arg) {
    (void)row0, (void)arg;
    return tdm_cross_entropy(out, target, NULL);
}

static tdm_optim *make_sgd(tdm_paramset *ps, void *arg) {
    (void)arg;
    tdm_sgd_opts so = tdm_sgd_defaults(0.05f);
    so.momentum = 0.9f;
    return tdm_sgd_new(ps, &so);
}

static void die(const char *what) {
    fprintf(stderr, "bench_resnet_steps: %s: %s\n", what, tdm_last_error());
    exit(1);
}

int main(int argc, char **argv) {
    int steps = 20, batch = 128, batches = 4;
    const char *dir = "/tmp", *script = "bench/torch_resnet_steps.py";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--batch")) batch = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--batches")) batches = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--dir")) dir = argv[i + 1];
        if (!strcmp(argv[i], "--script")) script = argv[i + 1];
    }
    if (steps < 1 || steps > MAX_STEPS) steps = 20;
    if (batch < 2 || batches < 1) batch = 128, batches = 4;
    char wpath[512], dpath[512];
    snprintf(wpath, sizeof wpath, "%s/tdm_resnet_steps_init.safetensors", dir);
    snprintf(dpath, sizeof dpath, "%s/tdm_resnet_steps_data.safetensors", dir);

    tdm_resnet_opts ro = tdm_resnet_defaults(18);
    ro.num_classes = 10;
    ro.small_input = true;
    tdm_rng rng = tdm_rng_make(0);
    tdm_module *m = tdm_resnet_new(&ro, tdm_cpu(0), &rng);
    if (!m || tdm_weights_save(wpath, m, NULL, 0)) die("model");
    tdm_rng drng = tdm_rng_make(1);
    tdm_tensor *x = tdm_randn(TDM_SHAPE(batches * batch, 3, 32, 32), 0, 1, tdm_cpu(0), &drng);
    int64_t *labels = malloc(sizeof *labels * (size_t)(batches * batch));
    for (int i = 0; labels && i < batches * batch; i++)
        labels[i] = (int64_t)((uint32_t)(i * 2654435761u) >> 7) % 10;
    tdm_tensor *y =
        labels ? tdm_from_data(TDM_SHAPE(batches * batch), TDM_I64, tdm_cpu(0), labels) : NULL;
    tdm_named_tensor data[2] = {{"x", x}, {"y", y}};
    if (!x || !y || tdm_safetensors_save(dpath, data, 2, NULL, 0)) die("data");

    float tl[MAX_STEPS], pl[MAX_STEPS];
    tdm_device devs[2] = {tdm_cpu(0), tdm_cpu(1)};
    tdm_dp *dp = tdm_dp_new(m, devs, 2, make_sgd, NULL);
    if (!dp) die("tdm_dp_new");
    for (int s = 0; s < steps; s++) {
        int64_t r0 = (int64_t)(s % batches) * batch;
        tdm_tensor *xb = tdm_contiguous(tdm_slice(x, 0, r0, r0 + batch, 1));
        tdm_tensor *yb = tdm_contiguous(tdm_slice(y, 0, r0, r0 + batch, 1));
        if (!xb || !yb || tdm_dp_step(dp, xb, yb, ce_loss, NULL, &tl[s])) die("step");
        tdm_tensor_free(xb), tdm_tensor_free(yb);
    }
    tdm_dp_free(dp);

    const char *py = getenv("TANDEM_BENCH_PYTHON");
    char venv[512], cmd[2048], line[256];
    if (!py) {
        snprintf(venv, sizeof venv, "%s/.cache/tandem/bench-venv/bin/python",
                 getenv("HOME") ? getenv("HOME") : "");
        py = venv;
    }
    snprintf(cmd, sizeof cmd, "%s %s --weights %s --data %s --steps %d --batch %d", py, script,
             wpath, dpath, steps, batch);
    FILE *p = popen(cmd, "r");
    int got = 0;
    while (p && fgets(line, sizeof line, p)) {
        int s;
        float v;
        if (sscanf(line, "torch loss %d %f", &s, &v) == 2 && s >= 0 && s < steps) pl[s] = v, got++;
    }
    if (p) pclose(p);
    printf("CIFAR ResNet-18, batch %d of 3x32x32 (%d random batches in turn), SGD lr 0.05 "
           "momentum 0.9, same initial weights; Tandem on cpu:0,cpu:1 (DataParallel)\n",
           batch, batches);
    printf("%-5s %10s %10s %10s\n", "step", "tandem", "torch", "diff");
    double worst = 0;
    for (int s = 0; s < steps; s++) {
        double d = got == steps ? tl[s] - pl[s] : 0;
        printf("%-5d %10.4f %10.4f %10.4f\n", s + 1, tl[s], got == steps ? pl[s] : -1, d);
        worst = (d < 0 ? -d : d) > worst ? (d < 0 ? -d : d) : worst;
    }
    if (got == steps)
        printf("after %d steps: Tandem %.4f, PyTorch %.4f; largest difference %.4f\n", steps,
               tl[steps - 1], pl[steps - 1], worst);
    else
        printf("PyTorch side gave %d of %d losses (%s)\n", got, steps, cmd);
    free(labels);
    tdm_tensor_free(x), tdm_tensor_free(y);
    tdm_module_free(m);
    return got == steps ? 0 : 1;
}
