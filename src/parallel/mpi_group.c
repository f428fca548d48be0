/* The MPI backend: one rank per process, launched by mpirun or a scheduler (srun).
 *
 * Threading. One communication thread per process owns MPI: it calls MPI_Init_thread with
 * MPI_THREAD_FUNNELED (it is the "main" thread in MPI's sense, since it initialises MPI), runs
 * every collective in launch order, and finalises MPI. The caller's threads only queue work
 * and wait on handles, exactly as with the threads backend, so DDP's bucket all-reduces
 * overlap backward. We do not use MPI_THREAD_MULTIPLE: Debian's Open MPI 4.1 offers it
 * (ompi_info: "MPI_THREAD_MULTIPLE: yes"), but it turns on locking inside every MPI call
 * and a single owner thread needs none of it; one thread also keeps the failure handling
 * (below) in one place.
 *
 * Determinism. MPI_Allreduce's summation order depends on the algorithm Open MPI picks for
 * the size and rank count (ring, recursive doubling, Rabenseifner), and some algorithms sum
 * in a different order on different ranks. We implement the all-reduce ourselves with
 * point-to-point messages, like the threads backend: chunk c of each segment is owned by rank
 * c, which receives chunk c from every rank, sums it in rank order 0, 1, ..., N-1 (then
 * divides for AVG), and sends the sum back to every rank (a direct reduce-scatter + all-gather:
 * each rank sends and receives (N-1)/N of the tensor twice, the bandwidth-optimal amount).
 * The result is bit-identical on every rank, on every run, and to the threads backend.
 * Large tensors go in segments of SEG_BYTES, so the scratch buffer is small and allocated
 * once (Open MPI's own all-reduce maps a fresh temporary buffer per call, which falls off a
 * cliff on this VM above 16 MiB: ../shared/baseline/README.md), and no message is larger:
 * tdm_mpi_tune_tcp (mpi_tune.c) lets each leave at once over TCP, one trip per round.
 *
 * Checks. Every collective starts with a header from each rank to every other (kind, op,
 * root, count, element size, sequence number, site; and what a watched group launched before
 * it: tdm_group_watch, the NCCL group's side channel), sent together with the first
 * data messages so it costs no extra round trip; the first data receives are posted only once
 * the headers agree (finish_round). Ranks that call different collectives, sizes or roots get
 * "ranks disagree on the ..." instead of corrupted memory.
 *
 * Faults. The communicator returns errors (MPI_ERRORS_RETURN) and the communication thread
 * never blocks inside MPI: it polls nonblocking requests with MPI_Testsome up to the group's
 * timeout (tdm_group_set_timeout; 30 s by default here), then fails naming the first rank
 * it was still waiting for. Any failure (a timeout, a mismatch, tdm_group_abort) is sticky
 * and is sent to every other rank as a notice, which each rank's communication thread is
 * always listening for, so the others fail at once with the same message instead of timing
 * out in turn. A process that dies is usually also reported by mpirun itself, which then
 * ends the job ("mpirun noticed that process rank 1 ... exited on signal 9"). A collective
 * that fails returns only once none of its requests can touch the caller's memory (drain). */
#include "parallel/group.h"
#include "parallel/sync.h"
#include "tandem/trace.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool tdm_mpi_launched(void) {
    /* Open MPI's mpirun, Hydra (MPICH's mpiexec), PMIx launchers and Slurm's srun */
    const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        if (getenv(vars[i])) return true;
    return false;
}

#ifndef TANDEM_HAVE_MPI

bool tdm_mpi_available(void) {
    return false;
}

tdm_group *tdm_mpi_init(int *argc, char ***argv) {
    return tdm_raise_null(TDM_ERR_STATE,
                          "mpi_init: this build of Tandem has no MPI (install libopenmpi-dev and "
                          "configure with -DTANDEM_MPI=ON)");
}

void tdm_mpi_finalize(void) {}

tdm_group *tdm_mpi_subgroup(tdm_group *g, int n, const int *ranks) {
    (void)g, (void)n, (void)ranks;
    return tdm_raise_null(TDM_ERR_STATE, "mpi_subgroup: this build of Tandem has no MPI");
}

void tdm_mpi_subgroup_free(tdm_group *sub) {
    (void)sub;
}

#else

#include <errno.h>
#include <mpi.h>
#include <sched.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <time.h>

#define DEFAULT_TIMEOUT_S 30.0
/* bytes of a tensor reduced per round: bounds the scratch buffer and the size of a message */
#define SEG_BYTES         (1 << 20)
/* chunk boundaries are multiples of this many bytes (cache lines, like the threads backend) */
/* floats per reduction block: the accumulator stays in L1 */
#define RED_BLK           2048
/* polling: spin this long after the last completion, then sleep with growing naps */
#define SPIN_NS           200000
#define NAP_MAX_NS        200000
/* how often an idle communication thread listens for failure notices */
#define IDLE_POLL_NS      5000000
/* how long a failed round waits for its requests to finish or be cancelled (drain) */
#define DRAIN_NS          1000000000

enum { TAG_HDR = 101, TAG_DATA = 102, TAG_FAIL = 103 };

typedef struct {
    int32_t kind, op, root, dtype;
    int64_t count, elem, seq;
    char site[TDM_SITE_LEN]; /* tdm_collective_label's name, NUL-terminated */
} fingerprint;

typedef struct {
    fingerprint c;
    /* what the group this one watches had launched (tdm_group_watch; all zero: none) */
    fingerprint watched_last; /* seq: how many */
    uint64_t watched_digest;
} header;

#define FAIL_LEN (TDM_WORK_MSG - 64) /* room for the "op on rank R: " prefix */

/* the first tags of the sub-groups: two each (headers, data) */
#define TAG_SUB  200

struct mworld;

