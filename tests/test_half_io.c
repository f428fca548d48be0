/* bf16 and fp16 tensors on the CPU: creation, fills and random draws, casts with PyTorch's
 * rounding (the bits of tests/fixtures/safetensors/half.safetensors, written by
 * gen_half_files.py from PyTorch's .to()), tdm_to_dtype's gradient, and safetensors files
 * holding BF16 and F16 read, converted and written. */
#include "check.h"
#include "testdir.h"
#include "tandem/half.h"
#include "io/io_internal.h" /* tdm_safetensors_read_bytes */

#include <math.h>
#include <string.h>

#define HALF_FILE "tests/fixtures/safetensors/half.safetensors"
#define NX        32 /* the values of "x" in HALF_FILE */

static const tdm_dtype halves[2] = {TDM_BF16, TDM_F16};

static uint16_t round_to(tdm_dtype dt, float x) {
    return dt == TDM_BF16 ? tdm_bf16_from_float(x) : tdm_f16_from_float(x);
}

static float widen(tdm_dtype dt, uint16_t h) {
    return dt == TDM_BF16 ? tdm_bf16_to_float(h) : tdm_f16_to_float(h);
}

/* The 16-bit elements of t (at most cap) into out; how many, or -1. */
static int64_t bits16(const tdm_tensor *t, uint16_t *out, int64_t cap) {
    if (!t || tdm_dtype_size(t->dtype) != 2 || tdm_numel(t) > cap) return -1;
    return tdm_to_host(t, out, sizeof(uint16_t) * (size_t)cap) ? -1 : tdm_numel(t);
}

/* Whether every element of t (2-byte dtype) has the bits want. */
static bool all_bits(const tdm_tensor *t, uint16_t want) {
    uint16_t b[64];
    int64_t n = bits16(t, b, 64);
    for (int64_t i = 0; i < n; i++)
        if (b[i] != want) return false;
    return n > 0;
}

static bool same_f32_bits(const float *a, const float *b, int64_t n) {
    return memcmp(a, b, sizeof(float) * (size_t)n) == 0;
}

/* ---- creation, fills, draws ---------------------------------------------------------------- */

static void test_creation(void) {
    for (int k = 0; k < 2; k++) {
        tdm_dtype dt = halves[k];
        const char *nm = tdm_dtype_name(dt);
        tdm_scope_begin();
        float third = 1.0f / 3.0f;
        tdm_tensor *z = tdm_zeros(TDM_SHAPE(2, 3), dt, tdm_cpu(0));
        tdm_tensor *o = tdm_ones(TDM_SHAPE(5), dt, tdm_cpu(0));
        tdm_tensor *f = tdm_full(TDM_SHAPE(2, 3), third, dt, tdm_cpu(0));
        CHECK(z && z->dtype == dt && all_bits(z, 0), "%s zeros", nm);
        CHECK(all_bits(o, round_to(dt, 1.0f)), "%s ones", nm);
        CHECK(all_bits(f, round_to(dt, third)), "%s full(1/3) rounds once to nearest", nm);
        float v = tdm_item(tdm_slice(tdm_slice(f, 0, 1, 2, 1), 1, 2, 3, 1));
        CHECK(v == widen(dt, round_to(dt, third)) && v != third,
              "%s item is the stored value, widened", nm);
        /* a fill through a strided view writes exactly the view's elements */
        tdm_tensor *col = tdm_slice(z, 1, 1, 2, 1);
        CHECK(tdm_fill_(col, -2.75f) == TDM_OK, "%s", tdm_last_error());
        uint16_t b[64], m2 = round_to(dt, -2.75f);
        CHECK(bits16(z, b, 64) == 6 && b[0] == 0 && b[1] == m2 && b[2] == 0 && b[4] == m2 &&
                  b[5] == 0,
              "%s strided fill", nm);
        /* arange: each float start + i * step rounded once */
        tdm_tensor *r = tdm_arange(0, 3, 0.1, dt, tdm_cpu(0));
        int64_t n = bits16(r, b, 64);
        bool ok = n == 30;
        for (int64_t i = 0; ok && i < n; i++) ok = b[i] == round_to(dt, (float)(0.1 * (double)i));
        CHECK(ok, "%s arange", nm);
        /* from_data and to_host move the raw bits */
        uint16_t raw[4] = {0x3F80, 0x7FC0, 0x8001, 0xFFFF}, back[4] = {0};
        tdm_tensor *d = tdm_from_data(TDM_SHAPE(2, 2), dt, tdm_cpu(0), raw);
        CHECK(d && tdm_to_host(d, back, sizeof back) == TDM_OK && memcmp(raw, back, 8) == 0,
              "%s from_data/to_host", nm);
        tdm_scope_end();
    }
}

