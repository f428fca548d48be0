/* Datasets: IDX (raw and gzipped), Fashion-MNIST, llm.c token shards, CSV and memory
 * datasets. Valid files read back exactly; every malformed file (written into a temporary
 * directory) gives NULL and a message naming the file and where the problem is. */
#define _GNU_SOURCE
#include "check.h"
#include "data/dataset_common.h" /* tdm_ds_bytes_to_unit */
#include "testdir.h"

#include <pthread.h>
#include <sys/stat.h>
#include <stdint.h>
#include <unistd.h>
#include <zlib.h>

static const char *tmp_path(const char *name) {
    static _Thread_local char buf[8][256];
    static _Thread_local int k;
    char *p = buf[k++ % 8];
    snprintf(p, 256, "%s/%s", tmpdir, name);
    return p;
}

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(data, 1, n, f) == n, "cannot write %s", path);
    if (f) fclose(f);
}

static void write_gz(const char *path, const void *data, size_t n) {
    gzFile g = gzopen(path, "wb");
    CHECK(g && (n == 0 || gzwrite(g, data, (unsigned)n) == (int)n), "cannot write %s", path);
    if (g) gzclose(g);
}

static size_t read_back(const char *path, unsigned char *buf, size_t cap) {
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(buf, 1, cap, f) : 0;
    if (f) fclose(f);
    return n;
}

static void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24), p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8), p[3] = (unsigned char)v;
}

/* An IDX images file [count, rows, cols] with pixel (i, j) = (7*i + 3*j) % 256; returns its
 * size (npix pixel bytes written, which may differ from the claim). */
static size_t make_images(unsigned char *buf, uint32_t magic, uint32_t count, uint32_t rows,
                          uint32_t cols, size_t npix) {
    put_be32(buf, magic), put_be32(buf + 4, count), put_be32(buf + 8, rows);
    put_be32(buf + 12, cols);
    for (size_t k = 0; k < npix; k++) buf[16 + k] = (unsigned char)((7 * k + 3 * (k % 5)) % 256);
    return 16 + npix;
}

static size_t make_labels(unsigned char *buf, uint32_t count, size_t nlab, int modulo) {
    put_be32(buf, 0x801), put_be32(buf + 4, count);
    for (size_t k = 0; k < nlab; k++) buf[8 + k] = (unsigned char)(k % (size_t)modulo);
    return 8 + nlab;
}

/* ---- IDX ---------------------------------------------------------------------------------- */

static void check_idx_contents(tdm_dataset *ds, const unsigned char *img, const char *what) {
    CHECK(ds && ds->n == 5 && ds->sample_shape.ndim == 3 && ds->sample_shape.d[0] == 1 &&
              ds->sample_shape.d[1] == 3 && ds->sample_shape.d[2] == 4 &&
              ds->target_shape.ndim == 0 && ds->x_dtype == TDM_F32 && ds->num_classes == 3,
          "%s: metadata (%s)", what, tdm_last_error());
    if (!ds) return;
    CHECK(tdm_dataset_sample_numel(ds) == 12, "%s: sample numel", what);
    int bad = 0;
    for (int64_t i = 0; i < ds->n; i++) {
        float x[12];
        int64_t y = -1;
        CHECK(ds->ops->get(ds, i, x, &y) == 0, "%s: get(%lld)", what, (long long)i);
        for (int j = 0; j < 12; j++) bad += x[j] != (float)img[16 + i * 12 + j] / 255.0f;
        bad += y != i % 3;
    }
    CHECK(bad == 0, "%s: %d values differ", what, bad);
    float x[12];
    int64_t y;
    CHECK_ERROR(ds->ops->get(ds, 5, x, &y) != 0, "out of range");
    CHECK_ERROR(ds->ops->get(ds, -1, x, &y) != 0, "out of range");
}

