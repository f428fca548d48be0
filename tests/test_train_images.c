/* `tandem train` and `tandem eval` on image folders and CIFAR files, as a user runs them: the
 * folders that tests/make_image_data.c writes from Fashion-MNIST (PNG, JPEG, CIFAR-10 format).
 *
 *   test_train_images PATH_TO_TANDEM PATH_TO_MAKE_IMAGE_DATA [--mpirun MPIRUN]
 *
 * Exits 77 (skipped) without Debian's dataset-fashion-mnist. */
#define _GNU_SOURCE /* memmem */
#include <math.h>
#include <sys/stat.h>

#include "check.h"
#include "testdir.h"

static const char *tandem_path;

typedef struct {
    int status;
    char *out, *err;
} result;

static result run(const char *const *argv) {
    result r = {wait_status(spawn_captured(argv)), NULL, NULL};
    r.out = captured("stdout");
    r.err = captured("stderr");
    return r;
}

static void result_free(result *r) {
    free(r->out);
    free(r->err);
}

#define TANDEM(...) run((const char *const[]){tandem_path, __VA_ARGS__, NULL})

static char png[300], cifar[300], bad[300];

/* The number after `key` in text, NAN when absent. */
static double number_after(const char *text, const char *key) {
    const char *p = strstr(text, key);
    return p ? strtod(p + strlen(key), NULL) : NAN;
}

/* A cnn trained on the IDX files scores the same on the PNG copy of the test images as on
 * the IDX ones: decoding, class folders and labels give Fashion-MNIST's exact samples (the
 * loss is summed in another order: equal to float rounding). */
static void png_equals_idx(void) {
    char ck[300];
    snprintf(ck, sizeof ck, "%s/idx-cnn", tmpdir);
    result r =
        TANDEM("train", "--model", "cnn", "--limit", "600", "--quiet", "--checkpoint-dir", ck);
    CHECK(r.status == 0, "training on IDX: exit %d: %s", r.status, r.err);
    result_free(&r);
    result a = TANDEM("eval", "--weights", ck, "--model", "cnn", "--limit", "600");
    result b = TANDEM("eval", "--weights", ck, "--model", "cnn", "--data", png, "--eval-transform",
                      "CenterCrop(28)");
    double la = number_after(a.out, "test loss "), lb = number_after(b.out, "test loss ");
    double aa = number_after(a.out, " acc "), ab = number_after(b.out, " acc ");
    CHECK(a.status == 0 && b.status == 0 && strstr(b.out, "(100 samples") && aa == ab &&
              fabs(la - lb) <= 1e-4,
          "IDX: %s %s; PNG folder: %s %s", a.out, a.err, b.out, b.err);
    result_free(&a);
    result_free(&b);
}

/* An image folder trains with transforms: the banner names the classes and the transforms,
 * --limit keeps every class, the checkpoint holds class_to_idx, and a stopped run resumes
 * to the uninterrupted run's weights (the transforms' draws come from the seed, epoch and
 * sample). */
static void folder_run(void) {
    char full[300], split[300];
    snprintf(full, sizeof full, "%s/png-full", tmpdir);
    snprintf(split, sizeof split, "%s/png-split", tmpdir);
    const char *const args[] = {"train",
                                "--data",
                                png,
                                "--model",
                                "cnn",
                                "--limit",
                                "192",
                                "--batch-size",
                                "32",
                                "--epochs",
                                "2",
                                "--transform",
                                "RandomCrop(28,padding=2),RandomHorizontalFlip()",
                                "--eval-transform",
                                "CenterCrop(28)",
                                "--checkpoint-dir"};
#define ARGS16                                                                                     \
    args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7], args[8], args[9],      \
        args[10], args[11], args[12], args[13], args[14], args[15]
    result r = TANDEM(ARGS16, full);
    CHECK(r.status == 0 && strstr(r.out, "192 train, 32 test images [1, 28, 28] of 10 classes") &&
              strstr(r.out, "classes   0_T-shirt_top, 1_Trouser, 2_Pullover") &&
              strstr(r.out,
                     "transform train RandomCrop(28, padding=2), RandomHorizontalFlip(p=0.5);"
                     " test CenterCrop(28)"),
          "image folder run: exit %d: %s %s", r.status, r.out, r.err);
    result_free(&r);
    char path[400];
    snprintf(path, sizeof path, "%s/ckpt-%010d/train_state.safetensors", full, 12);
    size_t n = 0;
    char *state = slurp_file(path, &n); /* after the header's length: binary */
    const char *first = "0_T-shirt_top\\\": 0", *last = "9_Ankle_boot\\\": 9";
    CHECK(state && memmem(state, n, first, strlen(first)) && memmem(state, n, last, strlen(last)),
          "%s holds no class_to_idx", path);
    free(state);
    r = TANDEM(ARGS16, split, "--max-steps", "7", "--quiet");
    result_free(&r);
    r = TANDEM(ARGS16, split, "--resume", "--quiet");
    CHECK(r.status == 0, "resumed image folder run: exit %d: %s", r.status, r.err);
    result_free(&r);
    char fa[400], fb[400];
    snprintf(fa, sizeof fa, "%s/ckpt-%010d/model.safetensors", full, 12);
    snprintf(fb, sizeof fb, "%s/ckpt-%010d/model.safetensors", split, 12);
    size_t na = 0, nb = 0;
    char *x = slurp_file(fa, &na), *y = slurp_file(fb, &nb);
    CHECK(x && y && na == nb && na > 0 && memcmp(x, y, na) == 0,
          "stopped at step 7 and resumed: %s differs from the uninterrupted run's", fb);
    free(x);
    free(y);