/* One group's view of the MPI world: the world itself, or a sub-group of its processes
 * (tdm_mpi_subgroup: a mesh's dimension). Every group's collectives run on the world's one
 * communication thread, in launch order, over the world's communicator under tags of their
 * own: a sub-group needs no communicator of its own, whose making (MPI_Comm_split) would be a
 * collective over every process on that thread. Run one after another, the collectives of
 * several groups cannot wait for each other in a cycle as long as every process launches
 * them in the same order, as one thread of ranks running the same program does (tensor
 * parallelism's collectives between DDP's buckets). Several threads of a process launching
 * on different groups break that: process 0 may queue group B's collective before A's while
 * process 1 queues A's first, and each runs the one the other has not reached, until the
 * timeout (a two-level mesh's data-parallel groups, one per device thread, did). Running them
 * needs collectives that progress side by side on the thread (each a state machine over its
 * rounds), or MPI_THREAD_MULTIPLE with a thread per group. */
typedef struct mcomm {
    tdm_group g; /* first member: a tdm_group * is an mcomm * */
    struct mworld *w;
    int tag_hdr, tag_data;
    int *peers; /* peers[k]: the world rank of the group's rank k; NULL for the world */
    /* ---- owned by the communication thread ---- */
    int64_t seq;
    header *hdr_in; /* a header from each rank of the group */
} mcomm;

typedef struct mworld {
    mcomm c;       /* first member: the world's group */
    int subgroups; /* made so far (tags TAG_SUB + 2 i, + 1) */
    pthread_t thread;
    bool started;
    /* launch queue, FIFO; also guards init_state, the abort's three flags and stop */
    pthread_mutex_t qlock;
    pthread_cond_t qcond;
    tdm_work *head, *tail;
    bool stop;
    int init_state; /* 0 starting, 1 ready, -1 failed (init_msg) */
    char init_msg[256];
    int *argc;
    char ***argv;
    bool abort_req, abort_taken, abort_done; /* asked, failed and told, returned (settle) */
    char abort_msg[FAIL_LEN];
    /* failure: fail_msg is written once, before failed is set (release) */
    atomic_int failed;
    char fail_msg[FAIL_LEN];
    /* ---- owned by the communication thread ---- */
    MPI_Comm comm;
    float *scratch; /* (size - 1) chunks of one segment */
    size_t scratch_bytes;
    tdm_work *cur; /* the collective being run */
    header hdr_out;
    bool hdr_round; /* this round started with the headers: its receives wait for them */
    void **rbuf;    /* such a receive, posted by finish_round: buffer and bytes */
    int64_t *rbytes;
    MPI_Request *reqs;
    int *req_peer; /* the rank each request talks to; negative for sends */
    int *req_idx;
    MPI_Status *stats;
    int nreq, req_cap;
    MPI_Request fail_recv, *fail_sends;
    char fail_in[FAIL_LEN], fail_out[FAIL_LEN];
    bool notices_sent;
    bool stuck; /* a request outlived a failure: no more MPI calls, nothing freed (drain) */
} mworld;

static mworld *world;  /* the one MPI world of this process */
static mworld *kept;   /* a stuck world, finalized but kept alive on purpose (drain) */
static bool finalized; /* MPI cannot be initialised again once finalised */
static pthread_mutex_t world_lock = PTHREAD_MUTEX_INITIALIZER;

/* ---- time --------------------------------------------------------------------------------- */

static void nap_ns(int64_t ns) {
    struct timespec t = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    nanosleep(&t, NULL);
}

/* ---- failure ------------------------------------------------------------------------------ */

static bool has_failed(mworld *w) {
    return atomic_load_explicit(&w->failed, memory_order_acquire) != 0;
}

/* Comm thread: tells every other rank, once, so they fail now rather than at their timeout.
 * The notices are small (eager) messages: they leave even if the peer never receives them. */
static void send_notices(mworld *w) {
    if (w->notices_sent) return;
    w->notices_sent = true;
    snprintf(w->fail_out, sizeof w->fail_out, "%s", w->fail_msg);
    for (int k = 0; k < w->c.g.size; k++) {
        w->fail_sends[k] = MPI_REQUEST_NULL;
        if (k != w->c.g.rank)
            MPI_Isend(w->fail_out, FAIL_LEN, MPI_CHAR, k, TAG_FAIL, w->comm, &w->fail_sends[k]);
    }
}

/* Comm thread: records the first failure; a local one (not a peer's notice) is sent on. */
static void fail(mworld *w, bool local, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail(mworld *w, bool local, const char *fmt, ...) {
    if (has_failed(w)) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->fail_msg, sizeof w->fail_msg, fmt, ap);
    va_end(ap);
    atomic_store_explicit(&w->failed, 1, memory_order_release);
    if (local) send_notices(w);
}

/* Comm thread: takes in a peer's notice or this rank's tdm_group_abort. True once failed. */
static bool poll_failure(mworld *w) {
    int got = 0;
    if (w->fail_recv != MPI_REQUEST_NULL && !w->stuck) {
        MPI_Status st;
        if (MPI_Test(&w->fail_recv, &got, &st) == MPI_SUCCESS && got) {
            w->fail_in[FAIL_LEN - 1] = '\0';
            /* a peer's own finding ("timed out ... waiting for rank 1") is said as the
             * peer's, not as this rank's; an abort's names its rank already */
            if (strncmp(w->fail_in, "rank ", 5) == 0)
                fail(w, false, "%s", w->fail_in);
            else
                fail(w, false, "rank %d stopped: %s", st.MPI_SOURCE, w->fail_in);
        }
    }
    pthread_mutex_lock(&w->qlock);
    bool req = w->abort_req && !w->abort_taken;
    w->abort_taken = w->abort_req;
    pthread_mutex_unlock(&w->qlock);
    if (req) {
        fail(w, true, "rank %d failed: %s", w->c.g.rank, w->abort_msg);
        if (!w->stuck) send_notices(w); /* also when a peer's failure came first */
        /* give the notices a moment to leave before the caller may exit the process */
        for (int64_t until = tdm_now_ns() + 100000000; !w->stuck && tdm_now_ns() < until;) {
            int all = 0;
            MPI_Testall(w->c.g.size, w->fail_sends, &all, MPI_STATUSES_IGNORE);
            if (all) break;
            nap_ns(100000);
        }
    }
    return has_failed(w);
}