static void test_idx_valid(void) {
    unsigned char img[16 + 60], lab[8 + 5];
    size_t ni = make_images(img, 0x803, 5, 3, 4, 60), nl = make_labels(lab, 5, 5, 3);
    write_file(tmp_path("img"), img, ni);
    write_file(tmp_path("lab"), lab, nl);
    write_gz(tmp_path("img.gz"), img, ni);
    write_gz(tmp_path("lab.gz"), lab, nl);
    tdm_dataset *raw = tdm_idx_dataset_open(tmp_path("img"), tmp_path("lab"));
    check_idx_contents(raw, img, "raw idx");
    CHECK(raw && strcmp(raw->name, "img") == 0, "name from the file");
    tdm_dataset_free(raw);
    tdm_dataset *gz = tdm_idx_dataset_open(tmp_path("img.gz"), tmp_path("lab.gz"));
    check_idx_contents(gz, img, "gzipped idx");
    tdm_dataset_free(gz);
    tdm_dataset *mixed = tdm_idx_dataset_open(tmp_path("img.gz"), tmp_path("lab"));
    check_idx_contents(mixed, img, "gzipped images, raw labels");
    tdm_dataset_free(mixed);
    /* two gzip members back to back (cat a.gz b.gz) are one stream, as for gzip -d */
    unsigned char both[4096];
    write_gz(tmp_path("part1.gz"), img, 30);
    write_gz(tmp_path("part2.gz"), img + 30, ni - 30);
    size_t g1 = read_back(tmp_path("part1.gz"), both, sizeof both);
    size_t g2 = read_back(tmp_path("part2.gz"), both + g1, sizeof both - g1);
    write_file(tmp_path("img2.gz"), both, g1 + g2);
    tdm_dataset *two = tdm_idx_dataset_open(tmp_path("img2.gz"), tmp_path("lab.gz"));
    check_idx_contents(two, img, "two gzip members");
    tdm_dataset_free(two);
    /* any u8 label is valid for plain IDX: num_classes = max + 1 */
    lab[8 + 2] = 200;
    write_file(tmp_path("lab200"), lab, nl);
    tdm_dataset *big = tdm_idx_dataset_open(tmp_path("img"), tmp_path("lab200"));
    CHECK(big && big->num_classes == 201, "num_classes from the largest label");
    tdm_dataset_free(big);
    tdm_dataset_free(NULL);
}

/* Opens (images, labels) and checks the failure names the file and the words. */
static void expect_idx_error(const char *img, const char *lab, const char *words, const char *named,
                             tdm_status status) {
    tdm_clear_error();
    tdm_dataset *ds = tdm_idx_dataset_open(img, lab);
    CHECK(!ds && tdm_last_status() == status && strstr(tdm_last_error(), named),
          "expected status %d naming %s, got %d \"%s\"", status, named, tdm_last_status(),
          tdm_last_error());
    CHECK_ERROR(!ds, words);
    tdm_dataset_free(ds);
}

