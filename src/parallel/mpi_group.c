/* The MPI backend: one rank per process, launched by mpirun or a scheduler (srun).
 *
 * Threading. Each group (the world, and each sub-group: tdm_mpi_subgroup) has a communication
 * thread that runs its collectives in launch order; the caller's threads only queue work and
 * wait on handles, exactly as with the threads backend, so DDP's bucket all-reduces overlap
 * backward. The world's thread initialises and finalises MPI. The threads take turns in MPI
 * (a mutex around every call: MPI_THREAD_SERIALIZED) and never block inside it, so the
 * collectives of different groups progress side by side whatever order each process launches
 * them in. We do not ask for MPI_THREAD_MULTIPLE: Debian's Open MPI 4.1 offers it
 * (ompi_info: "MPI_THREAD_MULTIPLE: yes"), but it turns on locking inside every MPI call where
 * one uncontended mutex around our few calls does. One failure (below) is shared by them all.
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

int tdm_mpi_subgroup_ids(tdm_group *g, int count) {
    (void)g, (void)count;
    return tdm_raise(TDM_ERR_STATE, "mpi_subgroup: this build of Tandem has no MPI"), -1;
}

tdm_group *tdm_mpi_subgroup_with_id(tdm_group *g, int n, const int *ranks, int id) {
    (void)g, (void)n, (void)ranks, (void)id;
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

#define FAIL_LEN      (TDM_WORK_MSG - 64) /* room for the "op on rank R: " prefix */

/* the first tags of the sub-groups: two each (headers, data) */
#define TAG_SUB       200

struct mworld;

/* The state of one round of a collective: its requests and where its deferred receives go. */
typedef struct {
    tdm_work *cur; /* the collective being run */
    header hdr_out;
    bool hdr_round; /* this round started with the headers: its receives wait for them */
    void **rbuf;    /* such a receive, posted by finish_round: buffer and bytes */
    int64_t *rbytes;
    MPI_Request *reqs;
    int *req_peer; /* the world rank each request talks to; -1 - rank for sends */
    int *req_idx;
    MPI_Status *stats;
    int nreq, req_cap;
    float *scratch; /* (size - 1) chunks of one segment */
    size_t scratch_bytes;
} mround;

/* One group's view of the MPI world: the world itself, or a sub-group of its processes
 * (tdm_mpi_subgroup: a mesh's dimension), over the world's communicator under tags of its
 * own (a sub-group needs no communicator of its own, whose making, MPI_Comm_split, would be
 * a collective over every process). Each group runs its collectives in launch order on a
 * communication thread of its own, so the collectives of different groups progress side by
 * side: threads of a process may launch on different groups in any order (a two-level mesh's
 * data-parallel groups, one per device thread), where one thread running them one after
 * another would wait in the collective a peer process has not reached. The threads take
 * turns in MPI (w->mpi_mu: MPI_THREAD_SERIALIZED); none ever blocks inside it. */
typedef struct mcomm {
    tdm_group g; /* first member: a tdm_group * is an mcomm * */
    struct mworld *w;
    int tag_hdr, tag_data;
    int *peers; /* peers[k]: the world rank of the group's rank k; NULL for the world */
    pthread_t thread;
    bool started;
    /* launch queue, FIFO, under the world's qlock */
    tdm_work *head, *tail;
    bool stop;
    /* ---- owned by the group's communication thread ---- */
    int64_t seq;
    header *hdr_in; /* a header from each rank of the group */
    mround rd;
} mcomm;

