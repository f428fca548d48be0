/* CPU dropout: element i keeps or drops by Philox counter offset + i of seed (the same draw
 * as tdm_philox's and as cuda_dropout.cu's), so a mask does not depend on threading or on the
 * device. */
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_lowp.h"
#include "backend/cpu/cpu_isa.h"

TDM_CPU_CLONES
int tdm_cpu_dropout(tdm_tensor *y, tdm_tensor *mask, const tdm_tensor *x, float p, uint64_t seed,
                    uint64_t offset, const uint64_t *at) {
    if (at) seed = at[0], offset = at[1]; /* the CPU's device memory is the host's */
    if (tdm_cpu_lowp_any(3, (const tdm_tensor *[]){y, mask, x}))
        return tdm_cpu_lowp_dropout(y, mask, x, p, seed, offset, NULL);
    int64_t n = tdm_numel(x);
    const float *xp = (const float *)tdm_data_ptr(x);
    float *yp = (float *)tdm_data_ptr(y), *mp = mask ? (float *)tdm_data_ptr(mask) : NULL;
    float keep = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f; /* p = 1 drops everything */
    for (int64_t i = 0; i < n; i++) {
        uint32_t r[4];
        /* element i owns counter offset + i: masks do not depend on how work is split */
        tdm_philox(seed, offset + (uint64_t)i, 0, r);
        float m = tdm_u32_to_unit(r[0]) >= p ? keep : 0.0f;
        if (mp) mp[i] = m;
        yp[i] = xp[i] * m;
    }
    return TDM_OK;
}