/* A draw into a bf16 or f16 tensor is the f32 draw of the same counters rounded once, also
 * through a strided view. */
static void test_random(void) {
    for (int k = 0; k < 2; k++) {
        tdm_dtype dt = halves[k];
        for (int dist = 0; dist < 2; dist++) {
            tdm_scope_begin();
            tdm_tensor *h = tdm_empty(TDM_SHAPE(3, 5), dt, tdm_cpu(0));
            tdm_tensor *f = tdm_empty(TDM_SHAPE(3, 5), TDM_F32, tdm_cpu(0));
            tdm_tensor *hv = tdm_transpose(h, 0, 1), *fv = tdm_transpose(f, 0, 1);
            tdm_rng r1 = tdm_rng_make(42), r2 = tdm_rng_make(42);
            int rc1 = dist ? tdm_normal_(hv, 0.5f, 2.0f, &r1) : tdm_uniform_(hv, -1, 3, &r1);
            int rc2 = dist ? tdm_normal_(fv, 0.5f, 2.0f, &r2) : tdm_uniform_(fv, -1, 3, &r2);
            float ff[15];
            uint16_t hb[15];
            bool ok = rc1 == TDM_OK && rc2 == TDM_OK && r1.offset == r2.offset &&
                      tdm_to_host(f, ff, sizeof ff) == TDM_OK && bits16(h, hb, 15) == 15;
            for (int i = 0; ok && i < 15; i++) ok = hb[i] == round_to(dt, ff[i]);
            CHECK(ok, "%s %s draw through a view: %s", tdm_dtype_name(dt),
                  dist ? "normal" : "uniform", tdm_last_error());
            /* contiguous: the fast conversion gives the same bits */
            tdm_tensor *hc = tdm_empty(TDM_SHAPE(15), dt, tdm_cpu(0));
            tdm_tensor *fc = tdm_empty(TDM_SHAPE(15), TDM_F32, tdm_cpu(0));
            r1 = tdm_rng_make(7), r2 = tdm_rng_make(7);
            ok = (dist ? tdm_normal_(hc, 0, 1, &r1) : tdm_uniform_(hc, 0, 1, &r1)) == TDM_OK &&
                 (dist ? tdm_normal_(fc, 0, 1, &r2) : tdm_uniform_(fc, 0, 1, &r2)) == TDM_OK &&
                 tdm_to_host(fc, ff, sizeof ff) == TDM_OK && bits16(hc, hb, 15) == 15;
            for (int i = 0; ok && i < 15; i++) ok = hb[i] == round_to(dt, ff[i]);
            CHECK(ok, "%s contiguous draw", tdm_dtype_name(dt));
            tdm_scope_end();
        }
    }
    tdm_scope_begin();
    tdm_tensor *i = tdm_zeros(TDM_SHAPE(2), TDM_I32, tdm_cpu(0));
    CHECK_ERROR(tdm_normal_(i, 0, 1, NULL) == TDM_ERR_DTYPE,
                "normal_: expected a floating-point tensor, got i32");
    CHECK_ERROR(!tdm_empty(TDM_SHAPE(2), (tdm_dtype)9, tdm_cpu(0)), "unknown dtype 9");
    CHECK_ERROR(!tdm_cast(i, (tdm_dtype)-1), "cast: unknown dtype -1 (from i32)");
    tdm_scope_end();
}

/* ---- casts: PyTorch's bits ------------------------------------------------------------------ */

/* PyTorch's x and x.to(bf16), x.to(f16), x.to(bf16).float() from HALF_FILE. */
typedef struct {
    float x[NX], bf16_f32[NX];
    uint16_t bf16[NX], f16[NX];
} torch_bits;