static void test_idx_errors(void) {
    static unsigned char img[16 + 70000], lab[8 + 64];
    size_t nl = make_labels(lab, 5, 5, 3);
    char l5[256]; /* tmp_path's buffers are reused */
    snprintf(l5, sizeof l5, "%s", tmp_path("l5"));
    write_file(l5, lab, nl);

    size_t n = make_images(img, 0x802, 5, 3, 4, 60);
    write_file(tmp_path("magic"), img, n);
    expect_idx_error(tmp_path("magic"), l5, "wrong magic 0x00000802 at byte offset 0",
                     tmp_path("magic"), TDM_ERR_FORMAT);
    write_file(tmp_path("lmagic"), img, 8); /* an images magic in a labels file */
    expect_idx_error(tmp_path("img"), tmp_path("lmagic"), "wrong magic", tmp_path("lmagic"),
                     TDM_ERR_FORMAT);

    n = make_images(img, 0x803, 5, 3, 4, 60);
    write_file(tmp_path("short_hdr"), img, 10);
    expect_idx_error(tmp_path("short_hdr"), l5, "truncated header: the file ends at byte offset 10",
                     tmp_path("short_hdr"), TDM_ERR_FORMAT);
    write_gz(tmp_path("short_hdr.gz"), img, 10);
    expect_idx_error(tmp_path("short_hdr.gz"), l5, "truncated header", tmp_path("short_hdr.gz"),
                     TDM_ERR_FORMAT);
    write_file(tmp_path("empty"), img, 0);
    expect_idx_error(tmp_path("empty"), l5, "truncated header", tmp_path("empty"), TDM_ERR_FORMAT);

    write_file(tmp_path("short_data"), img, n - 7);
    expect_idx_error(tmp_path("short_data"), l5, "truncated", tmp_path("short_data"),
                     TDM_ERR_FORMAT);
    expect_idx_error(tmp_path("short_data"), l5, "file size is 69 bytes", "from byte offset 16",
                     TDM_ERR_FORMAT);
    n = make_images(img, 0x803, 5, 3, 4, 61);
    write_file(tmp_path("trailing"), img, n);
    expect_idx_error(tmp_path("trailing"), l5, "trailing data", tmp_path("trailing"),
                     TDM_ERR_FORMAT);
    write_gz(tmp_path("trailing.gz"), img, n);
    expect_idx_error(tmp_path("trailing.gz"), l5, "trailing data", "byte offset 76 (decompressed)",
                     TDM_ERR_FORMAT);

    /* dims whose product overflows 64 bits, and a huge but representable claim */
    make_images(img, 0x803, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0);
    write_file(tmp_path("overflow"), img, 16 + 60);
    make_labels(lab, 0xffffffffu, 0, 3);
    write_file(tmp_path("lbig"), lab, 8 + 60);
    expect_idx_error(tmp_path("overflow"), tmp_path("lbig"), "overflow", tmp_path("overflow"),
                     TDM_ERR_FORMAT);
    make_images(img, 0x803, 0xffffffffu, 1000, 1000, 0);
    write_file(tmp_path("huge"), img, 16 + 60);
    expect_idx_error(tmp_path("huge"), tmp_path("lbig"), "file size", tmp_path("lbig"),
                     TDM_ERR_FORMAT);
    make_images(img, 0x803, 5, 0, 4, 0);
    write_file(tmp_path("zero"), img, 16);
    expect_idx_error(tmp_path("zero"), l5, "dimension 1 at byte offset 8 is zero", tmp_path("zero"),
                     TDM_ERR_FORMAT);

    /* a gzip file cannot hold more than ~1032x its size: rejected before any allocation */
    make_images(img, 0x803, 5, 100000, 100000, 60);
    write_gz(tmp_path("bomb.gz"), img, 16 + 60);
    expect_idx_error(tmp_path("bomb.gz"), l5, "more than a gzip file", tmp_path("bomb.gz"),
                     TDM_ERR_FORMAT);
    /* a plausible claim (64 KB of random pixels justify 64 MB) that the stream does not keep:
     * the buffer grows with the data, and the end is reported */
    make_images(img, 0x803, 5, 2000, 4000, 0);
    uint32_t s = 12345;
    for (size_t k = 16; k < 16 + 65536; k++)
        img[k] = (unsigned char)((s = s * 1103515245u + 12345u) >> 24);
    write_gz(tmp_path("liar.gz"), img, 16 + 65536);
    expect_idx_error(tmp_path("liar.gz"), l5, "ends at byte offset 65552 (decompressed)",
                     tmp_path("liar.gz"), TDM_ERR_FORMAT);

    /* a gzip stream cut short, and one whose CRC does not match */
    n = make_images(img, 0x803, 5, 3, 4, 60);
    write_gz(tmp_path("ok.gz"), img, n);
    unsigned char gz[4096];
    size_t gn = read_back(tmp_path("ok.gz"), gz, sizeof gz);
    CHECK(gn > 30, "gzip file written");
    write_file(tmp_path("cut.gz"), gz, gn - 12);
    expect_idx_error(tmp_path("cut.gz"), l5, "gzip stream is truncated", tmp_path("cut.gz"),
                     TDM_ERR_FORMAT);
    gz[gn - 6] ^= 0x5a; /* inside the CRC-32 of the trailer */
    write_file(tmp_path("crc.gz"), gz, gn);
    expect_idx_error(tmp_path("crc.gz"), l5, "corrupt gzip data", tmp_path("crc.gz"),
                     TDM_ERR_FORMAT);
    /* bytes after the gzip stream that are not another member: gzread would skip them */
    gz[gn - 6] ^= 0x5a;
    memcpy(gz + gn, "garbage", 7);
    write_file(tmp_path("garbage.gz"), gz, gn + 7);
    expect_idx_error(tmp_path("garbage.gz"), l5, "trailing data after the gzip stream",
                     tmp_path("garbage.gz"), TDM_ERR_FORMAT);
    char at[64];
    snprintf(at, sizeof at, "ends at byte offset %zu of the file's %zu bytes", gn, gn + 7);
    expect_idx_error(tmp_path("garbage.gz"), l5, at, tmp_path("garbage.gz"), TDM_ERR_FORMAT);
    gz[gn] = 0x1f; /* one byte of a gzip magic, then the end of the file */
    write_file(tmp_path("garbage1.gz"), gz, gn + 1);
    expect_idx_error(tmp_path("garbage1.gz"), l5, "trailing data after the gzip stream",
                     tmp_path("garbage1.gz"), TDM_ERR_FORMAT);
    nl = make_labels(lab, 5, 5, 3);
    write_gz(tmp_path("lab5.gz"), lab, nl);
    size_t lgn = read_back(tmp_path("lab5.gz"), gz, sizeof gz);
    gz[lgn] = 0;
    write_file(tmp_path("lab_nul.gz"), gz, lgn + 1); /* one NUL byte after the labels */
    expect_idx_error(tmp_path("ok.gz"), tmp_path("lab_nul.gz"), "trailing data after the gzip",
                     tmp_path("lab_nul.gz"), TDM_ERR_FORMAT);

    /* images and labels disagree */
    make_labels(lab, 6, 6, 3);
    write_file(tmp_path("l6"), lab, 14);
    expect_idx_error(tmp_path("img"), tmp_path("l6"), "count mismatch", "holds 5 images",
                     TDM_ERR_FORMAT);
    make_labels(lab, 5, 3, 3);
    write_file(tmp_path("lshort"), lab, 11);
    expect_idx_error(tmp_path("img"), tmp_path("lshort"), "truncated", tmp_path("lshort"),
                     TDM_ERR_FORMAT);

    expect_idx_error(tmp_path("missing"), l5, "cannot open", tmp_path("missing"), TDM_ERR_IO);
    expect_idx_error(tmpdir, l5, "not a regular file", tmpdir, TDM_ERR_IO);
    CHECK_ERROR(!tdm_idx_dataset_open(NULL, l5), "must not be NULL");
}