/* Comm thread, between two collectives, holding qlock: a tdm_group_abort taken in returns now
 * that no request of this rank can touch a caller's tensor (the collective it interrupted has
 * drained, those queued behind it fail before posting any), so a caller that gives up without
 * waiting for its collectives (DDP when backward fails) may free their tensors. */
static void settle_abort(mworld *w) {
    if (w->abort_taken && !w->abort_done) {
        w->abort_done = true;
        pthread_cond_broadcast(&w->qcond);
    }
}

/* Any group's abort fails the process's world: its groups share the one thread and failure. */
static void mpi_abort(tdm_group *g, const char *message) {
    mworld *w = ((mcomm *)g)->w;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += 2; /* bounded: never hang the failing rank */
    pthread_mutex_lock(&w->qlock);
    if (!w->abort_req) {
        snprintf(w->abort_msg, sizeof w->abort_msg, "%s", message);
        w->abort_req = true;
        pthread_cond_broadcast(&w->qcond);
    }
    while (!w->abort_done && !w->stop)
        if (pthread_cond_timedwait(&w->qcond, &w->qlock, &until) == ETIMEDOUT) break;
    pthread_mutex_unlock(&w->qlock);
}

/* ---- requests of one round ---------------------------------------------------------------- */

static void round_begin(mworld *w) {
    w->nreq = 0;
    w->hdr_round = false;
}

/* A send to or receive from rank k of m's group, under m's tag for TAG_HDR or TAG_DATA. */
static void post(mcomm *m, bool send, void *buf, int64_t bytes, int k, int tag) {
    mworld *w = m->w;
    int peer = m->peers ? m->peers[k] : k;
    tag = tag == TAG_HDR ? m->tag_hdr : m->tag_data;
    MPI_Request *r = &w->reqs[w->nreq];
    if (!send && w->hdr_round) { /* posted once the headers agree (finish_round) */
        *r = MPI_REQUEST_NULL;
        w->rbuf[w->nreq] = buf;
        w->rbytes[w->nreq] = bytes;
    } else if (send)
        MPI_Isend(buf, (int)bytes, MPI_BYTE, peer, tag, w->comm, r);
    else
        MPI_Irecv(buf, (int)bytes, MPI_BYTE, peer, tag, w->comm, r);
    w->req_peer[w->nreq++] = send ? -1 - peer : peer;
}

/* The first rank (of the world) a still-pending receive (else send) of this round waits for. */
static int missing_peer(const mworld *w) {
    int send_peer = -1;
    for (int i = 0; i < w->nreq; i++) {
        if (w->reqs[i] == MPI_REQUEST_NULL) continue;
        if (w->req_peer[i] >= 0) return w->req_peer[i];
        if (send_peer < 0) send_peer = -1 - w->req_peer[i];
    }
    return send_peer;
}

/* After a failure: makes sure that none of reqs[0..n) can still move data into or out of
 * memory that its owner (the caller of the collective, or this world) may free next. Freeing
 * the requests (MPI_Request_free) is not enough: a receive that a message has already matched
 * cannot be cancelled and goes on writing into its buffer whenever this process next calls
 * MPI, a send goes on reading its buffer. So the receives are cancelled (an unmatched one at
 * once), and every request is waited for, up to DRAIN_NS: in a mismatch or an abort the peers
 * are alive and drain their side meanwhile, so transfers under way complete. What is still
 * pending after that (a send that no peer will ever match, a transfer from a rank that died
 * or hangs) can move data only while this process calls MPI, since Open MPI's ob1 over shared
 * memory and TCP has no progress thread ("OMPI progress: no" in ompi_info). The world is then
 * stuck: its communication thread makes no MPI call again, and tdm_mpi_finalize keeps the
 * world's own buffers (the headers, the scratch, the notices) alive instead of freeing them.
 * The caller has cancelled the receives. True when every request has completed. */
static bool drain(mworld *w, MPI_Request *reqs, int n) {
    if (w->stuck) return false;
    for (int64_t until = tdm_now_ns() + DRAIN_NS;;) {
        int left = 0;
        for (int i = 0; i < n; i++) {
            if (reqs[i] == MPI_REQUEST_NULL) continue;
            int done = 0;
            MPI_Test(&reqs[i], &done, MPI_STATUS_IGNORE);
            /* one that completed with an error (a truncation) is not freed by MPI_Test */
            if (done && reqs[i] != MPI_REQUEST_NULL) MPI_Request_free(&reqs[i]);
            left += reqs[i] != MPI_REQUEST_NULL;
        }
        if (!left) return true;
        if (tdm_now_ns() > until) break;
        nap_ns(100000);
    }
    w->stuck = true;
    return false;
}

/* A failed round: its receives cancelled, its requests drained or the world stuck (drain). */
static void cancel_round(mworld *w) {
    for (int i = 0; i < w->nreq; i++)
        if (w->reqs[i] != MPI_REQUEST_NULL && w->req_peer[i] >= 0) MPI_Cancel(&w->reqs[i]);
    drain(w, w->reqs, w->nreq);
}

/* Polls the round's requests until all complete, spinning briefly after each completion and
 * then napping (the comm thread shares the core with the rank's computation). 0, or -1 with
 * the world failed: a peer's notice, an abort, an MPI error or the deadline. */
