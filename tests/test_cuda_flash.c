/* The fused causal attention (cuda_flash.cu) against the unfused one (cuda_attention.cu) on
 * the same GPU, in f32, bf16 and f16: y, lse and dqkv at sizes with partial tiles (T not a
 * multiple of the 64-row tile), one tile, several, one head and several, head sizes 16 to
 * 128; a fused run twice, bit for bit (every sum in a fixed order); in bf16 and f16 at heads
 * up to 64, the kernels' blocks of 128 rows (two tiles of 16 a warp, the default) against
 * their blocks of 64 (tdm_cuda_flash_wide(0)), bit for bit (the same products in the same
 * order; a warp's tile past all its rows adds zeros); in f32 at heads up to 64, the products
 * as 3xTF32 on the tensor cores (the default) and on the CUDA cores (tdm_cuda_flash_tf32x3),
 * each against the unfused; which heads it takes
 * (a head size that is not a multiple of 16, or whose blocks need more shared memory
 * than the GPU has, goes to the unfused path; and with --before-sm80, on a GPU the caller knows
 * to be older than sm_80, bf16 and f16 of every head; with --sm86 and --small-smem, on GPUs
 * whose blocks get 99 KB, f32 heads up to 64); in f32, which heads run on the tensor cores (the
 * default's bits against the CUDA cores'). The kernels against the CPU's are
 * test_cuda's attention rows, which run the fused kernel where it fits.
 *
 * The bound: in f32 both paths sum the same products in other orders (1e-5 of the
 * magnitudes; 3xTF32's products keep about 22 of f32's 24 bits, well inside it); in bf16 and f16
 * both round P and dS to the dtype (at other points: the fused one's P is not yet divided by the
 * row's sum) and y, so the two differ by up to twice attention_slack's bound on each against exact
 * arithmetic, plus a rounding of the output.
 *
 * Without the CUDA backend or a GPU: skipped (77). */
#include "attention_slack.h"
#include "check.h"

#ifndef TANDEM_HAVE_CUDA
int main(void) {
    printf("SKIP test_cuda_flash: built without the CUDA backend\n");
    return 77;
}
#else
#include "backend/backend.h"
#include "backend/cuda/cuda.h"
#include "tandem/half.h"

#include <cuda_runtime.h>
#include <string.h>

static const tdm_backend *GPU;
/* The widest f32 head the GPU's default runs as 3xTF32 on the tensor cores (its bits then differ
 * from the CUDA cores' kernels'); wider ones up to 64 run on the CUDA cores (the same bits). The
 * rule (cuda.h): 64 on sm_80, sm_90 and sm_100, whose blocks' shared memory holds them, else 0. */
static int64_t tf32x3_heads;

static int64_t tf32x3_heads_here(void) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
    const int cc = 10 * major + minor;
    return cc == 80 || cc == 90 || (cc >= 100 && cc < 110) ? 64 : 0;
}

/* A GPU tensor of dtype dt holding v (f32 values, rounded to dt). */
static tdm_tensor *on_gpu(tdm_shape s, tdm_dtype dt, const float *v) {
    tdm_tensor *h = tdm_from_data(s, TDM_F32, tdm_cpu(0), v);
    tdm_tensor *c = h ? tdm_cast(h, dt) : NULL;
    return c ? tdm_to_device(c, tdm_cuda(0)) : NULL;
}

/* t's values as f32 on the host (malloc'd), or NULL with the error set. */
static float *values(const tdm_tensor *t) {
    tdm_tensor *f = t ? tdm_cast(t, TDM_F32) : NULL;
    tdm_tensor *h = f ? tdm_to_device(f, tdm_cpu(0)) : NULL;
    float *v = h ? malloc(sizeof(float) * (size_t)tdm_numel(h)) : NULL;
    if (v) memcpy(v, tdm_data_ptr(h), sizeof(float) * (size_t)tdm_numel(h));
    return v;
}

/* n standard normal draws rounded to dt (so that the CPU's f32 reference holds the GPU's
 * values), malloc'd; in an open scope. */
static float *draws(int64_t n, tdm_dtype dt, tdm_rng *rng) {
    tdm_tensor *t = tdm_randn(TDM_SHAPE(n), 0.0f, 1.0f, tdm_cpu(0), rng);
    float *v = t ? malloc(sizeof(float) * (size_t)n) : NULL;
    for (int64_t i = 0; v && i < n; i++) {
        float x = ((const float *)tdm_data_ptr(t))[i];
        v[i] = dt == TDM_BF16  ? tdm_bf16_to_float(tdm_bf16_from_float(x))
               : dt == TDM_F16 ? tdm_f16_to_float(tdm_f16_from_float(x))
                               : x;
    }
    return v;
}

