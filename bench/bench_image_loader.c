/* The image loader against torchvision's: a JPEG ImageFolder through
 * RandomResizedCrop(224) + RandomHorizontalFlip + Normalize(ImageNet), batch 32, shuffled, with
 * W workers on both sides; images/s over full epochs (issue 18's figure: at least 2x).
 *
 *   build/bench_image_loader DIR [--workers 1,2] [--rounds 3] [--epochs 2]
 *                            [--backends pil,tensor | -]   (- : Tandem only)
 *
 * DIR is an ImageFolder of photo-sized JPEGs, e.g. make_image_data OUT --limit 2000
 * --photo 500x375 then OUT/photo/train. For each W, R interleaved rounds: Tandem's epochs,
 * then bench/torch_image_loader.py's with each torchvision backend (pil: ImageFolder's PIL
 * loader and transforms on PIL images, the default; tensor: torchvision.io.decode_jpeg and
 * transforms.v2 on uint8 tensors); each round is one warm-up epoch (page cache, workers
 * started) and E timed ones, reported as their median images/s. The ratio is Tandem's median
 * over the best torchvision backend's median. TANDEM_BENCH_PYTHON names the python with
 * PyPI's torch and torchvision (default: the venv of scripts/setup --bench). */
#include "tandem/tandem.h"
#include "tandem/transforms.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_ROUNDS   16
#define MAX_BACKENDS 2

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, int n) {
    double s[64];
    memcpy(s, v, (size_t)n * sizeof *v);
    qsort(s, (size_t)n, sizeof *s, cmp_double);
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

typedef struct {
    const char *dir;
    int workers[4], n_workers;
    int rounds, epochs;
    const char *backends[MAX_BACKENDS];
    int n_backends;
} bench_opts;

/* Images/s of one epoch of l, or -1 on an error. */
static double tandem_epoch(tdm_loader *l, int64_t epoch) {
    tdm_batch b;
    int64_t n = 0;
    double t0 = now_s();
    if (tdm_loader_start_epoch(l, epoch)) return -1;
    int rc;
    while ((rc = tdm_loader_next(l, &b)) == 1) n += b.size;
    if (rc < 0) return -1;
    return (double)n / (now_s() - t0);
}

/* The median images/s of one round of Tandem: a warm-up epoch (not timed) and E timed ones. */
static double tandem_round(tdm_loader *l, int epochs, int64_t *epoch) {
    double r[64];
    if (tandem_epoch(l, (*epoch)++) < 0) return -1;
    for (int e = 0; e < epochs; e++)
        if ((r[e] = tandem_epoch(l, (*epoch)++)) < 0) return -1;
    return median(r, epochs);
}

/* torchvision's median images/s over one run of the script, or -1. */
static double torch_round(const bench_opts *o, int workers, const char *backend) {
    const char *py = getenv("TANDEM_BENCH_PYTHON");
    char venv[512], cmd[2048], line[256];
    if (!py) {
        snprintf(venv, sizeof venv, "%s/.cache/tandem/bench-venv/bin/python",
                 getenv("HOME") ? getenv("HOME") : "");
        py = venv;
    }
    snprintf(cmd, sizeof cmd,
             "%s bench/torch_image_loader.py '%s' --workers %d --epochs %d "
             "--backend %s",
             py, o->dir, workers, o->epochs, backend);
    FILE *p = popen(cmd, "r");
    double v = -1;
    while (p && fgets(line, sizeof line, p)) sscanf(line, "torch median %lf", &v);
    if (p) pclose(p);
    return v;
}

static int usage(void) {
    fprintf(stderr, "usage: bench_image_loader DIR [--workers 1,2] [--rounds 3] [--epochs 2] "
                    "[--backends pil,tensor | -]\n");
    return 2;
}

static int parse(int argc, char **argv, bench_opts *o) {
    *o = (bench_opts){.workers = {1, 2},
                      .n_workers = 2,
                      .rounds = 3,
                      .epochs = 2,
                      .backends = {"pil", "tensor"},
                      .n_backends = 2};
    static char backends[64];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (a[0] != '-') {
            if (o->dir) return usage();
            o->dir = a;
            continue;
        }
        if (!v) return usage();
        i++;
        if (!strcmp(a, "--rounds")) {
            o->rounds = atoi(v);
        } else if (!strcmp(a, "--epochs")) {
            o->epochs = atoi(v);
        } else if (!strcmp(a, "--workers")) {
            o->n_workers = 0;
            for (const char *s = v; *s && o->n_workers < 4;
                 s = strchr(s, ',') ? strchr(s, ',') + 1 : "")
                o->workers[o->n_workers++] = atoi(s);
        } else if (!strcmp(a, "--backends")) {
            snprintf(backends, sizeof backends, "%s", v);
            o->n_backends = 0;
            for (char *s = strtok(backends, ","); s && o->n_backends < MAX_BACKENDS;
                 s = strtok(NULL, ","))
                if (strcmp(s, "-")) o->backends[o->n_backends++] = s;
        } else {
            return usage();
        }
    }
    if (!o->dir || o->rounds < 1 || o->rounds > MAX_ROUNDS || o->epochs < 1 || o->epochs > 64)
        return usage();
    for (int k = 0; k < o->n_workers; k++)
        if (o->workers[k] < 1 || o->workers[k] > 64) return usage();
    return 0;
}

