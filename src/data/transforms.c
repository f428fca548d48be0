/* Image transforms (transforms.h): a list of steps, checked once when made, whose output
 * shape is known ahead of the images, run per sample by the loader's workers. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "data/transforms_internal.h"

const char *tdm_tf_kind_name(tdm_transform_kind k) {
    static const char *const names[] = {
        "?",           "Resize",
        "CenterCrop",  "RandomResizedCrop",
        "RandomCrop",  "RandomHorizontalFlip",
        "ColorJitter", "Grayscale",
        "Normalize",   "RandomErasing",
    };
    return k >= TDM_TF_RESIZE && k <= TDM_TF_RANDOM_ERASING ? names[k] : names[0];
}

tdm_transform_step tdm_transform_defaults(tdm_transform_kind kind) {
    tdm_transform_step s = {.kind = kind, .p = 0.5f, .channels = 1};
    for (int k = 0; k < 3; k++) s.std[k] = 1.0f;
    if (kind == TDM_TF_RANDOM_ERASING) {
        s.scale[0] = 0.02f, s.scale[1] = 0.33f, s.ratio[0] = 0.3f, s.ratio[1] = 3.3f;
    } else {
        s.scale[0] = 0.08f, s.scale[1] = 1.0f, s.ratio[0] = 3.0f / 4.0f, s.ratio[1] = 4.0f / 3.0f;
    }
    return s;
}

/* ---- checks -------------------------------------------------------------------------------- */

static bool range_ok(const float v[2], float lo_excl, bool lo_incl_zero, float hi) {
    bool lo_ok = lo_incl_zero ? v[0] >= 0.0f : v[0] > lo_excl;
    return isfinite(v[0]) && isfinite(v[1]) && lo_ok && v[0] <= v[1] && v[1] <= hi;
}

/* TDM_OK, or TDM_ERR_ARG naming step i and what is wrong with it. */
static int step_check(int i, tdm_transform_step *s) {
    const char *nm = tdm_tf_kind_name(s->kind);
    /* a side no image decodes to (image_decode.c's limit): its products cannot overflow */
    if (s->size[0] > TDM_TRANSFORM_MAX_SIDE || s->size[1] > TDM_TRANSFORM_MAX_SIDE ||
        s->padding > TDM_TRANSFORM_MAX_SIDE)
        return tdm_raise(TDM_ERR_ARG,
                         "transform step %d (%s): size (%lld, %lld) or padding %lld is more than "
                         "%d",
                         i, nm, (long long)s->size[0], (long long)s->size[1], (long long)s->padding,
                         TDM_TRANSFORM_MAX_SIDE);
    switch (s->kind) {
    case TDM_TF_RESIZE:
        if (s->size[0] < 1 || s->size[1] < 0)
            return tdm_raise(TDM_ERR_ARG, "transform step %d (%s): size (%lld, %lld) must be >= 1",
                             i, nm, (long long)s->size[0], (long long)s->size[1]);
        return TDM_OK;
    case TDM_TF_RANDOM_CROP:
        if (s->padding < 0)
            return tdm_raise(TDM_ERR_ARG, "transform step %d (%s): padding %lld is negative", i, nm,
                             (long long)s->padding);
        /* fall through */
    case TDM_TF_CENTER_CROP:
    case TDM_TF_RANDOM_RESIZED_CROP:
        if (s->size[1] == 0) s->size[1] = s->size[0]; /* an int size: a square, as torchvision */
        if (s->size[0] < 1 || s->size[1] < 1)
            return tdm_raise(TDM_ERR_ARG, "transform step %d (%s): size (%lld, %lld) must be >= 1",
                             i, nm, (long long)s->size[0], (long long)s->size[1]);
        if (s->kind != TDM_TF_RANDOM_RESIZED_CROP) return TDM_OK;
        if (!range_ok(s->scale, 0.0f, false, 1.0f))
            return tdm_raise(
                TDM_ERR_ARG,
                "transform step %d (%s): scale (%g, %g) must satisfy 0 < lo <= hi <= 1", i, nm,
                (double)s->scale[0], (double)s->scale[1]);
        break;
    case TDM_TF_RANDOM_ERASING:
        if (!range_ok(s->scale, 0.0f, true, 1.0f))
            return tdm_raise(
                TDM_ERR_ARG,
                "transform step %d (%s): scale (%g, %g) must satisfy 0 <= lo <= hi <= 1", i, nm,
                (double)s->scale[0], (double)s->scale[1]);
        if (!isfinite(s->value))
            return tdm_raise(TDM_ERR_ARG, "transform step %d (%s): value %g is not finite", i, nm,
                             (double)s->value);
        break;
    case TDM_TF_RANDOM_HFLIP:
        break;
    case TDM_TF_COLOR_JITTER: {
        const float v[3] = {s->brightness, s->contrast, s->saturation};
        static const char *const what[3] = {"brightness", "contrast", "saturation"};
        for (int k = 0; k < 3; k++)
            if (!(isfinite(v[k]) && v[k] >= 0.0f))
                return tdm_raise(TDM_ERR_ARG, "transform step %d (%s): %s %g must be >= 0", i, nm,
                                 what[k], (double)v[k]);
        return TDM_OK;
    }
    case TDM_TF_GRAYSCALE:
        if (s->channels != 1 && s->channels != 3)
            return tdm_raise(TDM_ERR_ARG,
                             "transform step %d (%s): num_output_channels %d must be 1 or 3", i, nm,
                             s->channels);
        return TDM_OK;
    case TDM_TF_NORMALIZE:
        for (int k = 0; k < 3; k++)
            if (!(isfinite(s->mean[k]) && isfinite(s->std[k]) && s->std[k] > 0.0f))
                return tdm_raise(TDM_ERR_ARG,
                                 "transform step %d (%s): channel %d has mean %g, std %g; "
                                 "std must be > 0 and both finite",
                                 i, nm, k, (double)s->mean[k], (double)s->std[k]);
        return TDM_OK;
    default:
        return tdm_raise(TDM_ERR_ARG, "transform step %d: unknown kind %d", i, (int)s->kind);
    }
    /* the random steps: p where it is used, and ratio for the two that draw rectangles */
    if (s->kind != TDM_TF_RANDOM_RESIZED_CROP && !(s->p >= 0.0f && s->p <= 1.0f))
        return tdm_raise(TDM_ERR_ARG, "transform step %d (%s): p %g must be in [0, 1]", i, nm,
                         (double)s->p);
    if ((s->kind == TDM_TF_RANDOM_RESIZED_CROP || s->kind == TDM_TF_RANDOM_ERASING) &&
        !range_ok(s->ratio, 0.0f, false, INFINITY))
        return tdm_raise(TDM_ERR_ARG,
                         "transform step %d (%s): ratio (%g, %g) must satisfy 0 < lo <= hi", i, nm,
                         (double)s->ratio[0], (double)s->ratio[1]);
    return TDM_OK;
}

