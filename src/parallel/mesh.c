/* The device mesh (PyTorch's init_device_mesh): the ranks of a group laid out on named
 * dimensions, each rank given the group of the ranks that differ from it along one dimension
 * only (its tensor-parallel peers, its data-parallel peers).
 *
 * Over a threads group the groups of a dimension are threads worlds of their own, made by each
 * group's first rank (coordinate 0 along the dimension), who hands its world to the others
 * through an all-gather of pointers over the parent: the ranks of a threads group share this
 * process's memory. Over MPI (one rank a process) they are MPI sub-groups
 * (tdm_mpi_subgroup), every process making its own in the same order. Threads within MPI
 * (the two-level group) are refused with the reason. Ranks on GPUs get, over each dimension's
 * group, an NCCL group of their GPUs (tdm_nccl_group_new): the groups the mesh hands out then
 * run their collectives on the GPUs' memory, as a GPU rank's tensors need. */
#include "parallel/group.h"
#include "parallel/nccl_group.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct tdm_mesh {
    tdm_group *g;
    int ndim;
    int sizes[TDM_MESH_MAX_DIMS], coord[TDM_MESH_MAX_DIMS];
    char names[TDM_MESH_MAX_DIMS][TDM_MESH_NAME_LEN];
    tdm_group *sub[TDM_MESH_MAX_DIMS];
    tdm_group *nccl[TDM_MESH_MAX_DIMS];        /* over sub, on a GPU rank; what mesh_group gives */
    tdm_threads_world *own[TDM_MESH_MAX_DIMS]; /* the worlds this rank made (coordinate 0) */
    bool mpi;                                  /* sub are MPI sub-groups, this rank's to free */
};

/* Every rank's v[0..n) (int32) into all[rank * n + i]: an all-gather over g. */
static int gather_i32(tdm_group *g, const int32_t *v, int n, int32_t *all) {
    tdm_tensor *in = tdm_from_data(TDM_SHAPE(n), TDM_I32, tdm_cpu(0), v);
    tdm_tensor *out =
        in ? tdm_zeros(TDM_SHAPE((int64_t)n * tdm_group_size(g)), TDM_I32, tdm_cpu(0)) : NULL;
    if (out) tdm_collective_label("the device mesh's setup");
    int rc = out ? tdm_work_wait(tdm_all_gather(g, out, in)) : tdm_last_status();
    if (!rc) rc = tdm_to_host(out, all, sizeof(int32_t) * (size_t)n * tdm_group_size(g));
    tdm_tensor_free(in);
    tdm_tensor_free(out);
    return rc;
}

static int check_dims(tdm_group *g, int ndim, const int *sizes, const char *const *names) {
    if (!g || !sizes || !names) return tdm_raise(TDM_ERR_ARG, "mesh_new: NULL argument");
    if (ndim < 1 || ndim > TDM_MESH_MAX_DIMS)
        return tdm_raise(TDM_ERR_ARG, "mesh_new: %d dimensions (1 to %d)", ndim, TDM_MESH_MAX_DIMS);
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) {
        if (!names[d] || !names[d][0] || strlen(names[d]) >= TDM_MESH_NAME_LEN)
            return tdm_raise(TDM_ERR_ARG, "mesh_new: dimension %d needs a name of 1 to %d bytes", d,
                             TDM_MESH_NAME_LEN - 1);
        for (int e = 0; e < d; e++)
            if (!strcmp(names[d], names[e]))
                return tdm_raise(TDM_ERR_ARG, "mesh_new: two dimensions named \"%s\"", names[d]);
        if (sizes[d] < 1)
            return tdm_raise(TDM_ERR_ARG, "mesh_new: dimension \"%s\" of size %d", names[d],
                             sizes[d]);
        n *= sizes[d];
    }
    if (n != tdm_group_size(g))
        return tdm_raise(TDM_ERR_ARG, "mesh_new: the dimensions make %lld ranks, the group has %d",
                         (long long)n, tdm_group_size(g));
    if (strcmp(g->ops->name, "threads") != 0 && strcmp(g->ops->name, "mpi") != 0)
        return tdm_raise(TDM_ERR_STATE,
                         "mesh_new: a mesh over a %s group is not supported yet; use the devices "
                         "of one process (tdm_spawn's threads group) or one device a process "
                         "(tdm_mpi_init's group)",
                         g->ops->name);
    return TDM_OK;
}

