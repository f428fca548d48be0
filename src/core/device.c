/* Dtypes, devices and shapes: names, parsing, sizes. */
#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t tdm_dtype_size(tdm_dtype dt) {
    return dt == TDM_I64 ? 8 : dt == TDM_BF16 || dt == TDM_F16 ? 2 : 4;
}

bool tdm_dtype_valid(tdm_dtype dt) {
    return (unsigned)dt <= (unsigned)TDM_F16;
}

bool tdm_dtype_is_float(tdm_dtype dt) {
    return dt == TDM_F32 || dt == TDM_BF16 || dt == TDM_F16;
}

const char *tdm_dtype_name(tdm_dtype dt) {
    switch (dt) {
    case TDM_F32:
        return "f32";
    case TDM_I32:
        return "i32";
    case TDM_I64:
        return "i64";
    case TDM_BF16:
        return "bf16";
    case TDM_F16:
        return "f16";
    }
    return "?";
}

bool tdm_device_equal(tdm_device a, tdm_device b) {
    return a.type == b.type && a.index == b.index;
}

int tdm_device_parse(const char *text, tdm_device *out) {
    if (!text || !out) return tdm_raise(TDM_ERR_ARG, "device: NULL argument");
    tdm_device d = {TDM_CPU, 0};
    const char *rest;
    if (strncmp(text, "cpu", 3) == 0) {
        rest = text + 3;
    } else if (strncmp(text, "cuda", 4) == 0) {
        d.type = TDM_CUDA;
        rest = text + 4;
    } else {
        return tdm_raise(TDM_ERR_DEVICE, "device: unknown device \"%s\" (expected cpu:N or cuda:N)",
                         text);
    }
    if (*rest == ':') {
        char *end;
        long idx = strtol(rest + 1, &end, 10);
        if (end == rest + 1 || *end != '\0' || idx < 0 || idx > 1023)
            return tdm_raise(TDM_ERR_DEVICE, "device: bad index in \"%s\"", text);
        d.index = (int)idx;
    } else if (*rest != '\0') {
        return tdm_raise(TDM_ERR_DEVICE, "device: unknown device \"%s\" (expected cpu:N or cuda:N)",
                         text);
    }
    *out = d;
    return TDM_OK;
}

char *tdm_device_str(tdm_device d, char *buf) {
    snprintf(buf, 16, "%s:%d", d.type == TDM_CPU ? "cpu" : "cuda", d.index);
    return buf;
}

int64_t tdm_shape_numel(tdm_shape s) {
    int64_t n = 1;
    for (int i = 0; i < s.ndim; i++) n *= s.d[i];
    return n;
}

char *tdm_shape_str(tdm_shape s, char *buf) {
    int pos = snprintf(buf, 96, "[");
    for (int i = 0; i < s.ndim && pos < 90; i++)
        pos += snprintf(buf + pos, (size_t)(96 - pos), i ? ", %lld" : "%lld", (long long)s.d[i]);
    snprintf(buf + pos, (size_t)(96 - pos), "]");
    return buf;
}
