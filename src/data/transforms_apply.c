/* Running a transform on one image (tdm_transform_apply), from the loader's worker threads.
 *
 * The image passes from step to step in buffers of this call (malloc'd, at most two alive,
 * each the size of an intermediate image); the last step writes straight into out. A Resize
 * followed by a CenterCrop that lies inside it runs as one resample of just the crop, and a
 * RandomResizedCrop resamples its box of the image without copying it out first: both give
 * exactly the pixels of the two steps done apart. */
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "data/transforms_internal.h"

/* The image between steps; owned: data is this call's buffer, freed when replaced. Before the
 * first step the image may be a part of the decoded file (tdm_image_decode_part): rows
 * [top, top + h) and columns [left, left + w) of full_h x full_w; after any step it is whole. */
typedef struct {
    int64_t c, h, w;
    float *data;
    bool owned;
    float *out; /* the caller's output, where the last step writes */
    bool last;  /* the step being run is the last */
    int64_t top, left, full_h, full_w;
} tf_run;

static int64_t numel(int64_t c, int64_t h, int64_t w) {
    return c * h * w;
}

/* The buffer a step that changes the image's size writes to. */
static float *run_dest(tf_run *r, int64_t c, int64_t h, int64_t w) {
    if (r->last) return r->out;
    float *d = malloc((size_t)numel(c, h, w) * sizeof(float));
    if (!d)
        tdm_raise(TDM_ERR_NOMEM, "transform: an image [%lld, %lld, %lld]", (long long)c,
                  (long long)h, (long long)w);
    return d;
}

/* The image becomes dst [c, h, w]. */
static void run_set(tf_run *r, float *dst, int64_t c, int64_t h, int64_t w) {
    if (r->owned && r->data != dst) free(r->data);
    r->owned = dst != r->out;
    r->data = dst;
    r->c = c, r->h = h, r->w = w;
    r->top = r->left = 0, r->full_h = h, r->full_w = w;
}

/* box, drawn on the whole image, in the coordinates of the part r holds; an error when the
 * part does not hold it (a part decoded for other draws). */
static int run_box_in_part(const tf_run *r, int i, tdm_tf_box *box) {
    box->top -= r->top, box->left -= r->left;
    if (box->top < 0 || box->left < 0 || box->top + box->h > r->h || box->left + box->w > r->w)
        return tdm_raise(TDM_ERR_ARG,
                         "transform step %d: its crop is not inside the part of the image given "
                         "(rows %lld.., columns %lld.. of %lld x %lld); decode the part "
                         "tdm_transform_source_box names",
                         i, (long long)r->top, (long long)r->left, (long long)r->h,
                         (long long)r->w);
    return TDM_OK;
}

/* A step other than a first crop needs the whole image. */
static int run_need_whole(const tf_run *r, int i, const tdm_transform_step *s) {
    if (r->full_h == r->h && r->full_w == r->w) return TDM_OK;
    return tdm_raise(TDM_ERR_ARG,
                     "transform step %d (%s) needs the whole image, and it was given a part of "
                     "one (only a first RandomResizedCrop or CenterCrop reads a part)",
                     i, tdm_tf_kind_name(s->kind));
}

/* The buffer a step that works in place runs on: the image itself when it is ours, else a
 * copy (in out for the last step, as the input and out are the caller's). */
static float *run_inplace(tf_run *r) {
    if (r->owned && !r->last) return r->data;
    float *d = run_dest(r, r->c, r->h, r->w);
    if (!d) return NULL;
    memcpy(d, r->data, (size_t)numel(r->c, r->h, r->w) * sizeof(float));
    run_set(r, d, r->c, r->h, r->w);
    return d;
}

/* The buffer a step that maps each pixel from the image (in == out allowed) writes to: the
 * image itself when it is ours, else without a copy first. */
static float *run_map(tf_run *r) {
    return r->owned && !r->last ? r->data : run_dest(r, r->c, r->h, r->w);
}