static int round_wait(mcomm *m, int n, int64_t deadline) {
    mworld *w = m->w;
    int left = n;
    int64_t last = tdm_now_ns(), nap = 1000;
    for (int spins = 0; left > 0; spins++) {
        int outcount = 0;
        int rc = MPI_Testsome(n, w->reqs, &outcount, w->req_idx, w->stats);
        if (rc != MPI_SUCCESS) {
            int peer = -1, code = rc;
            for (int i = 0; i < outcount; i++)
                if (w->stats[i].MPI_ERROR != MPI_SUCCESS) {
                    peer = w->req_peer[w->req_idx[i]];
                    peer = peer < 0 ? -1 - peer : peer;
                    code = w->stats[i].MPI_ERROR;
                    break;
                }
            char es[MPI_MAX_ERROR_STRING];
            int len = 0;
            MPI_Error_string(code, es, &len);
            fail(w, true, "MPI error with rank %d: %s", peer, es);
            cancel_round(w);
            return -1;
        }
        if (outcount != MPI_UNDEFINED && outcount > 0) {
            left -= outcount;
            last = tdm_now_ns();
            nap = 1000;
            continue;
        }
        if (outcount == MPI_UNDEFINED) break;
        if ((spins & 63) == 63 || tdm_now_ns() - last > SPIN_NS) {
            if (poll_failure(w)) {
                /* the progress that brought a peer's notice may have completed the round too
                 * (the peer left a barrier, then aborted): the round is done, and the
                 * failure, sticky, fails the next collective (CI saw a barrier fail) */
                int all = 0;
                if (MPI_Testall(n, w->reqs, &all, MPI_STATUSES_IGNORE) == MPI_SUCCESS && all)
                    return 0;
                cancel_round(w);
                return -1;
            }
            int64_t t = tdm_now_ns();
            if (t > deadline) {
                double s = tdm_group_timeout(&m->g);
                char secs[32];
                snprintf(secs, sizeof secs, s >= 0.1 ? "%.1f" : "%.3g", s);
                fail(w, true, "timed out after %s s waiting for rank %d", secs, missing_peer(w));
                cancel_round(w);
                return -1;
            }
            if (t - last > SPIN_NS) {
                nap_ns(nap);
                nap = nap * 2 < NAP_MAX_NS ? nap * 2 : NAP_MAX_NS;
            } else {
                sched_yield();
            }
        }
    }
    return 0;
}

/* ---- the collectives ---------------------------------------------------------------------- */

/* Posts this collective's headers (call first in the first round of a collective): they are
 * requests 0 .. 2(n-1) - 1 of the round, and the round's data receives wait for them. */
static fingerprint fingerprint_of(const tdm_coll *c, int64_t seq) {
    fingerprint f = {c->kind, c->op, c->root, c->dtype, c->count, (int64_t)c->elem, seq, ""};
    memcpy(f.site, c->site, sizeof f.site);
    return f;
}

static void post_headers(mcomm *m, const tdm_coll *c) {
    mworld *w = m->w;
    const tdm_watch *wt = &w->cur->watch;
    w->hdr_out =
        (header){fingerprint_of(c, m->seq), fingerprint_of(&wt->last, wt->launched), wt->digest};
    for (int k = 0; k < m->g.size; k++) {
        if (k == m->g.rank) continue;
        post(m, false, &m->hdr_in[k], sizeof(header), k, TAG_HDR);
        post(m, true, &w->hdr_out, sizeof(header), k, TAG_HDR);
    }
    w->hdr_round = true;
}

/* A fingerprint as the collective it describes (tdm_coll_describe). */
static tdm_coll coll_of(const fingerprint *h) {
    tdm_coll c = {.kind = (tdm_coll_kind)h->kind,
                  .op = (tdm_reduce_kind)h->op,
                  .root = h->root,
                  .count = h->count,
                  .elem = (size_t)h->elem,
                  .dtype = (tdm_dtype)h->dtype,
                  .seq = h->seq};
    memcpy(c.site, h->site, sizeof c.site);
    c.site[sizeof c.site - 1] = '\0'; /* a peer's bytes: terminated whatever it sent */
    return c;
}

/* The world rank of rank k of m's group. */
static int world_rank(const mcomm *m, int k) {
    return m->peers ? m->peers[k] : k;
}

/* After the first round: every peer called the same collective (tdm_coll_disagree). 0, or -1
 * and failed naming both sides by their world ranks. */
static int check_headers(mcomm *m) {
    mworld *w = m->w;
    tdm_coll me = coll_of(&w->hdr_out.c);
    char msg[FAIL_LEN], during[160];
    int r = world_rank(m, m->g.rank);
    for (int k = 0; k < m->g.size; k++) {
        if (k == m->g.rank) continue;
        const header *h = &m->hdr_in[k];
        tdm_coll peer = coll_of(&h->c);
        bool bad = tdm_coll_disagree(r, &me, world_rank(m, k), &peer, true, msg, sizeof msg);
        if (!bad) { /* the same collective: then the same past on the watched group */
            tdm_watch a = {w->hdr_out.watched_last.seq, w->hdr_out.watched_digest,
                           coll_of(&w->hdr_out.watched_last)};
            tdm_watch b = {h->watched_last.seq, h->watched_digest, coll_of(&h->watched_last)};
            tdm_coll_describe(&me, during, sizeof during);
            bad = tdm_watch_disagree(r, &a, world_rank(m, k), &b, during, msg, sizeof msg);
        }
        if (!bad) continue;
        fail(w, true, "%s", msg);
        return -1;
    }
    return 0;
}