tdm_transform *tdm_transform_new(int n, const tdm_transform_step *steps) {
    if (n < 0 || n > TDM_TF_MAX_STEPS || (n > 0 && !steps))
        return tdm_raise_null(TDM_ERR_ARG, "transform_new: %d steps (at most %d, and steps set)", n,
                              TDM_TF_MAX_STEPS);
    tdm_transform *tf = calloc(1, sizeof *tf);
    tdm_transform_step *copy = malloc((size_t)(n > 0 ? n : 1) * sizeof *copy);
    if (!tf || !copy) {
        free(tf);
        free(copy);
        return tdm_raise_null(TDM_ERR_NOMEM, "transform_new: %d steps", n);
    }
    if (n > 0) memcpy(copy, steps, (size_t)n * sizeof *copy);
    tf->n = n;
    tf->steps = copy;
    for (int i = 0; i < n; i++) {
        if (step_check(i, &copy[i]) != TDM_OK) {
            tdm_transform_free(tf);
            return NULL;
        }
    }
    return tf;
}

void tdm_transform_free(tdm_transform *tf) {
    if (!tf) return;
    free(tf->steps);
    free(tf);
}

/* ---- shapes -------------------------------------------------------------------------------- */

void tdm_tf_resize_size(const tdm_transform_step *s, int64_t h, int64_t w, int64_t *oh,
                        int64_t *ow) {
    if (s->size[1] > 0) {
        *oh = s->size[0], *ow = s->size[1];
        return;
    }
    /* torchvision: the short side to size, the long one int(size * long / short), truncated */
    int64_t shorter = w <= h ? w : h, longer = w <= h ? h : w;
    int64_t nl = (int64_t)((double)(s->size[0] * longer) / (double)shorter);
    *oh = w <= h ? nl : s->size[0];
    *ow = w <= h ? s->size[0] : nl;
}