/* Whether step s, a Resize, runs together with next, a CenterCrop that lies inside its output
 * for an image h x w. */
static bool resize_fuses(const tdm_transform_step *s, const tdm_transform_step *next, int64_t h,
                         int64_t w) {
    if (s->kind != TDM_TF_RESIZE || !next || next->kind != TDM_TF_CENTER_CROP) return false;
    int64_t oh, ow;
    tdm_tf_resize_size(s, h, w, &oh, &ow);
    return next->size[0] <= oh && next->size[1] <= ow;
}

/* Resize, and crop (NULL: none) the CenterCrop after it. */
static int run_resize(tf_run *r, int i, const tdm_transform_step *s,
                      const tdm_transform_step *crop) {
    int64_t oh, ow;
    tdm_tf_resize_size(s, r->h, r->w, &oh, &ow);
    int st = tdm_tf_resize_check(i, r->h, r->w, oh, ow); /* the long side of a thin image */
    if (st) return st;
    tdm_tf_box part = {0, 0, oh, ow};
    if (crop) part = tdm_tf_center_box(oh, ow, crop->size[0], crop->size[1]);
    float *d = run_dest(r, r->c, part.h, part.w);
    if (!d) return TDM_ERR_NOMEM;
    st =
        tdm_tf_resample(r->data, r->c, r->h, r->w, (tdm_tf_box){0, 0, r->h, r->w}, oh, ow, part, d);
    if (st) {
        if (d != r->out) free(d);
        return st;
    }
    run_set(r, d, r->c, part.h, part.w);
    return TDM_OK;
}

static int run_crop(tf_run *r, tdm_tf_box box) {
    if (r->full_h != r->h || r->full_w != r->w) { /* a first CenterCrop of a part */
        int st = run_box_in_part(r, 0, &box);
        if (st) return st;
    }
    float *d = run_dest(r, r->c, box.h, box.w);
    if (!d) return TDM_ERR_NOMEM;
    tdm_tf_crop(r->data, r->c, r->h, r->w, box, d);
    run_set(r, d, r->c, box.h, box.w);
    return TDM_OK;
}

static int run_resized_crop(tf_run *r, int i, const tdm_transform_step *s, tdm_tf_rng *g) {
    tdm_tf_box box = tdm_tf_rrc_params(g, r->full_h, r->full_w, s->scale, s->ratio);
    int st = run_box_in_part(r, i, &box);
    if (st) return st;
    tdm_tf_box part = {0, 0, s->size[0], s->size[1]};
    float *d = run_dest(r, r->c, part.h, part.w);
    if (!d) return TDM_ERR_NOMEM;
    st = tdm_tf_resample(r->data, r->c, r->h, r->w, box, part.h, part.w, part, d);
    if (st) {
        if (d != r->out) free(d);
        return st;
    }
    run_set(r, d, r->c, part.h, part.w);
    return TDM_OK;
}

static int run_random_crop(tf_run *r, int i, const tdm_transform_step *s, tdm_tf_rng *g) {
    int64_t ph = r->h + 2 * s->padding, pw = r->w + 2 * s->padding;
    if (ph < s->size[0] || pw < s->size[1])
        return tdm_raise(TDM_ERR_SHAPE,
                         "transform step %d (RandomCrop): crop %lldx%lld is larger than the image "
                         "%lldx%lld padded by %lld",
                         i, (long long)s->size[0], (long long)s->size[1], (long long)r->h,
                         (long long)r->w, (long long)s->padding);
    /* torchvision: offsets uniform in the padded image; the box in the unpadded one */
    int64_t top = tdm_tf_rng_randint(g, ph - s->size[0] + 1) - s->padding;
    int64_t left = tdm_tf_rng_randint(g, pw - s->size[1] + 1) - s->padding;
    return run_crop(r, (tdm_tf_box){top, left, s->size[0], s->size[1]});
}

