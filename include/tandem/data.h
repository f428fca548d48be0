/* Tandem data: datasets read from files or memory, samplers, and a DataLoader whose worker
 * threads build batches in parallel into preallocated buffers.
 *
 * Every reader validates what it reads: a truncated file, a wrong magic, or dimensions that
 * overflow or disagree with the file size give NULL and an error naming the file and the
 * byte offset, never a crash or an allocation the file size does not justify.
 */
#ifndef TANDEM_DATA_H
#define TANDEM_DATA_H

#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- datasets ---------------------------------------------------------------------------- */

typedef struct tdm_dataset tdm_dataset;

/* One decoded image: data [c, h, w] f32, values in [0, 1] as torchvision's ToTensor gives them
 * (c is 1 for grey, 3 for RGB). Whoever fills it says who frees data.
 * A part of an image (tdm_image_decode_part) has full_h > 0: data then holds rows
 * [top, top + h) and columns [left, left + w) of an image of full_h x full_w pixels. full_h 0
 * (what a zeroed or designated initialiser gives): data is the whole image. */
typedef struct {
    int64_t c, h, w;
    float *data;
    int64_t top, left, full_h, full_w;
} tdm_image;

/* Says which part of an h x w image its reader needs: box = {top, left, height, width}, inside
 * the image (it comes in as the whole image). Called once the image's header is read. */
typedef void (*tdm_image_want_fn)(void *arg, int64_t h, int64_t w, int64_t box[4]);

typedef struct {
    /* Writes sample i: x (sample_numel elements of x_dtype) and y (target_numel i64).
     * Must be safe to call from several threads at once. */
    int (*get)(const tdm_dataset *ds, int64_t i, void *x, int64_t *y);
    void (*destroy)(tdm_dataset *ds); /* frees impl */
    /* Optional (NULL: none): a hint that sample i will be read soon, such as a prefetch of
     * its bytes. The loader calls it a few samples ahead, so that the memory reads of
     * several samples overlap instead of waiting for each in turn. No effect on results. */
    void (*prefetch)(const tdm_dataset *ds, int64_t i);
    /* Optional (NULL: none), for image datasets whose images differ in size (a folder of
     * JPEGs): decodes sample i into *img (data malloc'd here, freed by the caller with free())
     * and its label into *y. Such a dataset has sample_shape [c, 0, 0] and its get() fails;
     * the loader runs its transform (transforms.h), which makes every image one size. Safe to
     * call from several threads at once. A file that does not decode is a negative status
     * with an error naming the file and the reason. */
    int (*get_image)(const tdm_dataset *ds, int64_t i, tdm_image *img, int64_t *y);
    /* Optional (NULL: none): get_image for the part of sample i's image that want names (see
     * tdm_image_decode_part): *img holds that box, or more of the image around it, with the
     * same pixels get_image gives there. The loader calls it when its transform starts with a
     * crop (RandomResizedCrop, CenterCrop), so that a JPEG decodes only what the crop reads. */
    int (*get_image_part)(const tdm_dataset *ds, int64_t i, tdm_image_want_fn want, void *arg,
                          tdm_image *img, int64_t *y);
    /* Optional (NULL: none): the name of class k (a folder name), NULL when k is out of
     * range. The classes of an ImageFolder, for messages and checkpoints. */
    const char *(*class_name)(const tdm_dataset *ds, int64_t k);
} tdm_dataset_ops;

struct tdm_dataset {
    const tdm_dataset_ops *ops;
    int64_t n;              /* number of samples */
    tdm_shape sample_shape; /* e.g. [1, 28, 28] for images, [T] for token windows */
    tdm_dtype x_dtype;      /* TDM_F32 features, or TDM_I64 tokens */
    tdm_shape target_shape; /* [] for a class label, [T] for next tokens */
    int64_t num_classes;    /* labels lie in [0, num_classes); vocabulary size for tokens */
    char name[64];          /* for messages: "fashion-mnist/train" */
    void *impl;
};

/* IDX image and label files (MNIST, Fashion-MNIST), gzipped or raw (detected from the
 * content). Images become f32 [1, rows, cols] scaled to [0, 1]; labels i64. */