/* ---- Fashion-MNIST ------------------------------------------------------------------------ */

/* tdm_fashion_mnist_first: the first images only, each as the whole file's; the labels all
 * checked; what lies past the prefix unread (trailing data unnoticed), a truncation inside it
 * an error. dir holds the four images of img (ni bytes) as its test split. */
static void test_fashion_first(const char *dir, unsigned char *img, size_t ni,
                               const unsigned char *lab, size_t nl) {
    tdm_dataset *whole = tdm_fashion_mnist(dir, false);
    int64_t counts[4][2] = {{2, 2}, {1, 1}, {0, 4}, {9, 4}}; /* asked, held */
    for (int c = 0; c < 4; c++) {
        tdm_dataset *ds = tdm_fashion_mnist_first(dir, false, counts[c][0]);
        CHECK(ds && ds->n == counts[c][1] && ds->num_classes == 10, "first %lld: %lld samples (%s)",
              (long long)counts[c][0], ds ? (long long)ds->n : -1LL, tdm_last_error());
        for (int64_t i = 0; ds && whole && i < ds->n; i++) {
            float a[28 * 28], b[28 * 28];
            int64_t ya = -1, yb = -2;
            CHECK(ds->ops->get(ds, i, a, &ya) == TDM_OK &&
                      whole->ops->get(whole, i, b, &yb) == TDM_OK && ya == yb &&
                      memcmp(a, b, sizeof a) == 0,
                  "first %lld: sample %lld differs from the whole file's", (long long)counts[c][0],
                  (long long)i);
        }
        if (ds)
            CHECK_ERROR(ds->ops->get(ds, ds->n, (float[28 * 28]){0}, &(int64_t){0}) != 0,
                        "out of range");
        tdm_dataset_free(ds);
    }
    tdm_dataset_free(whole);
    /* gzipped (a raw file's size is checked against its header without reading it): trailing
     * bytes after the fourth image are seen by the whole read only */
    img[ni] = 7;
    write_gz(tmp_path("fm/t10k-images-idx3-ubyte.gz"), img, ni + 1);
    tdm_dataset *ds = tdm_fashion_mnist_first(dir, false, 3);
    CHECK(ds && ds->n == 3, "first 3 past trailing data (%s)", tdm_last_error());
    tdm_dataset_free(ds);
    CHECK_ERROR(!tdm_fashion_mnist(dir, false), "trailing data");
    /* the data cut inside the third image: an error for a prefix that needs it, not for 2 */
    write_gz(tmp_path("fm/t10k-images-idx3-ubyte.gz"), img, 16 + 2 * 28 * 28 + 100);
    CHECK_ERROR(!tdm_fashion_mnist_first(dir, false, 3), "truncated");
    ds = tdm_fashion_mnist_first(dir, false, 2);
    CHECK(ds && ds->n == 2, "first 2 of a file cut in the third image (%s)", tdm_last_error());
    tdm_dataset_free(ds);
    /* a bad label past the prefix is still found: every label is read */
    unsigned char bad[8 + 4];
    memcpy(bad, lab, nl);
    bad[8 + 3] = 10;
    write_gz(tmp_path("fm/t10k-images-idx3-ubyte.gz"), img, ni);
    write_gz(tmp_path("fm/t10k-labels-idx1-ubyte.gz"), bad, nl);
    CHECK_ERROR(!tdm_fashion_mnist_first(dir, false, 1), "label 10 at byte offset 11");
}

static void test_fashion_crafted(void) {
    unsigned char img[16 + 4 * 28 * 28 + 1], lab[8 + 4]; /* a byte for trailing data */
    char dir[128];
    snprintf(dir, sizeof dir, "%s/fm", tmpdir);
    CHECK(mkdir(dir, 0700) == 0, "mkdir %s", dir);
    size_t ni = make_images(img, 0x803, 4, 28, 28, 4 * 28 * 28);
    size_t nl = make_labels(lab, 4, 4, 10);
    lab[8 + 3] = 10; /* one past the ten classes */
    write_gz(tmp_path("fm/train-images-idx3-ubyte.gz"), img, ni);
    write_gz(tmp_path("fm/train-labels-idx1-ubyte.gz"), lab, nl);
    CHECK_ERROR(!tdm_fashion_mnist(dir, true), "label 10 at byte offset 11 (sample 3) is out of "
                                               "range [0, 10)");
    /* unpacked files are found too; a split with labels 0..3 still has 10 classes */
    lab[8 + 3] = 3;
    write_file(tmp_path("fm/t10k-images-idx3-ubyte"), img, ni);
    write_file(tmp_path("fm/t10k-labels-idx1-ubyte"), lab, nl);
    tdm_dataset *ds = tdm_fashion_mnist(dir, false);
    CHECK(ds && ds->n == 4 && ds->num_classes == 10 && strcmp(ds->name, "fashion-mnist/test") == 0,
          "crafted fashion test split (%s)", tdm_last_error());
    tdm_dataset_free(ds);
    CHECK_ERROR(!tdm_fashion_mnist(tmpdir, true), "cannot open");
    test_fashion_first(dir, img, ni, lab, nl);
}