#undef ARGS16
}

/* CIFAR files and a ResNet: the default CIFAR transforms (resized to --image-size), the
 * small-image stem; and the same first epoch on 2 devices as on one (synchronised batch
 * norm). */
static void cifar_resnet(void) {
    char data[320];
    snprintf(data, sizeof data, "cifar10:%s", cifar);
#define CIFAR_ARGS                                                                                 \
    "train", "--data", data, "--model", "resnet18", "--image-size", "8", "--limit", "16",          \
        "--batch-size", "8", "--lr", "0.01", "--workers", "1"
    result one = TANDEM(CIFAR_ARGS);
    CHECK(one.status == 0 && strstr(one.out, "small-image stem") &&
              strstr(one.out, "16 train, 2 test images [3, 8, 8] of 10 classes") &&
              strstr(one.out, "transform train Resize((8, 8)), RandomCrop(8, padding=4)"),
          "CIFAR resnet18: exit %d: %s %s", one.status, one.out, one.err);
    result two = TANDEM(CIFAR_ARGS, "--devices", "cpu:0,cpu:1");
    double a = number_after(one.out, "train loss "), b = number_after(two.out, "train loss ");
    CHECK(two.status == 0 && fabs(a - b) <= 2e-4, "resnet18 train loss: 1 device %.4f, 2 %.4f", a,
          b);
    result_free(&one);
    result_free(&two);
    /* a ResNet is a Sequential of named layers: a pipeline cuts it into stages */
    result pipe = TANDEM(CIFAR_ARGS, "--devices", "cpu:0,cpu:1", "--model-split", "2",
                         "--micro-batches", "2");
    CHECK(pipe.status == 0 && strstr(pipe.out, "2 pipeline stages") &&
              isfinite(number_after(pipe.out, "train loss ")),
          "resnet18 in 2 pipeline stages: exit %d: %s %s", pipe.status, pipe.out, pipe.err);
    result_free(&pipe);
    /* the stem follows the images the model gets, not --image-size: 8x8 crops of a run told
     * 224 still get the small-image stem */
    result told = TANDEM("train", "--data", data, "--model", "resnet18", "--image-size", "224",
                         "--transform", "RandomCrop(8)", "--eval-transform", "CenterCrop(8)",
                         "--limit", "16", "--batch-size", "8", "--max-steps", "1");
    CHECK(told.status == 0 && strstr(told.out, "small-image stem") &&
              strstr(told.out, "images [3, 8, 8]"),
          "resnet18 on 8x8 crops, --image-size 224: exit %d: %s %s", told.status, told.out,
          told.err);
    result_free(&told);
}

/* What goes wrong is named: an unreadable file (its path), no test folder, a transform that
 * does not parse (where), an image folder without a fixed size. */
