/* The host emulation behind nccl.h in this directory. A clique is the shared state of one
 * communicator's ranks; a collective waits until every rank has posted its buffers, the last
 * one to arrive computes it for all (sums in rank order), and everyone leaves together. */
#include "nccl.h"

#include "tandem/half.h"

#include <condition_variable>
#include <map>
#include <mutex>
#include <stdio.h>
#include <string.h>
#include <string>
#include <vector>

enum coll_kind { ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, REDUCE };

struct clique {
    int n, joined = 0, arrived = 0, left = 0;
    unsigned long long generation = 0;
    std::mutex mu;
    std::condition_variable cv;
    std::vector<const void *> send;
    std::vector<void *> recv;
    coll_kind kind = ALL_REDUCE;
    size_t count = 0;
    ncclDataType_t type = ncclFloat;
    ncclRedOp_t op = ncclSum;
    int root = 0;
    bool mismatch = false;
    bool aborted = false; /* ncclCommAbort by a rank: the others' collectives fail, now and later */
    explicit clique(int ranks) : n(ranks), send(ranks), recv(ranks) {}
};

struct emu_nccl_comm {
    clique *c;
    int rank;
};

static std::mutex registry_mu;
static std::map<std::string, clique *> registry; /* ncclCommInitRank's rendezvous, by id */
static unsigned long long next_id;

static size_t type_size(ncclDataType_t t) {
    return t == ncclFloat ? 4 : t == ncclFloat16 || t == ncclBfloat16 ? 2 : 1;
}

/* Runs the collective the ranks posted (called by the last to arrive, under c->mu). */
static void compute(clique *c) {
    size_t es = type_size(c->type), bytes = c->count * es;
    if (c->kind == BROADCAST) {
        for (int r = 0; r < c->n; r++)
            if (r != c->root) memmove(c->recv[r], c->send[c->root], bytes);
        if (c->recv[c->root] != c->send[c->root])
            memmove(c->recv[c->root], c->send[c->root], bytes);
        return;
    }
    if (c->kind == ALL_GATHER) {
        std::vector<char> all((size_t)c->n * bytes);
        for (int r = 0; r < c->n; r++) memcpy(all.data() + r * bytes, c->send[r], bytes);
        for (int r = 0; r < c->n; r++) memcpy(c->recv[r], all.data(), all.size());
        return;
    }
    /* float sums in rank order; reduce-scatter sums n x count and keeps each rank's part.
     * bf16 and f16 are widened and rounded once at the end, as the CPU groups reduce them */
    size_t total = c->kind == REDUCE_SCATTER ? c->count * c->n : c->count;
    std::vector<float> sum(total, 0.0f), wide(es == 2 ? total : 0);
    for (int r = 0; r < c->n; r++) {
        const float *s = (const float *)c->send[r];
        if (c->type == ncclBfloat16) tdm_bf16_to_f32(wide.data(), (const uint16_t *)s, total);
        if (c->type == ncclFloat16) tdm_f16_to_f32(wide.data(), (const uint16_t *)s, total);
        if (es == 2) s = wide.data();
        for (size_t i = 0; i < total; i++) sum[i] += s[i];
    }
    if (c->op == ncclAvg)
        for (float &v : sum) v /= (float)c->n;
    for (int r = 0; r < c->n; r++) {
        if (c->kind == REDUCE && r != c->root) continue; /* the others' recv stay as they were */
        const float *part = sum.data() + (c->kind == REDUCE_SCATTER ? r * c->count : 0);
        if (c->type == ncclBfloat16)
            tdm_bf16_from_f32((uint16_t *)c->recv[r], part, c->count);
        else if (c->type == ncclFloat16)
            tdm_f16_from_f32((uint16_t *)c->recv[r], part, c->count);
        else
            memcpy(c->recv[r], part, c->count * sizeof(float));
    }
}