/* The raw bytes of a gzipped file, decompressed independently of the library. */
static unsigned char *gunzip_all(const char *path, size_t size) {
    unsigned char *buf = malloc(size);
    gzFile g = gzopen(path, "rb");
    int got = g && buf ? gzread(g, buf, (unsigned)size) : -1;
    if (g) gzclose(g);
    if (got != (int)size) free(buf);
    return got == (int)size ? buf : NULL;
}

static void test_fashion_real(void) {
    const char *dir = "/usr/share/datasets/fashion-mnist";
    if (access(dir, R_OK) != 0) {
        printf("skipped: %s not installed (apt install dataset-fashion-mnist)\n", dir);
        return;
    }
    tdm_dataset *tr = tdm_fashion_mnist(NULL, true), *te = tdm_fashion_mnist(dir, false);
    CHECK(tr && tr->n == 60000 && te && te->n == 10000, "split sizes (%s)", tdm_last_error());
    if (!tr || !te) goto done;
    CHECK(tr->sample_shape.ndim == 3 && tr->sample_shape.d[0] == 1 && tr->sample_shape.d[1] == 28 &&
              tr->sample_shape.d[2] == 28 && tr->num_classes == 10 && te->num_classes == 10,
          "shape [1, 28, 28], 10 classes");
    CHECK(strcmp(tr->name, "fashion-mnist/train") == 0, "name %s", tr->name);
    float x[784];
    int64_t y = -1, counts[10] = {0};
    CHECK(tr->ops->get(tr, 0, x, &y) == 0 && y == 9, "train label[0] = %lld", (long long)y);
    CHECK(te->ops->get(te, 0, x, &y) == 0 && y == 9, "test label[0] = %lld", (long long)y);
    for (int64_t i = 0; i < tr->n; i++) {
        tr->ops->get(tr, i, x, &y);
        if (y >= 0 && y < 10) counts[y]++;
    }
    for (int c = 0; c < 10; c++)
        CHECK(counts[c] == 6000, "class %d has %lld", c, (long long)counts[c]);
    /* pixels against an independent decompression */
    unsigned char *raw =
        gunzip_all("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz", 16 + 10000 * 784);
    CHECK(raw != NULL, "independent gunzip");
    int bad = 0;
    for (int64_t i = 0; raw && i < te->n; i += 997) {
        te->ops->get(te, i, x, &y);
        for (int j = 0; j < 784; j++) bad += x[j] != (float)raw[16 + i * 784 + j] / 255.0f;
    }
    CHECK(bad == 0, "%d pixels differ", bad);
    free(raw);
done:
    tdm_dataset_free(tr);
    tdm_dataset_free(te);
}

/* ---- token shards ------------------------------------------------------------------------- */

/* A shard claiming `claim` tokens, holding `have`, token k = (k * 37) % 1000. */
static void write_shard(const char *path, int32_t magic, int32_t version, int32_t claim,
                        int32_t have) {
    size_t size = 1024 + 2 * (size_t)have;
    unsigned char *b = calloc(1, size);
    int32_t h[3] = {magic, version, claim};
    for (int k = 0; k < 3; k++)
        for (int j = 0; j < 4; j++) b[4 * k + j] = (unsigned char)((uint32_t)h[k] >> (8 * j));
    for (int32_t k = 0; k < have; k++) {
        uint16_t t = (uint16_t)((k * 37) % 1000);
        b[1024 + 2 * k] = (unsigned char)t, b[1024 + 2 * k + 1] = (unsigned char)(t >> 8);
    }
    write_file(path, b, size);
    free(b);
}