/* Makes dimension d's group of m (a collective over m->g): devs[k] is rank k's device. */
static int make_sub(tdm_mesh *m, int d, const tdm_device *devs) {
    int n = tdm_group_size(m->g), stride = 1;
    for (int e = d + 1; e < m->ndim; e++) stride *= m->sizes[e];
    int base = tdm_group_rank(m->g) - m->coord[d] * stride; /* its member of coordinate 0 */
    if (m->mpi) {
        int ranks[TDM_MAX_DEVICES];
        for (int k = 0; k < m->sizes[d]; k++) ranks[k] = base + k * stride;
        m->sub[d] = tdm_mpi_subgroup(m->g, m->sizes[d], ranks);
        return m->sub[d] ? TDM_OK : tdm_last_status();
    }
    if (m->coord[d] == 0) {
        tdm_device sub[TDM_MAX_DEVICES];
        for (int k = 0; k < m->sizes[d]; k++) sub[k] = devs[base + k * stride];
        m->own[d] = tdm_threads_world_new(m->sizes[d], sub);
    }
    /* every rank's world pointer (or 0), as two 32-bit halves */
    uintptr_t mine = (uintptr_t)m->own[d];
    int32_t v[2] = {(int32_t)(uint32_t)mine, (int32_t)(uint32_t)((uint64_t)mine >> 32)};
    int32_t *all = malloc(sizeof(int32_t) * 2 * (size_t)n);
    int rc =
        all ? gather_i32(m->g, v, 2, all) : tdm_raise(TDM_ERR_NOMEM, "mesh_new: out of memory");
    if (!rc) {
        uint64_t p = (uint32_t)all[2 * base] | (uint64_t)(uint32_t)all[2 * base + 1] << 32;
        tdm_threads_world *w = (tdm_threads_world *)(uintptr_t)p;
        m->sub[d] = w ? tdm_threads_world_group(w, m->coord[d]) : NULL;
        if (!w)
            rc = tdm_raise(TDM_ERR_STATE, "mesh_new: the group of \"%s\" could not be made",
                           m->names[d]);
    }
    free(all);
    return rc;
}

tdm_mesh *tdm_mesh_new(tdm_group *g, int ndim, const int *sizes, const char *const *names) {
    if (check_dims(g, ndim, sizes, names)) return NULL;
    int n = tdm_group_size(g), r = tdm_group_rank(g);
    if (n > TDM_MAX_DEVICES)
        return tdm_raise_null(TDM_ERR_ARG, "mesh_new: %d ranks (at most %d)", n, TDM_MAX_DEVICES);
    tdm_mesh *m = calloc(1, sizeof *m);
    int32_t *devs = calloc((size_t)n * 2, sizeof *devs);
    if (!m || !devs) {
        free(m), free(devs);
        return tdm_raise_null(TDM_ERR_NOMEM, "mesh_new: out of memory");
    }
    m->g = g, m->ndim = ndim, m->mpi = !strcmp(g->ops->name, "mpi");
    for (int d = ndim - 1, rest = r; d >= 0; d--) { /* row-major: the last dim varies fastest */
        m->sizes[d] = sizes[d];
        m->coord[d] = rest % sizes[d], rest /= sizes[d];
        snprintf(m->names[d], sizeof m->names[d], "%s", names[d]);
    }
    tdm_device dev = tdm_group_device(g);
    int rc = gather_i32(g, (int32_t[]){(int32_t)dev.type, dev.index}, 2, devs);
    tdm_device all[TDM_MAX_DEVICES];
    for (int k = 0; k < n; k++)
        all[k] = (tdm_device){(tdm_device_type)devs[2 * k], devs[2 * k + 1]};
    for (int d = 0; d < ndim && !rc; d++) rc = make_sub(m, d, all);
    for (int d = 0; d < ndim && !rc && dev.type == TDM_CUDA; d++)
        if (!(m->nccl[d] = tdm_nccl_group_new(m->sub[d], dev))) rc = tdm_last_status();
    free(devs);
    if (rc) {
        tdm_mesh_free(m);
        return NULL;
    }
    return m;
}

static int dim_of(const tdm_mesh *m, const char *dim, const char *op) {
    for (int d = 0; m && dim && d < m->ndim; d++)
        if (!strcmp(m->names[d], dim)) return d;
    if (!m || !dim) return tdm_raise(TDM_ERR_ARG, "%s: NULL %s", op, m ? "dimension" : "mesh"), -1;
    char list[TDM_MESH_MAX_DIMS * (TDM_MESH_NAME_LEN + 2)] = "";
    for (int d = 0; d < m->ndim; d++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", d ? ", " : "",
                 m->names[d]);
    tdm_raise(TDM_ERR_ARG, "%s: the mesh has no dimension \"%s\" (it has %s)", op, dim, list);
    return -1;
}

tdm_group *tdm_mesh_group(const tdm_mesh *m, const char *dim) {
    int d = dim_of(m, dim, "mesh_group");
    return d < 0 ? NULL : m->nccl[d] ? m->nccl[d] : m->sub[d];
}

int tdm_mesh_coord(const tdm_mesh *m, const char *dim) {
    int d = dim_of(m, dim, "mesh_coord");
    return d < 0 ? -1 : m->coord[d];
}

int tdm_mesh_size(const tdm_mesh *m, const char *dim) {
    int d = dim_of(m, dim, "mesh_size");
    return d < 0 ? -1 : m->sizes[d];
}

void tdm_mesh_free(tdm_mesh *m) {
    if (!m) return;
    /* every rank done with every group before their makers free them */
    tdm_collective_label("the device mesh's end");
    tdm_work_wait(tdm_barrier(m->g));
    if (m->nccl[0]) { /* a GPU rank's: gone on every rank before the groups under them */
        for (int d = 0; d < m->ndim; d++) tdm_nccl_group_free(m->nccl[d]);
        tdm_collective_label("the device mesh's NCCL groups' end");
        tdm_work_wait(tdm_barrier(m->g));
    }
    for (int d = 0; d < m->ndim; d++) {
        tdm_threads_world_free(m->own[d]);
        if (m->mpi) tdm_mpi_subgroup_free(m->sub[d]);
    }
    free(m);
}