static ncclResult_t collective(ncclComm_t comm, coll_kind kind, const void *send, void *recv,
                               size_t count, ncclDataType_t type, ncclRedOp_t op, int root) {
    if (!comm || !comm->c) return ncclInvalidArgument;
    clique *c = comm->c;
    std::unique_lock<std::mutex> lock(c->mu);
    c->cv.wait(lock, [c] { return c->left == 0 || c->aborted; }); /* the previous one is over */
    if (c->aborted) return ncclInvalidUsage;
    if (c->arrived == 0) {
        c->kind = kind, c->count = count, c->type = type, c->op = op, c->root = root;
        c->mismatch = false;
    } else if (c->kind != kind || c->count != count || c->type != type || c->root != root) {
        c->mismatch = true;
    }
    c->send[comm->rank] = send, c->recv[comm->rank] = recv;
    unsigned long long gen = c->generation;
    if (++c->arrived == c->n) {
        if (!c->mismatch) compute(c);
        c->arrived = 0, c->left = c->n, c->generation++;
        c->cv.notify_all();
    } else {
        c->cv.wait(lock, [c, gen] { return c->generation != gen || c->aborted; });
        if (c->generation == gen) return ncclInvalidUsage; /* aborted: a GPU kernel stopped */
    }
    bool bad = c->mismatch;
    if (--c->left == 0) c->cv.notify_all();
    return bad ? ncclInvalidUsage : ncclSuccess;
}

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    std::lock_guard<std::mutex> g(registry_mu);
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "emu-%llu", ++next_id);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    if (nranks < 1 || rank < 0 || rank >= nranks || !id.internal[0]) return ncclInvalidArgument;
    clique *c;
    {
        std::lock_guard<std::mutex> g(registry_mu);
        std::string key(id.internal);
        auto it = registry.find(key);
        c = it != registry.end() ? it->second : (registry[key] = new clique(nranks));
        if (++c->joined == nranks) registry.erase(key);
    }
    if (c->n != nranks) return ncclInvalidArgument;
    *comm = new emu_nccl_comm{c, rank};
    return ncclSuccess;
}

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
    if (ndev < 1) return ncclInvalidArgument;
    clique *c = new clique(ndev);
    c->joined = ndev;
    for (int i = 0; i < ndev; i++) comms[i] = new emu_nccl_comm{c, i};
    return ncclSuccess;
}

/* The last rank to leave frees the clique. */
static ncclResult_t comm_free(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    clique *c = comm->c;
    bool last;
    {
        std::lock_guard<std::mutex> g(c->mu);
        last = --c->joined == 0;
    }
    if (last) delete c;
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    return comm_free(comm);
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (comm && comm->c) {
        std::lock_guard<std::mutex> g(comm->c->mu);
        comm->c->aborted = true;
        comm->c->cv.notify_all();
    }
    return comm_free(comm);
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *err) {
    *err = ncclSuccess;
    return ncclSuccess;
}
const char *ncclGetErrorString(ncclResult_t r) {
    return r == ncclSuccess        ? "no error"
           : r == ncclInvalidUsage ? "invalid usage (emulated)"
                                   : "emulated NCCL error";
}
ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    if (type != ncclFloat && type != ncclBfloat16 && type != ncclFloat16)
        return ncclInvalidArgument;
    return collective(comm, ALL_REDUCE, send, recv, count, type, op, 0);
}
ncclResult_t ncclReduce(const void *send, void *recv, size_t count, ncclDataType_t type,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    if (type != ncclFloat && type != ncclBfloat16 && type != ncclFloat16)
        return ncclInvalidArgument;
    return collective(comm, REDUCE, send, recv, count, type, op, root);
}
ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
    return collective(comm, BROADCAST, send, recv, count, type, ncclSum, root);
}
ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
    return collective(comm, ALL_GATHER, send, recv, count, type, ncclSum, 0);
}
ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    if (type != ncclFloat && type != ncclBfloat16 && type != ncclFloat16)
        return ncclInvalidArgument;
    return collective(comm, REDUCE_SCATTER, send, recv, count, type, op, 0);
}
}
