/* Image augmentation applied by the loader to each sample, in place, on the host buffer of
 * the batch being built. Draws come from Philox keyed by (seed, epoch, sample index), so a
 * sample is augmented the same way whichever worker builds it. */
#include <math.h>
#include <string.h>

#include "core/core.h"
#include "data/sampler.h"

#define AUGMENT_STREAM (1ull << 63)

bool tdm_augment_active(const tdm_augment *a) {
    return a->normalize || a->crop_padding > 0 || a->hflip;
}

int tdm_augment_check(const tdm_augment *a, const tdm_dataset *ds, tdm_shape shape) {
    char buf[96];
    if (!tdm_augment_active(a) && a->crop_padding == 0) return TDM_OK;
    if (a->crop_padding < 0)
        return tdm_raise(TDM_ERR_ARG, "loader_new: augment.crop_padding %d is negative",
                         a->crop_padding);
    if (ds->x_dtype != TDM_F32)
        return tdm_raise(TDM_ERR_DTYPE,
                         "loader_new: augmentation needs f32 samples; dataset '%s' has %s",
                         ds->name, tdm_dtype_name(ds->x_dtype));
    if (a->normalize && !(isfinite(a->mean) && isfinite(a->std) && a->std > 0))
        return tdm_raise(TDM_ERR_ARG,
                         "loader_new: augment normalize needs a finite mean and std > 0 "
                         "(mean %g, std %g)",
                         (double)a->mean, (double)a->std);
    if ((a->crop_padding > 0 || a->hflip) && shape.ndim != 3)
        return tdm_raise(TDM_ERR_SHAPE,
                         "loader_new: random crop and flip need image samples [C, H, W]; "
                         "dataset '%s' has samples %s",
                         ds->name, tdm_shape_str(shape, buf));
    return TDM_OK;
}

/* One plane [h, w]: out[y][x] = in[y + dy][x + dx], zero outside the image; this is the
 * crop at (pad + dy, pad + dx) of the zero-padded image. In place: rows are visited in the
 * direction that reads every source row before it is overwritten. */
static void shift_plane(float *p, int64_t h, int64_t w, int64_t dy, int64_t dx) {
    int64_t keep = w - (dx < 0 ? -dx : dx); /* columns that come from the image */
    for (int64_t t = 0; t < h; t++) {
        int64_t y = dy >= 0 ? t : h - 1 - t;
        int64_t sy = y + dy;
        float *dst = p + y * w;
        if (sy < 0 || sy >= h || keep <= 0) {
            memset(dst, 0, (size_t)w * sizeof(float));
            continue;
        }
        const float *src = p + sy * w;
        if (dx >= 0) {
            memmove(dst, src + dx, (size_t)keep * sizeof(float));
            memset(dst + keep, 0, (size_t)dx * sizeof(float));
        } else {
            memmove(dst - dx, src, (size_t)keep * sizeof(float));
            memset(dst, 0, (size_t)-dx * sizeof(float));
        }
    }
}

static void flip_rows(float *p, int64_t rows, int64_t w) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = p + r * w;
        for (int64_t a = 0, b = w - 1; a < b; a++, b--) {
            float t = row[a];
            row[a] = row[b];
            row[b] = t;
        }
    }
}

void tdm_augment_apply(const tdm_augment *a, float *x, tdm_shape s, uint64_t seed, int64_t epoch,
                       int64_t index) {
    if (a->crop_padding > 0 || a->hflip) {
        /* x [C, H, W]; one Philox block per sample: words 0-1 the crop offset, word 2 the flip */
        int64_t c = s.d[0], h = s.d[1], w = s.d[2];
        uint32_t r[4];
        tdm_philox(seed, (uint64_t)index, AUGMENT_STREAM | (uint64_t)epoch, r);
        if (a->crop_padding > 0) {
            uint32_t span = 2u * (uint32_t)a->crop_padding + 1u;
            int64_t dy = (int64_t)(r[0] % span) - a->crop_padding;
            int64_t dx = (int64_t)(r[1] % span) - a->crop_padding;
            for (int64_t ch = 0; ch < c; ch++) shift_plane(x + ch * h * w, h, w, dy, dx);
        }
        if (a->hflip && (r[2] >> 31)) flip_rows(x, c * h, w);
    }
    if (a->normalize) {
        /* (x - mean) / std, as torchvision's Normalize (sub then div) */
        int64_t n = tdm_shape_numel(s);
        float mean = a->mean, sd = a->std;
        for (int64_t i = 0; i < n; i++) x[i] = (x[i] - mean) / sd;
    }
}
