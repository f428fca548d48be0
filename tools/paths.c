/* No output may be an input (paths.h). */
#include "paths.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* One path as compared: its real path (see resolve) and, when it exists, its stat. */
typedef struct {
    char real[PATH_MAX];
    struct stat st;
    bool exists;
} resolved;

/* The real path of path's longest existing prefix, then the rest as written (less empty and
 * "." components): what the path names once an output has been created there. */
static void resolve(const char *path, resolved *r) {
    r->exists = stat(path, &r->st) == 0;
    char head[PATH_MAX];
    snprintf(head, sizeof head, "%s", path);
    size_t cut = strlen(head);
    while (!realpath(cut ? head : ".", r->real)) {
        if (cut == 0) { /* not even the working directory: compare as written */
            r->real[0] = '\0';
            break;
        }
        char *slash = strrchr(head, '/');
        cut = !slash ? 0 : slash == head ? 1 : (size_t)(slash - head);
        head[cut] = '\0';
    }
    const char *rest = path + cut;
    size_t n = strlen(r->real);
    while (*rest) {
        size_t len = strcspn(rest, "/");
        bool skip = len == 0 || (len == 1 && rest[0] == '.');
        if (!skip && n + len + 2 < sizeof r->real) {
            if (n == 0 || r->real[n - 1] != '/') r->real[n++] = '/';
            memcpy(r->real + n, rest, len);
            r->real[n += len] = '\0';
        }
        rest += len + (rest[len] == '/');
    }
}

static bool same(const resolved *a, const resolved *b) {
    if (a->exists && b->exists) return a->st.st_dev == b->st.st_dev && a->st.st_ino == b->st.st_ino;
    return strcmp(a->real, b->real) == 0;
}

/* Whether child lies strictly inside directory dir. */
static bool inside(const resolved *child, const resolved *dir) {
    size_t n = strlen(dir->real);
    if (n == 0 || strncmp(child->real, dir->real, n) != 0) return false;
    return dir->real[n - 1] == '/' ? child->real[n] != '\0' : child->real[n] == '/';
}

/* Output o against input i: -1 with why when one is the other. */
static int against_input(const path_use *o, const resolved *ro, const path_use *i,
                         const resolved *ri, char *why, size_t cap) {
    if (!ri->exists) return 0;
    bool dir = S_ISDIR(ri->st.st_mode);
    const char *kind = dir ? "directory" : "file";
    if (same(ro, ri))
        snprintf(why, cap, "%s '%s' is the %s %s '%s'; an output may not overwrite an input",
                 o->option, o->path, i->option, kind, i->path);
    else if (dir && inside(ro, ri))
        snprintf(why, cap,
                 "%s '%s' is inside the %s directory '%s'; no output may be written among "
                 "the inputs",
                 o->option, o->path, i->option, i->path);
    else if (o->dir && inside(ri, ro) && !i->may_be_held)
        snprintf(why, cap,
                 "%s '%s' holds the %s %s '%s'; an output directory may not hold an input",
                 o->option, o->path, i->option, kind, i->path);
    else
        return 0;
    return -1;
}

int paths_check(const path_use *uses, int n, char *why, size_t cap) {
    resolved *r = calloc((size_t)n, sizeof *r);
    if (!r) {
        snprintf(why, cap, "checking the files given: out of memory");
        return -1;
    }
    for (int k = 0; k < n; k++)
        if (uses[k].path) resolve(uses[k].path, &r[k]);
    int rc = 0;
    for (int o = 0; o < n && !rc; o++) {
        const path_use *out = &uses[o];
        if (!out->output || !out->path) continue;
        for (int k = 0; k < n && !rc; k++) {
            const path_use *u = &uses[k];
            if (k == o || !u->path) continue;
            if (!u->output) {
                rc = against_input(out, &r[o], u, &r[k], why, cap);
            } else if (k > o && !(out->dir && u->dir) && same(&r[o], &r[k])) {
                snprintf(why, cap,
                         "%s '%s' and %s '%s' are the same file; give each output its own",
                         out->option, out->path, u->option, u->path);
                rc = -1;
            }
        }
    }
    free(r);
    return rc;
}