/* Waits for a round. In a collective's first round the data receives are posted only once
 * every peer's header agrees with this rank's: a peer that called another collective, size
 * or root may send more than this rank expects, and Open MPI over TCP wrote such a message
 * past the end of the receive's buffer, a tensor (under ASan: a heap-buffer-overflow in
 * mca_btl_tcp_frag_recv). The data sends leave with the headers, so ranks that agree lose
 * no round trip; a peer that disagrees never posts the receives they would match. */
static int finish_round(mcomm *m, bool first, int64_t deadline) {
    mworld *w = m->w;
    if (first) {
        if (round_wait(m, 2 * (m->g.size - 1), deadline)) return -1;
        if (check_headers(m)) {
            cancel_round(w); /* the data sends */
            return -1;
        }
        for (int i = 2 * (m->g.size - 1); i < w->nreq; i++)
            if (w->req_peer[i] >= 0) /* a world rank */
                MPI_Irecv(w->rbuf[i], (int)w->rbytes[i], MPI_BYTE, w->req_peer[i], m->tag_data,
                          w->comm, &w->reqs[i]);
    }
    return round_wait(m, w->nreq, deadline);
}

/* out[0..len) = rank-order reduction of srcs[k][0..len) in c's dtype (bf16 and f16 summed in
 * f32: tdm_reduce_block); out may be one of the sources. */
static void reduce_into(const tdm_coll *c, void *out, const void **srcs, int n, int64_t len) {
    float acc[RED_BLK]; /* RED_BLK elements of the dtype, at most 4 bytes each */
    for (int64_t off = 0; off < len; off += RED_BLK) {
        int l = (int)(len - off < RED_BLK ? len - off : RED_BLK);
        tdm_reduce_block(acc, srcs, n, off, l, c->op == TDM_AVG, c->dtype);
        memcpy((char *)out + off * (int64_t)c->elem, acc, (size_t)l * c->elem);
    }
}

/* Scratch slot of peer k (k != me) for one segment's chunk of at most `per` elements. */
static void *slot(mcomm *m, int k, int64_t per, size_t elem) {
    int idx = k < m->g.rank ? k : k - 1;
    return (char *)m->w->scratch + (size_t)idx * (size_t)per * elem;
}

/* The all-reduce in c's dtype: bf16 and f16 travel as 2-byte elements (half an f32's bytes)
 * and are summed in f32 by the chunk's owner, then rounded once. */
static int run_all_reduce(mcomm *m, const tdm_coll *c, int64_t deadline) {
    mworld *w = m->w;
    int n = m->g.size, r = m->g.rank;
    char *buf = c->out;
    int64_t elem = (int64_t)c->elem, align = TDM_CHUNK_ALIGN / elem;
    bool first = true;
    /* a segment's chunks fit the scratch: n chunks of per_max elements, n - 1 of them received */
    int64_t per_max = (int64_t)w->scratch_bytes / elem / (n - 1) / align * align;
    int64_t seg = per_max * n;
    const void *srcs[64];
    for (int64_t s0 = 0; s0 < c->count || first; s0 += seg) {
        int64_t len = c->count - s0 < seg ? c->count - s0 : seg;
        char *sb = buf + s0 * elem;
        int64_t lo, hi, per;
        tdm_chunk_of(len, c->elem, n, 0, &lo, &per); /* per = size of chunk 0: the largest */
        /* reduce-scatter: chunk k of my segment goes to rank k, chunk r comes from everyone */
        round_begin(w);
        if (first) post_headers(m, c);
        tdm_chunk_of(len, c->elem, n, r, &lo, &hi);
        for (int k = 0; k < n; k++) {
            if (k == r) continue;
            int64_t klo, khi;
            tdm_chunk_of(len, c->elem, n, k, &klo, &khi);
            post(m, false, slot(m, k, per, c->elem), (hi - lo) * elem, k, TAG_DATA);
            post(m, true, sb + klo * elem, (khi - klo) * elem, k, TAG_DATA);
        }
        if (finish_round(m, first, deadline)) return -1;
        first = false;
        for (int k = 0; k < n; k++) srcs[k] = k == r ? sb + lo * elem : slot(m, k, per, c->elem);
        reduce_into(c, sb + lo * elem, srcs, n, hi - lo);
        /* all-gather: my reduced chunk to everyone, theirs into place */
        round_begin(w);
        for (int k = 0; k < n; k++) {
            if (k == r) continue;
            int64_t klo, khi;
            tdm_chunk_of(len, c->elem, n, k, &klo, &khi);
            post(m, false, sb + klo * elem, (khi - klo) * elem, k, TAG_DATA);
            post(m, true, sb + lo * elem, (hi - lo) * elem, k, TAG_DATA);
        }
        if (round_wait(m, w->nreq, deadline)) return -1;
        if (len == 0) break;
    }
    return 0;
}

/* Reduce-scatter (rank k reduces chunk k of every rank's in into its out) and reduce (the
 * root reduces every rank's buffer into its own), in segments of the scratch: each rank sends
 * the pieces others reduce, and reduces the pieces it receives with its own in rank order, as
 * run_all_reduce does (the same bits). A reduce sends each segment once, where an all-reduce
 * sends it twice. */
static int run_reduce_pieces(mcomm *m, const tdm_coll *c, int64_t deadline) {
    mworld *w = m->w;
    int n = m->g.size, r = m->g.rank;
    bool scatter = c->kind == TDM_COLL_REDUCE_SCATTER, first = true;
    bool reducer = scatter || r == c->root;
    const char *in = c->in;
    int64_t elem = (int64_t)c->elem;
    int64_t seg = (int64_t)w->scratch_bytes / elem / (n - 1);
    const void *srcs[64];
    for (int64_t s0 = 0; s0 < c->count || first; s0 += seg) {
        int64_t len = c->count - s0 < seg ? c->count - s0 : seg;
        round_begin(w);
        if (first) post_headers(m, c);
        for (int k = 0; k < n; k++) {
            if (k == r) continue;
            if (reducer) post(m, false, slot(m, k, seg, c->elem), len * elem, k, TAG_DATA);
            if (scatter || k == c->root)
                post(m, true, (void *)(in + ((scatter ? k * c->count : 0) + s0) * elem), len * elem,
                     k, TAG_DATA);
        }
        if (finish_round(m, first, deadline)) return -1;
        first = false;
        if (reducer) {
            for (int k = 0; k < n; k++)
                srcs[k] = k == r ? in + ((scatter ? r * c->count : 0) + s0) * elem
                                 : slot(m, k, seg, c->elem);
            reduce_into(c, (char *)c->out + s0 * elem, srcs, n, len);
        }
        if (len == 0) break;
    }
    return 0;
}

