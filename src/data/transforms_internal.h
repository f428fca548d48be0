/* Private interface of the image transforms (transforms.h): the transform itself, the draws of
 * the random steps (transforms_draw.c) and the pixel kernels (transforms_ops.c). Exposed to
 * tests/test_transforms.c, which runs the kernels with fixed parameters against torchvision.
 *
 * Images are planes [c, h, w] f32, row-major and contiguous. */
#ifndef TDM_TRANSFORMS_INTERNAL_H
#define TDM_TRANSFORMS_INTERNAL_H

#include "tandem/transforms.h"

/* Philox's stream word has 8 bits for the step's position (transforms_draw.c) */
#define TDM_TF_MAX_STEPS 64

struct tdm_transform {
    int n;
    tdm_transform_step *steps; /* [n] */
};

/* torchvision's class name of a kind ("RandomCrop"), "?" for none */
const char *tdm_tf_kind_name(tdm_transform_kind k);

/* ---- draws (transforms_draw.c) ----------------------------------------------------------- */

/* The draws of one step of one sample: Philox keyed by seed, counting blocks of 4 words in
 * the stream of (step, epoch) at counter index. A step's draws depend on nothing else, so a
 * step added to a transform does not change the others'. */
typedef struct {
    uint64_t seed, index, stream;
    uint32_t block, used; /* blocks drawn; words of the current block used (4: none left) */
    uint32_t word[4];
} tdm_tf_rng;

void tdm_tf_rng_init(tdm_tf_rng *r, uint64_t seed, int64_t epoch, int64_t index, int step);
uint32_t tdm_tf_rng_u32(tdm_tf_rng *r);
/* Uniform in [lo, hi), 32 bits of resolution. */
double tdm_tf_rng_uniform(tdm_tf_rng *r, double lo, double hi);
/* Uniform in [0, n) for 1 <= n <= 2^32, torch.randint(0, n)'s role. */
int64_t tdm_tf_rng_randint(tdm_tf_rng *r, int64_t n);

/* A rectangle of an image: rows [top, top + h), columns [left, left + w). */
typedef struct {
    int64_t top, left, h, w;
} tdm_tf_box;

/* RandomResizedCrop.get_params for an image of H x W: ten tries of an area in scale and a
 * log-uniform aspect in ratio, then the central crop with the aspect clamped to ratio. */
tdm_tf_box tdm_tf_rrc_params(tdm_tf_rng *r, int64_t H, int64_t W, const float scale[2],
                             const float ratio[2]);
/* RandomErasing.get_params: true and *box for a rectangle found in ten tries, false (nothing
 * erased) when none fits. */
bool tdm_tf_erasing_params(tdm_tf_rng *r, int64_t H, int64_t W, const float scale[2],
                           const float ratio[2], tdm_tf_box *box);

/* ---- sizes ------------------------------------------------------------------------------ */

/* Resize's output (h, w) for an image h x w: step size (short side, or (h, w)). */
void tdm_tf_resize_size(const tdm_transform_step *s, int64_t h, int64_t w, int64_t *oh,
                        int64_t *ow);
/* TDM_OK when a Resize (step i) of an image h x w to oh x ow keeps both sides within
 * TDM_TRANSFORM_MAX_SIDE, else TDM_ERR_SHAPE naming the step and the sizes: a short side of
 * thousands makes a thin image's long side larger still. */
int tdm_tf_resize_check(int i, int64_t h, int64_t w, int64_t oh, int64_t ow);
/* CenterCrop's box in an image h x w: negative top/left where the crop is larger (padding). */
tdm_tf_box tdm_tf_center_box(int64_t h, int64_t w, int64_t ch, int64_t cw);

/* ---- pixel kernels (transforms_ops.c); in and out may be the same where it says so ------- */

/* Antialiased bilinear resize (torchvision's antialias=True; PyTorch's _upsample_bilinear2d_aa)
 * of the window src of in [c, H, W] to oh x ow, writing only the part `part` of that output
 * into out [c, part.h, part.w]: a resize then a crop in one pass (the weights of an output
 * pixel depend only on its position, so the part is exactly the crop of the full resize).
 * TDM_OK or TDM_ERR_NOMEM. */
int tdm_tf_resample(const float *in, int64_t c, int64_t H, int64_t W, tdm_tf_box src, int64_t oh,
                    int64_t ow, tdm_tf_box part, float *out);
/* out [c, box.h, box.w] = in [c, H, W] at box, 0 outside the image (torchvision's zero
 * padding then crop). */
void tdm_tf_crop(const float *in, int64_t c, int64_t H, int64_t W, tdm_tf_box box, float *out);
/* Mirrors each row; in == out allowed. */
void tdm_tf_hflip(const float *in, int64_t c, int64_t h, int64_t w, float *out);
/* torchvision's adjust_brightness, adjust_contrast, adjust_saturation on an image of c = 1 or
 * 3 channels, in place: a blend with black, the grey mean, the grey image, clamped to [0, 1]. */
void tdm_tf_brightness(float *x, int64_t c, int64_t h, int64_t w, float factor);
void tdm_tf_contrast(float *x, int64_t c, int64_t h, int64_t w, float factor);
void tdm_tf_saturation(float *x, int64_t c, int64_t h, int64_t w, float factor);
/* rgb_to_grayscale: in [c (1 or 3), h, w] to out [out_c (1 or 3), h, w]; in != out. */
void tdm_tf_grayscale(const float *in, int64_t c, int64_t h, int64_t w, int out_c, float *out);
/* (x - mean[k]) / std[k] per channel k (mean[0], std[0] for a grey image); in == out allowed. */
void tdm_tf_normalize(const float *in, int64_t c, int64_t h, int64_t w, const float *mean,
                      const float *std, float *out);
/* Sets box of every channel to value, in place. */
void tdm_tf_erase(float *x, int64_t c, int64_t h, int64_t w, tdm_tf_box box, float value);

/* ---- text (transforms_parse.c) ------------------------------------------------------------ */

/* The named Normalize sets: the name of the set mean/std equal ("imagenet", ...), or NULL. */
const char *tdm_tf_norm_set_name(const float mean[3], const float std[3]);

#endif