typedef struct {
    float *y, *lse, *g;
} result;

/* y, lse and dqkv of attention over qkv with upstream gradient dy, fused or not. */
static int attend(const tdm_tensor *qkv, const tdm_tensor *dy, int nh, bool fused, result *r) {
    tdm_cuda_flash_enable(fused);
    int64_t B = qkv->shape[0], T = qkv->shape[1];
    tdm_tensor *y = tdm_tensor_alloc(tdm_shape_of(dy), dy->dtype, dy->device);
    tdm_tensor *lse = tdm_tensor_alloc(TDM_SHAPE(B, nh, T), TDM_F32, dy->device);
    tdm_tensor *g = tdm_tensor_alloc(tdm_shape_of(qkv), qkv->dtype, qkv->device);
    int rc = y && lse && g ? GPU->attention(y, lse, qkv, nh) : tdm_last_status();
    if (!rc) rc = GPU->attention_backward(g, dy, qkv, y, lse, nh);
    tdm_cuda_flash_enable(true);
    r->y = rc ? NULL : values(y), r->lse = rc ? NULL : values(lse), r->g = rc ? NULL : values(g);
    return rc ? rc : r->y && r->lse && r->g ? TDM_OK : tdm_last_status();
}

/* Whether a and b hold the same n values (== : a zero's sign aside). */
static bool same(const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!(a[i] == b[i])) return false;
    return true;
}

static void result_free(result *r) {
    free(r->y), free(r->lse), free(r->g);
}

/* The largest |a - b| over n, and whether every one is within atol + rtol |b| + slack. */
static bool within(const float *a, const float *b, const double *slack, int64_t n, double atol,
                   double rtol, double *worst) {
    bool good = true;
    *worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > *worst) *worst = d;
        if (!(d <= atol + rtol * fabs(b[i]) + (slack ? 2 * slack[i] : 0))) good = false;
    }
    return good;
}

/* One size in one dtype: fused against unfused, and where twice, the fused run twice bit for
 * bit. */