tdm_dataset *tdm_idx_dataset_open(const char *images_path, const char *labels_path);
/* Where Debian's dataset-fashion-mnist puts the four files. */
#define TDM_FASHION_MNIST_DIR "/usr/share/datasets/fashion-mnist"
/* Fashion-MNIST from dir (NULL: TDM_FASHION_MNIST_DIR), train or test split ("train-*" or
 * "t10k-*" files). */
tdm_dataset *tdm_fashion_mnist(const char *dir, bool train);
/* As tdm_fashion_mnist, with only the first max_samples images decoded (every one where
 * max_samples <= 0 or exceeds the count): a quick run (tandem train --limit) starts without
 * inflating the whole file. The dataset then holds that many samples. The headers and all
 * the labels are read and checked as tdm_fashion_mnist does, and an unpacked file's size
 * against its header; the data of a gzipped file past the first max_samples images is not
 * read, so trailing data or a truncation there goes unnoticed. NULL with the error set on
 * failure; the caller frees the dataset. */
tdm_dataset *tdm_fashion_mnist_first(const char *dir, bool train, int64_t max_samples);
/* llm.c's token shards: a header of 256 little-endian int32 (magic 20240520, version 1,
 * token count), then u16 tokens. Sample i is the window tokens[i*T, i*T + T] (x) and the same
 * shifted by one (y); vocab is the vocabulary size (tokens >= vocab are an error). */
tdm_dataset *tdm_token_dataset_open(const char *path, int64_t context, int64_t vocab);
/* Raw text (any file) as byte-level tokens, vocabulary 256: sample i is the window of bytes
 * [i*T, i*T + T) (x, i64) and the same shifted by one (y), like the token shards, so a GPT
 * trains on any text without a tokenizer. The file is read into memory. NULL and TDM_ERR_IO
 * naming the file, or TDM_ERR_FORMAT when it holds fewer than T + 1 bytes. */
tdm_dataset *tdm_text_dataset_open(const char *path, int64_t context);
/* Numeric CSV: one sample per line, f32 features and an integer label in column
 * label_column (negative counts from the end); header skips the first line. */
tdm_dataset *tdm_csv_dataset_open(const char *path, int label_column, bool header);
/* ImageFolder, as torchvision reads it: dir holds one folder per class, the classes are the
 * sorted folder names (class k is the k-th; ops->class_name gives it), and the samples are the
 * files with an image extension under each, at any depth, in torchvision's order (folders by
 * path, then files by name). Only JPEG and PNG are read: .jpg .jpeg .png (any case) are
 * samples; a file with torchvision's other extensions (.bmp .ppm .pgm .tif .tiff .webp) is one
 * only when its bytes are a JPEG or PNG, else a bad file; other files are not samples.
 * Images decode (libjpeg-turbo, libspng) in the loader's workers, to f32 [channels, h, w] in
 * [0, 1] of each file's own size (get_image); the loader's transform makes them one size.
 * sample_shape is [channels, 0, 0] and get() fails. docs/FORMATS.md has the details. */
typedef struct {
    int channels;  /* 3 (the default: grey files become RGB, as torchvision's loader) or 1 */
    bool skip_bad; /* a file whose header does not read (empty, not a JPEG or PNG, broken
                    * signature or IHDR) is skipped and counted (tdm_image_folder_skipped)
                    * instead of failing the open; damage past the header shows in
                    * get_image either way */
} tdm_image_folder_opts;
tdm_image_folder_opts tdm_image_folder_defaults(void);
/* Reads every file's header (not its pixels). NULL and an error naming the file or folder and
 * the reason: dir missing, no class folders, a class without images, a file that is not a
 * JPEG or PNG (unless skip_bad). o may be NULL (the defaults). */
tdm_dataset *tdm_image_folder_open(const char *dir, const tdm_image_folder_opts *o);
/* Files tdm_image_folder_open skipped (skip_bad); 0 for any other dataset. */
int64_t tdm_image_folder_skipped(const tdm_dataset *ds);
/* Decodes a JPEG or PNG held in memory (the format from its first bytes) into *img, data
 * malloc'd (the caller frees it), with `channels` channels (1 or 3): the values of PIL's
 * convert("RGB") or convert("L") and ToTensor (grey replicated, luma for RGB to grey, alpha
 * dropped). name is for messages. At most 65535 pixels a side and 89478485 in all. TDM_OK, or
 * TDM_ERR_FORMAT naming name and the decoder's reason (img zeroed). Thread-safe. */