static bool read_torch_bits(torch_bits *t) {
    tdm_safetensors *f = tdm_safetensors_open(HALF_FILE);
    bool ok =
        f && tdm_safetensors_read_bytes(f, "x", 0, sizeof t->x, t->x) == TDM_OK &&
        tdm_safetensors_read_bytes(f, "x_bf16", 0, sizeof t->bf16, t->bf16) == TDM_OK &&
        tdm_safetensors_read_bytes(f, "x_f16", 0, sizeof t->f16, t->f16) == TDM_OK &&
        tdm_safetensors_read_bytes(f, "x_bf16_f32", 0, sizeof t->bf16_f32, t->bf16_f32) == TDM_OK;
    CHECK(ok, "reading %s: %s", HALF_FILE, tdm_last_error());
    tdm_safetensors_close(f);
    return ok;
}

static void test_cast_rne(void) {
    torch_bits t;
    if (!read_torch_bits(&t)) return;
    tdm_scope_begin();
    tdm_tensor *x = f32(TDM_SHAPE(NX), t.x);
    for (int k = 0; k < 2; k++) {
        tdm_dtype dt = halves[k];
        const uint16_t *want = dt == TDM_BF16 ? t.bf16 : t.f16;
        uint16_t b[NX];
        CHECK(bits16(tdm_cast(x, dt), b, NX) == NX && memcmp(b, want, sizeof b) == 0,
              "cast f32 -> %s has PyTorch's bits (ties to even, denormals, overflow, NaN)",
              tdm_dtype_name(dt));
        CHECK(bits16(tdm_to_dtype(x, dt), b, NX) == NX && memcmp(b, want, sizeof b) == 0,
              "to_dtype f32 -> %s", tdm_dtype_name(dt));
        /* a strided source goes the element-by-element way: the same bits, in view order */
        tdm_tensor *xt = tdm_transpose(tdm_reshape(x, TDM_SHAPE(4, 8)), 0, 1);
        bool ok = bits16(tdm_cast(xt, dt), b, NX) == NX;
        for (int i = 0; ok && i < NX; i++) ok = b[i] == want[(i % 4) * 8 + i / 4];
        CHECK(ok, "cast of a strided f32 view -> %s", tdm_dtype_name(dt));
        /* back to f32: exact */
        tdm_tensor *h = tdm_from_data(TDM_SHAPE(NX), dt, tdm_cpu(0), want);
        float w[NX], expect[NX];
        for (int i = 0; i < NX; i++) expect[i] = widen(dt, want[i]);
        CHECK(tdm_to_host(tdm_cast(h, TDM_F32), w, sizeof w) == TDM_OK &&
                  same_f32_bits(w, expect, NX),
              "cast %s -> f32 is exact", tdm_dtype_name(dt));
        if (dt == TDM_BF16)
            CHECK(same_f32_bits(w, t.bf16_f32, NX), "bf16 -> f32 equals PyTorch's .float()");
        /* between the two 16-bit formats: through the float value */
        tdm_dtype other = halves[1 - k];
        ok = bits16(tdm_cast(h, other), b, NX) == NX;
        for (int i = 0; ok && i < NX; i++) ok = b[i] == round_to(other, widen(dt, want[i]));
        CHECK(ok, "cast %s -> %s", tdm_dtype_name(dt), tdm_dtype_name(other));
        /* integers: each value rounded once (257 is a bf16 tie, to 256) */
        tdm_tensor *ints = tdm_arange(250, 270, 1, TDM_I32, tdm_cpu(0));
        ok = bits16(tdm_cast(ints, dt), b, NX) == 20;
        for (int i = 0; ok && i < 20; i++) ok = b[i] == round_to(dt, (float)(250 + i));
        CHECK(ok, "cast i32 -> %s", tdm_dtype_name(dt));
        int64_t back[20];
        ok = tdm_to_host(tdm_cast(tdm_cast(ints, dt), TDM_I64), back, sizeof back) == TDM_OK;
        CHECK(ok && back[7] == (dt == TDM_BF16 ? 256 : 257), "%s -> i64", tdm_dtype_name(dt));
    }
    tdm_scope_end();
}

/* ---- tdm_to_dtype's gradient ---------------------------------------------------------------- */

