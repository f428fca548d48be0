/* Stopping a run cleanly on SIGTERM or SIGINT (preemption: Slurm, Kubernetes and torchrun
 * stop jobs with SIGTERM, a user with Ctrl-C). The handler only records the signal; the
 * training loop polls tdm_stop_requested between steps, finishes the step in flight, saves a
 * checkpoint and returns. A second signal gets the default action (the process ends at once),
 * as a user pressing Ctrl-C twice expects. */
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

#include "core/core.h"

static atomic_int stop_signal; /* the first SIGTERM or SIGINT received, 0 before */

/* The default action, made before any signal (the handler keeps no buffer on its stack,
 * which a sanitizer's fake stack would move to the heap). */
static struct sigaction default_action;

/* Records the first signal and hands both back to their default action: sigaction is
 * async-signal-safe, and so are lock-free atomics. */
static void on_stop_signal(int sig) {
    int none = 0;
    atomic_compare_exchange_strong(&stop_signal, &none, sig);
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
     * returns EINTR instead of holding the checkpoint up; files on disk are not interrupted */
    sa.sa_flags = 0;
    if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGINT, &sa, NULL) != 0)
        return tdm_raise(TDM_ERR_IO, "cannot handle SIGTERM and SIGINT: sigaction failed");
    return TDM_OK;
}

int tdm_stop_requested(void) {
    return atomic_load_explicit(&stop_signal, memory_order_relaxed);
}

void tdm_stop_request(int sig) {
    int none = 0;
    atomic_compare_exchange_strong(&stop_signal, &none, sig > 0 ? sig : SIGTERM);
}