static int run_color_jitter(tf_run *r, const tdm_transform_step *s, tdm_tf_rng *g) {
    /* torchvision permutes its four adjustments (hue the fourth, not here): the order of
     * three in a uniform permutation of four is itself uniform, so draw it directly */
    int order[3] = {0, 1, 2};
    for (int k = 2; k > 0; k--) {
        int j = (int)tdm_tf_rng_randint(g, k + 1), t = order[k];
        order[k] = order[j], order[j] = t;
    }
    const float v[3] = {s->brightness, s->contrast, s->saturation};
    float f[3];
    for (int k = 0; k < 3; k++) /* drawn even when unused: the stream does not shift */
        f[k] = (float)tdm_tf_rng_uniform(g, v[k] < 1.0f ? 1.0 - v[k] : 0.0, 1.0 + v[k]);
    float *x = run_inplace(r);
    if (!x) return TDM_ERR_NOMEM;
    for (int k = 0; k < 3; k++) {
        int a = order[k];
        if (v[a] == 0.0f) continue; /* torchvision leaves out an adjustment of 0 */
        if (a == 0) tdm_tf_brightness(x, r->c, r->h, r->w, f[a]);
        if (a == 1) tdm_tf_contrast(x, r->c, r->h, r->w, f[a]);
        if (a == 2) tdm_tf_saturation(x, r->c, r->h, r->w, f[a]);
    }
    return TDM_OK;
}

/* Step i, s; next is the step run with it (a Resize's CenterCrop) or NULL. */
static int run_step(tf_run *r, int i, const tdm_transform_step *s, const tdm_transform_step *next,
                    tdm_tf_rng *g) {
    if (s->kind != TDM_TF_RANDOM_RESIZED_CROP && s->kind != TDM_TF_CENTER_CROP) {
        int st = run_need_whole(r, i, s);
        if (st) return st;
    }
    switch (s->kind) {
    case TDM_TF_RESIZE:
        return run_resize(r, i, s, next);
    case TDM_TF_CENTER_CROP:
        return run_crop(r, tdm_tf_center_box(r->full_h, r->full_w, s->size[0], s->size[1]));
    case TDM_TF_RANDOM_RESIZED_CROP:
        return run_resized_crop(r, i, s, g);
    case TDM_TF_RANDOM_CROP:
        return run_random_crop(r, i, s, g);
    case TDM_TF_RANDOM_HFLIP: {
        bool flip = tdm_tf_rng_uniform(g, 0.0, 1.0) < s->p; /* torch.rand(1) < p */
        if (!flip) return TDM_OK; /* tdm_transform_apply copies a last image into out */
        float *d = run_map(r);
        if (!d) return TDM_ERR_NOMEM;
        tdm_tf_hflip(r->data, r->c, r->h, r->w, d);
        run_set(r, d, r->c, r->h, r->w);
        return TDM_OK;
    }
    case TDM_TF_COLOR_JITTER:
        return run_color_jitter(r, s, g);
    case TDM_TF_GRAYSCALE: {
        float *d = run_dest(r, s->channels, r->h, r->w);
        if (!d) return TDM_ERR_NOMEM;
        tdm_tf_grayscale(r->data, r->c, r->h, r->w, s->channels, d);
        run_set(r, d, s->channels, r->h, r->w);
        return TDM_OK;
    }
    case TDM_TF_NORMALIZE: {
        float *d = run_map(r);
        if (!d) return TDM_ERR_NOMEM;
        tdm_tf_normalize(r->data, r->c, r->h, r->w, s->mean, s->std, d);
        run_set(r, d, r->c, r->h, r->w);
        return TDM_OK;
    }
    case TDM_TF_RANDOM_ERASING: {
        tdm_tf_box box;
        bool erase = tdm_tf_rng_uniform(g, 0.0, 1.0) < s->p &&
                     tdm_tf_erasing_params(g, r->h, r->w, s->scale, s->ratio, &box);
        float *x = run_inplace(r);
        if (!x) return TDM_ERR_NOMEM;
        if (erase) tdm_tf_erase(x, r->c, r->h, r->w, box, s->value);
        return TDM_OK;
    }
    default:
        return tdm_raise(TDM_ERR_ARG, "transform step %d: unknown kind %d", i, (int)s->kind);
    }
}

