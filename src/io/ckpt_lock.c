/* One run per checkpoint directory: the directory's lock, and run identities.
 *
 * The lock is flock(2) on DIR/LOCK, taken without waiting. flock rather than fcntl's record
 * locks: an fcntl lock belongs to the process and is dropped when any descriptor of the file
 * is closed (a reader of LOCK in the same process would release it), while a flock lock
 * belongs to its open file, so a second lock taken by the same process conflicts as another
 * process's would. Either way the kernel drops the lock when its holder dies, which is why a
 * lock file needs no staleness rules (no pid checks, no timeouts): a LOCK left by a run killed
 * with -9 is just a file. It is never unlinked: a process that opened it before the unlink
 * would lock the old file while the next one creates and locks a new one.
 *
 * The holder writes who it is into the file, for the message of the one that is refused.
 *
 * A lock holds a directory, not a path: should the directory be deleted or renamed, and
 * perhaps another made under its name (by a user, or by another run that then locks it), the
 * holder's next save must not write there. Each lock keeps the device and inode of the
 * directory and of its LOCK file, and the locks this process holds are listed, so that
 * tdm_ckpt_lock_verify, called by every save before it touches the directory, finds the lock
 * taken under the same path and compares.
 */
#include "io/io_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct tdm_checkpoint_lock {
    int fd;                    /* DIR/LOCK, flock'd */
    char *dir;                 /* the path it was taken under */
    struct stat dir_st;        /* what that path named then */
    struct stat lock_st;       /* DIR/LOCK, through fd */
    tdm_checkpoint_lock *next; /* in held */
};

/* The locks this process holds, for tdm_ckpt_lock_verify. */
static tdm_checkpoint_lock *held;
static pthread_mutex_t held_mutex = PTHREAD_MUTEX_INITIALIZER;

static bool same_inode(const struct stat *a, const struct stat *b) {
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

/* What changed under lock l: NULL when nothing, else the error's words. */
static const char *lock_changed(const tdm_checkpoint_lock *l) {
    struct stat st;
    if (stat(l->dir, &st) != 0) return "was deleted or moved";
    if (!same_inode(&st, &l->dir_st)) return "was replaced by another directory";
    char path[4200];
    snprintf(path, sizeof path, "%s/LOCK", l->dir);
    if (stat(path, &st) != 0 || !same_inode(&st, &l->lock_st))
        return "had its LOCK file deleted or replaced";
    return NULL;
}

int tdm_ckpt_lock_verify(const char *dir) {
    pthread_mutex_lock(&held_mutex);
    const char *changed = NULL;
    for (const tdm_checkpoint_lock *l = held; l && !changed; l = l->next)
        if (strcmp(l->dir, dir) == 0) changed = lock_changed(l);
    pthread_mutex_unlock(&held_mutex);
    if (!changed) return TDM_OK;
    return tdm_raise(TDM_ERR_STATE,
                     "checkpoint directory '%s' %s since this process locked it: no "
                     "checkpoint is written into a directory the lock does not hold (the "
                     "earlier ones went with the directory)",
                     dir, changed);
}

/* Whether name is a temporary file of an atomic write (tdm_io_temp_open: "<file>.tmp-" and
 * mkstemp's six characters, such as the model.bin a GPT writes beside its checkpoints) or of
 * tdm_checkpoint_dir_check's probe. */
static bool temp_file_name(const char *name) {
    size_t n = strlen(name);
    return (n > 11 && strncmp(name + n - 11, ".tmp-", 5) == 0) ||
           strncmp(name, ".tandem-probe-", 14) == 0;
}

/* Removes what saves interrupted by a kill left in dir (its holder now): each temporary
 * .ckpt-<step>.tmp, each temporary file of an atomic write, and each .ckpt-<step>.old, a
 * checkpoint moved aside to be replaced, which goes back into place when its replacement
 * never arrived. Best effort: a leftover that cannot be removed costs disk space only, and
 * the save of its step removes it again. */
static void remove_leftovers(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        const char *name = e->d_name;
        size_t n = strlen(name);
        bool tmp = n > 10 && strcmp(name + n - 4, ".tmp") == 0;
        bool old = n > 10 && strcmp(name + n - 4, ".old") == 0;
        char path[4200], final[4200];
        snprintf(path, sizeof path, "%s/%s", dir, name);
        struct stat st;
        if (temp_file_name(name) && lstat(path, &st) == 0 && S_ISREG(st.st_mode)) {
            unlink(path);
            continue;
        }
        if (strncmp(name, ".ckpt-", 6) != 0 || (!tmp && !old)) continue;
        snprintf(final, sizeof final, "%s/%.*s", dir, (int)(n - 5), name + 1); /* ckpt-<step> */
        if (old && stat(final, &st) != 0 && errno == ENOENT && rename(path, final) == 0) continue;
        tdm_ckpt_remove_dir(path);
    }
    if (d) closedir(d);
}

