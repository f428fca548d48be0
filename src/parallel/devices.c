/* Devices as workers: how many this machine offers, and device lists such as "cpu:0,cpu:1",
 * "cpu:all" or "4" (the --devices option of the trainer and DataParallel). */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT, pthread_setaffinity_np */
#include "backend/backend.h"
#include "parallel/group.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* CPU devices index the allocator's per-device pools (src/core/alloc.c MAX_POOLS). */

int tdm_device_count(tdm_device_type type) {
    if (type == TDM_CUDA) return tdm_cuda_device_count();
    if (type != TDM_CPU) return 0;
    /* the cores this process may run on (a container or taskset may allow fewer than exist) */
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* Appends d to out unless it is already there. */
static int add_device(tdm_device d, tdm_device *out, int *count, int max, const char *entry) {
    char db[16];
    for (int i = 0; i < *count; i++)
        if (tdm_device_equal(out[i], d))
            return tdm_raise(TDM_ERR_DEVICE, "devices: %s is listed twice (entry \"%s\")",
                             tdm_device_str(d, db), entry);
    if (*count >= max)
        return tdm_raise(TDM_ERR_ARG, "devices: more than %d devices (at entry \"%s\")", max,
                         entry);
    out[(*count)++] = d;
    return TDM_OK;
}

/* This process's rank among those of its machine, from the launcher (Open MPI, Slurm, MPICH
 * and Intel MPI), or 0 when there is none: "cuda:local" is then GPU <local rank>. */
static int local_rank(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID",
                          "PMI_LOCAL_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return atoi(v);
    }
    return 0;
}

/* One comma-separated entry: "cpu", "cpu:N", "cpu:all", "cuda:N", "cuda:all", or "cuda" /
 * "cuda:local" (the GPU of this process's local rank). */
static int parse_entry(const char *e, tdm_device *out, int *count, int max) {
    if (!*e) return tdm_raise(TDM_ERR_DEVICE, "devices: empty entry in the device list");
    int gpus = tdm_device_count(TDM_CUDA);
    if (strcmp(e, "cuda") == 0 || strcmp(e, "cuda:local") == 0) { /* rank r of a machine: GPU r */
        int r = local_rank();
        if (r >= gpus)
            return tdm_raise(TDM_ERR_DEVICE,
                             "devices: %s is GPU %d (this process's local rank) but this machine "
                             "has %d GPU%s",
                             e, r, gpus, gpus == 1 ? "" : "s");
        return add_device(tdm_cuda(r), out, count, max, e);
    }
    bool cpus = strcmp(e, "cpu:all") == 0;
    if (cpus || strcmp(e, "cuda:all") == 0) {
        int n = cpus ? tdm_device_count(TDM_CPU) : gpus;
        if (n == 0)
            return tdm_raise(TDM_ERR_DEVICE, "devices: cuda:all, but this machine has no GPU");
        for (int i = 0; i < n; i++)
            if (add_device(cpus ? tdm_cpu(i) : tdm_cuda(i), out, count, max, e))
                return tdm_last_status();
        return TDM_OK;
    }
    tdm_device d;
    if (tdm_device_parse(e, &d) != TDM_OK)
        return tdm_raise(TDM_ERR_DEVICE,
                         "devices: unknown device \"%s\" (expected cpu, cpu:N, "
                         "cpu:all, cuda, cuda:N, cuda:all or a count)",
                         e);
    int avail = d.type == TDM_CPU ? TDM_MAX_DEVICES : tdm_device_count(d.type);
    if (d.index >= avail)
        return tdm_raise(TDM_ERR_DEVICE, "devices: \"%s\" is not available (%d %s device%s)", e,
                         avail, d.type == TDM_CPU ? "CPU" : "CUDA", avail == 1 ? "" : "s");
    return add_device(d, out, count, max, e);
}

/* The whole text is a count "N": cpu:0..cpu:N-1. 0 if it is not a number. */
static int parse_count(const char *text, tdm_device *out, int max) {
    char *end;
    long n = strtol(text, &end, 10);
    if (end == text || *end != '\0') return 0;
    if (n < 1 || n > TDM_MAX_DEVICES)
        return tdm_raise(TDM_ERR_DEVICE, "devices: count %ld out of range 1..%d", n,
                         TDM_MAX_DEVICES);
    if (n > max) return tdm_raise(TDM_ERR_ARG, "devices: %ld devices but room for %d", n, max);
    for (int i = 0; i < (int)n; i++) out[i] = tdm_cpu(i);
    return (int)n;
}

int tdm_devices_parse(const char *text, tdm_device *out, int max) {
    if (!text || !out) return tdm_raise(TDM_ERR_ARG, "devices: NULL argument");
    if (max < 1) return tdm_raise(TDM_ERR_ARG, "devices: room for %d devices", max);
    char buf[1024];
    /* copy without blanks: "cpu:0, cpu:1" reads like "cpu:0,cpu:1" */
    size_t len = 0;
    for (const char *p = text; *p; p++) {
        if (*p == ' ' || *p == '\t') continue;
        if (len + 1 >= sizeof buf)
            return tdm_raise(TDM_ERR_ARG, "devices: device list longer than %zu characters",
                             sizeof buf - 1);
        buf[len++] = *p;
    }
    buf[len] = '\0';
    if (!len) return tdm_raise(TDM_ERR_DEVICE, "devices: empty device list");
    int n = parse_count(buf, out, max);
    if (n != 0) return n;
    int count = 0;
    for (char *e = buf, *comma;; e = comma + 1) {
        comma = strchr(e, ',');
        if (comma) *comma = '\0';
        if (parse_entry(e, out, &count, max)) return tdm_last_status();
        if (!comma) break;
    }
    return count;
}