static void test_tokens(void) {
    const char *p = tmp_path("shard.bin");
    write_shard(p, 20240520, 1, 14, 14);
    tdm_dataset *ds = tdm_token_dataset_open(p, 4, 1000);
    CHECK(ds && ds->n == 3 && ds->x_dtype == TDM_I64 && ds->sample_shape.ndim == 1 &&
              ds->sample_shape.d[0] == 4 && ds->target_shape.ndim == 1 &&
              ds->target_shape.d[0] == 4 && ds->num_classes == 1000,
          "token metadata (%s)", tdm_last_error());
    int bad = 0;
    for (int64_t i = 0; ds && i < ds->n; i++) {
        int64_t x[4], y[4];
        CHECK(ds->ops->get(ds, i, x, y) == 0, "get window %lld", (long long)i);
        for (int j = 0; j < 4; j++) {
            bad += x[j] != ((i * 4 + j) * 37) % 1000;
            bad += y[j] != ((i * 4 + j + 1) * 37) % 1000;
        }
    }
    CHECK(bad == 0, "%d window tokens differ", bad);
    int64_t x[4], y[4];
    if (ds) CHECK_ERROR(ds->ops->get(ds, 3, x, y) != 0, "index 3 out of range [0, 3)");
    tdm_dataset_free(ds);
    /* context 1: pairs */
    ds = tdm_token_dataset_open(p, 1, 1000);
    CHECK(ds && ds->n == 13, "context 1 gives 13 pairs");
    if (ds)
        CHECK(ds->ops->get(ds, 12, x, y) == 0 && x[0] == (12 * 37) % 1000 &&
                  y[0] == (13 * 37) % 1000,
              "last pair");
    tdm_dataset_free(ds);

    CHECK_ERROR(!tdm_token_dataset_open(p, 4, 400), "token 407 at byte offset 1046 (token 11)");
    tdm_clear_error();
    CHECK(!tdm_token_dataset_open(p, 4, 400) && strstr(tdm_last_error(), p) &&
              tdm_last_status() == TDM_ERR_FORMAT,
          "vocab error names the file: %s", tdm_last_error());
    CHECK_ERROR(!tdm_token_dataset_open(p, 4, 37), "token 37 at byte offset 1026 (token 1) is >= "
                                                   "vocab 37");
    CHECK_ERROR(!tdm_token_dataset_open(p, 14, 1000), "too few");
    CHECK_ERROR(!tdm_token_dataset_open(p, 0, 1000), "context");
    CHECK_ERROR(!tdm_token_dataset_open(p, 4, 0), "vocab");

    write_shard(tmp_path("bad_magic.bin"), 20240521, 1, 14, 14);
    CHECK_ERROR(!tdm_token_dataset_open(tmp_path("bad_magic.bin"), 4, 1000),
                "wrong magic 20240521 at byte offset 0");
    write_shard(tmp_path("bad_version.bin"), 20240520, 2, 14, 14);
    CHECK_ERROR(!tdm_token_dataset_open(tmp_path("bad_version.bin"), 4, 1000),
                "unsupported version 2 at byte offset 4");
    write_shard(tmp_path("short.bin"), 20240520, 1, 14, 13);
    CHECK_ERROR(!tdm_token_dataset_open(tmp_path("short.bin"), 4, 1000),
                "token count 14 at byte offset 8 disagrees with the file size: 1050 bytes, "
                "expected 1052");
    write_shard(tmp_path("long.bin"), 20240520, 1, 14, 15);
    CHECK_ERROR(!tdm_token_dataset_open(tmp_path("long.bin"), 4, 1000), "disagrees");
    write_shard(tmp_path("negative.bin"), 20240520, 1, -5, 14);
    CHECK_ERROR(!tdm_token_dataset_open(tmp_path("negative.bin"), 4, 1000), "token count -5");
    write_file(tmp_path("tiny.bin"), "abc", 3);
    CHECK_ERROR(!tdm_token_dataset_open(tmp_path("tiny.bin"), 4, 1000),
                "truncated header: the file ends at byte offset 3");
    CHECK_ERROR(!tdm_token_dataset_open(tmp_path("nothing.bin"), 4, 1000), "cannot open");
}

/* ---- CSV ---------------------------------------------------------------------------------- */

static tdm_dataset *csv(const char *name, const char *text, int label_column, bool header) {
    write_file(tmp_path(name), text, strlen(text));
    return tdm_csv_dataset_open(tmp_path(name), label_column, header);
}