int tdm_image_decode(const void *bytes, size_t n, const char *name, int channels, tdm_image *img);
/* tdm_image_decode of the part of the image that want(arg, h, w, box) names once the header is
 * read: a JPEG decodes only those rows (and those columns, with a margin of one iMCU inside
 * which its pixels are bit for bit the whole decode's) and *img is the box, with its top,
 * left, full_h and full_w set (full_h 0 when the box is the whole image); a PNG, or a JPEG
 * whose end marker is missing (so that a file cut short fails whatever part is asked for),
 * decodes whole and want is not called. TDM_ERR_ARG for a box outside the image, else as
 * tdm_image_decode. want NULL is tdm_image_decode. */
int tdm_image_decode_part(const void *bytes, size_t n, const char *name, int channels,
                          tdm_image_want_fn want, void *arg, tdm_image *img);
/* CIFAR-10 (classes 10: data_batch_1..5.bin for train, test_batch.bin; records of a label
 * byte and 3072 pixel bytes) or CIFAR-100 (classes 100: train.bin, test.bin; records of a
 * coarse and a fine label byte, then the pixels; coarse picks the 20 superclasses) in their
 * binary format from dir (or its cifar-10-batches-bin / cifar-100-binary folder). Samples
 * f32 [3, 32, 32] in [0, 1], labels i64; get_image gives the same. NULL and an error naming
 * the file: missing, a size not a multiple of the record, a label out of range (its record). */
tdm_dataset *tdm_cifar_open(const char *dir, int classes, bool train, bool coarse);
/* Samples from memory: x [n, sample_shape...] f32 and y [n] labels, copied. */
tdm_dataset *tdm_memory_dataset(tdm_shape sample_shape, int64_t n, const float *x, const int64_t *y,
                                int64_t num_classes);
/* The samples indices[0..n) of base, in that order (PyTorch's Subset): indices are copied, base
 * is borrowed and must outlive the subset. NULL and TDM_ERR_ARG naming an index outside base. */
tdm_dataset *tdm_dataset_subset(tdm_dataset *base, const int64_t *indices, int64_t n);
int64_t tdm_dataset_sample_numel(const tdm_dataset *ds);
void tdm_dataset_free(tdm_dataset *ds);

/* ---- samplers and the loader ------------------------------------------------------------- */

typedef struct {
    bool normalize; /* x = (x - mean) / std */
    float mean, std;
    int crop_padding; /* random crop of the original size after zero-padding each side; 0 off */
    bool hflip;       /* random horizontal flip with probability 1/2 */
} tdm_augment;

typedef struct tdm_transform tdm_transform; /* transforms.h */

typedef struct {
    int64_t batch_size;
    bool shuffle; /* a permutation per epoch from (seed, epoch) */
    uint64_t seed;
    bool drop_last;       /* drop a last, smaller batch (and, with world_size > 1, one
                           * holding DistributedSampler's padding) */
    int workers;          /* 0: batches are built by the calling thread */
    int prefetch;         /* batches built ahead per worker (default 2); small batches get
                           * more, up to 16 in all within 4 MiB (fewer wake-ups) */
    int rank, world_size; /* world_size > 1: PyTorch's DistributedSampler semantics */
    tdm_augment augment;  /* randomness from (seed, epoch, sample index) only */
    /* Applied to each sample before augment (NULL: none; borrowed, it must outlive the loader):
     * batches are [B, its output shape]. Needed for a dataset of images that differ in size
     * (get_image). */
    const tdm_transform *transform;
    /* Where batches are delivered: cpu:0 (the default), or a GPU, for which workers build
     * batches in pinned host memory and tdm_loader_next uploads them asynchronously,
     * overlapped with the work already queued on the GPU (PyTorch's pin_memory with
     * non_blocking copies). */
    tdm_device device;
} tdm_loader_opts;

tdm_loader_opts tdm_loader_defaults(int64_t batch_size);

typedef struct tdm_loader tdm_loader;

/* One batch: x [B, sample_shape...] and y [B, target_shape...] on the loader's device. The
 * tensors belong to the loader and stay valid until the next tdm_loader_next on this loader
 * (on a GPU: work queued before that call may still read them; the loader orders its next
 * upload into them after it). */