static void test_size(int64_t B, int64_t T, int64_t C, int nh, tdm_dtype dt, bool twice) {
    const char *dn = tdm_dtype_name(dt);
    tdm_rng rng = tdm_rng_make((uint64_t)(B * 1000 + T * 10 + nh));
    int64_t nq = B * T * 3 * C, ny = B * T * C;
    tdm_scope_begin();
    float *q = draws(nq, dt, &rng), *gy = draws(ny, dt, &rng);
    tdm_tensor *qkv = on_gpu(TDM_SHAPE(B, T, 3 * C), dt, q),
               *dy = on_gpu(TDM_SHAPE(B, T, C), dt, gy);
    CHECK(tdm_cuda_flash_fits(qkv, nh),
          "B=%lld T=%lld C=%lld heads %d %s: the fused kernel "
          "does not take it",
          (long long)B, (long long)T, (long long)C, nh, dn);
    result f = {0}, f2 = {0}, u = {0}, n = {0};
    const bool narrow = dt != TDM_F32 && C / nh <= 64; /* the wide blocks' heads */
    const bool simt = dt == TDM_F32 && C / nh <= 64;   /* 3xTF32's heads: n on the CUDA cores */
    int rc = attend(qkv, dy, nh, true, &f);
    if (!rc && twice) rc = attend(qkv, dy, nh, true, &f2);
    if (!rc) rc = attend(qkv, dy, nh, false, &u);
    if (!rc && narrow) {
        tdm_cuda_flash_wide(0);
        rc = attend(qkv, dy, nh, true, &n);
        tdm_cuda_flash_wide(TDM_CUDA_FLASH_WIDE_ALL);
    }
    if (!rc && simt) {
        tdm_cuda_flash_tf32x3(false);
        rc = attend(qkv, dy, nh, true, &n);
        tdm_cuda_flash_tf32x3(true);
    }
    CHECK(rc == TDM_OK, "%s: %s", dn, tdm_last_error());
    if (!rc) {
        double *sy = NULL, *sl = NULL, *sg = NULL;
        double atol = 1e-5, rtol = dt == TDM_F32 ? 1e-5 : dt == TDM_BF16 ? 0x1p-7 : 0x1p-10;
        if (dt != TDM_F32) {
            sy = malloc(sizeof(double) * (size_t)ny),
            sl = malloc(sizeof(double) * (size_t)(B * nh * T));
            sg = malloc(sizeof(double) * (size_t)nq);
            attention_slack(q, gy, B, T, C, nh, dt == TDM_BF16 ? 0x1p-8 : 0x1p-11, true, sy, sl,
                            sg);
        }
        double wy, wl, wg;
        bool oy = within(f.y, u.y, sy, ny, atol, rtol, &wy);
        bool ol = within(f.lse, u.lse, NULL, B * nh * T, 1e-5, 1e-5, &wl);
        bool og = within(f.g, u.g, sg, nq, atol, rtol, &wg);
        CHECK(oy && ol && og,
              "B=%lld T=%lld C=%lld heads %d %s: fused against unfused: y %.3g "
              "lse %.3g dqkv %.3g apart, over the bound",
              (long long)B, (long long)T, (long long)C, nh, dn, wy, wl, wg);
        CHECK(!twice || (!memcmp(f.y, f2.y, sizeof(float) * (size_t)ny) &&
                         !memcmp(f.g, f2.g, sizeof(float) * (size_t)nq)),
              "%s: two fused runs differ", dn);
        CHECK(!narrow ||
                  (same(f.y, n.y, ny) && same(f.lse, n.lse, B * nh * T) && same(f.g, n.g, nq)),
              "B=%lld T=%lld C=%lld heads %d %s: blocks of 128 rows and of 64 differ", (long long)B,
              (long long)T, (long long)C, nh, dn);
        if (simt) {
            const bool tc = !same(f.y, n.y, ny) || !same(f.g, n.g, nq);
            CHECK(tc == (C / nh <= tf32x3_heads),
                  "B=%lld T=%lld C=%lld heads %d f32: the default ran on the %s, not the %s",
                  (long long)B, (long long)T, (long long)C, nh, tc ? "tensor cores" : "CUDA cores",
                  tc ? "CUDA cores" : "tensor cores");
            double sy2, sl2, sg2;
            bool o2 = within(n.y, u.y, NULL, ny, atol, rtol, &sy2) &&
                      within(n.lse, u.lse, NULL, B * nh * T, 1e-5, 1e-5, &sl2) &&
                      within(n.g, u.g, NULL, nq, atol, rtol, &sg2);
            CHECK(o2,
                  "B=%lld T=%lld C=%lld heads %d f32 on the CUDA cores: y %.3g lse %.3g dqkv "
                  "%.3g from the unfused, over the bound",
                  (long long)B, (long long)T, (long long)C, nh, sy2, sl2, sg2);
            printf("fused attention B=%lld T=%lld C=%lld heads %d f32 on the CUDA cores: y within "
                   "%.3g, lse %.3g, dqkv %.3g of the unfused\n",
                   (long long)B, (long long)T, (long long)C, nh, sy2, sl2, sg2);
        }
        printf("fused attention B=%lld T=%lld C=%lld heads %d %s: y within %.3g, lse %.3g, dqkv "
               "%.3g of the unfused\n",
               (long long)B, (long long)T, (long long)C, nh, dn, wy, wl, wg);
        free(sy), free(sl), free(sg);
    }
    result_free(&f), result_free(&f2), result_free(&u), result_free(&n);
    tdm_scope_end();
    free(q), free(gy);
}

