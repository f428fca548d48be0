/* The device mesh (PyTorch's init_device_mesh): the ranks of a group laid out on named
 * dimensions, each rank given the group of the ranks that differ from it along one dimension
 * only (its tensor-parallel peers, its data-parallel peers).
 *
 * A group's members that sit in one process (all of them over a threads group) share a
 * threads world, made by the first of them, who hands it to the others through an all-gather
 * of pointers over the process's ranks (they share its memory). Members in several processes
 * (over MPI, or the two-level group of several devices a process) run over an MPI sub-group of
 * those processes (tdm_mpi_subgroup_with_id, under ids every process reserves in the same
 * order), alone when a process holds one member, else under a two-level world of the
 * process's members over it. A layout whose groups hold unequal numbers of members in their
 * processes is refused with the reason. Ranks on GPUs (one process) get, over each dimension's
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
    tdm_group *nccl[TDM_MESH_MAX_DIMS]; /* over sub, on a GPU rank; what mesh_group gives */
    /* what this rank made (the first of its group's members in its process) */
    tdm_threads_world *own[TDM_MESH_MAX_DIMS];
    tdm_hier_world *own_hier[TDM_MESH_MAX_DIMS];
    tdm_group *own_mpi[TDM_MESH_MAX_DIMS];
    /* how g's ranks sit in processes: rank = process * local_size + local rank */
    tdm_group *local;     /* this rank's group among its process's (g itself over threads) */
    tdm_group *processes; /* the processes' MPI group (NULL over threads) */
    int local_size;
    int id0; /* the first of the MPI group ids this mesh reserved (tdm_mpi_subgroup_ids) */
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
    const char *kind = g->ops->name;
    if (strcmp(kind, "threads") && strcmp(kind, "mpi") && strcmp(kind, "threads+mpi"))
        return tdm_raise(TDM_ERR_STATE,
                         "mesh_new: a mesh over a %s group is not supported yet; use a threads "
                         "group (tdm_spawn's), an MPI group (tdm_mpi_init's) or a two-level one",
                         kind);
    if (!strcmp(kind, "threads+mpi") && tdm_group_device(g).type == TDM_CUDA)
        return tdm_raise(TDM_ERR_STATE,
                         "mesh_new: a mesh of GPUs in several processes needs NCCL groups across "
                         "processes, which Tandem does not make yet; use one process's GPUs");
    return TDM_OK;
}

/* Dimension d's groups: the members of the group of rank r's are ranks *base + k * *stride. */
static void dim_layout(const tdm_mesh *m, int d, int r, int *base, int *stride) {
    *stride = 1;
    for (int e = d + 1; e < m->ndim; e++) *stride *= m->sizes[e];
    int coord = r / *stride % m->sizes[d];
    *base = r - coord * *stride;
}

/* How many of the group of dimension d with first member base sit in each of its processes
 * (L ranks a process), or 0 when not as many in each, or not one after another. */
static int per_process(const tdm_mesh *m, int d, int base, int stride, int L) {
    int n = m->sizes[d], c = 0;
    while (c < n && (base + c * stride) / L == base / L) c++;
    if (n % c) return 0;
    for (int k = 0; k < n; k++)
        if ((base + k * stride) / L != (base + k / c * c * stride) / L ||
            (k % c == 0 && k && (base + k * stride) / L == (base + (k - 1) * stride) / L))
            return 0;
    return c;
}

/* Every rank's own object (or NULL) made by the rank of local rank `maker`, through an
 * all-gather of pointers over this process's ranks (they share its memory). */
static void *hand_over(tdm_mesh *m, void *mine, int maker, int *rc) {
    int n = tdm_group_size(m->local);
    uintptr_t p = (uintptr_t)mine;
    int32_t v[2] = {(int32_t)(uint32_t)p, (int32_t)(uint32_t)((uint64_t)p >> 32)};
    int32_t *all = malloc(sizeof(int32_t) * 2 * (size_t)n);
    *rc =
        all ? gather_i32(m->local, v, 2, all) : tdm_raise(TDM_ERR_NOMEM, "mesh_new: out of memory");
    void *got = NULL;
    if (!*rc)
        got = (void *)(uintptr_t)((uint32_t)all[2 * maker] | (uint64_t)(uint32_t)all[2 * maker + 1]
                                                                 << 32);
    free(all);
    return got;
}

/* Makes dimension d's group of m (a collective over m->g): devs[k] is rank k's device. The
 * members in this process (c of them) share a threads world; a group across processes runs
 * over an MPI sub-group of them, alone (c = 1) or under a two-level world (c > 1). Each piece
 * is made by the first member in this process and handed to the others. */