typedef struct {
    tdm_tensor *x, *y;
    const int64_t *y_host; /* y's elements in host memory, valid as long as y: for metrics
                            * without reading a GPU back */
    int64_t size;          /* B: batch_size, or smaller for a last batch without drop_last */
    int64_t index;         /* batch number within the epoch */
} tdm_batch;

/* A loader over ds (which must outlive it). Worker threads start here and are kept across
 * epochs. NULL and an error for invalid options. */
tdm_loader *tdm_loader_new(tdm_dataset *ds, const tdm_loader_opts *o);
/* The bytes of device memory (or pinned host memory, for a GPU) a loader over ds with options
 * o would hold in its batch buffers, at the caching allocator's size classes, into *bytes:
 * its ring of slots, each one batch of x and y, or of every sample of the rank when a batch
 * is larger than that. Makes nothing. Returns TDM_OK, or the error tdm_loader_new would give
 * for these options. */
int tdm_loader_memory(const tdm_dataset *ds, const tdm_loader_opts *o, int64_t *bytes);
/* Starts epoch e (any order; restarting an epoch is allowed). */
int tdm_loader_start_epoch(tdm_loader *l, int64_t epoch);
/* Starts epoch e at batch `batch` (0 <= batch <= batches per epoch): the batches before it
 * are skipped without being built, and the rest are exactly those a full epoch would give
 * (resuming from a checkpoint). */
int tdm_loader_start_epoch_at(tdm_loader *l, int64_t epoch, int64_t batch);
/* The current epoch and the batches of it handed out so far (through *epoch and *batch;
 * either may be NULL). Returns TDM_OK, or TDM_ERR_STATE before any epoch was started. */
int tdm_loader_position(const tdm_loader *l, int64_t *epoch, int64_t *batch);
/* The position in samples: how many samples of the current epoch's order this rank has been
 * handed (the last, smaller batch counted at its size). 0 for NULL or before any epoch. With
 * one rank this is the global position below; with several, only ranks as many read it
 * right (checkpoints before the global position stored it). */
int64_t tdm_loader_samples_done(const tdm_loader *l);
/* The batch that starts at `sample` of an epoch of this loader (through *batch; the end of
 * the epoch gives the batch count). TDM_ERR_ARG, naming the sample and the batch size, when
 * no batch starts there. */
int tdm_loader_batch_at(const tdm_loader *l, int64_t sample, int64_t *batch);
/* The position over every rank: samples of the epoch's global order handed out by all the
 * ranks together, each at the same batch as this one (as under DDP): batch k * batch_size *
 * world_size, and at the epoch's end the dataset's size (with drop_last, the end of its last
 * whole global batch), DistributedSampler's padding not counted. Rank r's rows of global batch
 * k are positions k*G + r, k*G + r + world, ... of the order (G = batch_size * world_size), so
 * a global batch holds the same samples for any world size with the same G, but for the
 * epoch's last without drop_last when world does not divide the dataset: that one also holds
 * the padding's repeats of the order's first samples. A checkpoint stores this, so that a run
 * resumes on another number of ranks. 0 for NULL or before any epoch. */
int64_t tdm_loader_global_samples_done(const tdm_loader *l);
/* The batch of this loader that starts at global sample `global` (as
 * tdm_loader_global_samples_done counts; the epoch's end gives the batch count). TDM_ERR_ARG,
 * naming the sample and the global batch, when no global batch starts there. */
int tdm_loader_global_batch_at(const tdm_loader *l, int64_t global, int64_t *batch);
/* Next batch of the epoch, in order: 1 and *b filled, 0 at the end of the epoch, or a
 * negative status (a sample that failed to load, naming it). */
int tdm_loader_next(tdm_loader *l, tdm_batch *b);
/* Batches per epoch for this rank. */
int64_t tdm_loader_batches(const tdm_loader *l);
/* The sample indices this rank sees in epoch e, in order (n_out receives the count,
 * including DistributedSampler padding). For tests and resumption. Caller frees. */
int64_t *tdm_loader_indices(const tdm_loader *l, int64_t epoch, int64_t *n_out);
/* Seconds the caller spent blocked in tdm_loader_next since the loader was made. */
double tdm_loader_wait_seconds(const tdm_loader *l);
/* Stops the workers and frees the loader. NULL is allowed. */
void tdm_loader_free(tdm_loader *l);

#ifdef __cplusplus
}
#endif
#endif