/* Which heads the fused kernels take. */
static void test_fits(void) {
    tdm_scope_begin();
    struct {
        int64_t C;
        int nh;
        tdm_dtype dt;
        bool fits;
    } cases[] = {
        {48, 2, TDM_F32, false},   /* a head of 24 */
        {256, 2, TDM_BF16, true},  /* 128 */
        {256, 2, TDM_F32, true},   /* 128 in f32 */
        {320, 2, TDM_BF16, false}, /* 160 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        tdm_tensor *qkv = tdm_zeros(TDM_SHAPE(1, 4, 3 * cases[i].C), cases[i].dt, tdm_cuda(0));
        CHECK(qkv && tdm_cuda_flash_fits(qkv, cases[i].nh) == cases[i].fits,
              "a head of %lld in %s: fits %d expected", (long long)(cases[i].C / cases[i].nh),
              tdm_dtype_name(cases[i].dt), cases[i].fits);
    }
    tdm_tensor *qkv = tdm_zeros(TDM_SHAPE(1, 4, 96), TDM_F32, tdm_cuda(0));
    tdm_cuda_flash_enable(false);
    CHECK(qkv && !tdm_cuda_flash_fits(qkv, 2), "disabled, the fused kernel still takes heads");
    tdm_cuda_flash_enable(true);
    CHECK(qkv && tdm_cuda_flash_fits(qkv, 2), "a head of 16 in f32 not taken");
    tdm_scope_end();
}

/* On a GPU before sm_80 (the caller says so: the emulation's EMU_CC_MAJOR=7), bf16 and f16 have
 * no mma.sync: no head of theirs is taken (their unfused path runs), f32's still are. */
static void test_before_sm80(void) {
    tdm_scope_begin();
    const tdm_dtype dts[] = {TDM_F32, TDM_BF16, TDM_F16};
    for (int d = 0; d < 3; d++)
        for (int64_t hs = 16; hs <= 128; hs += 16) {
            tdm_tensor *qkv = tdm_zeros(TDM_SHAPE(1, 4, 3 * 2 * hs), dts[d], tdm_cuda(0));
            bool fits = qkv && tdm_cuda_flash_fits(qkv, 2);
            CHECK(fits == (dts[d] == TDM_F32), "before sm_80, a head of %lld in %s: fits %d",
                  (long long)hs, tdm_dtype_name(dts[d]), fits);
        }
    tdm_scope_end();
}

/* On a GPU whose blocks get 99 KB of shared memory (the caller says so: the emulation's
 * EMU_SMEM_OPTIN=101376), f32 heads up to 64 still run fused. sm_86 (--sm86: EMU_CC_MAJOR=8
 * EMU_CC_MINOR=6; sm_89 alike), where TF32 is no faster than f32, on the CUDA cores at every
 * head; an sm_80 with that little (--small-smem) at 64 on the CUDA cores (3xTF32's dK/dV block
 * takes 103 KB), at 48 on the tensor cores. */
static void test_small_smem(void) {
    tdm_scope_begin();
    for (int64_t hs = 16; hs <= 64; hs += 16) {
        tdm_tensor *qkv = tdm_zeros(TDM_SHAPE(1, 4, 3 * 2 * hs), TDM_F32, tdm_cuda(0));
        CHECK(qkv && tdm_cuda_flash_fits(qkv, 2), "99 KB a block: an f32 head of %lld not taken",
              (long long)hs);
    }
    tdm_scope_end();
    test_size(1, 130, 128, 2, TDM_F32, false); /* heads of 64 */
    test_size(1, 70, 96, 2, TDM_F32, false);   /* heads of 48 */
}

int main(int argc, char **argv) {
    if (tdm_cuda_device_count() == 0) {
        printf("SKIP test_cuda_flash: no GPU: %s\n", tdm_cuda_unavailable_reason());
        return 77;
    }
    if (!(GPU = tdm_backend_for(tdm_cuda(0)))) {
        fprintf(stderr, "test_cuda_flash: %s\n", tdm_last_error());
        return 1;
    }
    tf32x3_heads = tf32x3_heads_here();
    if (argc > 1 && !strcmp(argv[1], "--before-sm80")) {
        test_before_sm80();
        return check_summary();
    }
    if (argc > 1 && (!strcmp(argv[1], "--sm86") || !strcmp(argv[1], "--small-smem"))) {
        tf32x3_heads = !strcmp(argv[1], "--sm86") ? 0 : 48; /* 64's blocks exceed 99 KB */
        test_small_smem();
        return check_summary();
    }
    test_fits();
    const tdm_dtype dts[] = {TDM_F32, TDM_BF16, TDM_F16};
    for (int d = 0; d < 3; d++) {
        test_size(1, 70, 32, 1, dts[d], false);   /* one head, a partial second tile */
        test_size(2, 64, 32, 2, dts[d], false);   /* one whole tile, heads of 16 */
        test_size(1, 130, 64, 2, dts[d], true);   /* three tiles, the last of 2 rows */
        test_size(1, 200, 128, 2, dts[d], false); /* heads of 64, a block's last warps past T */
        test_size(2, 300, 64, 2, dts[d], false);  /* three blocks of 128 rows, five key tiles */
        test_size(1, 33, 96, 2, dts[d], false);   /* heads of 48 */
        test_size(1, 20, 96, 1, dts[d], false);   /* a head of 96 */
        test_size(1, 130, 128, 2, dts[d], false); /* heads of 64 (GPT-2's), three tiles */
        test_size(1, 9, 128, 1, dts[d], false);   /* a head of 128 */
        test_size(1, 70, 112, 1, dts[d], false);  /* a head of 112: an odd count of 16s */
    }
    return check_summary();
}
#endif