typedef struct mworld {
    mcomm c;       /* first member: the world's group; its thread owns MPI's start and end */
    int subgroups; /* made so far (tags TAG_SUB + 2 i, + 1) */
    /* guards the queues, init_state, the abort's three flags and busy; qcond: any change */
    pthread_mutex_t qlock;
    pthread_cond_t qcond;
    int busy;       /* groups in the middle of a collective */
    int init_state; /* 0 starting, 1 ready, -1 failed (init_msg) */
    char init_msg[256];
    int *argc;
    char ***argv;
    bool abort_req, abort_taken, abort_done; /* asked, failed and told, returned (settle) */
    char abort_msg[FAIL_LEN];
    pthread_mutex_t mpi_mu;  /* held around every MPI call after setup */
    pthread_mutex_t fail_mu; /* the first failure's message and its notices */
    /* failure: fail_msg is written once, before failed is set (release) */
    atomic_int failed;
    char fail_msg[FAIL_LEN];
    MPI_Comm comm;
    MPI_Request fail_recv, *fail_sends;
    char fail_in[FAIL_LEN], fail_out[FAIL_LEN];
    bool notices_sent;
    atomic_bool stuck; /* a request outlived a failure: no more MPI calls, nothing freed */
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

static void mpi_lock(mworld *w) {
    pthread_mutex_lock(&w->mpi_mu);
}

static void mpi_unlock(mworld *w) {
    pthread_mutex_unlock(&w->mpi_mu);
}

static bool is_stuck(mworld *w) {
    return atomic_load(&w->stuck);
}

/* Holding fail_mu: tells every other rank, once, so they fail now rather than at their
 * timeout. The notices are small (eager) messages: they leave even if the peer never receives
 * them. */
static void send_notices(mworld *w) {
    if (w->notices_sent || is_stuck(w)) return;
    w->notices_sent = true;
    snprintf(w->fail_out, sizeof w->fail_out, "%s", w->fail_msg);
    mpi_lock(w);
    for (int k = 0; k < w->c.g.size; k++) {
        w->fail_sends[k] = MPI_REQUEST_NULL;
        if (k != w->c.g.rank)
            MPI_Isend(w->fail_out, FAIL_LEN, MPI_CHAR, k, TAG_FAIL, w->comm, &w->fail_sends[k]);
    }
    mpi_unlock(w);
}

/* Records the first failure (any group's thread); a local one (not a peer's notice) is sent
 * on. Not called holding mpi_mu. */
static void fail(mworld *w, bool local, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail(mworld *w, bool local, const char *fmt, ...) {
    pthread_mutex_lock(&w->fail_mu);
    if (!has_failed(w)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(w->fail_msg, sizeof w->fail_msg, fmt, ap);
        va_end(ap);
        atomic_store_explicit(&w->failed, 1, memory_order_release);
        if (local) send_notices(w);
    }
    pthread_mutex_unlock(&w->fail_mu);
}

/* Takes in a peer's notice or this rank's tdm_group_abort (any group's thread). True once
 * failed. */
static bool poll_failure(mworld *w) {
    int got = 0;
    MPI_Status st;
    mpi_lock(w);
    if (w->fail_recv != MPI_REQUEST_NULL && !is_stuck(w))
        if (MPI_Test(&w->fail_recv, &got, &st) != MPI_SUCCESS) got = 0;
    mpi_unlock(w);
    if (got) {
        w->fail_in[FAIL_LEN - 1] = '\0';
        /* a peer's own finding ("timed out ... waiting for rank 1") is said as the peer's,
         * not as this rank's; an abort's names its rank already */
        if (strncmp(w->fail_in, "rank ", 5) == 0)
            fail(w, false, "%s", w->fail_in);
        else
            fail(w, false, "rank %d stopped: %s", st.MPI_SOURCE, w->fail_in);
    }
    pthread_mutex_lock(&w->qlock);
    bool req = w->abort_req && !w->abort_taken;
    w->abort_taken = w->abort_req;
    pthread_mutex_unlock(&w->qlock);
    if (req) {
        fail(w, true, "rank %d failed: %s", w->c.g.rank, w->abort_msg);
        pthread_mutex_lock(&w->fail_mu);
        send_notices(w); /* also when a peer's failure came first */
        pthread_mutex_unlock(&w->fail_mu);
        /* give the notices a moment to leave before the caller may exit the process */
        for (int64_t until = tdm_now_ns() + 100000000; !is_stuck(w) && tdm_now_ns() < until;) {
            int all = 0;
            mpi_lock(w);
            MPI_Testall(w->c.g.size, w->fail_sends, &all, MPI_STATUSES_IGNORE);
            mpi_unlock(w);
            if (all) break;
            nap_ns(100000);
        }
    }
    return has_failed(w);
}

/* Holding qlock: a tdm_group_abort taken in returns once no group is in the middle of a
 * collective, so no request of this rank can touch a caller's tensor (the collectives it
 * interrupted have drained, those queued behind them fail before posting any), and a caller
 * that gives up without waiting for its collectives (DDP when backward fails) may free their
 * tensors. */
static void settle_abort(mworld *w) {
    if (w->abort_taken && !w->abort_done && w->busy == 0) {
        w->abort_done = true;
        pthread_cond_broadcast(&w->qcond);
    }
}

/* Any group's abort fails the process's world: its groups share one failure. */
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
    while (!w->abort_done && !w->c.stop)
        if (pthread_cond_timedwait(&w->qcond, &w->qlock, &until) == ETIMEDOUT) break;
    pthread_mutex_unlock(&w->qlock);
}

/* ---- requests of one round ---------------------------------------------------------------- */

static void round_begin(mcomm *m) {
    m->rd.nreq = 0;
    m->rd.hdr_round = false;
}

/* A send to or receive from rank k of m's group, under m's tag for TAG_HDR or TAG_DATA. */
static void post(mcomm *m, bool send, void *buf, int64_t bytes, int k, int tag) {
    mworld *w = m->w;
    mround *rd = &m->rd;
    int peer = m->peers ? m->peers[k] : k;
    tag = tag == TAG_HDR ? m->tag_hdr : m->tag_data;
    MPI_Request *r = &rd->reqs[rd->nreq];
    if (!send && rd->hdr_round) { /* posted once the headers agree (finish_round) */
        *r = MPI_REQUEST_NULL;
        rd->rbuf[rd->nreq] = buf;
        rd->rbytes[rd->nreq] = bytes;
    } else {
        mpi_lock(w);
        if (send)
            MPI_Isend(buf, (int)bytes, MPI_BYTE, peer, tag, w->comm, r);
        else
            MPI_Irecv(buf, (int)bytes, MPI_BYTE, peer, tag, w->comm, r);
        mpi_unlock(w);
    }
    rd->req_peer[rd->nreq++] = send ? -1 - peer : peer;
}

/* The first rank (of the world) a still-pending receive (else send) of this round waits for. */
static int missing_peer(const mround *rd) {
    int send_peer = -1;
    for (int i = 0; i < rd->nreq; i++) {
        if (rd->reqs[i] == MPI_REQUEST_NULL) continue;
        if (rd->req_peer[i] >= 0) return rd->req_peer[i];
        if (send_peer < 0) send_peer = -1 - rd->req_peer[i];
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
    if (is_stuck(w)) return false;
    for (int64_t until = tdm_now_ns() + DRAIN_NS;;) {
        int left = 0;
        mpi_lock(w);
        for (int i = 0; i < n; i++) {
            if (reqs[i] == MPI_REQUEST_NULL) continue;
            int done = 0;
            MPI_Test(&reqs[i], &done, MPI_STATUS_IGNORE);
            /* one that completed with an error (a truncation) is not freed by MPI_Test */
            if (done && reqs[i] != MPI_REQUEST_NULL) MPI_Request_free(&reqs[i]);
            left += reqs[i] != MPI_REQUEST_NULL;
        }
        mpi_unlock(w);
        if (!left) return true;
        if (tdm_now_ns() > until) break;
        nap_ns(100000);
    }
    atomic_store(&w->stuck, true);
    return false;
}

/* A failed round: its receives cancelled, its requests drained or the world stuck (drain). */
static void cancel_round(mcomm *m) {
    mround *rd = &m->rd;
    mpi_lock(m->w);
    for (int i = 0; i < rd->nreq; i++)
        if (rd->reqs[i] != MPI_REQUEST_NULL && rd->req_peer[i] >= 0 && !is_stuck(m->w))
            MPI_Cancel(&rd->reqs[i]);
    mpi_unlock(m->w);
    drain(m->w, rd->reqs, rd->nreq);
}

/* Polls the round's requests until all complete, spinning briefly after each completion and
 * then napping (the comm thread shares the core with the rank's computation). 0, or -1 with
 * the world failed: a peer's notice, an abort, an MPI error or the deadline. */
static int round_wait(mcomm *m, int n, int64_t deadline) {
    mworld *w = m->w;
    mround *rd = &m->rd;
    int left = n;
    int64_t last = tdm_now_ns(), nap = 1000;
    for (int spins = 0; left > 0; spins++) {
        int outcount = 0;
        mpi_lock(w);
        int rc = MPI_Testsome(n, rd->reqs, &outcount, rd->req_idx, rd->stats);
        int peer = -1, code = rc, len = 0;
        char es[MPI_MAX_ERROR_STRING];
        if (rc != MPI_SUCCESS) {
            for (int i = 0; i < outcount; i++)
                if (rd->stats[i].MPI_ERROR != MPI_SUCCESS) {
                    peer = rd->req_peer[rd->req_idx[i]];
                    peer = peer < 0 ? -1 - peer : peer;
                    code = rd->stats[i].MPI_ERROR;
                    break;
                }
            MPI_Error_string(code, es, &len);
        }
        mpi_unlock(w);
        if (rc != MPI_SUCCESS) {
            fail(w, true, "MPI error with rank %d: %s", peer, es);
            cancel_round(m);
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
                mpi_lock(w);
                if (!is_stuck(w) && MPI_Testall(n, rd->reqs, &all, MPI_STATUSES_IGNORE)) all = 0;
                mpi_unlock(w);
                if (all) return 0;
                cancel_round(m);
                return -1;
            }
            int64_t t = tdm_now_ns();
            if (t > deadline) {
                double s = tdm_group_timeout(&m->g);
                char secs[32];
                snprintf(secs, sizeof secs, s >= 0.1 ? "%.1f" : "%.3g", s);
                fail(w, true, "timed out after %s s waiting for rank %d", secs, missing_peer(rd));
                cancel_round(m);
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
    mround *rd = &m->rd;
    const tdm_watch *wt = &rd->cur->watch;
    rd->hdr_out =
        (header){fingerprint_of(c, m->seq), fingerprint_of(&wt->last, wt->launched), wt->digest};
    for (int k = 0; k < m->g.size; k++) {
        if (k == m->g.rank) continue;
        post(m, false, &m->hdr_in[k], sizeof(header), k, TAG_HDR);
        post(m, true, &rd->hdr_out, sizeof(header), k, TAG_HDR);
    }
    rd->hdr_round = true;
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
    tdm_coll me = coll_of(&m->rd.hdr_out.c);
    char msg[FAIL_LEN], during[160];
    int r = world_rank(m, m->g.rank);
    for (int k = 0; k < m->g.size; k++) {
        if (k == m->g.rank) continue;
        const header *h = &m->hdr_in[k];
        tdm_coll peer = coll_of(&h->c);
        bool bad = tdm_coll_disagree(r, &me, world_rank(m, k), &peer, true, msg, sizeof msg);
        if (!bad) { /* the same collective: then the same past on the watched group */
            tdm_watch a = {m->rd.hdr_out.watched_last.seq, m->rd.hdr_out.watched_digest,
                           coll_of(&m->rd.hdr_out.watched_last)};
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
    mround *rd = &m->rd;
    if (first) {
        if (round_wait(m, 2 * (m->g.size - 1), deadline)) return -1;
        if (check_headers(m)) {
            cancel_round(m); /* the data sends */
            return -1;
        }
        mpi_lock(w);
        for (int i = 2 * (m->g.size - 1); i < rd->nreq; i++)
            if (rd->req_peer[i] >= 0) /* a world rank */
                MPI_Irecv(rd->rbuf[i], (int)rd->rbytes[i], MPI_BYTE, rd->req_peer[i], m->tag_data,
                          w->comm, &rd->reqs[i]);
        mpi_unlock(w);
    }
    return round_wait(m, rd->nreq, deadline);
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
    return (char *)m->rd.scratch + (size_t)idx * (size_t)per * elem;
}

/* The all-reduce in c's dtype: bf16 and f16 travel as 2-byte elements (half an f32's bytes)
 * and are summed in f32 by the chunk's owner, then rounded once. */
static int run_all_reduce(mcomm *m, const tdm_coll *c, int64_t deadline) {
    int n = m->g.size, r = m->g.rank;
    char *buf = c->out;
    int64_t elem = (int64_t)c->elem, align = TDM_CHUNK_ALIGN / elem;
    bool first = true;
    /* a segment's chunks fit the scratch: n chunks of per_max elements, n - 1 of them received */
    int64_t per_max = (int64_t)m->rd.scratch_bytes / elem / (n - 1) / align * align;
    int64_t seg = per_max * n;
    const void *srcs[64];
    for (int64_t s0 = 0; s0 < c->count || first; s0 += seg) {
        int64_t len = c->count - s0 < seg ? c->count - s0 : seg;
        char *sb = buf + s0 * elem;
        int64_t lo, hi, per;
        tdm_chunk_of(len, c->elem, n, 0, &lo, &per); /* per = size of chunk 0: the largest */
        /* reduce-scatter: chunk k of my segment goes to rank k, chunk r comes from everyone */
        round_begin(m);
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
        round_begin(m);
        for (int k = 0; k < n; k++) {
            if (k == r) continue;
            int64_t klo, khi;
            tdm_chunk_of(len, c->elem, n, k, &klo, &khi);
            post(m, false, sb + klo * elem, (khi - klo) * elem, k, TAG_DATA);
            post(m, true, sb + lo * elem, (hi - lo) * elem, k, TAG_DATA);
        }
        if (round_wait(m, m->rd.nreq, deadline)) return -1;
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
    int n = m->g.size, r = m->g.rank;
    bool scatter = c->kind == TDM_COLL_REDUCE_SCATTER, first = true;
    bool reducer = scatter || r == c->root;
    const char *in = c->in;
    int64_t elem = (int64_t)c->elem;
    int64_t seg = (int64_t)m->rd.scratch_bytes / elem / (n - 1);
    const void *srcs[64];
    for (int64_t s0 = 0; s0 < c->count || first; s0 += seg) {
        int64_t len = c->count - s0 < seg ? c->count - s0 : seg;
        round_begin(m);
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
    int n = m->g.size, r = m->g.rank;
    bool gather = c->kind == TDM_COLL_ALL_GATHER, first = true;
    int64_t bytes = c->count * (int64_t)c->elem;
    if (gather && bytes) memcpy((char *)c->out + r * bytes, c->in, (size_t)bytes);
    for (int64_t s0 = 0; s0 < bytes || first; s0 += SEG_BYTES) {
        int64_t len = bytes - s0 < SEG_BYTES ? bytes - s0 : SEG_BYTES;
        round_begin(m);
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
                round_begin(m);
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

/* ---- the communication threads ----------------------------------------------------------- */

/* m's round buffers for a group of n ranks: requests, and the scratch of one segment's (n - 1)
 * received chunks, allocated and touched once (huge pages where the kernel gives them: first
 * touches of fresh 4 KiB pages are slow on this VM). */
static int round_alloc(mround *rd, int n) {
    int cap = 4 * n + 4;
    rd->reqs = calloc((size_t)cap, sizeof *rd->reqs);
    rd->req_peer = calloc((size_t)cap, sizeof *rd->req_peer);
    rd->req_idx = calloc((size_t)cap, sizeof *rd->req_idx);
    rd->stats = calloc((size_t)cap, sizeof *rd->stats);
    rd->rbuf = calloc((size_t)cap, sizeof *rd->rbuf);
    rd->rbytes = calloc((size_t)cap, sizeof *rd->rbytes);
    rd->req_cap = cap;
    rd->scratch_bytes = n > 1 ? (size_t)SEG_BYTES : 64;
    size_t huge = 2 << 20;
    rd->scratch = aligned_alloc(huge, (rd->scratch_bytes + huge - 1) / huge * huge);
    if (!rd->reqs || !rd->req_peer || !rd->req_idx || !rd->stats || !rd->rbuf || !rd->rbytes ||
        !rd->scratch)
        return -1;
    madvise(rd->scratch, rd->scratch_bytes, MADV_HUGEPAGE);
    memset(rd->scratch, 0, rd->scratch_bytes);
    return 0;
}

static void round_free(mround *rd) {
    free(rd->reqs);
    free(rd->req_peer);
    free(rd->req_idx);
    free(rd->stats);
    free(rd->rbuf);
    free(rd->rbytes);
    free(rd->scratch);
}

static int setup(mworld *w) {
    int provided = 0;
    if (MPI_Init_thread(w->argc, w->argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
        snprintf(w->init_msg, sizeof w->init_msg, "mpi_init: MPI_Init_thread failed");
        return -1;
    }
    if (provided < MPI_THREAD_SERIALIZED) {
        snprintf(w->init_msg, sizeof w->init_msg,
                 "mpi_init: this MPI provides thread level %d, Tandem needs "
                 "MPI_THREAD_SERIALIZED",
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
    w->c.hdr_in = calloc((size_t)size, sizeof *w->c.hdr_in);
    w->fail_sends = calloc((size_t)size, sizeof *w->fail_sends);
    if (!w->c.hdr_in || !w->fail_sends || round_alloc(&w->c.rd, size)) {
        snprintf(w->init_msg, sizeof w->init_msg, "mpi_init: out of memory");
        return -1;
    }
    for (int k = 0; k < size; k++) w->fail_sends[k] = MPI_REQUEST_NULL;
    w->fail_recv = MPI_REQUEST_NULL;
    if (size > 1)
        MPI_Irecv(w->fail_in, FAIL_LEN, MPI_CHAR, MPI_ANY_SOURCE, TAG_FAIL, w->comm, &w->fail_recv);
    return 0;
}

/* m's next queued collective (counted busy), or NULL once asked to stop and the queue is
 * empty. The world's thread listens for failure notices while idle, for every group. */
static tdm_work *dequeue(mcomm *m) {
    mworld *w = m->w;
    bool listen = m == &w->c;
    pthread_mutex_lock(&w->qlock);
    settle_abort(w);
    while (!m->head && !m->stop) {
        if (listen && w->abort_req && !w->abort_done) {
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
        if (pthread_cond_timedwait(&w->qcond, &w->qlock, &until) == ETIMEDOUT && listen) {
            pthread_mutex_unlock(&w->qlock);
            poll_failure(w);
            pthread_mutex_lock(&w->qlock);
        }
    }
    tdm_work *wk = m->head;
    if (wk) {
        m->head = wk->next;
        if (!m->head) m->tail = NULL;
        w->busy++;
    }
    pthread_mutex_unlock(&w->qlock);
    return wk;
}

/* Runs m's collectives until m is stopped. */
static void serve(mcomm *m) {
    char msg[TDM_WORK_MSG];
    for (tdm_work *wk; (wk = dequeue(m));) {
        msg[0] = '\0';
        tdm_trace_begin(tdm_coll_name(wk->c.kind));
        m->rd.cur = wk;
        int status = run(m, &wk->c, msg);
        tdm_trace_end();
        pthread_mutex_lock(&m->w->qlock);
        m->w->busy--;
        pthread_mutex_unlock(&m->w->qlock);
        tdm_work_finish(wk, status, msg);
    }
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
        if (w->fail_recv != MPI_REQUEST_NULL && !is_stuck(w)) MPI_Cancel(&w->fail_recv);
        drain(w, &w->fail_recv, 1);
        if (w->notices_sent) drain(w, w->fail_sends, w->c.g.size);
    }
    if (is_stuck(w)) return; /* kept, with its buffers: see drain */
    free(w->c.hdr_in);
    free(w->fail_sends);
    round_free(&w->c.rd);
}

static void *world_main(void *arg) {
    mworld *w = arg;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); /* naps of microseconds, not 50 us */
    int ok = setup(w) == 0;
    pthread_mutex_lock(&w->qlock);
    w->init_state = ok ? 1 : -1;
    pthread_cond_broadcast(&w->qcond);
    pthread_mutex_unlock(&w->qlock);
    if (!ok) return NULL;
    tdm_trace_name_thread("MPI communication");
    serve(&w->c);
    teardown(w);
    return NULL;
}

static void *sub_main(void *arg) {
    mcomm *m = arg;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    tdm_trace_name_thread("MPI sub-group communication");
    serve(m);
    return NULL;
}

static int mpi_launch(tdm_group *g, tdm_work *wk) {
    mcomm *m = (mcomm *)g;
    mworld *w = m->w;
    pthread_mutex_lock(&w->qlock);
    if (m->stop || w->c.stop) {
        pthread_mutex_unlock(&w->qlock);
        return tdm_raise(TDM_ERR_STATE, "%s: the MPI group was finalized",
                         tdm_coll_name(wk->c.kind));
    }
    if (m->tail)
        m->tail->next = wk;
    else
        m->head = wk;
    m->tail = wk;
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
    pthread_mutex_destroy(&w->mpi_mu);
    pthread_mutex_destroy(&w->fail_mu);
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
    atomic_init(&w->stuck, false);
    pthread_mutex_init(&w->qlock, NULL);
    pthread_mutex_init(&w->mpi_mu, NULL);
    pthread_mutex_init(&w->fail_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->qcond, &ca);
    pthread_condattr_destroy(&ca);
    int e = pthread_create(&w->c.thread, NULL, world_main, w);
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
        pthread_join(w->c.thread, NULL);
        char msg[256];
        snprintf(msg, sizeof msg, "%s", w->init_msg);
        world_free(w);
        pthread_mutex_unlock(&world_lock);
        return tdm_raise_null(TDM_ERR_COMM, "%s", msg);
    }
    w->c.started = true;
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

static void sub_free(mcomm *m) {
    /* after a failure a request of its last round may outlive it (drain): kept, as the
     * world's own buffers are */
    if (!has_failed(m->w)) {
        free(m->hdr_in);
        round_free(&m->rd);
    }
    free(m->peers);
    free(m);
}

/* the most ids the tags allow: TAG_SUB + 2 id + 1 <= 32767, the least MPI_TAG_UB there is */
#define MAX_SUBGROUPS ((32767 - TAG_SUB) / 2)

int tdm_mpi_subgroup_ids(tdm_group *g, int count) {
    if (!g || g->ops != &mpi_ops || count < 0)
        return tdm_raise(TDM_ERR_ARG, "mpi_subgroup: %s", g ? "not an MPI group" : "NULL group"),
               -1;
    mworld *w = ((mcomm *)g)->w;
    pthread_mutex_lock(&w->qlock);
    int id = w->subgroups;
    bool ok = count <= MAX_SUBGROUPS - id;
    if (ok) w->subgroups += count;
    pthread_mutex_unlock(&w->qlock);
    if (!ok) return tdm_raise(TDM_ERR_ARG, "mpi_subgroup: more than %d groups", MAX_SUBGROUPS), -1;
    return id;
}

tdm_group *tdm_mpi_subgroup(tdm_group *g, int n, const int *ranks) {
    int me = -1;
    if (check_members(g, n, ranks, &me)) return NULL;
    int id = tdm_mpi_subgroup_ids(g, 1);
    return id < 0 ? NULL : tdm_mpi_subgroup_with_id(g, n, ranks, id);
}

tdm_group *tdm_mpi_subgroup_with_id(tdm_group *g, int n, const int *ranks, int id) {
    int me = -1;
    if (check_members(g, n, ranks, &me)) return NULL;
    mcomm *parent = (mcomm *)g;
    mworld *w = parent->w;
    if (id < 0 || id >= MAX_SUBGROUPS)
        return tdm_raise_null(TDM_ERR_ARG, "mpi_subgroup: group id %d (0 to %d)", id,
                              MAX_SUBGROUPS - 1);
    mcomm *m = calloc(1, sizeof *m);
    if (!m) return tdm_raise_null(TDM_ERR_NOMEM, "mpi_subgroup: out of memory");
    *m = (mcomm){.w = w,
                 .tag_hdr = TAG_SUB + 2 * id,
                 .tag_data = TAG_SUB + 2 * id + 1,
                 .peers = malloc(sizeof *m->peers * (size_t)n),
                 .hdr_in = calloc((size_t)n, sizeof *m->hdr_in)};
    if (!m->peers || !m->hdr_in || round_alloc(&m->rd, n)) {
        sub_free(m);
        return tdm_raise_null(TDM_ERR_NOMEM, "mpi_subgroup: out of memory");
    }
    for (int k = 0; k < n; k++) m->peers[k] = world_rank(parent, ranks[k]);
    tdm_group_init(&m->g, &mpi_ops, me, n, g->device);
    atomic_store(&m->g.timeout_ns, atomic_load(&g->timeout_ns));
    int e = pthread_create(&m->thread, NULL, sub_main, m);
    if (e) {
        tdm_group_destroy(&m->g);
        sub_free(m);
        return tdm_raise_null(
            TDM_ERR_NOMEM, "mpi_subgroup: cannot start its communication thread (%s)", strerror(e));
    }
    m->started = true;
    return &m->g;
}

void tdm_mpi_subgroup_free(tdm_group *sub) {
    if (!sub) return;
    mcomm *m = (mcomm *)sub;
    pthread_mutex_lock(&m->w->qlock);
    m->stop = true;
    pthread_cond_broadcast(&m->w->qcond);
    pthread_mutex_unlock(&m->w->qlock);
    if (m->started) pthread_join(m->thread, NULL);
    tdm_group_destroy(&m->g);
    sub_free(m);
}

void tdm_mpi_finalize(void) {
    pthread_mutex_lock(&world_lock);
    mworld *w = world;
    world = NULL;
    if (w) {
        finalized = true;
        pthread_mutex_lock(&w->qlock);
        w->c.stop = true;
        pthread_cond_broadcast(&w->qcond);
        pthread_mutex_unlock(&w->qlock);
        pthread_join(w->c.thread, NULL);
        tdm_group_destroy(&w->c.g);
        if (w->stuck)
            kept = w; /* requests may still point into it: see drain */
        else
            world_free(w);
    }
    pthread_mutex_unlock(&world_lock);
}

#endif