/* Broadcast (root sends to all) and all-gather (everyone sends to all) in byte segments. */
static int run_copies(mcomm *m, const tdm_coll *c, int64_t deadline) {
    mworld *w = m->w;
    int n = m->g.size, r = m->g.rank;
    bool gather = c->kind == TDM_COLL_ALL_GATHER, first = true;
    int64_t bytes = c->count * (int64_t)c->elem;
    if (gather && bytes) memcpy((char *)c->out + r * bytes, c->in, (size_t)bytes);
    for (int64_t s0 = 0; s0 < bytes || first; s0 += SEG_BYTES) {
        int64_t len = bytes - s0 < SEG_BYTES ? bytes - s0 : SEG_BYTES;
        round_begin(w);
        if (first) post_headers(m, c);
        for (int k = 0; k < n; k++) {
            if (k == r) continue;
            if (gather) {
                post(m, false, (char *)c->out + k * bytes + s0, len, k, TAG_DATA);
                post(m, true, (char *)c->in + s0, len, k, TAG_DATA);
            } else if (r == c->root) {
                post(m, true, (char *)c->out + s0, len, k, TAG_DATA);
            } else if (k == c->root) {
                post(m, false, (char *)c->out + s0, len, k, TAG_DATA);
            }
        }
        if (finish_round(m, first, deadline)) return -1;
        first = false;
        if (len == 0) break;
    }
    return 0;
}

/* Runs one collective. TDM_OK, or TDM_ERR_COMM with msg. */
static int run(mcomm *m, const tdm_coll *c, char *msg) {
    mworld *w = m->w;
    int rc = -1;
    if (!poll_failure(w)) {
        int64_t deadline = tdm_now_ns() + atomic_load(&m->g.timeout_ns);
        m->seq++;
        if (m->g.size == 1) {
            rc = 0;
            if (c->kind == TDM_COLL_ALL_GATHER || c->kind == TDM_COLL_REDUCE_SCATTER)
                memmove(c->out, c->in, (size_t)c->count * c->elem);
            /* AVG over one rank divides by 1: nothing to do */
        } else {
            switch (c->kind) {
            case TDM_COLL_ALL_REDUCE:
                rc = run_all_reduce(m, c, deadline);
                break;
            case TDM_COLL_REDUCE_SCATTER:
            case TDM_COLL_REDUCE:
                rc = run_reduce_pieces(m, c, deadline);
                break;
            case TDM_COLL_BROADCAST:
            case TDM_COLL_ALL_GATHER:
                rc = run_copies(m, c, deadline);
                break;
            case TDM_COLL_BARRIER: /* the header exchange is the barrier */
                round_begin(w);
                post_headers(m, c);
                rc = finish_round(m, true, deadline);
                break;
            }
        }
    }
    if (!rc) return TDM_OK;
    snprintf(msg, TDM_WORK_MSG, "%s on rank %d: %s", tdm_coll_name(c->kind),
             world_rank(m, m->g.rank), w->fail_msg);
    return TDM_ERR_COMM;
}

/* ---- the communication thread ------------------------------------------------------------- */

