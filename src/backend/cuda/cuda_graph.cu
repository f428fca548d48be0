/* CUDA graphs (kernels.def's graph_*): the work one host thread queues on a GPU's compute
 * stream, recorded by stream capture and launched again as one graph, so that a training step
 * of hundreds of kernels costs one launch. Capture runs in relaxed mode: the caching allocator
 * may call cudaMalloc while recording (src/core/alloc.c keeps the recorded blocks for the
 * graph). What cannot be recorded raises through cu_not_capturable (random fills, reads back
 * to the host); the user-index checks are recorded with their own words, read on launch, and
 * dropout's draws read their counters from words each launch sets (graph_draw). */
#include "backend/cuda/cuda_common.cuh"

#include <stdlib.h>
#include <string.h>

int cu_not_capturable(int index, const char *op, const char *why) {
    return tdm_raise(TDM_ERR_STATE, "%s on cuda:%d cannot be recorded in a CUDA graph: %s", op,
                     index, why);
}

static void graph_free(cu_graph *g) {
    if (!g) return;
    if (g->exec) cudaGraphExecDestroy(g->exec);
    if (g->draws_copied) cudaEventDestroy(g->draws_copied);
    cudaFree(g->bad_dev);
    cudaFreeHost(g->bad_host);
    cudaFree(g->draw_dev);
    cudaFreeHost(g->draw_host);
    free(g);
}

extern "C" int tdm_cuda_graph_begin(int index) {
    cu_device *d = cu_dev(index, "graph capture");
    if (!d) return tdm_last_status();
    if (d->capture)
        return tdm_raise(TDM_ERR_STATE, "graph capture on cuda:%d: a capture is under way", index);
    cu_graph *g = (cu_graph *)calloc(1, sizeof *g);
    if (!g) return tdm_raise(TDM_ERR_NOMEM, "graph capture on cuda:%d: out of memory", index);
    size_t words = CU_GRAPH_CHECKS * sizeof *g->bad_dev;
    size_t draws = 2 * CU_GRAPH_DRAWS * sizeof(uint64_t);
    if (cu_check(cudaMalloc(&g->bad_dev, words), "allocating a graph's index flags", index) ||
        cu_check(cudaMallocHost(&g->bad_host, words), "allocating a graph's pinned flags", index) ||
        cu_check(cudaMalloc(&g->draw_dev, draws), "allocating a graph's draw words", index) ||
        cu_check(cudaMallocHost(&g->draw_host, draws), "allocating a graph's pinned draws",
                 index) ||
        cu_check(cudaEventCreateWithFlags(&g->draws_copied, cudaEventDisableTiming),
                 "creating a graph's event", index) ||
        cu_check(cudaStreamBeginCapture(d->compute, cudaStreamCaptureModeRelaxed),
                 "beginning a graph capture", index)) {
        graph_free(g);
        return tdm_last_status();
    }
    d->capture = g;
    return TDM_OK;
}

extern "C" int tdm_cuda_graph_draw(int index, const uint64_t **at) {
    *at = NULL;
    cu_device *d = cu_dev(index, "graph capture");
    if (!d) return tdm_last_status();
    cu_graph *g = d->capture;
    if (!g) return tdm_raise(TDM_ERR_STATE, "graph capture on cuda:%d: none under way", index);
    if (g->n_draws == CU_GRAPH_DRAWS)
        return tdm_raise(TDM_ERR_STATE, "graph capture on cuda:%d: more than %d random draws",
                         index, CU_GRAPH_DRAWS);
    *at = g->draw_dev + 2 * g->n_draws++;
    return TDM_OK;
}

extern "C" int tdm_cuda_graph_end(int index, void **graph) {
    *graph = NULL;
    cu_device *d = cu_dev(index, "graph capture");
    if (!d) return tdm_last_status();
    cu_graph *g = d->capture;
    if (!g) return tdm_raise(TDM_ERR_STATE, "graph capture on cuda:%d: none under way", index);
    d->capture = NULL;
    cudaGraph_t rec = NULL;
    int rc = cu_check(cudaStreamEndCapture(d->compute, &rec), "recording a graph", index);
    if (!rc) rc = cu_check(cudaGraphInstantiate(&g->exec, rec, 0), "instantiating a graph", index);
    if (rec) cudaGraphDestroy(rec);
    if (rc) return graph_free(g), rc;
    *graph = g;
    return TDM_OK;
}

/* The draws' words from the host, in stream order before the graph: through pinned memory the
 * last launch's copy has finished reading (its event). */
static int set_draws(cu_device *d, int index, cu_graph *g, const uint64_t *draws, int n) {
    if (n != g->n_draws)
        return tdm_raise(TDM_ERR_ARG, "graph launch on cuda:%d: %d draws given, %d recorded", index,
                         n, g->n_draws);
    if (n == 0) return TDM_OK;
    size_t bytes = 2 * (size_t)n * sizeof(uint64_t);
    if (cu_check(cudaEventSynchronize(g->draws_copied), "waiting for a graph's draws", index))
        return tdm_last_status();
    memcpy(g->draw_host, draws, bytes);
    if (cu_check(
            cudaMemcpyAsync(g->draw_dev, g->draw_host, bytes, cudaMemcpyHostToDevice, d->compute),
            "setting a graph's draws", index) ||
        cu_check(cudaEventRecord(g->draws_copied, d->compute), "recording a graph's event", index))
        return tdm_last_status();
    return TDM_OK;
}

extern "C" int tdm_cuda_graph_launch(int index, void *graph, const uint64_t *draws, int n_draws) {
    cu_device *d = cu_dev(index, "graph launch");
    if (!d) return tdm_last_status();
    cu_graph *g = (cu_graph *)graph;
    if (set_draws(d, index, g, draws, n_draws) ||
        cu_check(cudaGraphLaunch(g->exec, d->compute), "launching a graph", index))
        return tdm_last_status();
    if (g->n_checks == 0) return TDM_OK;
    size_t bytes = (size_t)g->n_checks * sizeof *g->bad_dev;
    if (cu_check(
            cudaMemcpyAsync(g->bad_host, g->bad_dev, bytes, cudaMemcpyDeviceToHost, d->compute),
            "reading a graph's index checks", index) ||
        cu_check(cudaStreamSynchronize(d->compute), "waiting for a graph's index checks", index))
        return tdm_last_status();
    for (int i = 0; i < g->n_checks; i++) {
        if (g->bad_host[i] == ~0ull) continue;
        const cu_graph_check *c = &g->checks[i];
        long long pos = (long long)g->bad_host[i];
        return cu_index_error(c->op, (long long)cu_index_value(c->idx, c->i64, c->stride, pos), pos,
                              c->dim, c->n, c->use_ignore);
    }
    return TDM_OK;
}

extern "C" void tdm_cuda_graph_free(int index, void *graph) {
    if (!graph) return;
    cu_device *d = cu_dev(index, "graph free");
    if (d) cudaStreamSynchronize(d->compute); /* a launch may still run it */
    graph_free((cu_graph *)graph);
}
