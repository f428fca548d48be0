/* The CUDA backend table: every kernel of backend.h for cuda:N devices, filled from the
 * entry lists of backend.h. */
#include "backend/cuda/cuda.h"

void *tdm_cuda_ptr(const tdm_tensor *t) {
    if (!t || !t->storage) return NULL;
    return (char *)t->storage->data + t->offset * (int64_t)tdm_dtype_size(t->dtype);
}

void *tdm_cuda_storage_ptr(const tdm_storage *s) {
    return s ? s->data : NULL;
}

/* tdm_cuda_<entry> for every entry of backend.h's lists: a missing kernel fails the build */
#define CUDA_ENTRY(e) .e = tdm_cuda_##e,
const tdm_backend tdm_cuda_backend = {
    .name = "cuda", TDM_BACKEND_KERNELS(CUDA_ENTRY) TDM_BACKEND_UPLOADS(CUDA_ENTRY)};