static void test_csv(void) {
    tdm_dataset *ds = csv("a.csv", "f1,f2,label\n0.5, -1.25 ,2\r\n\n3e2,4,0\n7,8,1", -1, true);
    CHECK(ds && ds->n == 3 && ds->sample_shape.ndim == 1 && ds->sample_shape.d[0] == 2 &&
              ds->num_classes == 3 && ds->x_dtype == TDM_F32 && ds->target_shape.ndim == 0,
          "csv metadata (%s)", tdm_last_error());
    float want[3][2] = {{0.5f, -1.25f}, {300, 4}, {7, 8}};
    int64_t labels[3] = {2, 0, 1};
    int bad = 0;
    for (int64_t i = 0; ds && i < 3; i++) {
        float x[2];
        int64_t y;
        CHECK(ds->ops->get(ds, i, x, &y) == 0, "csv get");
        bad += x[0] != want[i][0] || x[1] != want[i][1] || y != labels[i];
    }
    CHECK(bad == 0, "%d csv rows differ", bad);
    tdm_dataset_free(ds);
    /* label in the first column, no header */
    ds = csv("b.csv", "4,1.5,2.5\n0,3,4\n", 0, false);
    float x[2];
    int64_t y;
    CHECK(ds && ds->n == 2 && ds->num_classes == 5 && ds->ops->get(ds, 0, x, &y) == 0 && y == 4 &&
              x[0] == 1.5f && x[1] == 2.5f,
          "label column 0 (%s)", tdm_last_error());
    tdm_dataset_free(ds);
    ds = csv("c.csv", "1,2,0\n3,4,1\n", -3, false); /* -3 is column 0 */
    CHECK(ds && ds->ops->get(ds, 1, x, &y) == 0 && y == 3 && x[0] == 4 && x[1] == 1,
          "label column -3");
    tdm_dataset_free(ds);

    CHECK_ERROR(!csv("ragged.csv", "1,2,0\n3,4,1\n5,6\n", -1, false),
                "line 3 has 2 fields, expected 3");
    CHECK_ERROR(!csv("ragged2.csv", "a,b,c\n1,2,0\n3,4,1,9\n", -1, true), "ragged");
    CHECK_ERROR(!csv("nan.csv", "h\n1,2,0\n3,x4,1\n", -1, true), "line 3, column 2: 'x4' is not a "
                                                                 "number");
    CHECK_ERROR(!csv("empty_field.csv", "1,,0\n", -1, false), "line 1, column 2: '' is not a "
                                                              "number");
    CHECK_ERROR(!csv("inf.csv", "1,inf,0\n", -1, false), "not a finite");
    CHECK_ERROR(!csv("frac.csv", "1,2,0.5\n", -1, false), "line 1, column 3: '0.5' is not an "
                                                          "integer label");
    CHECK_ERROR(!csv("neg.csv", "1,2,0\n1,2,-1\n", -1, false), "line 2, column 3: label -1");
    CHECK_ERROR(!csv("col.csv", "1,2,0\n", 3, false), "label_column 3 is out of range");
    CHECK_ERROR(!csv("one.csv", "1\n2\n", -1, false), "at least one feature");
    CHECK_ERROR(!csv("hdr.csv", "a,b\n\n", -1, true), "no data rows");
    CHECK_ERROR(!csv("none.csv", "", -1, false), "no data rows");
    tdm_clear_error();
    CHECK(!csv("named.csv", "1,2,0\n1,q,0\n", -1, false) &&
              strstr(tdm_last_error(), tmp_path("named.csv")) &&
              tdm_last_status() == TDM_ERR_FORMAT,
          "csv error names the file: %s", tdm_last_error());
    CHECK_ERROR(!tdm_csv_dataset_open(tmp_path("absent.csv"), -1, false), "cannot open");
    /* grows past its first allocation */
    char *big = malloc(200 * 16);
    size_t len = 0;
    for (int i = 0; i < 200; i++) len += (size_t)sprintf(big + len, "%d,%d.5,%d\n", i, -i, i % 7);
    ds = csv("big.csv", big, 2, false);
    CHECK(ds && ds->n == 200 && ds->num_classes == 7 && ds->ops->get(ds, 199, x, &y) == 0 &&
              x[0] == 199 && x[1] == -199.5f && y == 199 % 7,
          "200-row csv (%s)", tdm_last_error());
    tdm_dataset_free(ds);
    free(big);
}

/* ---- memory ------------------------------------------------------------------------------- */

static void test_memory(void) {
    float xs[3 * 2 * 2];
    int64_t ys[3] = {1, 0, 1};
    for (int k = 0; k < 12; k++) xs[k] = (float)k * 0.5f;
    tdm_dataset *ds = tdm_memory_dataset(TDM_SHAPE(2, 2), 3, xs, ys, 2);
    xs[4] = -1, ys[1] = 7; /* copied: later changes do not show */
    float x[4];
    int64_t y;
    CHECK(ds && ds->n == 3 && tdm_dataset_sample_numel(ds) == 4 && ds->num_classes == 2 &&
              ds->ops->get(ds, 1, x, &y) == 0 && x[0] == 2.0f && x[3] == 3.5f && y == 0,
          "memory dataset (%s)", tdm_last_error());
    if (ds) CHECK_ERROR(ds->ops->get(ds, 3, x, &y) != 0, "dataset memory: index 3 out of range");
    tdm_dataset_free(ds);
    ys[1] = 2;
    CHECK_ERROR(!tdm_memory_dataset(TDM_SHAPE(2, 2), 3, xs, ys, 2),
                "label y[1] = 2 out of range [0, 2)");
    CHECK_ERROR(!tdm_memory_dataset(TDM_SHAPE(2, 2), 3, NULL, ys, 2), "must not be NULL");
    CHECK_ERROR(!tdm_memory_dataset(TDM_SHAPE(2, 0), 3, xs, ys, 3), "invalid sample shape");
    CHECK_ERROR(!tdm_memory_dataset(TDM_SHAPE(1 << 30, 1 << 30), (int64_t)1 << 40, xs, ys, 3),
                "overflow");
    CHECK_ERROR(!tdm_memory_dataset(TDM_SHAPE(4), 0, xs, ys, 3), "n must be positive");
    CHECK(tdm_dataset_sample_numel(NULL) == 0, "numel of NULL");
    tdm_clear_error();
}

