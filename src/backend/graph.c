/* CUDA graphs (runtime.h): a GPU's recorded work and the private pool of the blocks it used.
 * The recording is the backend's (kernels.def, graph_*); the blocks are core's (alloc.c,
 * tdm_alloc_capture_begin).
 *
 * Random draws (dropout's): a recorded kernel reads its seed and counter offset from device
 * words (graph_draw), and each replay takes from the generators what the eager step would
 * have taken, in the recorded order, and sets the words before the launch: the replays'
 * masks are the eager steps' bit for bit. Recording runs nothing, so it gives the generators
 * back the counters it took. */
#include "backend/backend.h"
#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct {
    tdm_rng *rng;
    uint64_t used, first; /* the draw's take and its first counter in it (a rank's rows) */
    uint64_t before;      /* rng's offset before the recording's take */
} graph_draw_rec;

struct tdm_graph {
    tdm_device dev;
    const tdm_backend *be;
    void *rec;              /* the backend's recording */
    tdm_graph_pool *blocks; /* the blocks it writes on each replay */
    graph_draw_rec *draws;
    uint64_t *words; /* each replay's (seed, offset) pairs */
    int n_draws, cap_draws;
};

/* The graph this thread is recording, or NULL. */
static _Thread_local tdm_graph *recording;

int tdm_graph_draw(tdm_device dev, tdm_rng *rng, uint64_t used, uint64_t first,
                   const uint64_t **at) {
    *at = NULL;
    tdm_graph *g = recording;
    if (!g || !tdm_device_equal(g->dev, dev)) return TDM_OK;
    if (g->n_draws == g->cap_draws) {
        int cap = g->cap_draws ? 2 * g->cap_draws : 8;
        graph_draw_rec *d = realloc(g->draws, sizeof *d * (size_t)cap);
        if (!d) return tdm_raise(TDM_ERR_NOMEM, "graph capture: out of memory");
        g->draws = d, g->cap_draws = cap;
    }
    /* kept first, so that the recording gives the counters back whatever happens next */
    g->draws[g->n_draws++] = (graph_draw_rec){rng, used, first, rng->offset};
    if (tdm_rng_logging())
        return tdm_raise(TDM_ERR_STATE,
                         "a random draw in a recomputed function cannot be recorded in a CUDA "
                         "graph: its counters come from the function's first run");
    return g->be->graph_draw(dev.index, at);
}

/* The generators as they were before the recording took from them (the last draw first, so
 * that each ends at its first draw's offset). */
static void give_back_draws(tdm_graph *g) {
    for (int i = g->n_draws - 1; i >= 0; i--) g->draws[i].rng->offset = g->draws[i].before;
}

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
    recording = g;
    int rc = fn(arg);
    recording = NULL;
    give_back_draws(g);
    char why[512];
    snprintf(why, sizeof why, "%s", rc ? tdm_last_error() : "");
    int end = be->graph_end(dev.index, &g->rec); /* always: the stream leaves capture */
    g->blocks = tdm_alloc_capture_end();
    if (!rc && !end && g->n_draws &&
        !(g->words = malloc(2 * sizeof *g->words * (size_t)g->n_draws)))
        end = tdm_raise(TDM_ERR_NOMEM, "graph capture on %s: out of memory", d);
    if (!rc && !end) return g;
    /* nothing recorded ran: the blocks are free to anyone */
    if (rc) tdm_raise((tdm_status)rc, "graph capture on %s: %s", d, why);
    tdm_graph_free(g);
    return NULL;
}

int tdm_graph_replay(tdm_graph *g) {
    if (!g) return tdm_raise(TDM_ERR_ARG, "graph replay: NULL graph");
    for (int i = 0; i < g->n_draws; i++) { /* what the eager step would take, in its order */
        const graph_draw_rec *r = &g->draws[i];
        g->words[2 * i] = r->rng->seed;
        g->words[2 * i + 1] = tdm_rng_take(r->rng, r->used) + r->first;
    }
    return g->be->graph_launch(g->dev.index, g->rec, g->words, g->n_draws);
}

void tdm_graph_free(tdm_graph *g) {
    if (!g) return;
    g->be->graph_free(g->dev.index, g->rec); /* waits for a replay still running */
    tdm_alloc_graph_pool_free(g->blocks);
    free(g->draws);
    free(g->words);
    free(g);
}