/* L = sum(to_dtype(to_dtype(x, dt), f32) * w): dL/dx is w rounded to dt and widened back,
 * bit for bit (the backward of the outer cast rounds w, the inner one widens it). */
static void test_to_dtype_grad(void) {
    enum { N = 12 };
    float xv[N], wv[N];
    for (int i = 0; i < N; i++) {
        xv[i] = 0.37f * (float)i - 1.9f;
        wv[i] = 1.0f + (float)i / 256.0f + (float)i / 2048.0f; /* ties and non-ties of both */
    }
    wv[3] = 1e-7f, wv[4] = 70000.0f, wv[5] = -1.0f / 3.0f;
    for (int k = 0; k < 2; k++) {
        tdm_dtype dt = halves[k];
        tdm_tensor *x = f32(TDM_SHAPE(3, 4), xv);
        tdm_requires_grad_(x, true);
        tdm_scope_begin();
        tdm_tensor *h = tdm_to_dtype(x, dt);
        tdm_tensor *y = tdm_to_dtype(h, TDM_F32);
        CHECK(h && h->dtype == dt && h->requires_grad && y && y->requires_grad,
              "%s: the casts are recorded: %s", tdm_dtype_name(dt), tdm_last_error());
        tdm_tensor *loss = tdm_sum_all(tdm_mul(y, f32(TDM_SHAPE(3, 4), wv)));
        CHECK(tdm_backward(loss) == TDM_OK, "backward: %s", tdm_last_error());
        float g[N], expect[N];
        for (int i = 0; i < N; i++) expect[i] = widen(dt, round_to(dt, wv[i]));
        CHECK(x->grad && tdm_to_host(x->grad, g, sizeof g) == TDM_OK && same_f32_bits(g, expect, N),
              "%s: dL/dx is the %s-rounded gradient widened back", tdm_dtype_name(dt),
              tdm_dtype_name(dt));
        tdm_scope_end();
        tdm_tensor_free(x);
    }
    /* same dtype: a new tensor (as tdm_cast), the gradient passed as it is */
    tdm_tensor *x = f32(TDM_SHAPE(3, 4), xv);
    tdm_requires_grad_(x, true);
    tdm_scope_begin();
    tdm_tensor *y = tdm_to_dtype(x, TDM_F32);
    CHECK(y && y != x && y->storage != x->storage && y->requires_grad, "f32 -> f32 copies");
    CHECK(tdm_backward(tdm_sum_all(tdm_mul(y, f32(TDM_SHAPE(3, 4), wv)))) == TDM_OK, "%s",
          tdm_last_error());
    float g[N];
    CHECK(x->grad && tdm_to_host(x->grad, g, sizeof g) == TDM_OK && same_f32_bits(g, wv, N),
          "f32 -> f32 passes the gradient unchanged");
    /* integers carry no gradient; tdm_cast records nothing */
    tdm_tensor *i = tdm_to_dtype(x, TDM_I32);
    CHECK(i && i->dtype == TDM_I32 && !i->requires_grad && !i->grad_fn, "to i32: no history");
    tdm_tensor *c = tdm_cast(x, TDM_BF16);
    CHECK(c && !c->requires_grad && !c->grad_fn, "tdm_cast: no history");
    CHECK(!tdm_to_dtype(NULL, TDM_BF16), "NULL in, NULL out");
    tdm_scope_end();
    tdm_tensor_free(x);
}

/* ---- safetensors ---------------------------------------------------------------------------- */

