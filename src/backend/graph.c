/* CUDA graphs (runtime.h): a GPU's recorded work and the private pool of the blocks it used.
 * The recording is the backend's (kernels.def, graph_*); the blocks are core's (alloc.c,
 * tdm_alloc_capture_begin). */
#include "backend/backend.h"

#include <stdio.h>
#include <stdlib.h>

struct tdm_graph {
    tdm_device dev;
    const tdm_backend *be;
    void *rec;              /* the backend's recording */
    tdm_graph_pool *blocks; /* the blocks it writes on each replay */
};

tdm_graph *tdm_graph_capture(tdm_device dev, int (*fn)(void *arg), void *arg) {
    char d[16];
    tdm_device_str(dev, d);
    if (!fn) return tdm_raise_null(TDM_ERR_ARG, "graph capture on %s: NULL function", d);
    const tdm_backend *be = tdm_backend_for(dev);
    if (!be) return NULL;
    if (!be->graph_begin)
        return tdm_raise_null(TDM_ERR_DEVICE, "graph capture on %s: graphs are CUDA's (a GPU)", d);
    tdm_graph *g = calloc(1, sizeof *g);
    if (!g) return tdm_raise_null(TDM_ERR_NOMEM, "graph capture on %s: out of memory", d);
    *g = (tdm_graph){.dev = dev, .be = be};
    if (tdm_alloc_capture_begin(dev)) return free(g), NULL;
    if (be->graph_begin(dev.index)) {
        tdm_alloc_graph_pool_free(tdm_alloc_capture_end());
        return free(g), NULL;
    }
    int rc = fn(arg);
    char why[512];
    snprintf(why, sizeof why, "%s", rc ? tdm_last_error() : "");
    int end = be->graph_end(dev.index, &g->rec); /* always: the stream leaves capture */
    g->blocks = tdm_alloc_capture_end();
    if (!rc && !end) return g;
    /* nothing recorded ran: the blocks are free to anyone */
    if (rc) tdm_raise((tdm_status)rc, "graph capture on %s: %s", d, why);
    tdm_graph_free(g);
    return NULL;
}

int tdm_graph_replay(tdm_graph *g) {
    if (!g) return tdm_raise(TDM_ERR_ARG, "graph replay: NULL graph");
    return g->be->graph_launch(g->dev.index, g->rec);
}

void tdm_graph_free(tdm_graph *g) {
    if (!g) return;
    g->be->graph_free(g->dev.index, g->rec); /* waits for a replay still running */
    tdm_alloc_graph_pool_free(g->blocks);
    free(g);
}
