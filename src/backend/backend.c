/* Device -> backend table lookup. */
#include "backend/backend.h"

#include <unistd.h>

#ifdef TANDEM_HAVE_CUDA
#include "backend/cuda/cuda.h"
#else
int tdm_cuda_device_count(void) {
    return 0; /* this build has no CUDA backend */
}
#endif

/* ---- device memory for core's caching allocator ----------------------------------------- */

static void *device_alloc(tdm_device dev, size_t nbytes) {
    const tdm_backend *be = tdm_backend_for(dev); /* raises for a device this build lacks */
    return be ? be->mem_alloc(dev.index, nbytes) : NULL;
}

static void device_free(tdm_device dev, void *p, size_t nbytes) {
    const tdm_backend *be = tdm_backend_for(dev);
    if (be) be->mem_free(dev.index, p, nbytes);
}

static const tdm_device_memory device_memory = {device_alloc, device_free};

/* Registered as the library loads, not at a first lookup: a program's first tensor may be
 * made without one (a loader's CPU batch slots). Every program that makes a tensor links this
 * file, since every tensor is made or filled through tdm_backend_for. */
__attribute__((constructor)) static void register_device_memory(void) {
    tdm_alloc_set_device_memory(&device_memory);
}

int tdm_backend_check(const tdm_backend *be, bool uploads) {
    if (!be) return tdm_raise(TDM_ERR_ARG, "backend_check: NULL backend");
#define TDM_KERNEL(ret, entry, params)                                                             \
    if (!be->entry)                                                                                \
        return tdm_raise(TDM_ERR_STATE, "backend %s: no kernel for %s", be->name, #entry);
#define TDM_UPLOAD(ret, entry, params)                                                             \
    if (uploads && !be->entry)                                                                     \
        return tdm_raise(TDM_ERR_STATE, "backend %s: no kernel for %s", be->name, #entry);
#include "backend/kernels.def"
#undef TDM_KERNEL
#undef TDM_UPLOAD
    return TDM_OK;
}

int tdm_device_describe(tdm_device d, char *buf, size_t cap) {
    if (!buf || cap == 0) return tdm_raise(TDM_ERR_ARG, "device_describe: no buffer");
    buf[0] = '\0';
    if (d.type != TDM_CUDA) {
        char b[16];
        return tdm_raise(TDM_ERR_DEVICE, "device_describe: %s is not a GPU", tdm_device_str(d, b));
    }
    if (!tdm_backend_for(d)) return tdm_last_status();
#ifdef TANDEM_HAVE_CUDA
    return tdm_cuda_describe(d.index, buf, cap);
#else
    return TDM_ERR_DEVICE; /* unreachable: tdm_backend_for refused */
#endif
}

int tdm_device_memory_info(tdm_device d, int64_t *total, int64_t *avail) {
    int64_t t = 0, a = 0;
    if (d.type == TDM_CPU) {
        long pages = sysconf(_SC_PHYS_PAGES), free_pages = sysconf(_SC_AVPHYS_PAGES);
        long page = sysconf(_SC_PAGESIZE);
        t = pages > 0 && page > 0 ? (int64_t)pages * page : 0;
        a = free_pages > 0 && page > 0 ? (int64_t)free_pages * page : 0;
    } else if (!tdm_backend_for(d)) {
        return tdm_last_status();
    } else {
#ifdef TANDEM_HAVE_CUDA
        int rc = tdm_cuda_memory(d.index, &t, &a);
        if (rc) return rc;
#endif
    }
    if (total) *total = t;
    if (avail) *avail = a;
    return TDM_OK;
}

const tdm_backend *tdm_backend_for(tdm_device dev) {
    if (dev.type == TDM_CPU) return &tdm_cpu_backend;
    char b[16];
    tdm_device_str(dev, b);
#ifdef TANDEM_HAVE_CUDA
    int n = tdm_cuda_device_count(); /* cached after the first call */
    if (dev.index >= 0 && dev.index < n) return &tdm_cuda_backend;
    if (n == 0)
        return tdm_raise_null(TDM_ERR_DEVICE, "device %s asked for but %s", b,
                              tdm_cuda_unavailable_reason());
    return tdm_raise_null(TDM_ERR_DEVICE, "device %s asked for but only %d GPU%s found", b, n,
                          n == 1 ? "" : "s");
#else
    return tdm_raise_null(TDM_ERR_DEVICE, "device %s asked for but this build has no CUDA", b);
#endif
}