static void test_safetensors_read(void) {
    torch_bits t;
    if (!read_torch_bits(&t)) return;
    tdm_safetensors *f = tdm_safetensors_open(HALF_FILE);
    if (!f) return;
    tdm_scope_begin();
    int kb = tdm_safetensors_find(f, "x_bf16"), kh = tdm_safetensors_find(f, "x_f16");
    tdm_dtype db = TDM_F32, dh = TDM_F32;
    CHECK(kb >= 0 && strcmp(tdm_safetensors_dtype(f, kb), "BF16") == 0 &&
              tdm_safetensors_tdm_dtype(f, kb, &db) == TDM_OK && db == TDM_BF16,
          "BF16 is bf16");
    CHECK(kh >= 0 && strcmp(tdm_safetensors_dtype(f, kh), "F16") == 0 &&
              tdm_safetensors_tdm_dtype(f, kh, &dh) == TDM_OK && dh == TDM_F16,
          "F16 is f16");
    uint16_t b[NX];
    tdm_tensor *lb = tdm_safetensors_load(f, "x_bf16", tdm_cpu(0));
    CHECK(lb && lb->dtype == TDM_BF16 && bits16(lb, b, NX) == NX &&
              memcmp(b, t.bf16, sizeof b) == 0,
          "a BF16 tensor loads as bf16 with its bits: %s", tdm_last_error());
    tdm_tensor *lh = tdm_safetensors_load(f, "x_f16", tdm_cpu(0));
    CHECK(lh && lh->dtype == TDM_F16 && bits16(lh, b, NX) == NX && memcmp(b, t.f16, sizeof b) == 0,
          "an F16 tensor loads as f16 with its bits");
    /* into existing tensors of another float dtype: converted */
    float w[NX], expect[NX];
    tdm_tensor *dst = tdm_zeros(TDM_SHAPE(NX), TDM_F32, tdm_cpu(0));
    CHECK(tdm_safetensors_read(f, "x_bf16", dst) == TDM_OK &&
              tdm_to_host(dst, w, sizeof w) == TDM_OK && same_f32_bits(w, t.bf16_f32, NX),
          "BF16 into f32 widens exactly: %s", tdm_last_error());
    for (int i = 0; i < NX; i++) expect[i] = tdm_f16_to_float(t.f16[i]);
    CHECK(tdm_safetensors_read(f, "x_f16", dst) == TDM_OK &&
              tdm_to_host(dst, w, sizeof w) == TDM_OK && same_f32_bits(w, expect, NX),
          "F16 into f32 widens exactly");
    tdm_tensor *hb = tdm_zeros(TDM_SHAPE(NX), TDM_BF16, tdm_cpu(0));
    CHECK(tdm_safetensors_read(f, "x", hb) == TDM_OK && bits16(hb, b, NX) == NX &&
              memcmp(b, t.bf16, sizeof b) == 0,
          "F32 into bf16 rounds as PyTorch");
    tdm_tensor *hh = tdm_zeros(TDM_SHAPE(NX), TDM_F16, tdm_cpu(0));
    bool ok = tdm_safetensors_read(f, "x_bf16", hh) == TDM_OK && bits16(hh, b, NX) == NX;
    for (int i = 0; ok && i < NX; i++)
        ok = b[i] == tdm_f16_from_float(tdm_bf16_to_float(t.bf16[i]));
    CHECK(ok, "BF16 into f16 through the float value");
    /* a strided destination gets the converted values in row-major order */
    tdm_tensor *m = tdm_zeros(TDM_SHAPE(2, NX), TDM_F32, tdm_cpu(0));
    float two[2 * NX];
    ok = tdm_safetensors_read(f, "x_bf16", tdm_squeeze(tdm_slice(m, 0, 1, 2, 1), 0)) == TDM_OK &&
         tdm_to_host(m, two, sizeof two) == TDM_OK && same_f32_bits(two + NX, t.bf16_f32, NX);
    for (int i = 0; ok && i < NX; i++) ok = two[i] == 0;
    CHECK(ok, "BF16 into a view of an f32 tensor: %s", tdm_last_error());
    /* what stays refused */
    CHECK_ERROR(!tdm_safetensors_load(f, "u8", tdm_cpu(0)),
                "'u8' is U8; Tandem reads F32, BF16, F16, I32 and I64");
    tdm_tensor *ints = tdm_zeros(TDM_SHAPE(NX), TDM_I64, tdm_cpu(0));
    CHECK_ERROR(tdm_safetensors_read(f, "x_bf16", ints) == TDM_ERR_DTYPE, "is BF16, expected I64");
    tdm_tensor *wrong = tdm_zeros(TDM_SHAPE(NX + 1), TDM_F32, tdm_cpu(0));
    CHECK_ERROR(tdm_safetensors_read(f, "x_f16", wrong) == TDM_ERR_SHAPE, "has shape [32]");
    tdm_scope_end();
    tdm_safetensors_close(f);
}

/* Written here, read back: the dtype strings, the bits, and the order of the data (8-byte
 * elements first, then 4, then 2, so that each is aligned to its size). */