int tdm_tf_resize_check(int i, int64_t h, int64_t w, int64_t oh, int64_t ow) {
    if (oh <= TDM_TRANSFORM_MAX_SIDE && ow <= TDM_TRANSFORM_MAX_SIDE) return TDM_OK;
    return tdm_raise(TDM_ERR_SHAPE,
                     "transform step %d (Resize): an image of %lldx%lld would become %lldx%lld, "
                     "a side over %d",
                     i, (long long)h, (long long)w, (long long)oh, (long long)ow,
                     TDM_TRANSFORM_MAX_SIDE);
}

/* Python's int(round(k / 2.0)) for k >= 0: halves go to the even neighbour */
static int64_t half_round_even(int64_t k) {
    int64_t q = k / 2;
    return (k % 2 == 1 && q % 2 == 1) ? q + 1 : q;
}

tdm_tf_box tdm_tf_center_box(int64_t h, int64_t w, int64_t ch, int64_t cw) {
    /* torchvision pads a smaller side by (crop - side) // 2 before, the rest after, and then
     * crops at round((side - crop) / 2), which is 0 on a padded side */
    tdm_tf_box b = {0, 0, ch, cw};
    b.top = ch > h ? -((ch - h) / 2) : half_round_even(h - ch);
    b.left = cw > w ? -((cw - w) / 2) : half_round_even(w - cw);
    return b;
}

/* The shape after step s of an image [c, h, w] (0: the size varies), or TDM_ERR_SHAPE naming
 * step i. */
static int step_shape(int i, const tdm_transform_step *s, int64_t d[3]) {
    const char *nm = tdm_tf_kind_name(s->kind);
    bool known = d[1] > 0 && d[2] > 0;
    switch (s->kind) {
    case TDM_TF_RESIZE:
        if (!(s->size[1] > 0 || known)) return TDM_OK;
        int64_t h = d[1], w = d[2];
        tdm_tf_resize_size(s, h, w, &d[1], &d[2]);
        return tdm_tf_resize_check(i, h, w, d[1], d[2]);
    case TDM_TF_RANDOM_CROP:
        if (known && (d[1] + 2 * s->padding < s->size[0] || d[2] + 2 * s->padding < s->size[1]))
            return tdm_raise(TDM_ERR_SHAPE,
                             "transform step %d (%s): crop %lldx%lld is larger than the image "
                             "%lldx%lld padded by %lld",
                             i, nm, (long long)s->size[0], (long long)s->size[1], (long long)d[1],
                             (long long)d[2], (long long)s->padding);
        /* fall through */
    case TDM_TF_CENTER_CROP:
    case TDM_TF_RANDOM_RESIZED_CROP:
        d[1] = s->size[0], d[2] = s->size[1];
        return TDM_OK;
    case TDM_TF_GRAYSCALE:
    case TDM_TF_COLOR_JITTER:
    case TDM_TF_NORMALIZE:
        if (d[0] != 1 && d[0] != 3)
            return tdm_raise(TDM_ERR_SHAPE,
                             "transform step %d (%s): needs images of 1 or 3 channels, not %lld", i,
                             nm, (long long)d[0]);
        if (s->kind == TDM_TF_GRAYSCALE) d[0] = s->channels;
        return TDM_OK;
    default:
        return TDM_OK;
    }
}

int tdm_transform_output_shape(const tdm_transform *tf, tdm_shape in, tdm_shape *out) {
    char buf[96];
    if (!tf || !out || in.ndim != 3 || in.d[0] < 1 || in.d[1] < 0 || in.d[2] < 0)
        return tdm_raise(TDM_ERR_ARG, "transform_output_shape: input %s is not [c, h, w]",
                         tdm_shape_str(in, buf));
    int64_t d[3] = {in.d[0], in.d[1], in.d[2]};
    for (int i = 0; i < tf->n; i++) {
        int st = step_shape(i, &tf->steps[i], d);
        if (st) return st;
    }
    if (d[1] <= 0 || d[2] <= 0)
        return tdm_raise(TDM_ERR_SHAPE,
                         "transform: images of shape %s leave the transform in sizes that vary, "
                         "and a batch needs one size: end it with CenterCrop, RandomResizedCrop, "
                         "RandomCrop or Resize((h, w))",
                         tdm_shape_str(in, buf));
    *out = TDM_SHAPE(d[0], d[1], d[2]);
    return TDM_OK;
}