/* ---- concurrent get ----------------------------------------------------------------------- */

typedef struct {
    const tdm_dataset *ds;
    int start; /* threads walk the samples in different orders */
    uint64_t checksum;
    int failures;
} walker;

static void *walk(void *arg) {
    walker *w = (walker *)arg;
    const tdm_dataset *ds = w->ds;
    int64_t numel = tdm_dataset_sample_numel(ds), tnumel = tdm_shape_numel(ds->target_shape);
    size_t xsize = (size_t)numel * (ds->x_dtype == TDM_F32 ? 4 : 8);
    void *x = malloc(xsize);
    int64_t *y = malloc((size_t)(tnumel ? tnumel : 1) * sizeof(int64_t));
    for (int64_t k = 0; k < ds->n; k++) {
        int64_t i = w->start ? ds->n - 1 - k : k;
        if (ds->ops->get(ds, i, x, y) != 0) w->failures++;
        uint64_t h = (uint64_t)i * 0x9e3779b97f4a7c15ull;
        const unsigned char *b = x;
        for (size_t j = 0; j < xsize; j += 7) h = h * 31 + b[j];
        h += (uint64_t)y[0];
        w->checksum += h;
    }
    free(x);
    free(y);
    return NULL;
}

static void check_concurrent(const tdm_dataset *ds, const char *what) {
    walker single = {ds, 0, 0, 0}, w[2] = {{ds, 0, 0, 0}, {ds, 1, 0, 0}};
    walk(&single);
    pthread_t t[2];
    for (int k = 0; k < 2; k++) pthread_create(&t[k], NULL, walk, &w[k]);
    for (int k = 0; k < 2; k++) pthread_join(t[k], NULL);
    CHECK(w[0].failures + w[1].failures == 0 && w[0].checksum == single.checksum &&
              w[1].checksum == single.checksum,
          "%s: concurrent gets agree with a single thread", what);
}

static void test_concurrent(void) {
    tdm_dataset *img = tdm_idx_dataset_open(tmp_path("img.gz"), tmp_path("lab.gz"));
    tdm_dataset *tok = tdm_token_dataset_open(tmp_path("shard.bin"), 2, 1000);
    CHECK(img && tok, "datasets for the threads");
    if (img) check_concurrent(img, "idx");
    if (tok) check_concurrent(tok, "tokens");
    tdm_dataset *fm = access("/usr/share/datasets/fashion-mnist", R_OK) == 0
                          ? tdm_fashion_mnist(NULL, false)
                          : NULL;
    if (fm) check_concurrent(fm, "fashion-mnist test");
    tdm_dataset_free(img);
    tdm_dataset_free(tok);
    tdm_dataset_free(fm);
}

/* Removes the files of the temporary directory (one level of subdirectories). */
/* Every byte value divided by 255 in f32, bit for bit, at every length that ends a vector
 * step early (8 and 16 bytes a step) and from unaligned starts. */
static void test_bytes_to_unit(void) {
    uint8_t bytes[256 + 40];
    float out[256 + 40];
    for (int i = 0; i < (int)sizeof bytes; i++) bytes[i] = (uint8_t)(i * 7 + 3);
    int bad = 0;
    for (int start = 0; start < 3; start++)
        for (int n = 0; n <= 256 + 37; n++) {
            memset(out, 0xff, sizeof out);
            tdm_ds_bytes_to_unit(out + start, bytes + start, n);
            for (int i = 0; i < n; i++) {
                volatile float want = (float)bytes[start + i] / 255.0f;
                bad += out[start + i] != want;
            }
            bad += n + start < (int)(sizeof out / sizeof out[0]) &&
                   out[start + n] == out[start + n]; /* past the end: untouched (NaN) */
        }
    CHECK(bad == 0, "bytes_to_unit: %d floats differ from the division by 255", bad);
}

int main(void) {
    if (tmpdir_make("test_datasets") != 0) return 1;
    test_bytes_to_unit();
    test_idx_valid();
    test_idx_errors();
    test_fashion_crafted();
    test_fashion_real();
    test_tokens();
    test_csv();
    test_memory();
    test_concurrent();
    tmpdir_remove();
    return check_summary();
}