/* R interleaved rounds for W workers; prints them and the medians. */
static int bench_workers(const bench_opts *o, tdm_dataset *ds, const tdm_transform *tf, int w) {
    tdm_loader_opts lo = tdm_loader_defaults(32);
    lo.shuffle = true;
    lo.seed = 1;
    lo.workers = w;
    lo.transform = tf;
    tdm_loader *l = tdm_loader_new(ds, &lo);
    if (!l) return -1;
    double tt[MAX_ROUNDS], pt[MAX_BACKENDS][MAX_ROUNDS];
    int64_t epoch = 0;
    printf("W=%d  images/s (median of %d epochs after a warm-up epoch, per round)\n", w, o->epochs);
    printf("%-6s %10s", "round", "tandem");
    for (int b = 0; b < o->n_backends; b++) printf(" %10s", o->backends[b]);
    printf("\n");
    for (int r = 0; r < o->rounds; r++) {
        if ((tt[r] = tandem_round(l, o->epochs, &epoch)) < 0) {
            tdm_loader_free(l);
            return -1;
        }
        printf("%-6d %10.1f", r + 1, tt[r]);
        fflush(stdout);
        for (int b = 0; b < o->n_backends; b++) {
            pt[b][r] = torch_round(o, w, o->backends[b]);
            printf(" %10.1f", pt[b][r]);
            fflush(stdout);
        }
        printf("\n");
    }
    double tm = median(tt, o->rounds), best = -1;
    printf("%-6s %10.1f", "median", tm);
    for (int b = 0; b < o->n_backends; b++) {
        double m = median(pt[b], o->rounds);
        best = m > best ? m : best;
        printf(" %10.1f", m);
    }
    if (best > 0)
        printf("   Tandem / torchvision's best: %.2fx\n", tm / best);
    else
        printf("\n");
    tdm_loader_free(l);
    return 0;
}

int main(int argc, char **argv) {
    bench_opts o;
    if (parse(argc, argv, &o)) return 2;
    const char *text = "RandomResizedCrop(224),RandomHorizontalFlip(),Normalize(imagenet)";
    tdm_dataset *ds = tdm_image_folder_open(o.dir, NULL);
    tdm_transform *tf = ds ? tdm_transform_parse(text, 224) : NULL;
    if (!tf) {
        fprintf(stderr, "bench_image_loader: %s\n", tdm_last_error());
        tdm_dataset_free(ds);
        return 1;
    }
    printf("%s: %lld JPEGs, %lld classes; %s, batch 32, shuffle\n", o.dir, (long long)ds->n,
           (long long)ds->num_classes, text);
    int rc = 0;
    for (int k = 0; k < o.n_workers && !rc; k++) rc = bench_workers(&o, ds, tf, o.workers[k]);
    if (rc) fprintf(stderr, "bench_image_loader: %s\n", tdm_last_error());
    tdm_transform_free(tf);
    tdm_dataset_free(ds);
    return rc ? 1 : 0;
}
