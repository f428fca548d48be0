/* Device -> backend table lookup. */
#include "backend/backend.h"

const tdm_backend *tdm_backend_for(tdm_device dev) {
    if (dev.type == TDM_CPU) return &tdm_cpu_backend;
    char b[16];
    return tdm_raise_null(TDM_ERR_DEVICE, "device %s: this build has no CUDA backend",
                          tdm_device_str(dev, b));
}