static int setup(mworld *w) {
    int provided = 0;
    if (MPI_Init_thread(w->argc, w->argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
        snprintf(w->init_msg, sizeof w->init_msg, "mpi_init: MPI_Init_thread failed");
        return -1;
    }
    if (provided < MPI_THREAD_FUNNELED) {
        snprintf(w->init_msg, sizeof w->init_msg,
                 "mpi_init: this MPI provides thread level %d, Tandem needs MPI_THREAD_FUNNELED",
                 provided);
        return -1;
    }
    MPI_Comm_dup(MPI_COMM_WORLD, &w->comm);
    MPI_Comm_set_errhandler(w->comm, MPI_ERRORS_RETURN);
    int rank = 0, size = 1;
    MPI_Comm_rank(w->comm, &rank);
    MPI_Comm_size(w->comm, &size);
    if (size > 64) {
        snprintf(w->init_msg, sizeof w->init_msg,
                 "mpi_init: %d ranks; this backend handles at most 64", size);
        return -1;
    }
    tdm_group_init(&w->c.g, w->c.g.ops, rank, size, tdm_cpu(0));
    tdm_group_set_timeout(&w->c.g, DEFAULT_TIMEOUT_S);
    int cap = 4 * size + 4;
    w->c.hdr_in = calloc((size_t)size, sizeof *w->c.hdr_in);
    w->reqs = calloc((size_t)cap, sizeof *w->reqs);
    w->req_peer = calloc((size_t)cap, sizeof *w->req_peer);
    w->req_idx = calloc((size_t)cap, sizeof *w->req_idx);
    w->stats = calloc((size_t)cap, sizeof *w->stats);
    w->rbuf = calloc((size_t)cap, sizeof *w->rbuf);
    w->rbytes = calloc((size_t)cap, sizeof *w->rbytes);
    w->fail_sends = calloc((size_t)size, sizeof *w->fail_sends);
    w->req_cap = cap;
    /* scratch: (n - 1) chunks of one segment, allocated and touched once (huge pages where
     * the kernel gives them: first touches of fresh 4 KiB pages are slow on this VM) */
    w->scratch_bytes = size > 1 ? (size_t)SEG_BYTES : 64;
    w->scratch = aligned_alloc(2 << 20, (w->scratch_bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20));
    if (!w->c.hdr_in || !w->reqs || !w->req_peer || !w->req_idx || !w->stats || !w->rbuf ||
        !w->rbytes || !w->fail_sends || !w->scratch) {
        snprintf(w->init_msg, sizeof w->init_msg, "mpi_init: out of memory");
        return -1;
    }
    madvise(w->scratch, w->scratch_bytes, MADV_HUGEPAGE);
    memset(w->scratch, 0, w->scratch_bytes);
    for (int k = 0; k < size; k++) w->fail_sends[k] = MPI_REQUEST_NULL;
    w->fail_recv = MPI_REQUEST_NULL;
    if (size > 1)
        MPI_Irecv(w->fail_in, FAIL_LEN, MPI_CHAR, MPI_ANY_SOURCE, TAG_FAIL, w->comm, &w->fail_recv);
    return 0;
}

/* The next queued collective, or NULL once asked to stop and the queue is empty. Listens for
 * failure notices while idle. */
static tdm_work *dequeue(mworld *w) {
    pthread_mutex_lock(&w->qlock);
    settle_abort(w);
    while (!w->head && !w->stop) {
        if (w->abort_req && !w->abort_done) {
            pthread_mutex_unlock(&w->qlock);
            poll_failure(w);
            pthread_mutex_lock(&w->qlock);
            settle_abort(w);
            continue;
        }
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += IDLE_POLL_NS;
        if (until.tv_nsec >= 1000000000) until.tv_sec++, until.tv_nsec -= 1000000000;
        if (pthread_cond_timedwait(&w->qcond, &w->qlock, &until) == ETIMEDOUT) {
            pthread_mutex_unlock(&w->qlock);
            poll_failure(w);
            pthread_mutex_lock(&w->qlock);
        }
    }
    tdm_work *wk = w->head;
    if (wk) {
        w->head = wk->next;
        if (!w->head) w->tail = NULL;
    }
    pthread_mutex_unlock(&w->qlock);
    return wk;
}

static void teardown(mworld *w) {
    if (!has_failed(w)) {
        if (w->fail_recv != MPI_REQUEST_NULL) {
            MPI_Cancel(&w->fail_recv);
            MPI_Wait(&w->fail_recv, MPI_STATUS_IGNORE);
        }
        MPI_Comm_free(&w->comm);
        MPI_Finalize();
    } else {
        /* after a failure a peer may be dead, and MPI_Finalize would wait for it forever: MPI
         * is left as it is and the process is expected to exit with an error (mpirun then
         * ends the job). The notices still in flight write into or read from this world. */
        if (w->fail_recv != MPI_REQUEST_NULL && !w->stuck) MPI_Cancel(&w->fail_recv);
        drain(w, &w->fail_recv, 1);
        if (w->notices_sent) drain(w, w->fail_sends, w->c.g.size);
    }
    if (w->stuck) return; /* kept, with its buffers: see drain */
    free(w->c.hdr_in);
    free(w->reqs);
    free(w->req_peer);
    free(w->req_idx);
    free(w->stats);
    free(w->rbuf);
    free(w->rbytes);
    free(w->fail_sends);
    free(w->scratch);
}

static void *comm_main(void *arg) {
    mworld *w = arg;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); /* naps of microseconds, not 50 us */
    int ok = setup(w) == 0;
    pthread_mutex_lock(&w->qlock);
    w->init_state = ok ? 1 : -1;
    pthread_cond_broadcast(&w->qcond);
    pthread_mutex_unlock(&w->qlock);
    if (!ok) return NULL;
    char msg[TDM_WORK_MSG];
    tdm_trace_name_thread("MPI communication");
    for (tdm_work *wk; (wk = dequeue(w));) {
        msg[0] = '\0';
        tdm_trace_begin(tdm_coll_name(wk->c.kind));
        w->cur = wk;
        int status = run((mcomm *)wk->group, &wk->c, msg);
        tdm_trace_end();
        tdm_work_finish(wk, status, msg);
    }
    teardown(w);
    return NULL;
}

static int mpi_launch(tdm_group *g, tdm_work *wk) {
    mworld *w = ((mcomm *)g)->w;
    pthread_mutex_lock(&w->qlock);
    if (w->stop) {
        pthread_mutex_unlock(&w->qlock);
        return tdm_raise(TDM_ERR_STATE, "%s: the MPI group was finalized",
                         tdm_coll_name(wk->c.kind));
    }
    if (w->tail)
        w->tail->next = wk;
    else
        w->head = wk;
    w->tail = wk;
    pthread_cond_broadcast(&w->qcond);
    pthread_mutex_unlock(&w->qlock);
    return TDM_OK;
}

static const tdm_group_ops mpi_ops = {
    .name = "mpi",
    .launch = mpi_launch,
    .abort = mpi_abort,
};

/* ---- the public API ----------------------------------------------------------------------- */

bool tdm_mpi_available(void) {
    return true;
}

static void world_free(mworld *w) {
    pthread_cond_destroy(&w->qcond);
    pthread_mutex_destroy(&w->qlock);
    free(w);
}

