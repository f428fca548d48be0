/* Atomic file replacement: write a temporary file in the destination's directory, fsync it,
 * rename it over the destination, fsync the directory. A crash at any moment leaves the old
 * file or the new one; the rename is the commit point, and the directory fsync makes the
 * rename itself durable. The directory helpers the writers of src/io share live here too. */
#define _GNU_SOURCE /* mkostemp */
#include "io/io_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static atomic_int fail_countdown; /* steps until the injected failure; <= 0: none */
static atomic_int fail_errno;

void tdm_io_fail_nth(int n, int err) {
    atomic_store(&fail_errno, err);
    atomic_store(&fail_countdown, n);
}

bool tdm_io_fault(void) {
    if (atomic_load_explicit(&fail_countdown, memory_order_relaxed) <= 0) return false;
    if (atomic_fetch_sub(&fail_countdown, 1) != 1) return false;
    errno = atomic_load(&fail_errno);
    return true;
}

void tdm_io_dirname(const char *path, char *dir, size_t cap) {
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, cap, ".");
    else if (slash == path)
        snprintf(dir, cap, "/");
    else
        snprintf(dir, cap, "%.*s", (int)(slash - path), path);
}

int tdm_io_mkdir_p(const char *dir, const char *what) {
    char p[4096];
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p)
        return tdm_raise(TDM_ERR_IO, "%s: cannot create directory '%.200s...': path too long", what,
                         dir);
    /* each parent in turn; one that cannot be made ends the walk, and the mkdir below, of that
     * same parent, reports why */
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST) break;
        *s = '/';
    }
    if ((tdm_io_fault() || mkdir(p, 0755) != 0) && errno != EEXIST)
        return tdm_raise(TDM_ERR_IO, "%s: cannot create directory '%s': %s", what, dir,
                         strerror(errno));
    return TDM_OK;
}

int tdm_io_fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return tdm_raise(TDM_ERR_IO, "cannot open directory '%s': %s", dir, strerror(errno));
    int rc = (!tdm_io_fault() && fsync(fd) == 0) || errno == EINVAL
                 ? TDM_OK
                 : tdm_raise(TDM_ERR_IO,
                             "cannot flush directory "
                             "'%s': %s",
                             dir, strerror(errno));
    close(fd);
    return rc;
}

int tdm_io_temp_open(const char *path, char *tmp, size_t cap) {
    int n = snprintf(tmp, cap, "%s.tmp-XXXXXX", path);
    if (n < 0 || (size_t)n >= cap) {
        tdm_raise(TDM_ERR_IO, "cannot write '%.200s': path too long", path);
        return -1;
    }
    int fd = tdm_io_fault() ? -1 : mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        tdm_raise(TDM_ERR_IO, "cannot write '%s': %s", path, strerror(errno));
        return -1;
    }
    fchmod(fd, 0644); /* mkstemp's 0600 would make weights unreadable to other users */
    return fd;
}

int tdm_io_temp_commit(int fd, const char *tmp, const char *path, int rc) {
    if (!rc && (tdm_io_fault() || fsync(fd) != 0))
        rc = tdm_raise(TDM_ERR_IO, "cannot flush '%s' to disk: %s", path, strerror(errno));
    if (close(fd) != 0 && !rc)
        rc = tdm_raise(TDM_ERR_IO, "cannot write '%s': %s", path, strerror(errno));
    if (!rc && (tdm_io_fault() || rename(tmp, path) != 0))
        rc = tdm_raise(TDM_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
    if (rc) {
        unlink(tmp);
        return rc;
    }
    char dir[4096];
    tdm_io_dirname(path, dir, sizeof dir);
    return tdm_io_fsync_dir(dir);
}
