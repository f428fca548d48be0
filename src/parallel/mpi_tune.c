/* What a process started by an MPI launcher sets before MPI starts: Open MPI's TCP transport
 * sized for Tandem's messages, and the GEMM's threads sized to this process's share of the
 * machine's cores, each unless the user chose (issue 39, issue 40).
 *
 * The transport (issue 39).
 *
 * Over TCP, Open MPI sends a message above its eager limit (64 KiB) by rendezvous: a first
 * fragment, then the rest only once the receiver has answered, so a 1 MiB message costs at
 * least a round trip more than its one-way trip, and an all-reduce's two rounds four or more
 * round trips where there is latency (bench/RESULTS.md, "Issue 39"). No message of Tandem's is
 * larger than a segment (mpi_group.c: SEG_BYTES), so with the eager limit and the largest
 * fragment just above that size every message leaves at once. The receiver buffers a message
 * that arrives before its receive is posted; that is at most one segment per peer.
 *
 * The user's choice wins: where either is set in the environment (mpirun --mca and -x set
 * OMPI_MCA_*) or in one of the MCA parameter files Open MPI reads, neither is touched. Other
 * MPIs ignore these variables. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "parallel/group.h"
#include "backend/backend.h" /* tdm_cpu_gemm_set_threads */

#include <ctype.h>
#include <sched.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Whether file `path` sets parameter `name` ("name = value" on a line of its own). */
static bool file_sets(const char *path, const char *name) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[512];
    size_t n = strlen(name);
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        const char *p = line;
        while (isspace((unsigned char)*p)) p++;
        found = !strncmp(p, name, n) && (isspace((unsigned char)p[n]) || p[n] == '=');
    }
    fclose(f);
    return found;
}

/* Whether the user set MCA parameter `name`: in the environment, or in a parameter file
 * (OMPI_MCA_mca_base_param_files's list, else Open MPI's defaults: the user's, the system's). */
static bool user_set(const char *name) {
    char var[128], path[1024];
    snprintf(var, sizeof var, "OMPI_MCA_%s", name);
    if (getenv(var)) return true;
    const char *list = getenv("OMPI_MCA_mca_base_param_files");
    if (list) {
        for (const char *p = list; *p;) {
            size_t len = strcspn(p, ":");
            snprintf(path, sizeof path, "%.*s", (int)len, p);
            if (file_sets(path, name)) return true;
            p += len + (p[len] == ':');
        }
        return false;
    }
    const char *home = getenv("HOME"), *prefix = getenv("OPAL_PREFIX");
    snprintf(path, sizeof path, "%s/.openmpi/mca-params.conf", home ? home : "");
    if (home && file_sets(path, name)) return true;
    snprintf(path, sizeof path, "%s/etc/openmpi-mca-params.conf", prefix ? prefix : "");
    if (prefix && file_sets(path, name)) return true;
    return file_sets("/etc/openmpi/openmpi-mca-params.conf", name);
}

int tdm_mpi_tune_tcp(int64_t max_message) {
    const char *names[] = {"btl_tcp_eager_limit", "btl_tcp_max_send_size"};
    size_t n = sizeof names / sizeof names[0];
    for (size_t i = 0; i < n; i++)
        if (user_set(names[i])) return 0; /* the user sizes the transport: all of it */
    char value[32];
    /* the limits count Open MPI's headers too: room for them above the largest message */
    snprintf(value, sizeof value, "%lld", (long long)max_message + 4096);
    int set = 0;
    for (size_t i = 0; i < n; i++) {
        char var[128];
        snprintf(var, sizeof var, "OMPI_MCA_%s", names[i]);
        set += setenv(var, value, 1) == 0;
    }
    return set;
}

/* ---- the cores of a machine shared by its ranks -------------------------------------------- */

/* How many ranks the launcher started on this machine (Open MPI, MPICH's Hydra, Slurm), or 0. */
static int local_ranks(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return atoi(v); /* Slurm's "2(x3)" reads as 2 */
    }
    return 0;
}

int tdm_mpi_share_cores(void) {
    int local = local_ranks();
    if (getenv("OMP_NUM_THREADS") || local <= 1) return 0; /* the user's, or nobody to share with */
    cpu_set_t set;
    long machine = sysconf(_SC_NPROCESSORS_ONLN);
    int mine = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : (int)machine;
    int share = machine > 0 ? (int)(machine / local) : 1;
    int n = mine < share ? mine : share;
    if (n < 1) n = 1;
    char v[16];
    snprintf(v, sizeof v, "%d", n);
    /* an OpenMP that starts later (LLVM's) reads it for every thread; GNU's read the
     * environment as it loaded, so the calling thread's count is set, and the threads Tandem
     * starts for this process's rank take the caller's (strategy_tensor_parallel.c) */
    setenv("OMP_NUM_THREADS", v, 0);
    tdm_cpu_gemm_set_threads(n);
    return n;
}
