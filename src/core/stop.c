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

/* Records the first signal and hands both back to their default action: sigaction is
 * async-signal-safe, and so are lock-free atomics. */
static void on_stop_signal(int sig) {
    int none = 0;
    atomic_compare_exchange_strong(&stop_signal, &none, sig);
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGTERM, &dfl, NULL);
    sigaction(SIGINT, &dfl, NULL);
}

int tdm_stop_on_signals(void) {
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