static void errors(void) {
    char dir[300], sub[400];
    snprintf(dir, sizeof dir, "%s/badrun", tmpdir);
    mkdir(dir, 0755);
    snprintf(sub, sizeof sub, "%s/train", dir);
    CHECK(symlink(bad, sub) == 0, "symlink %s", sub);
    result r = TANDEM("train", "--data", dir, "--model", "cnn");
    CHECK(r.status == 1 && strstr(r.err, "no '") && strstr(r.err, "/val' or '"),
          "no test folder: exit %d: %s", r.status, r.err);
    result_free(&r);
    snprintf(sub, sizeof sub, "%s/val", dir);
    CHECK(symlink(bad, sub) == 0, "symlink %s", sub);
    r = TANDEM("train", "--data", dir, "--model", "cnn");
    CHECK(r.status == 1 && strstr(r.err, "empty.jpg"), "a zero-byte image: exit %d: %s", r.status,
          r.err);
    result_free(&r);
    /* skipped and counted instead (both splits are the same folder here); the corrupt pixels
     * of a truncated JPEG or a bad CRC still stop the run, naming the file */
    r = TANDEM("train", "--data", dir, "--model", "cnn", "--skip-bad-images", "--transform",
               "CenterCrop(28)", "--eval-transform", "CenterCrop(28)");
    CHECK(strstr(r.out, "unreadable files skipped)") &&
              (r.status == 0 || strstr(r.err, "truncated.jpg") || strstr(r.err, "badcrc.png")),
          "--skip-bad-images: exit %d: %s %s", r.status, r.out, r.err);
    result_free(&r);
    /* a training batch that fails to load stops the run (exit 1, nothing evaluated, no
     * "done"), though val/ is good: the bad folder's truncated JPEG and bad-CRC PNG pass the
     * header checks and fail in a loader worker */
    snprintf(dir, sizeof dir, "%s/badtrain", tmpdir);
    snprintf(sub, sizeof sub, "%s/val", dir);
    CHECK(mkdir(dir, 0755) == 0 && mkdir(sub, 0755) == 0, "mkdir %s", sub);
    DIR *classes = opendir(bad);
    for (struct dirent *e; classes && (e = readdir(classes));) {
        if (e->d_name[0] == '.') continue;
        char from[700], to[700];
        snprintf(from, sizeof from, "%s/test/%s", png, e->d_name);
        snprintf(to, sizeof to, "%s/%s", sub, e->d_name);
        CHECK(symlink(from, to) == 0, "symlink %s", to);
    }
    if (classes) closedir(classes);
    snprintf(sub, sizeof sub, "%s/train", dir);
    CHECK(symlink(bad, sub) == 0, "symlink %s", sub);
    r = TANDEM("train", "--data", dir, "--model", "cnn", "--skip-bad-images", "--transform",
               "CenterCrop(28)", "--eval-transform", "CenterCrop(28)", "--batch-size", "4");
    CHECK(r.status == 1 && (strstr(r.err, "truncated.jpg") || strstr(r.err, "badcrc.png")) &&
              !strstr(r.out, "done") && !strstr(r.out, "test acc"),
          "a corrupt training image: exit %d: %s %s", r.status, r.out, r.err);
    result_free(&r);
    r = TANDEM("train", "--data", png, "--model", "cnn", "--transform", "CenterCrop(28", "--quiet");
    CHECK(r.status == 2 && strstr(r.err, "--transform"), "bad transform text: exit %d: %s",
          r.status, r.err);
    result_free(&r);
    r = TANDEM("train", "--data", png, "--model", "cnn", "--transform", "RandomHorizontalFlip()",
               "--quiet");
    CHECK(r.status == 1 && strstr(r.err, "end it with"),
          "a folder's images of any size: exit %d: %s", r.status, r.err);
    result_free(&r);
}

/* The same first epoch of a ResNet in 1 process and in 2 under mpirun (DDP with batch norm
 * over the global batch). */
static void mpi_resnet(const char *mpirun) {
    char data[320];
    snprintf(data, sizeof data, "cifar10:%s", cifar);
    result one = TANDEM(CIFAR_ARGS, "--quiet");
    result two = run((const char *const[]){mpirun, "--oversubscribe", "-np", "2", tandem_path,
                                           CIFAR_ARGS, "--quiet", NULL});
    double a = number_after(one.out, "train loss "), b = number_after(two.out, "train loss ");
    CHECK(one.status == 0 && two.status == 0 && fabs(a - b) <= 2e-4,
          "resnet18 train loss: 1 process %.4f, 2 processes %.4f (exit %d: %s)", a, b, two.status,
          two.err);
    result_free(&one);
    result_free(&two);
}

int main(int argc, char **argv) {
    if (argc != 3 && !(argc == 5 && strcmp(argv[3], "--mpirun") == 0)) {
        fprintf(stderr, "usage: test_train_images TANDEM MAKE_IMAGE_DATA [--mpirun MPIRUN]\n");
        return 2;
    }
    struct stat st;
    if (stat("/usr/share/datasets/fashion-mnist", &st) != 0) {
        printf("skipped: no /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist)\n");
        return 77;
    }
    tandem_path = argv[1];
    if (tmpdir_make("train_images") != 0) return 1;
    char data[100]; /* tmpdir is 64 bytes */
    snprintf(data, sizeof data, "%s/data", tmpdir);
    result made =
        run((const char *const[]){argv[2], data, "--limit", "600", "--test-limit", "100", NULL});
    CHECK(made.status == 0, "make_image_data: exit %d: %s", made.status, made.err);
    result_free(&made);
    snprintf(png, sizeof png, "%s/png", data);
    snprintf(cifar, sizeof cifar, "%s/cifar10", data);
    snprintf(bad, sizeof bad, "%s/bad", data);
    if (argc == 5) {
        mpi_resnet(argv[4]);
    } else {
        png_equals_idx();
        folder_run();
        cifar_resnet();
        errors();
    }
    tmpdir_remove();
    return check_summary();
}
