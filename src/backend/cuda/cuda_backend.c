/* The CUDA backend table: every kernel of backend.h for cuda:N devices, filled from the
 * entries of kernels.def. */
#include "backend/cuda/cuda.h"

void *tdm_cuda_ptr(const tdm_tensor *t) {
    if (!t || !t->storage) return NULL;
    return (char *)t->storage->data + t->offset * (int64_t)tdm_dtype_size(t->dtype);
}

void *tdm_cuda_storage_ptr(const tdm_storage *s) {
    return s ? s->data : NULL;
}

/* tdm_cuda_<entry> for every entry of kernels.def, uploads included: a missing kernel fails
 * the link */
const tdm_backend tdm_cuda_backend = {
    .name = "cuda",
#define TDM_KERNEL(ret, entry, params) .entry = tdm_cuda_##entry,
#define TDM_UPLOAD                     TDM_KERNEL
#include "backend/kernels.def"
#undef TDM_KERNEL
#undef TDM_UPLOAD
};