/* The whole image's size: in's, or the image in is a part of. */
static void image_full_size(const tdm_image *in, int64_t *h, int64_t *w) {
    *h = in->full_h > 0 ? in->full_h : in->h;
    *w = in->full_h > 0 ? in->full_w : in->w;
}

int tdm_transform_apply(const tdm_transform *tf, const tdm_image *in, float *out, uint64_t seed,
                        int64_t epoch, int64_t index) {
    if (!tf || !in || !in->data || !out || in->c < 1 || in->h < 1 || in->w < 1)
        return tdm_raise(TDM_ERR_ARG, "transform_apply: no transform, image or output, or an "
                                      "empty image");
    int64_t fh, fw;
    image_full_size(in, &fh, &fw);
    if (in->full_h > 0 &&
        (in->top < 0 || in->left < 0 || in->top + in->h > fh || in->left + in->w > fw))
        return tdm_raise(TDM_ERR_ARG, "transform_apply: the image's part is not inside its "
                                      "full size");
    tdm_shape shape;
    int st = tdm_transform_output_shape(tf, TDM_SHAPE(in->c, fh, fw), &shape);
    if (st) return st;
    bool part = in->full_h > 0;
    tf_run r = {.c = in->c,
                .h = in->h,
                .w = in->w,
                .data = in->data,
                .out = out,
                .top = part ? in->top : 0,
                .left = part ? in->left : 0,
                .full_h = fh,
                .full_w = fw};
    for (int i = 0; i < tf->n && st == TDM_OK; i++) {
        const tdm_transform_step *s = &tf->steps[i], *next = i + 1 < tf->n ? s + 1 : NULL;
        bool fuse = resize_fuses(s, next, r.h, r.w);
        r.last = i + 1 + fuse == tf->n;
        tdm_tf_rng g;
        tdm_tf_rng_init(&g, seed, epoch, index, i);
        st = run_step(&r, i, s, fuse ? next : NULL, &g);
        i += fuse;
    }
    if (st == TDM_OK && (r.h != r.full_h || r.w != r.full_w)) /* no steps */
        st = tdm_raise(TDM_ERR_ARG, "transform_apply: an empty transform of a part of an image");
    if (st == TDM_OK && r.data != out)
        memcpy(out, r.data, (size_t)numel(r.c, r.h, r.w) * sizeof(float));
    if (r.owned) free(r.data);
    return st;
}

void tdm_transform_source_box(const tdm_transform *tf, int64_t h, int64_t w, uint64_t seed,
                              int64_t epoch, int64_t index, int64_t box[4]) {
    box[0] = 0, box[1] = 0, box[2] = h, box[3] = w;
    if (!tf || tf->n == 0) return;
    const tdm_transform_step *s = &tf->steps[0];
    tdm_tf_box b = {0, 0, h, w};
    if (s->kind == TDM_TF_RANDOM_RESIZED_CROP) {
        tdm_tf_rng g;
        tdm_tf_rng_init(&g, seed, epoch, index, 0); /* the draws tdm_transform_apply makes */
        b = tdm_tf_rrc_params(&g, h, w, s->scale, s->ratio);
    } else if (s->kind == TDM_TF_CENTER_CROP) {
        b = tdm_tf_center_box(h, w, s->size[0], s->size[1]);
    }
    if (b.top < 0 || b.left < 0 || b.top + b.h > h || b.left + b.w > w) return; /* padded */
    box[0] = b.top, box[1] = b.left, box[2] = b.h, box[3] = b.w;
}