static void test_safetensors_round_trip(void) {
    char path[128];
    snprintf(path, sizeof path, "%s/mixed.safetensors", tmpdir);
    tdm_scope_begin();
    uint16_t hb[3] = {0x3F80, 0xC049, 0x0001}, gb[5] = {0x3C00, 0x7BFF, 0x8400, 0x7C00, 0x0200};
    float fv[2] = {1.5f, -0.0f};
    int64_t iv[2] = {-3, 1LL << 40};
    tdm_named_tensor ts[4] = {
        {"h", tdm_from_data(TDM_SHAPE(3), TDM_BF16, tdm_cpu(0), hb)},
        {"g", tdm_from_data(TDM_SHAPE(5), TDM_F16, tdm_cpu(0), gb)},
        {"f", tdm_from_data(TDM_SHAPE(2), TDM_F32, tdm_cpu(0), fv)},
        {"i", tdm_from_data(TDM_SHAPE(2), TDM_I64, tdm_cpu(0), iv)},
    };
    CHECK(tdm_safetensors_save(path, ts, 4, NULL, 0) == TDM_OK, "save: %s", tdm_last_error());
    tdm_safetensors *f = tdm_safetensors_open(path);
    CHECK(f && tdm_safetensors_count(f) == 4, "reopen: %s", tdm_last_error());
    if (f) {
        const char *order[4] = {"i", "f", "h", "g"}, *dts[4] = {"I64", "F32", "BF16", "F16"};
        for (int i = 0; i < 4; i++)
            CHECK(strcmp(tdm_safetensors_name(f, i), order[i]) == 0 &&
                      strcmp(tdm_safetensors_dtype(f, i), dts[i]) == 0,
                  "data %d is '%s' (%s)", i, order[i], dts[i]);
        uint16_t b[5];
        CHECK(bits16(tdm_safetensors_load(f, "h", tdm_cpu(0)), b, 5) == 3 &&
                  memcmp(b, hb, sizeof hb) == 0,
              "bf16 bits back");
        CHECK(bits16(tdm_safetensors_load(f, "g", tdm_cpu(0)), b, 5) == 5 &&
                  memcmp(b, gb, sizeof gb) == 0,
              "f16 bits back");
        tdm_safetensors_close(f);
    }
    tdm_scope_end();
}

/* Printing shows the stored values, summarised past 8. */
static void test_format(void) {
    tdm_scope_begin();
    char buf[200];
    tdm_tensor *h = tdm_full(TDM_SHAPE(2, 2), 1.0f / 3.0f, TDM_BF16, tdm_cpu(0));
    CHECK(tdm_tensor_format(h, buf, sizeof buf) == TDM_OK &&
              strcmp(buf, "tensor([0.333984, 0.333984, 0.333984, 0.333984], shape [2, 2], bf16, "
                          "cpu:0)") == 0,
          "bf16: %s", buf);
    tdm_tensor *f = tdm_arange(0, 10, 1, TDM_F16, tdm_cpu(0));
    CHECK(tdm_tensor_format(tdm_mul_scalar(tdm_cast(f, TDM_F32), 0.5f), buf, sizeof buf) == 0 &&
              strcmp(buf, "tensor([0, 0.5, 1, 1.5, ..., 3, 3.5, 4, 4.5], shape [10], f32, "
                          "cpu:0)") == 0,
          "f32 summarised: %s", buf);
    tdm_tensor *i = tdm_arange(-2, 1, 1, TDM_I64, tdm_cpu(0));
    CHECK(tdm_tensor_format(i, buf, 20) == TDM_OK && strlen(buf) == 19 &&
              strncmp(buf, "tensor([-2, -1, 0],", 19) == 0,
          "i64, cut to fit: %s", buf);
    CHECK_ERROR(tdm_tensor_format(NULL, buf, sizeof buf) == TDM_ERR_ARG, "NULL argument");
    tdm_scope_end();
}

int main(void) {
    if (tmpdir_make("test_half_io") != 0) return 1;
    test_creation();
    test_random();
    test_cast_rne();
    test_to_dtype_grad();
    test_safetensors_read();
    test_safetensors_round_trip();
    test_format();
    tmpdir_remove();
    return check_summary();
}
