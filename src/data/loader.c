/* The DataLoader: worker threads build whole batches into a ring of preallocated slots, and
 * tdm_loader_next hands them out strictly in order.
 *
 * Batch k always goes to slot k % nslots, so a slot is free for batch k only once the caller
 * has released batch k - nslots: order comes from the ring itself and workers never need to
 * reorder. Slot states move FREE -> FILLING (a worker builds it) -> READY -> IN_USE (the
 * caller holds it until its next call) -> FREE. Everything a worker reads while building
 * (the epoch's indices, the slot's buffers) is only rewritten while no build is in flight.
 *
 * The batch tensors are allocated once per slot, owned by the loader (not by any scope), so
 * a steady-state epoch allocates nothing. With workers == 0 there is one slot and the caller
 * builds each batch itself.
 *
 * For a GPU (opts.device) a slot is built in pinned host memory and tdm_loader_next queues
 * its upload into the slot's device tensors (backend upload_async): after the work already
 * queued on the device, which may still read the slot's last batch, and before the work
 * queued next, so the copy overlaps the step in flight and the host never waits for it. A
 * worker rebuilding the slot first waits for that upload's fence (long done, in order).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "core/core.h"
#include "data/sampler.h"
#include "tandem/trace.h"
#include "tandem/transforms.h"

#define MAX_WORKERS     256
#define MAX_SLOTS       4096
#define BUILD_CANCELLED 1
/* samples hinted ahead of the one being read: a batch of random IDX images read one after
 * the other waits on every cache miss; with the next rows already requested, about half as
 * long (bench/RESULTS.md, "Figures behind the code") */
#define PREFETCH_AHEAD 4

typedef enum { SLOT_FREE, SLOT_FILLING, SLOT_READY, SLOT_IN_USE } slot_state;

typedef struct {
    tdm_tensor *x, *y;           /* x [B, sample...], y [B, target...]: a full batch */
    tdm_tensor *x_tail, *y_tail; /* the first rows only, for a last smaller batch (or NULL) */
    char *xdata;                 /* host memory the batch is built in: x's own on the CPU, */
    int64_t *ydata;              /* pinned buffers uploaded into x and y for a GPU */
    float *raw;                  /* one sample as the dataset gives it, before the transform
                                  * (a transform over a dataset of one image size), or NULL */
    void *fence;                 /* GPU: completes with the last upload from xdata/ydata */
    slot_state state;
    int64_t k;       /* the batch it holds */
    int status;      /* < 0: a sample failed to load; error says which */
    char error[640]; /* written by the builder, read by the caller once READY */
} slot;

struct tdm_loader {
    tdm_dataset *ds;
    tdm_loader_opts o;
    const tdm_backend *gpu; /* the device's backend when batches are uploaded, else NULL */
    int64_t per_rank; /* samples this rank sees per epoch, DistributedSampler padding included */
    int64_t nbatches;
    int64_t tail;           /* size of a last smaller batch, 0 if none */
    int64_t slot_rows;      /* rows a slot holds: batch_size, or per_rank when that is less */
    tdm_shape sample_shape; /* of a batch's row: the dataset's, or its transform's output */
    size_t x_row_bytes;
    int64_t y_row;    /* i64 elements per target */
    int64_t *indices; /* [per_rank] this epoch's order */
    int64_t *scratch; /* [n] the full order when world_size > 1 */
    int nslots;
    slot *slots;

    /* the caller's side */
    bool started;
    int64_t epoch;
    int64_t next_consume;
    slot *held; /* handed out by the last next(), released by the following one */
    int failed; /* sticky status of a failed batch until the next start_epoch */
    char failed_msg[640];
    double wait_s;

    /* shared with the workers, under mu */
    pthread_mutex_t mu;
    pthread_cond_t work_cv;  /* a slot was freed, an epoch started, or stop */
    pthread_cond_t ready_cv; /* a slot became READY */
    pthread_cond_t idle_cv;  /* in_flight reached 0 */
    bool active, stop;
    int64_t next_build;
    int in_flight;
    int sleeping;       /* workers waiting on work_cv */
    atomic_bool cancel; /* read between samples: abandons builds of a finished epoch */
    pthread_t *threads;
    int nthreads;
    bool sync_made; /* mu and the condition variables exist */
};