tdm_group *tdm_mpi_init(int *argc, char ***argv) {
    pthread_mutex_lock(&world_lock);
    if (world) {
        pthread_mutex_unlock(&world_lock);
        return &world->c.g;
    }
    if (finalized) {
        pthread_mutex_unlock(&world_lock);
        return tdm_raise_null(TDM_ERR_STATE,
                              "mpi_init: MPI was finalized and cannot be initialized again");
    }
    if (!tdm_mpi_launched()) {
        pthread_mutex_unlock(&world_lock);
        return tdm_raise_null(TDM_ERR_STATE,
                              "mpi_init: not launched by mpirun or srun (none of "
                              "OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK is set); run "
                              "`mpirun -np N program`");
    }
    mworld *w = calloc(1, sizeof *w);
    if (!w) {
        pthread_mutex_unlock(&world_lock);
        return tdm_raise_null(TDM_ERR_NOMEM, "mpi_init: out of memory");
    }
    tdm_mpi_tune_tcp(SEG_BYTES); /* before MPI reads its parameters */
    tdm_mpi_share_cores();       /* before OpenMP reads its threads */
    w->c.g.ops = &mpi_ops;
    w->c.w = w;
    w->c.tag_hdr = TAG_HDR, w->c.tag_data = TAG_DATA;
    w->argc = argc;
    w->argv = argv;
    atomic_init(&w->failed, 0);
    pthread_mutex_init(&w->qlock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->qcond, &ca);
    pthread_condattr_destroy(&ca);
    int e = pthread_create(&w->thread, NULL, comm_main, w);
    if (e) {
        world_free(w);
        pthread_mutex_unlock(&world_lock);
        return tdm_raise_null(TDM_ERR_NOMEM, "mpi_init: cannot start the communication thread (%s)",
                              strerror(e));
    }
    pthread_mutex_lock(&w->qlock);
    while (w->init_state == 0) pthread_cond_wait(&w->qcond, &w->qlock);
    pthread_mutex_unlock(&w->qlock);
    if (w->init_state < 0) {
        pthread_join(w->thread, NULL);
        char msg[256];
        snprintf(msg, sizeof msg, "%s", w->init_msg);
        world_free(w);
        pthread_mutex_unlock(&world_lock);
        return tdm_raise_null(TDM_ERR_COMM, "%s", msg);
    }
    w->started = true;
    world = w;
    pthread_mutex_unlock(&world_lock);
    return &w->c.g;
}

static int check_members(const tdm_group *g, int n, const int *ranks, int *me) {
    if (!g || !ranks) return tdm_raise(TDM_ERR_ARG, "mpi_subgroup: NULL group or ranks");
    if (g->ops != &mpi_ops)
        return tdm_raise(TDM_ERR_ARG, "mpi_subgroup: a %s group is not an MPI group", g->ops->name);
    if (n < 1 || n > g->size)
        return tdm_raise(TDM_ERR_ARG, "mpi_subgroup: %d ranks of a group of %d", n, g->size);
    *me = -1;
    for (int k = 0; k < n; k++) {
        if (ranks[k] < 0 || ranks[k] >= g->size)
            return tdm_raise(TDM_ERR_ARG, "mpi_subgroup: rank %d of a group of %d", ranks[k],
                             g->size);
        for (int j = 0; j < k; j++)
            if (ranks[j] == ranks[k])
                return tdm_raise(TDM_ERR_ARG, "mpi_subgroup: rank %d listed twice", ranks[k]);
        if (ranks[k] == g->rank) *me = k;
    }
    if (*me < 0)
        return tdm_raise(TDM_ERR_ARG, "mpi_subgroup: rank %d is not one of the group's", g->rank);
    return TDM_OK;
}

tdm_group *tdm_mpi_subgroup(tdm_group *g, int n, const int *ranks) {
    int me = -1;
    if (check_members(g, n, ranks, &me)) return NULL;
    mcomm *parent = (mcomm *)g;
    mworld *w = parent->w;
    pthread_mutex_lock(&w->qlock);
    int id = w->subgroups++;
    pthread_mutex_unlock(&w->qlock);
    if (TAG_SUB + 2 * id + 1 > 32767) /* the least MPI_TAG_UB the standard allows */
        return tdm_raise_null(TDM_ERR_ARG, "mpi_subgroup: more than %d groups made",
                              (32767 - TAG_SUB) / 2);
    mcomm *m = calloc(1, sizeof *m);
    int *peers = m ? malloc(sizeof *peers * (size_t)n) : NULL;
    header *hdr = peers ? calloc((size_t)n, sizeof *hdr) : NULL;
    if (!hdr) {
        free(m), free(peers);
        return tdm_raise_null(TDM_ERR_NOMEM, "mpi_subgroup: out of memory");
    }
    for (int k = 0; k < n; k++) peers[k] = world_rank(parent, ranks[k]);
    *m = (mcomm){.w = w,
                 .tag_hdr = TAG_SUB + 2 * id,
                 .tag_data = TAG_SUB + 2 * id + 1,
                 .peers = peers,
                 .hdr_in = hdr};
    tdm_group_init(&m->g, &mpi_ops, me, n, g->device);
    atomic_store(&m->g.timeout_ns, atomic_load(&g->timeout_ns));
    return &m->g;
}

void tdm_mpi_subgroup_free(tdm_group *sub) {
    if (!sub) return;
    mcomm *m = (mcomm *)sub;
    tdm_group_destroy(&m->g);
    /* after a failure a receive of a header may outlive its round (drain): kept, as the
     * world's own buffers are */
    if (!has_failed(m->w)) free(m->hdr_in);
    free(m->peers);
    free(m);
}

void tdm_mpi_finalize(void) {
    pthread_mutex_lock(&world_lock);
    mworld *w = world;
    world = NULL;
    if (w) {
        finalized = true;
        pthread_mutex_lock(&w->qlock);
        w->stop = true;
        pthread_cond_broadcast(&w->qcond);
        pthread_mutex_unlock(&w->qlock);
        pthread_join(w->thread, NULL);
        tdm_group_destroy(&w->c.g);
        if (w->stuck)
            kept = w; /* requests may still point into it: see drain */
        else
            world_free(w);
    }
    pthread_mutex_unlock(&world_lock);
}

#endif
