/* Stopping a run cleanly on SIGTERM or SIGINT (preemption: Slurm, Kubernetes and torchrun
 * stop jobs with SIGTERM, a user with Ctrl-C). The handler only records the signal; the
 * training loop polls tdm_stop_requested between steps, finishes the step in flight, saves a
 * checkpoint and returns. A second signal gets the default action (the process ends at once),
 * as a user pressing Ctrl-C twice expects. SIGUSR1 is the early warning (`srun
 * --signal=USR1@120`): recorded as a stop too, and it keeps its handler, so another SIGUSR1
 * only asks again. Each of the three also asks for diagnostics (a semaphore a watcher thread
 * waits on, tdm_stop_wait_dump): a process that mpirun stops because a peer died may be stuck
 * in a collective and killed a second later.
 *
 * The handler runs on a stack of its own (sigaltstack, SA_ONSTACK): Linux writes a signal's
 * frame (~3 KiB with the vector registers) below the interrupted code's stack pointer, and
 * oneDNN's JIT GEMM kernels point theirs into a workspace they malloc'd, so a SIGTERM during a
 * matrix product overwrote malloc's chunk headers and the trainer died of "corrupted size vs.
 * prev_size" instead of saving its checkpoint. The stack is the calling thread's (tandem
 * train's main thread): Linux hands a signal sent to the process to the main thread unless
 * that thread has another one pending. */
#include <errno.h>
#include <semaphore.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "core/core.h"

static atomic_int stop_signal; /* the first SIGTERM, SIGINT or SIGUSR1 received, 0 before */
static sem_t dump_sem;         /* posted once per SIGUSR1 (sem_post is async-signal-safe) */
static atomic_bool dump_ready; /* dump_sem initialised */

/* The default action, made before any signal (the handler keeps no buffer on its stack,
 * which a sanitizer's fake stack would move to the heap). */
static struct sigaction default_action;

/* The handler's stack, for the first thread that installs it: the handler needs a few hundred
 * bytes, Linux's frame ~3 KiB (~11 KiB with AMX state) */
#define ALT_STACK_SIZE (64 * 1024)
static _Alignas(64) char alt_stack[ALT_STACK_SIZE];
static atomic_flag alt_stack_taken = ATOMIC_FLAG_INIT;

/* Gives the calling thread an alternate signal stack unless it has one already (a sanitizer's,
 * or this one from an earlier call). Returns 0, or -1 when sigaltstack failed. */
static int use_alt_stack(void) {
    stack_t now;
    if (sigaltstack(NULL, &now) != 0) return -1;
    if (!(now.ss_flags & SS_DISABLE)) return 0;
    if (atomic_flag_test_and_set(&alt_stack_taken)) return 0; /* another thread's: keep its own */
    stack_t ss = {.ss_sp = alt_stack, .ss_size = sizeof alt_stack, .ss_flags = 0};
    return sigaltstack(&ss, NULL);
}

/* Records the first signal and hands both back to their default action: sigaction is
 * async-signal-safe, and so are lock-free atomics. */
static void on_stop_signal(int sig) {
    int none = 0;
    atomic_compare_exchange_strong(&stop_signal, &none, sig);
    if (atomic_load(&dump_ready)) sem_post(&dump_sem);
    if (sig == SIGUSR1) return;
    sigaction(SIGTERM, &default_action, NULL);
    sigaction(SIGINT, &default_action, NULL);
}

int tdm_stop_on_signals(void) {
    default_action.sa_handler = SIG_DFL;
    sigemptyset(&default_action.sa_mask);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    /* no SA_RESTART: a write blocked on a pipe nobody reads any more (a stopping mpirun's)
     * returns EINTR instead of holding the checkpoint up; files on disk are not interrupted.
     * SA_ONSTACK: never on the interrupted code's stack (see the top of the file) */
    sa.sa_flags = SA_ONSTACK;
    if (use_alt_stack() != 0)
        return tdm_raise(TDM_ERR_IO, "cannot handle SIGTERM and SIGINT: sigaltstack failed");
    if (!atomic_load(&dump_ready) && sem_init(&dump_sem, 0, 0) == 0) atomic_store(&dump_ready, 1);
    if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGINT, &sa, NULL) != 0 ||
        sigaction(SIGUSR1, &sa, NULL) != 0)
        return tdm_raise(TDM_ERR_IO, "cannot handle SIGTERM, SIGINT and SIGUSR1: sigaction failed");
    return TDM_OK;
}

bool tdm_stop_wait_dump(double timeout_s) {
    if (!atomic_load(&dump_ready)) return false;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    double s = timeout_s > 0 ? timeout_s : 0;
    until.tv_sec += (time_t)s;
    until.tv_nsec += (long)((s - (double)(time_t)s) * 1e9);
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    int rc;
    while ((rc = sem_timedwait(&dump_sem, &until)) != 0 && errno == EINTR) {
    }
    return rc == 0;
}

int tdm_stop_requested(void) {
    return atomic_load_explicit(&stop_signal, memory_order_relaxed);
}

void tdm_stop_request(int sig) {
    int none = 0;
    atomic_compare_exchange_strong(&stop_signal, &none, sig > 0 ? sig : SIGTERM);
}