/* The holder's line of a LOCK file (a lock held elsewhere) into out, printable. */
static void read_holder(int fd, char *out, size_t cap) {
    ssize_t n = pread(fd, out, cap - 1, 0);
    out[n > 0 ? n : 0] = '\0';
    out[strcspn(out, "\n")] = '\0';
    for (char *p = out; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
    if (!out[0]) snprintf(out, cap, "another process (which has not yet written its name)");
}

tdm_checkpoint_lock *tdm_checkpoint_lock_dir(const char *dir, const char *who) {
    if (!dir) {
        tdm_raise(TDM_ERR_ARG, "checkpoint lock: NULL directory");
        return NULL;
    }
    if (tdm_io_mkdir_p(dir, "checkpoint")) return NULL;
    char path[4200];
    snprintf(path, sizeof path, "%s/LOCK", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        tdm_raise(TDM_ERR_IO, "checkpoint directory '%s': cannot open its lock file '%s': %s", dir,
                  path, strerror(errno));
        return NULL;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        char holder[512];
        if (e == EWOULDBLOCK) read_holder(fd, holder, sizeof holder);
        close(fd);
        if (e == EWOULDBLOCK)
            tdm_raise(TDM_ERR_STATE, "checkpoint directory '%s' is in use by %s", dir, holder);
        else
            tdm_raise(TDM_ERR_IO, "checkpoint directory '%s': cannot lock '%s': %s", dir, path,
                      strerror(e));
        return NULL;
    }
    tdm_checkpoint_lock *l = calloc(1, sizeof *l);
    if (!l || !(l->dir = strdup(dir))) {
        free(l);
        close(fd); /* releases the lock */
        tdm_raise(TDM_ERR_NOMEM, "checkpoint lock: out of memory");
        return NULL;
    }
    l->fd = fd;
    if (stat(dir, &l->dir_st) != 0 || fstat(fd, &l->lock_st) != 0) {
        tdm_raise(TDM_ERR_IO, "checkpoint directory '%s': cannot read it: %s", dir,
                  strerror(errno));
        tdm_checkpoint_unlock(l);
        return NULL;
    }
    pthread_mutex_lock(&held_mutex);
    l->next = held;
    held = l;
    pthread_mutex_unlock(&held_mutex);
    remove_leftovers(dir);
    /* who holds it, for the message of a process refused: a failure to say so is harmless */
    char host[256] = "?", since[64] = "?", line[1024];
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "?");
    host[sizeof host - 1] = '\0';
    time_t now = time(NULL);
    struct tm tm;
    if (localtime_r(&now, &tm)) strftime(since, sizeof since, "%Y-%m-%d %H:%M:%S %Z", &tm);
    int n = snprintf(line, sizeof line, "%s pid %ld on host %s since %s\n", who ? who : "a process",
                     (long)getpid(), host, since);
    if (ftruncate(fd, 0) == 0 && n > 0) {
        ssize_t w = pwrite(fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1, 0);
        (void)w;
    }
    return l;
}

void tdm_checkpoint_unlock(tdm_checkpoint_lock *l) {
    if (!l) return;
    pthread_mutex_lock(&held_mutex);
    for (tdm_checkpoint_lock **p = &held; *p; p = &(*p)->next)
        if (*p == l) {
            *p = l->next;
            break;
        }
    pthread_mutex_unlock(&held_mutex);
    /* an unheld LOCK names nobody (should this fail, the stale line is harmless); the file
     * stays (see the top) */
    int rc = ftruncate(l->fd, 0);
    (void)rc;
    close(l->fd);
    free(l->dir);
    free(l);
}

/* splitmix64's finaliser: spreads the bits of a weak seed (the clock and the pid). */
static uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

int tdm_checkpoint_new_run_id(char *out, size_t cap) {
    if (!out || cap < 17)
        return tdm_raise(TDM_ERR_ARG, "checkpoint_new_run_id: needs 17 bytes, got %zu",
                         out ? cap : (size_t)0);
    uint64_t x = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    bool ok = fd >= 0 && read(fd, &x, sizeof x) == (ssize_t)sizeof x;
    if (fd >= 0) close(fd);
    if (!ok) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        x = mix64((uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec) ^
            mix64((uint64_t)getpid() ^ (uint64_t)(uintptr_t)&ts);
    }
    snprintf(out, cap, "%016" PRIx64, x);
    return TDM_OK;
}