static int make_sub(tdm_mesh *m, int d, const tdm_device *devs) {
    int r = tdm_group_rank(m->g), L = m->local_size, n = m->sizes[d], base, stride;
    dim_layout(m, d, r, &base, &stride);
    int c = per_process(m, d, base, stride, L), np = n / c, k0 = m->coord[d] / c * c;
    /* the group's id: this dimension's first (after the earlier dimensions' groups) + its
     * index among them (its outer coordinates, then its offset within a stride) */
    int id = m->id0 + base / (stride * n) * stride + base % stride;
    for (int e = 0; e < d; e++) id += tdm_group_size(m->g) / m->sizes[e];
    int maker = base + k0 * stride;
    bool spans = np > 1, mine = r == maker;
    if (mine && spans) { /* the group's processes, as ranks of m->processes */
        int procs[TDM_MAX_DEVICES];
        for (int q = 0; q < np; q++) procs[q] = (base + q * c * stride) / L;
        m->own_mpi[d] = tdm_mpi_subgroup_with_id(m->processes, np, procs, id);
    }
    if (mine && c > 1 && (!spans || m->own_mpi[d])) {
        tdm_device sub[TDM_MAX_DEVICES];
        for (int j = 0; j < c; j++) sub[j] = devs[maker + j * stride];
        m->own[d] = tdm_threads_world_new(c, sub);
        if (m->own[d] && spans) m->own_hier[d] = tdm_hier_world_new(m->own[d], c, m->own_mpi[d]);
    }
    int rc = TDM_OK, j = m->coord[d] - k0;
    if (c == 1) { /* alone in this process: its own MPI group, or (n = 1) a world of one */
        if (!spans) m->own[d] = tdm_threads_world_new(1, &devs[r]);
        m->sub[d] = spans       ? m->own_mpi[d]
                    : m->own[d] ? tdm_threads_world_group(m->own[d], 0)
                                : NULL;
    } else if (spans) {
        tdm_hier_world *h = hand_over(m, m->own_hier[d], maker % L, &rc);
        m->sub[d] = h ? tdm_hier_world_group(h, j) : NULL;
    } else {
        tdm_threads_world *w = hand_over(m, m->own[d], maker % L, &rc);
        m->sub[d] = w ? tdm_threads_world_group(w, j) : NULL;
    }
    if (!rc && !m->sub[d])
        rc = tdm_raise(TDM_ERR_STATE, "mesh_new: the group of \"%s\" could not be made",
                       m->names[d]);
    return rc;
}

/* How g's ranks sit in processes (m->local, local_size, processes); 0, or -1 and an error when
 * a dimension's groups hold unequal numbers of ranks in their processes. */
static int place(tdm_mesh *m) {
    tdm_group *g = m->g;
    int n = tdm_group_size(g);
    if (!strcmp(g->ops->name, "mpi"))
        m->local_size = 1, m->processes = g;
    else if (!tdm_hier_group_parts(g, &m->local, &m->local_size, &m->processes))
        m->local_size = n, m->local = g;
    for (int d = 0; d < m->ndim; d++)
        for (int r = 0; r < n; r++) {
            int base, stride;
            dim_layout(m, d, r, &base, &stride);
            if (!per_process(m, d, base, stride, m->local_size))
                return tdm_raise(TDM_ERR_ARG,
                                 "mesh_new: the groups of \"%s\" would hold different numbers of "
                                 "devices in different processes (%d devices a process); order "
                                 "the dimensions so that each group has as many in each",
                                 m->names[d], m->local_size);
        }
    return 0;
}

tdm_mesh *tdm_mesh_new(tdm_group *g, int ndim, const int *sizes, const char *const *names) {
    if (check_dims(g, ndim, sizes, names)) return NULL;
    int n = tdm_group_size(g), r = tdm_group_rank(g);
    if (n > TDM_MAX_DEVICES)
        return tdm_raise_null(TDM_ERR_ARG, "mesh_new: %d ranks (at most %d)", n, TDM_MAX_DEVICES);
    tdm_mesh *m = calloc(1, sizeof *m);
    int32_t *info = calloc((size_t)n * 3, sizeof *info);
    if (!m || !info) {
        free(m), free(info);
        return tdm_raise_null(TDM_ERR_NOMEM, "mesh_new: out of memory");
    }
    m->g = g, m->ndim = ndim;
    for (int d = ndim - 1, rest = r; d >= 0; d--) { /* row-major: the last dim varies fastest */
        m->sizes[d] = sizes[d];
        m->coord[d] = rest % sizes[d], rest /= sizes[d];
        snprintf(m->names[d], sizeof m->names[d], "%s", names[d]);
    }
    int rc = place(m), ids = 0;
    for (int d = 0; d < ndim; d++) ids += n / sizes[d]; /* one per group of each dimension */
    /* the MPI groups' ids, reserved by each process's first rank: the same on every process */
    int32_t id0 = -1;
    if (!rc && m->processes && r % m->local_size == 0)
        if ((id0 = tdm_mpi_subgroup_ids(m->processes, ids)) < 0) rc = tdm_last_status();
    tdm_device dev = tdm_group_device(g);
    /* every rank's device, and its process's ids (a failed rank sends -1 and fails below) */
    int rc2 = gather_i32(g, (int32_t[]){(int32_t)dev.type, dev.index, rc ? -2 : id0}, 3, info);
    rc = rc ? rc : rc2;
    tdm_device all[TDM_MAX_DEVICES];
    for (int k = 0; k < n && !rc; k++) {
        all[k] = (tdm_device){(tdm_device_type)info[3 * k], info[3 * k + 1]};
        if (info[3 * k + 2] == -2)
            rc = tdm_raise(TDM_ERR_STATE, "mesh_new: rank %d could not take part", k);
    }
    m->id0 = rc ? -1 : info[3 * (r - r % m->local_size) + 2];
    for (int d = 0; d < ndim && !rc; d++) rc = make_sub(m, d, all);
    for (int d = 0; d < ndim && !rc && dev.type == TDM_CUDA; d++)
        if (!(m->nccl[d] = tdm_nccl_group_new(m->sub[d], dev))) rc = tdm_last_status();
    free(info);
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
    for (int d = 0; d < m->ndim; d++) { /* each before what it runs over */
        tdm_hier_world_free(m->own_hier[d]);
        tdm_threads_world_free(m->own[d]);
        tdm_mpi_subgroup_free(m->own_mpi[d]);
    }
    free(m);
}