tdm_loader_opts tdm_loader_defaults(int64_t batch_size) {
    tdm_loader_opts o;
    memset(&o, 0, sizeof o);
    o.batch_size = batch_size;
    o.prefetch = 2;
    o.world_size = 1;
    o.augment.mean = 0.0f;
    o.augment.std = 1.0f;
    o.device = tdm_cpu(0);
    return o;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- building a batch -------------------------------------------------------------------- */

/* The part of sample idx's image the loader's transform reads (tdm_image_want_fn). */
typedef struct {
    const tdm_loader *l;
    int64_t idx;
} want_arg;

static void want_source_box(void *arg, int64_t h, int64_t w, int64_t box[4]) {
    const want_arg *a = arg;
    tdm_transform_source_box(a->l->o.transform, h, w, a->l->o.seed, a->l->epoch, a->idx, box);
}

/* Sample idx into x (a row of the batch) and y: the dataset's get(), or with a transform
 * its decoded image (get_image; get_image_part where the dataset has it: a JPEG decodes only
 * what the transform's first crop reads) or its sample as an image, transformed into x. */
static int read_sample(tdm_loader *l, slot *s, int64_t idx, void *x, int64_t *y) {
    const tdm_dataset *ds = l->ds;
    if (!l->o.transform) return ds->ops->get(ds, idx, x, y);
    tdm_image img = {0};
    int rc;
    want_arg want = {l, idx};
    if (ds->ops->get_image_part) {
        rc = ds->ops->get_image_part(ds, idx, want_source_box, &want, &img, y);
    } else if (ds->ops->get_image) {
        rc = ds->ops->get_image(ds, idx, &img, y);
    } else {
        const tdm_shape *in = &ds->sample_shape; /* [C, H, W], checked at creation */
        img = (tdm_image){.c = in->d[0], .h = in->d[1], .w = in->d[2], .data = s->raw};
        rc = ds->ops->get(ds, idx, s->raw, y);
    }
    if (rc == 0) rc = tdm_transform_apply(l->o.transform, &img, x, l->o.seed, l->epoch, idx);
    if (ds->ops->get_image_part || ds->ops->get_image) free(img.data);
    return rc;
}

/* Fills s with batch k of the current epoch: get() per sample into the slot's buffers, then
 * augmentation in place. Returns TDM_OK, BUILD_CANCELLED, or a negative status with s->error
 * naming the sample. Runs on a worker, or on the caller when workers == 0. */
static int build_batch(tdm_loader *l, slot *s, int64_t k) {
    const tdm_dataset *ds = l->ds;
    int64_t start = k * l->o.batch_size;
    int64_t count = l->per_rank - start < l->o.batch_size ? l->per_rank - start : l->o.batch_size;
    bool augment = tdm_augment_active(&l->o.augment);
    void (*prefetch)(const tdm_dataset *, int64_t) = ds->ops->prefetch;
    s->status = TDM_OK;
    if (s->fence && l->gpu->fence_wait(s->fence)) { /* the last upload still reads the buffers */
        snprintf(s->error, sizeof s->error, "loader: batch %lld: %s", (long long)k,
                 tdm_last_error());
        tdm_clear_error();
        return s->status = TDM_ERR_DEVICE;
    }
    for (int64_t j = 0; prefetch && j < PREFETCH_AHEAD && j < count; j++)
        prefetch(ds, l->indices[start + j]);
    for (int64_t j = 0; j < count; j++) {
        if (atomic_load_explicit(&l->cancel, memory_order_relaxed)) return BUILD_CANCELLED;
        int64_t idx = l->indices[start + j];
        if (prefetch && j + PREFETCH_AHEAD < count)
            prefetch(ds, l->indices[start + j + PREFETCH_AHEAD]);
        void *x = s->xdata + (size_t)j * l->x_row_bytes;
        int rc = read_sample(l, s, idx, x, s->ydata + j * l->y_row);
        if (rc != 0) {
            const char *why = tdm_last_error();
            snprintf(s->error, sizeof s->error,
                     "loader: sample %lld of dataset '%s' (batch %lld) failed to load: %s",
                     (long long)idx, ds->name, (long long)k,
                     why[0] ? why : "get() returned an error");
            tdm_clear_error();
            s->status = rc < 0 ? rc : TDM_ERR_IO;
            return s->status;
        }
        if (augment)
            tdm_augment_apply(&l->o.augment, (float *)x, l->sample_shape, l->o.seed, l->epoch, idx);
    }
    return TDM_OK;
}

/* ---- workers ----------------------------------------------------------------------------- */

/* The slot for the next batch to build, if it may be built now (under mu). */
static slot *claimable(tdm_loader *l) {
    if (!l->active || l->next_build >= l->nbatches) return NULL;
    slot *s = &l->slots[l->next_build % l->nslots];
    return s->state == SLOT_FREE ? s : NULL;
}

static void *worker_main(void *arg) {
    tdm_loader *l = arg;
    tdm_trace_name_thread("loader worker");
    pthread_mutex_lock(&l->mu);
    while (!l->stop) {
        slot *s = claimable(l);
        if (!s) {
            l->sleeping++;
            pthread_cond_wait(&l->work_cv, &l->mu);
            l->sleeping--;
            continue;
        }
        int64_t k = l->next_build++;
        s->state = SLOT_FILLING;
        s->k = k;
        l->in_flight++;
        pthread_mutex_unlock(&l->mu);

        tdm_trace_begin("build batch");
        int rc = build_batch(l, s, k);
        tdm_trace_end();

        pthread_mutex_lock(&l->mu);
        s->state = rc == BUILD_CANCELLED ? SLOT_FREE : SLOT_READY;
        if (rc != BUILD_CANCELLED) pthread_cond_broadcast(&l->ready_cv);
        if (--l->in_flight == 0) pthread_cond_broadcast(&l->idle_cv);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* Ends the current epoch: no new builds, builds in flight abandoned and waited for, every
 * slot free. Afterwards no worker touches the indices or the slots until active is set. */
static void halt_epoch(tdm_loader *l) {
    l->held = NULL;
    if (l->nthreads == 0) {
        l->slots[0].state = SLOT_FREE;
        return;
    }
    pthread_mutex_lock(&l->mu);
    l->active = false;
    atomic_store(&l->cancel, true);
    while (l->in_flight > 0) pthread_cond_wait(&l->idle_cv, &l->mu);
    for (int i = 0; i < l->nslots; i++) l->slots[i].state = SLOT_FREE;
    atomic_store(&l->cancel, false);
    pthread_mutex_unlock(&l->mu);
}

/* ---- creation ---------------------------------------------------------------------------- */

/* The shape of a batch's row: the dataset's samples, or what the transform makes of them. */
static int row_shape(const tdm_dataset *ds, const tdm_loader_opts *o, tdm_shape *shape) {
    char b[96];
    *shape = ds->sample_shape;
    if (!o->transform && ds->ops->get_image)
        return tdm_raise(TDM_ERR_ARG,
                         "loader_new: the images of dataset '%s' differ in size: give the loader "
                         "a transform that makes them one size (transforms.h)",
                         ds->name);
    if (!o->transform) return TDM_OK;
    if (ds->x_dtype != TDM_F32 || ds->sample_shape.ndim != 3)
        return tdm_raise(TDM_ERR_SHAPE,
                         "loader_new: a transform needs images [C, H, W] of f32; dataset '%s' "
                         "has %s samples %s",
                         ds->name, tdm_dtype_name(ds->x_dtype), tdm_shape_str(ds->sample_shape, b));
    if (tdm_transform_output_shape(o->transform, ds->sample_shape, shape) != TDM_OK)
        return tdm_raise(tdm_last_status(), "loader_new: dataset '%s': %s", ds->name,
                         tdm_last_error());
    return TDM_OK;
}

static int check_opts(const tdm_dataset *ds, const tdm_loader_opts *o, tdm_shape *shape) {
    if (!ds || !o) return tdm_raise(TDM_ERR_ARG, "loader_new: NULL %s", ds ? "options" : "dataset");
    if (!ds->ops || !(ds->ops->get || ds->ops->get_image))
        return tdm_raise(TDM_ERR_ARG, "loader_new: dataset '%s' has no get()", ds->name);
    if (ds->n < 1)
        return tdm_raise(TDM_ERR_ARG, "loader_new: dataset '%s' has %lld samples", ds->name,
                         (long long)ds->n);
    if (ds->sample_shape.ndim < 0 || ds->sample_shape.ndim >= TDM_MAX_DIMS ||
        ds->target_shape.ndim < 0 || ds->target_shape.ndim >= TDM_MAX_DIMS)
        return tdm_raise(TDM_ERR_SHAPE,
                         "loader_new: dataset '%s': sample and target need at most %d dims "
                         "(got %d and %d)",
                         ds->name, TDM_MAX_DIMS - 1, ds->sample_shape.ndim, ds->target_shape.ndim);
    if (o->batch_size < 1)
        return tdm_raise(TDM_ERR_ARG, "loader_new: batch_size must be >= 1 (got %lld)",
                         (long long)o->batch_size);
    if (o->workers < 0 || o->workers > MAX_WORKERS)
        return tdm_raise(TDM_ERR_ARG, "loader_new: workers must be in [0, %d] (got %d)",
                         MAX_WORKERS, o->workers);
    if (o->workers > 0 && (o->prefetch < 1 || o->workers * o->prefetch > MAX_SLOTS))
        return tdm_raise(TDM_ERR_ARG,
                         "loader_new: prefetch must be >= 1 with workers * prefetch <= %d "
                         "(got prefetch %d, workers %d)",
                         MAX_SLOTS, o->prefetch, o->workers);
    if (o->world_size < 1)
        return tdm_raise(TDM_ERR_ARG, "loader_new: world_size must be >= 1 (got %d)",
                         o->world_size);
    if (o->device.type != TDM_CPU) {
        const tdm_backend *be = tdm_backend_for(o->device); /* raises for a missing GPU */
        char db[16];
        if (!be) return tdm_last_status();
        if (!be->upload_async || !be->pinned_alloc)
            return tdm_raise(TDM_ERR_DEVICE, "loader_new: batches cannot be uploaded to %s",
                             tdm_device_str(o->device, db));
    }
    if (o->rank < 0 || o->rank >= o->world_size)
        return tdm_raise(TDM_ERR_ARG, "loader_new: rank %d is not in [0, world_size %d)", o->rank,
                         o->world_size);
    int rc = row_shape(ds, o, shape);
    return rc ? rc : tdm_augment_check(&o->augment, ds, *shape);
}

/* A caller-owned view of the first rows of base: the last, smaller batch. Made here, outside
 * any scope, so that it lives as long as the loader. */
static tdm_tensor *rows_view(const tdm_tensor *base, int64_t rows) {
    tdm_tensor *t = tdm_tensor_header_owned(NULL);
    if (!t) return NULL;
    t->dtype = base->dtype;
    t->ndim = base->ndim;
    memcpy(t->shape, base->shape, sizeof t->shape);
    memcpy(t->strides, base->strides, sizeof t->strides);
    t->shape[0] = rows;
    t->offset = base->offset;
    t->device = base->device;
    t->storage = base->storage;
    tdm_storage_retain(t->storage);
    return t;
}

/* [B, inner...] */
static tdm_shape batch_shape(int64_t b, tdm_shape inner) {
    tdm_shape s;
    s.ndim = inner.ndim + 1;
    s.d[0] = b;
    for (int i = 0; i < inner.ndim; i++) s.d[i + 1] = inner.d[i];
    return s;
}

static int slot_init(tdm_loader *l, slot *s) {
    const tdm_dataset *ds = l->ds;
    int64_t b = l->slot_rows;
    tdm_device dev = l->gpu ? l->o.device : tdm_cpu(0);
    s->x = tdm_tensor_alloc_owned(batch_shape(b, l->sample_shape), ds->x_dtype, dev, NULL);
    s->y = tdm_tensor_alloc_owned(batch_shape(b, ds->target_shape), TDM_I64, dev, NULL);
    if (!s->x || !s->y) return tdm_last_status() ? tdm_last_status() : TDM_ERR_NOMEM;
    if (l->gpu) {
        s->xdata = l->gpu->pinned_alloc((size_t)tdm_numel(s->x) * tdm_dtype_size(ds->x_dtype));
        s->ydata =
            s->xdata ? l->gpu->pinned_alloc((size_t)tdm_numel(s->y) * sizeof(int64_t)) : NULL;
        if (!s->ydata) return tdm_last_status() ? tdm_last_status() : TDM_ERR_NOMEM;
    } else {
        s->xdata = tdm_data_ptr(s->x);
        s->ydata = tdm_data_ptr(s->y);
    }
    if (l->tail > 0) {
        s->x_tail = rows_view(s->x, l->tail);
        s->y_tail = rows_view(s->y, l->tail);
        if (!s->x_tail || !s->y_tail) return TDM_ERR_NOMEM;
    }
    if (l->o.transform && !ds->ops->get_image) {
        s->raw = malloc(sizeof(float) * (size_t)tdm_shape_numel(ds->sample_shape));
        if (!s->raw) return TDM_ERR_NOMEM;
    }
    s->state = SLOT_FREE;
    return TDM_OK;
}

static int start_workers(tdm_loader *l) {
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->work_cv, NULL);
    pthread_cond_init(&l->ready_cv, NULL);
    pthread_cond_init(&l->idle_cv, NULL);
    atomic_init(&l->cancel, false);
    l->sync_made = true;
    if (l->o.workers == 0) return TDM_OK;
    l->threads = calloc((size_t)l->o.workers, sizeof *l->threads);
    if (!l->threads) return tdm_raise(TDM_ERR_NOMEM, "loader_new: out of memory");
    for (int i = 0; i < l->o.workers; i++) {
        int rc = pthread_create(&l->threads[i], NULL, worker_main, l);
        if (rc != 0)
            return tdm_raise(TDM_ERR_NOMEM, "loader_new: cannot start worker %d of %d (%s)", i,
                             l->o.workers, strerror(rc));
        l->nthreads++;
    }
    return TDM_OK;
}

/* Slots in the ring: workers * prefetch, or more for small batches. A woken worker builds every
 * free slot before it sleeps and is woken once half the ring is free (release_held), so the
 * depth sets how often the training thread pays a wake-up (a futex call and a cross-core
 * interrupt): the MLP's batches of 200 KB on one core waited for data about a quarter as long
 * with 16 slots as with 4 (`--trace`, the span "wait for data"; bench/RESULTS.md, "Issue 15:
 * A @ B^T without packing B, the loader's ring"). Small batches get up to
 * RING_SLOTS_MAX slots within RING_BYTES; large ones keep the ring asked for. */
#define RING_BYTES     (4u << 20)
#define RING_SLOTS_MAX 16

static int ring_slots(const tdm_loader_opts *o, size_t batch_bytes) {
    int asked = o->workers * o->prefetch;
    size_t fit = batch_bytes ? RING_BYTES / batch_bytes : RING_SLOTS_MAX;
    int small = fit < RING_SLOTS_MAX ? (int)fit : RING_SLOTS_MAX;
    return small > asked ? small : asked;
}

/* A slot's rows: a batch, or every sample of the rank when there are fewer (a batch larger
 * than the data holds them all, and no more: --batch-size 1000000 over 600 samples). */
static int64_t slot_rows(const tdm_dataset *ds, const tdm_loader_opts *o) {
    int64_t per_rank = tdm_sampler_count(ds->n, o->world_size);
    return o->batch_size < per_rank ? o->batch_size : per_rank;
}

int tdm_loader_memory(const tdm_dataset *ds, const tdm_loader_opts *o, int64_t *bytes) {
    tdm_shape shape;
    if (!bytes) return tdm_raise(TDM_ERR_ARG, "loader_memory: NULL result");
    if (check_opts(ds, o, &shape)) return tdm_last_status();
    int64_t rows = slot_rows(ds, o), row = tdm_shape_numel(shape);
    int64_t trow = tdm_shape_numel(ds->target_shape);
    double x = (double)rows * (double)row * (double)tdm_dtype_size(ds->x_dtype);
    double y = (double)rows * (double)trow * (double)sizeof(int64_t);
    if (x + y > 9e18)
        return tdm_raise(TDM_ERR_ARG,
                         "loader_memory: a batch of %lld rows of dataset '%s' overflows",
                         (long long)rows, ds->name);
    int slots = o->workers > 0 ? ring_slots(o, (size_t)x) : 1;
    *bytes = slots * (tdm_memory_block_bytes((int64_t)x) + tdm_memory_block_bytes((int64_t)y));
    return TDM_OK;
}

tdm_loader *tdm_loader_new(tdm_dataset *ds, const tdm_loader_opts *o) {
    tdm_shape shape;
    if (check_opts(ds, o, &shape)) return NULL;
    int64_t row = tdm_shape_numel(shape), trow = tdm_shape_numel(ds->target_shape);
    if (row < 0 || trow < 0 || (row > 0 && o->batch_size > INT64_MAX / 16 / row) ||
        (trow > 0 && o->batch_size > INT64_MAX / 16 / trow))
        return tdm_raise_null(TDM_ERR_ARG, "loader_new: batch_size %lld of dataset '%s' overflows",
                              (long long)o->batch_size, ds->name);
    tdm_loader *l = calloc(1, sizeof *l);
    if (!l) return tdm_raise_null(TDM_ERR_NOMEM, "loader_new: out of memory");
    l->ds = ds;
    l->o = *o;
    l->gpu = o->device.type == TDM_CPU ? NULL : tdm_backend_for(o->device);
    l->per_rank = tdm_sampler_count(ds->n, o->world_size);
    int64_t b = o->batch_size, rem = l->per_rank % b;
    /* drop_last keeps whole batches of real samples only: floor(n / world) per rank, as
     * DistributedSampler(drop_last=True), so an epoch has floor(n / (b * world)) batches on
     * any number of ranks (with the padding a last batch of repeats could be one more) */
    l->nbatches = o->drop_last ? ds->n / o->world_size / b : (l->per_rank + b - 1) / b;
    l->tail = o->drop_last ? 0 : rem;
    l->sample_shape = shape;
    l->x_row_bytes = (size_t)row * tdm_dtype_size(ds->x_dtype);
    l->y_row = trow;
    l->slot_rows = slot_rows(ds, o);
    l->nslots = o->workers > 0 ? ring_slots(o, (size_t)l->slot_rows * l->x_row_bytes) : 1;
    l->indices = malloc((size_t)l->per_rank * sizeof *l->indices);
    l->scratch = o->world_size > 1 ? malloc((size_t)ds->n * sizeof *l->scratch) : NULL;
    l->slots = calloc((size_t)l->nslots, sizeof *l->slots);
    if (!l->indices || !l->slots || (o->world_size > 1 && !l->scratch)) {
        free(l->indices);
        free(l->scratch);
        free(l->slots);
        free(l);
        return tdm_raise_null(TDM_ERR_NOMEM, "loader_new: out of memory for %lld indices",
                              (long long)ds->n);
    }
    int rc = TDM_OK;
    for (int i = 0; i < l->nslots && rc == TDM_OK; i++) rc = slot_init(l, &l->slots[i]);
    if (rc == TDM_OK) rc = start_workers(l);
    if (rc != TDM_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", tdm_last_error());
        tdm_loader_free(l);
        tdm_raise(rc, "%s", msg[0] ? msg : "loader_new: out of memory for batch buffers");
        return NULL;
    }
    return l;
}

/* ---- epochs and batches ------------------------------------------------------------------ */

int tdm_loader_start_epoch(tdm_loader *l, int64_t epoch) {
    return tdm_loader_start_epoch_at(l, epoch, 0);
}

int tdm_loader_position(const tdm_loader *l, int64_t *epoch, int64_t *batch) {
    if (!l) return tdm_raise(TDM_ERR_ARG, "loader_position: NULL loader");
    if (!l->started)
        return tdm_raise(TDM_ERR_STATE, "loader_position: no epoch started on dataset '%s'",
                         l->ds->name);
    if (epoch) *epoch = l->epoch;
    if (batch) *batch = l->next_consume;
    return TDM_OK;
}

int64_t tdm_loader_samples_done(const tdm_loader *l) {
    if (!l || !l->started) return 0;
    int64_t b = l->o.batch_size, k = l->next_consume;
    return l->tail > 0 && k == l->nbatches ? (k - 1) * b + l->tail : k * b;
}

int tdm_loader_batch_at(const tdm_loader *l, int64_t sample, int64_t *batch) {
    if (!l || !batch) return tdm_raise(TDM_ERR_ARG, "loader_batch_at: NULL argument");
    int64_t b = l->o.batch_size,
            end = l->tail > 0 ? (l->nbatches - 1) * b + l->tail : l->nbatches * b;
    if (sample == end) return *batch = l->nbatches, TDM_OK;
    if (sample < 0 || sample > end || sample % b != 0)
        return tdm_raise(TDM_ERR_ARG,
                         "loader position: sample %lld is not the start of a batch of %lld "
                         "(an epoch of '%s' has %lld samples here)",
                         (long long)sample, (long long)b, l->ds->name, (long long)end);
    *batch = sample / b;
    return TDM_OK;
}

/* Where the epoch's global order ends for this loader: its dataset's size, or with drop_last
 * the last whole global batch's end (the same for any number of ranks: see nbatches). */
static int64_t global_end(const tdm_loader *l) {
    int64_t global_batch = l->o.batch_size * l->o.world_size;
    return l->o.drop_last ? l->nbatches * global_batch : l->ds->n;
}

int64_t tdm_loader_global_samples_done(const tdm_loader *l) {
    if (!l || !l->started) return 0;
    /* every rank is at the same batch; the padding of a last batch is not counted */
    if (l->next_consume == l->nbatches) return global_end(l);
    return l->next_consume * l->o.batch_size * l->o.world_size;
}

int tdm_loader_global_batch_at(const tdm_loader *l, int64_t global, int64_t *batch) {
    if (!l || !batch) return tdm_raise(TDM_ERR_ARG, "loader_global_batch_at: NULL argument");
    int64_t gb = l->o.batch_size * l->o.world_size, end = global_end(l);
    if (global == end) return *batch = l->nbatches, TDM_OK;
    if (global < 0 || global > end || global % gb != 0) {
        char split[64] = "";
        if (l->o.world_size > 1)
            snprintf(split, sizeof split, "%lld on each of %d ranks; ", (long long)l->o.batch_size,
                     l->o.world_size);
        return tdm_raise(TDM_ERR_ARG,
                         "loader position: global sample %lld is not the start of a global batch "
                         "of %lld (%san epoch of '%s' has %lld samples here)",
                         (long long)global, (long long)gb, split, l->ds->name, (long long)end);
    }
    *batch = global / gb;
    return TDM_OK;
}

int tdm_loader_start_epoch_at(tdm_loader *l, int64_t epoch, int64_t batch) {
    if (!l) return tdm_raise(TDM_ERR_ARG, "loader_start_epoch: NULL loader");
    if (epoch < 0)
        return tdm_raise(TDM_ERR_ARG, "loader_start_epoch: epoch %lld is negative",
                         (long long)epoch);
    if (batch < 0 || batch > l->nbatches)
        return tdm_raise(TDM_ERR_ARG,
                         "loader_start_epoch: batch %lld is not in [0, %lld] (batches per "
                         "epoch of dataset '%s')",
                         (long long)batch, (long long)l->nbatches, l->ds->name);
    halt_epoch(l);
    /* no build is in flight: the order can be rewritten */
    l->epoch = epoch;
    tdm_sampler_fill(l->indices, l->scratch, l->ds->n, l->o.shuffle, l->o.seed, epoch, l->o.rank,
                     l->o.world_size);
    l->started = true;
    l->next_consume = batch; /* batch k lives in slot k % nslots: any start works */
    l->failed = TDM_OK;
    if (l->nthreads > 0) {
        pthread_mutex_lock(&l->mu);
        l->next_build = batch;
        l->active = true;
        pthread_cond_broadcast(&l->work_cv);
        pthread_mutex_unlock(&l->mu);
    }
    return TDM_OK;
}

/* Gives the slot of the previous batch back to the workers. */
static void release_held(tdm_loader *l) {
    if (!l->held) return;
    if (l->nthreads == 0) {
        l->held->state = SLOT_FREE;
    } else {
        pthread_mutex_lock(&l->mu);
        l->held->state = SLOT_FREE;
        /* A woken worker builds every free slot before it sleeps again, so it is woken only
         * once half the ring is free (or all that is left of the epoch), not every step: a
         * wake-up is a syscall on the training thread and a context switch on a core a device
         * may need. One worker, not all: the others would preempt the training
         * thread for nothing (bench/RESULTS.md, "Figures behind the code"). wait_ready wakes one
         * too when the caller gets ahead of the builds. */
        int64_t end =
            l->next_consume + l->nslots < l->nbatches ? l->next_consume + l->nslots : l->nbatches;
        int64_t ahead = end - l->next_build;
        if (l->sleeping > 0 && ahead > 0 && (ahead >= (l->nslots + 1) / 2 || end == l->nbatches))
            pthread_cond_signal(&l->work_cv);
        pthread_mutex_unlock(&l->mu);
    }
    l->held = NULL;
}

/* Blocks until a worker has built batch k into s, counting the time blocked. */
static void wait_ready(tdm_loader *l, slot *s, int64_t k) {
    pthread_mutex_lock(&l->mu);
    if (!(s->state == SLOT_READY && s->k == k)) {
        if (l->sleeping > 0) pthread_cond_signal(&l->work_cv); /* see release_held */
        double t0 = now_s();
        while (!(s->state == SLOT_READY && s->k == k)) pthread_cond_wait(&l->ready_cv, &l->mu);
        l->wait_s += now_s() - t0;
    }
    s->state = SLOT_IN_USE;
    pthread_mutex_unlock(&l->mu);
}

int tdm_loader_next(tdm_loader *l, tdm_batch *b) {
    if (!l || !b) return tdm_raise(TDM_ERR_ARG, "loader_next: NULL %s", l ? "batch" : "loader");
    if (!l->started)
        return tdm_raise(TDM_ERR_STATE,
                         "loader_next: no epoch started on dataset '%s'; call "
                         "tdm_loader_start_epoch first",
                         l->ds->name);
    release_held(l);
    if (l->failed) return tdm_raise(l->failed, "%s", l->failed_msg);
    if (l->next_consume >= l->nbatches) return 0;

    int64_t k = l->next_consume++;
    slot *s = &l->slots[k % l->nslots];
    if (l->nthreads == 0) {
        /* the caller builds: all of that time is time the caller waits for data */
        double t0 = now_s();
        s->k = k;
        build_batch(l, s, k);
        s->state = SLOT_IN_USE;
        l->wait_s += now_s() - t0;
    } else {
        wait_ready(l, s, k);
    }
    l->held = s;
    if (s->status < 0) {
        l->failed = s->status;
        memcpy(l->failed_msg, s->error, sizeof l->failed_msg);
        return tdm_raise(s->status, "%s", s->error);
    }
    bool tail = l->tail > 0 && k == l->nbatches - 1;
    b->x = tail ? s->x_tail : s->x;
    b->y = tail ? s->y_tail : s->y;
    b->y_host = s->ydata;
    if (l->gpu && (l->gpu->upload_async(b->x, s->xdata, &s->fence) ||
                   l->gpu->upload_async(b->y, s->ydata, &s->fence))) {
        char why[512];
        snprintf(why, sizeof why, "%s", tdm_last_error());
        return tdm_raise(TDM_ERR_DEVICE, "loader: uploading batch %lld: %s", (long long)k, why);
    }
    b->size = tail ? l->tail : l->o.batch_size;
    b->index = k;
    return 1;
}

int64_t tdm_loader_batches(const tdm_loader *l) {
    return l ? l->nbatches : 0;
}

int64_t *tdm_loader_indices(const tdm_loader *l, int64_t epoch, int64_t *n_out) {
    if (n_out) *n_out = 0;
    if (!l || !n_out) return tdm_raise_null(TDM_ERR_ARG, "loader_indices: NULL argument");
    if (epoch < 0)
        return tdm_raise_null(TDM_ERR_ARG, "loader_indices: epoch %lld is negative",
                              (long long)epoch);
    int64_t *out = malloc((size_t)l->per_rank * sizeof *out);
    int64_t *scratch = l->o.world_size > 1 ? malloc((size_t)l->ds->n * sizeof *scratch) : NULL;
    if (!out || (l->o.world_size > 1 && !scratch)) {
        free(out);
        free(scratch);
        return tdm_raise_null(TDM_ERR_NOMEM, "loader_indices: out of memory for %lld indices",
                              (long long)l->per_rank);
    }
    tdm_sampler_fill(out, scratch, l->ds->n, l->o.shuffle, l->o.seed, epoch, l->o.rank,
                     l->o.world_size);
    free(scratch);
    *n_out = l->per_rank;
    return out;
}

double tdm_loader_wait_seconds(const tdm_loader *l) {
    return l ? l->wait_s : 0.0;
}

void tdm_loader_free(tdm_loader *l) {
    if (!l) return;
    if (l->nthreads > 0) {
        pthread_mutex_lock(&l->mu);
        l->stop = true;
        l->active = false;
        atomic_store(&l->cancel, true);
        pthread_cond_broadcast(&l->work_cv);
        pthread_mutex_unlock(&l->mu);
        for (int i = 0; i < l->nthreads; i++) pthread_join(l->threads[i], NULL);
    }
    if (l->sync_made) {
        pthread_mutex_destroy(&l->mu);
        pthread_cond_destroy(&l->work_cv);
        pthread_cond_destroy(&l->ready_cv);
        pthread_cond_destroy(&l->idle_cv);
    }
    for (int i = 0; i < l->nslots; i++) {
        slot *s = &l->slots[i];
        tdm_tensor_free(s->x_tail);
        tdm_tensor_free(s->y_tail);
        tdm_tensor_free(s->x);
        tdm_tensor_free(s->y);
        free(s->raw);
        if (!l->gpu) continue;
        if (s->fence) l->gpu->fence_wait(s->fence); /* an upload may still read the buffers */
        l->gpu->pinned_free(s->xdata);
        l->gpu->pinned_free(s->ydata);
        l->gpu->fence_free(s->fence);
    }
    free(l->threads);
    free(l->slots);
    free(l->indices);
    free(l->scratch);
    free(l);
}
