/* Tandem image transforms: torchvision.transforms' names and meaning, run by the loader's
 * workers on each sample (tdm_loader_opts.transform).
 *
 * A transform is a list of steps applied in order to one image [C, H, W] f32 (tdm_image, data.h):
 * the geometric ones change its size, and the list as a whole must make every image one size
 * (end with a crop, or a Resize to (h, w)) for a batch to hold them. Random choices come from
 * Philox keyed by (seed, epoch, sample index) only: a sample is transformed the same way
 * whichever worker, device or process builds it, and a resumed run draws what the
 * uninterrupted one drew. Where a step draws its parameters, the draws follow torchvision's
 * rules (RandomResizedCrop's ten tries then the central fallback, ColorJitter's random order)
 * but not its random number generator, so the same seed gives other crops than torchvision's;
 * the same parameters give torchvision's pixels, its tensor path (torchvision.transforms.v2 or
 * functional on tensors), to ~1e-7 (tests/test_transforms.c, against fixtures from
 * tests/fixtures/gen_transforms.py). Each step draws from its own Philox stream, chosen by its
 * position in the list, so appending a step leaves the draws of the others as they were.
 */
#ifndef TANDEM_TRANSFORMS_H
#define TANDEM_TRANSFORMS_H

#include "data.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    /* size[1] 0: shorter side to size[0], the longer int(size[0] * long / short), truncated;
     * else (h, w). Bilinear with antialias (torchvision's default for tensors): PIL's triangle
     * filter widened by the downscale factor; plain bilinear when enlarging */
    TDM_TF_RESIZE = 1,
    TDM_TF_CENTER_CROP,         /* (size[0], size[1]) at round((side - crop) / 2), halves to
                                 * even as Python's; zero-padded where the image is smaller */
    TDM_TF_RANDOM_RESIZED_CROP, /* crop of area in scale x the image's, aspect in ratio, resized
                                 * to (size[0], size[1]) as Resize does */
    TDM_TF_RANDOM_CROP,         /* (size[0], size[1]) after zero-padding each side by padding;
                                 * an image still smaller fails (TDM_ERR_SHAPE), as torchvision
                                 * without pad_if_needed */
    TDM_TF_RANDOM_HFLIP,        /* with probability p */
    TDM_TF_COLOR_JITTER,        /* brightness, contrast, saturation: factors drawn uniformly in
                                 * [max(0, 1 - v), 1 + v], applied in a random order; a v of 0
                                 * leaves its adjustment out. No hue. Saturation leaves a grey
                                 * image as it is, as torchvision */
    TDM_TF_GRAYSCALE,           /* to channels (1 or 3) grey channels, ITU-R 601-2 luma
                                 * (0.2989, 0.587, 0.114); a grey image is copied */
    TDM_TF_NORMALIZE,           /* (x - mean[c]) / std[c]; images of 1 or 3 channels */
    TDM_TF_RANDOM_ERASING,      /* with probability p, a rectangle of area in scale and aspect in
                                 * ratio set to value (torchvision's RandomErasing; cutout) */
} tdm_transform_kind;

/* One step. Fields a kind does not use are ignored; tdm_transform_defaults(kind) gives
 * torchvision's defaults for the rest (scale (0.08, 1) and ratio (3/4, 4/3) for
 * RandomResizedCrop, scale (0.02, 0.33) and ratio (0.3, 3.3) for RandomErasing, p 0.5). */
typedef struct {
    tdm_transform_kind kind;
    int64_t size[2]; /* h, w; for the crops size[1] 0 means size[0] (torchvision's int size) */
    int64_t padding;
    float p;
    float scale[2], ratio[2];
    float brightness, contrast, saturation;
    int channels;
    float mean[3], std[3]; /* per channel (a grey image uses [0]) */
    float value;           /* RandomErasing's fill */
} tdm_transform_step;

tdm_transform_step tdm_transform_defaults(tdm_transform_kind kind);

/* The largest size or padding a step takes (the decoders' largest side). */
#define TDM_TRANSFORM_MAX_SIDE 65535

/* A transform of n steps (copied). NULL and TDM_ERR_ARG naming the step for a bad one (a
 * size < 1, a scale outside (0, 1], p outside [0, 1], std <= 0, ...). Free with
 * tdm_transform_free. */
tdm_transform *tdm_transform_new(int n, const tdm_transform_step *steps);
/* A transform from text, as the command line gives it: steps with torchvision's class names
 * and arguments, comma-separated, e.g.
 *   "RandomResizedCrop(224),RandomHorizontalFlip(),Normalize(imagenet)"
 *   "RandomCrop(32,padding=4),RandomHorizontalFlip(),ColorJitter(0.4,0.4,0.4)"
 * (Normalize takes imagenet, cifar10, fmnist or mean and std lists: Normalize((0.5,),(0.5,))),
 * or a preset name (tdm_transform_presets) sized by image_size. NULL and TDM_ERR_ARG pointing
 * at the character that could not be read. */
tdm_transform *tdm_transform_parse(const char *text, int64_t image_size);
/* The presets tdm_transform_parse knows, NULL-terminated, each "name: what it stands for", S
 * standing for image_size (imagenet-eval's Resize is to S * 256 / 224, 256 for 224). */
extern const char *const tdm_transform_presets[];
/* The shape of the transform's output for inputs of shape in [c, h, w] (h and w 0 when
 * images differ in size): TDM_OK and *out, or TDM_ERR_SHAPE when the output's size would
 * still vary (the message says to end with a crop or a Resize to (h, w)). */
int tdm_transform_output_shape(const tdm_transform *tf, tdm_shape in, tdm_shape *out);
/* Applies tf to in (not changed), writing out [the output shape for in's shape], with the
 * draws of (seed, epoch, index). Thread-safe: tf is only read, and the buffers between steps
 * are this call's (malloc'd, the size of an intermediate image). in may be a part of an image
 * (in->full_h > 0, see tdm_image_decode_part) when tf starts with a RandomResizedCrop or a
 * CenterCrop whose box (drawn on the whole image) lies in the part, e.g. the part that
 * tdm_transform_source_box names: the output is then that of the whole image, bit for bit.
 * TDM_OK, or an error (an image a RandomCrop does not fit, a part that does not hold the
 * first crop, out of memory). */
int tdm_transform_apply(const tdm_transform *tf, const tdm_image *in, float *out, uint64_t seed,
                        int64_t epoch, int64_t index);
/* The part of an h x w image that tdm_transform_apply(tf, ..., seed, epoch, index) reads, as
 * box = {top, left, height, width}: the box of a first RandomResizedCrop (the same draws), or
 * of a first CenterCrop inside the image; else the whole image. A tdm_image_want_fn for
 * tdm_image_decode_part, so that a JPEG decodes only the rows and columns the crop reads. */
void tdm_transform_source_box(const tdm_transform *tf, int64_t h, int64_t w, uint64_t seed,
                              int64_t epoch, int64_t index, int64_t box[4]);
/* The steps as text, torchvision's way ("RandomCrop(32, padding=4), RandomHorizontalFlip(p=0.5)";
 * "none" for no steps), into buf (truncated to cap); returns buf. tdm_transform_parse reads it
 * back to the same steps. */
const char *tdm_transform_str(const tdm_transform *tf, char *buf, size_t cap);
/* NULL is allowed. */
void tdm_transform_free(tdm_transform *tf);

#ifdef __cplusplus
}
#endif
#endif
