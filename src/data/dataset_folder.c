/* ImageFolder, as torchvision's datasets.ImageFolder lists it, so that labels and sample
 * order carry over from PyTorch:
 * - classes are the names of dir's subdirectories (symbolic links to directories count, as
 *   do hidden ones), sorted by byte (Python's sorted() of UTF-8 names); class k is the k-th;
 * - the samples of a class are the files with an image extension anywhere below its folder
 *   (make_dataset's os.walk(followlinks=True)): the directories sorted by path, the files of
 *   each sorted by name, classes in order.
 *
 * torchvision's extensions are .jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp (any case).
 * Tandem decodes JPEG and PNG only: a file with one of the other extensions is a sample when
 * its bytes are a JPEG or PNG (PIL goes by content too), and otherwise a bad file, like an
 * unreadable one, so that no file torchvision would list is dropped without a word.
 *
 * Opening reads each file's header only (format, size: a few kilobytes, no decoding), so a
 * file that is empty, not an image, or a PNG with a broken signature or IHDR fails the open
 * with its path and the reason, or, with skip_bad, is left out and counted. Damage past the
 * header (a truncated JPEG, a bad CRC in IDAT) shows when get_image decodes the file, as an
 * error naming it. Paths are kept below dir in one arena of bytes. */
#include "data/dataset_common.h"
#include "data/image_decode.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define OP          "tdm_image_folder_open"
#define MAX_PATH    4096
#define MAX_DEPTH   64 /* folders nested below a class folder */
#define MAX_SAMPLES ((int64_t)INT32_MAX)

/* ---- growable storage: a byte arena addressed by offsets, and arrays of offsets --------- */

typedef struct {
    char *p;
    size_t len, cap;
} arena;

/* Appends s[0, n) and a NUL; the offset of the copy, or (size_t)-1 out of memory. */
static size_t arena_put(arena *a, const char *s, size_t n) {
    if (a->len + n + 1 > a->cap) {
        size_t cap = a->cap ? a->cap : 4096;
        while (cap < a->len + n + 1) cap *= 2;
        char *p = (char *)realloc(a->p, cap);
        if (!p) return (size_t)-1;
        a->p = p, a->cap = cap;
    }
    size_t at = a->len;
    memcpy(a->p + at, s, n);
    a->p[at + n] = '\0';
    a->len += n + 1;
    return at;
}

typedef struct {
    size_t *v;
    size_t n, cap;
} offsets;

static int offsets_push(offsets *o, size_t x) {
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 256;
        size_t *v = (size_t *)realloc(o->v, cap * sizeof *v);
        if (!v) return tdm_raise(TDM_ERR_NOMEM, OP ": out of memory");
        o->v = v, o->cap = cap;
    }
    o->v[o->n++] = x;
    return TDM_OK;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* ---- the dataset ------------------------------------------------------------------------- */

typedef struct {
    size_t path;   /* offset in paths of the path below root, "class/sub/name" */
    int32_t label; /* its class */
} folder_sample;

typedef struct {
    char *root;             /* dir as given */
    arena paths;            /* every sample's path below root */
    folder_sample *samples; /* [n] */
    size_t n, cap;
    arena class_names; /* the class folder names */
    size_t *class_at;  /* [classes] offsets into class_names, in class order */
    int64_t classes, skipped;
    int channels;
} folder_impl;

/* root/rel into buf (MAX_PATH); false when it does not fit */
static bool full_path(char *buf, const char *root, const char *rel) {
    int k = snprintf(buf, MAX_PATH, "%s/%s", root, rel);
    return k >= 0 && k < MAX_PATH;
}

static int folder_get(const tdm_dataset *ds, int64_t i, void *x, int64_t *y) {
    return tdm_raise(TDM_ERR_STATE,
                     "dataset %s: its images differ in size (sample shape [%lld, 0, 0]), so get() "
                     "cannot batch them: give the loader a transform that makes them one size "
                     "(tdm_loader_opts.transform, transforms.h), or call get_image",
                     ds->name, (long long)ds->sample_shape.d[0]);
}

/* Reads sample i's file whole (no shared state: safe from any thread) and decodes the part of
 * it want names (want NULL: all of it). */
static int folder_get_image_part(const tdm_dataset *ds, int64_t i, tdm_image_want_fn want,
                                 void *arg, tdm_image *img, int64_t *y) {
    int rc = tdm_ds_check_index(ds, i);
    if (rc) return rc;
    const folder_impl *m = (const folder_impl *)ds->impl;
    char path[MAX_PATH], *bytes = NULL;
    size_t n = 0;
    full_path(path, m->root, m->paths.p + m->samples[i].path); /* it fitted at open */
    if (tdm_ds_read_file(path, "image", &bytes, &n)) return tdm_last_status();
    rc = tdm_image_decode_part(bytes, n, path, m->channels, want, arg, img);
    free(bytes);
    *y = m->samples[i].label;
    return rc;
}

static int folder_get_image(const tdm_dataset *ds, int64_t i, tdm_image *img, int64_t *y) {
    return folder_get_image_part(ds, i, NULL, NULL, img, y);
}

static const char *folder_class_name(const tdm_dataset *ds, int64_t k) {
    const folder_impl *m = (const folder_impl *)ds->impl;
    return k >= 0 && k < m->classes ? m->class_names.p + m->class_at[k] : NULL;
}

static void folder_free_impl(folder_impl *m) {
    if (!m) return;
    free(m->root);
    free(m->paths.p);
    free(m->samples);
    free(m->class_names.p);
    free(m->class_at);
    free(m);
}

static void folder_destroy(tdm_dataset *ds) {
    folder_free_impl((folder_impl *)ds->impl);
    ds->impl = NULL;
}

static const tdm_dataset_ops folder_ops = {.get = folder_get,
                                           .destroy = folder_destroy,
                                           .get_image = folder_get_image,
                                           .get_image_part = folder_get_image_part,
                                           .class_name = folder_class_name};

int64_t tdm_image_folder_skipped(const tdm_dataset *ds) {
    return ds && ds->ops == &folder_ops ? ((const folder_impl *)ds->impl)->skipped : 0;
}

tdm_image_folder_opts tdm_image_folder_defaults(void) {
    return (tdm_image_folder_opts){.channels = 3, .skip_bad = false};
}

/* ---- listing: classes, then each class's files as os.walk finds them ---------------------- */

/* One folder below root, and its candidate files (names in walk.names). */
typedef struct {
    const char *s;       /* first, for cmp_str: path as a pointer once the walk is over */
    size_t path;         /* offset in walk.names of its path below root, "class/sub" */
    size_t first, count; /* its files: walk.files.v[first, first + count) */
} walk_dir;

typedef struct {
    const char *root;
    char path[MAX_PATH]; /* scratch */
    arena names;         /* folder paths and file names */
    walk_dir *dirs;
    size_t ndirs, capdirs;
    offsets files;            /* offsets of file names in names */
    dev_t dev[MAX_DEPTH + 1]; /* the folders being walked, outermost */
    ino_t ino[MAX_DEPTH + 1]; /* first: a symbolic link loop shows */
} walk;

/* A name torchvision's IMG_EXTENSIONS would list (case-insensitive). */
static bool image_name(const char *name) {
    static const char *const ext[] = {".jpg", ".jpeg", ".png",  ".ppm", ".bmp",
                                      ".pgm", ".tif",  ".tiff", ".webp"};
    size_t n = strlen(name);
    for (size_t k = 0; k < sizeof ext / sizeof *ext; k++) {
        size_t e = strlen(ext[k]);
        if (n >= e && strcasecmp(name + n - e, ext[k]) == 0) return true;
    }
    return false;
}

/* A directory, or a symbolic link to one (os.scandir's is_dir()). */
static bool entry_is_dir(DIR *d, const struct dirent *e) {
    if (e->d_type == DT_DIR) return true;
    if (e->d_type != DT_LNK && e->d_type != DT_UNKNOWN) return false;
    struct stat st;
    return fstatat(dirfd(d), e->d_name, &st, 0) == 0 && S_ISDIR(st.st_mode);
}

static int walk_nomem(void) {
    return tdm_raise(TDM_ERR_NOMEM, OP ": out of memory listing the files");
}

/* Records folder rel (an offset in names) and its files, after checking it is not one of
 * the folders it lies in (a link loop). Its subfolders' names go to subs. */
static int walk_list(walk *w, size_t rel, int depth, offsets *subs) {
    if (!full_path(w->path, w->root, w->names.p + rel))
        return tdm_raise(TDM_ERR_ARG, OP ": a path below %s is too long", w->root);
    DIR *d = opendir(w->path);
    struct stat st;
    if (!d || fstat(dirfd(d), &st) != 0) {
        if (d) closedir(d);
        return tdm_raise(TDM_ERR_IO, OP ": cannot read the folder %s: %s", w->path,
                         strerror(errno));
    }
    for (int k = 0; k < depth; k++)
        if (w->dev[k] == st.st_dev && w->ino[k] == st.st_ino)
            return closedir(d), tdm_raise(TDM_ERR_FORMAT,
                                          OP ": %s: a symbolic link loop (it is the folder "
                                             "%d levels up)",
                                          w->path, depth - k);
    w->dev[depth] = st.st_dev, w->ino[depth] = st.st_ino;
    if (w->ndirs == w->capdirs) {
        size_t cap = w->capdirs ? w->capdirs * 2 : 64;
        walk_dir *nd = (walk_dir *)realloc(w->dirs, cap * sizeof *nd);
        if (!nd) return closedir(d), walk_nomem();
        w->dirs = nd, w->capdirs = cap;
    }
    size_t me = w->ndirs++;
    w->dirs[me] = (walk_dir){.path = rel, .first = w->files.n};
    struct dirent *e;
    int rc = TDM_OK;
    while (!rc && (errno = 0, e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        bool sub = entry_is_dir(d, e);
        if (!sub && !image_name(e->d_name)) continue;
        size_t at = arena_put(&w->names, e->d_name, strlen(e->d_name));
        rc = at == (size_t)-1 ? walk_nomem() : offsets_push(sub ? subs : &w->files, at);
        w->dirs[me].count += !sub && !rc;
    }
    if (!rc && errno)
        rc = tdm_raise(TDM_ERR_IO, OP ": cannot read the folder %s: %s", w->path, strerror(errno));
    closedir(d);
    return rc;
}

/* Walks folder rel and everything below it (os.walk with followlinks=True). */
static int walk_folder(walk *w, size_t rel, int depth) {
    offsets subs = {0};
    int rc = walk_list(w, rel, depth, &subs);
    for (size_t k = 0; !rc && k < subs.n; k++) {
        int len = snprintf(w->path, MAX_PATH, "%s/%s", w->names.p + rel, w->names.p + subs.v[k]);
        size_t child =
            len < 0 || len >= MAX_PATH ? (size_t)-1 : arena_put(&w->names, w->path, (size_t)len);
        if (child == (size_t)-1)
            rc = len >= MAX_PATH
                     ? tdm_raise(TDM_ERR_ARG, OP ": %s/%s: the path is too long", w->root, w->path)
                     : walk_nomem();
        else if (depth + 1 > MAX_DEPTH)
            rc = tdm_raise(TDM_ERR_FORMAT, OP ": %s/%s: folders nested more than %d deep", w->root,
                           w->names.p + child, MAX_DEPTH);
        else
            rc = walk_folder(w, child, depth + 1);
    }
    free(subs.v);
    return rc;
}

/* Sorts the folders by path and each folder's files by name, as sorted(os.walk(...)) and
 * sorted(fnames) in torchvision's make_dataset; *sorted receives the file names in sample
 * order (freed by the caller). */
static int walk_sort(walk *w, const char ***sorted) {
    const char **f = (const char **)malloc((w->files.n + 1) * sizeof *f);
    if (!f) return walk_nomem();
    for (size_t k = 0; k < w->ndirs; k++) w->dirs[k].s = w->names.p + w->dirs[k].path;
    /* s is the first member: the folders sort as strings */
    qsort(w->dirs, w->ndirs, sizeof *w->dirs, cmp_str);
    for (size_t k = 0; k < w->files.n; k++) f[k] = w->names.p + w->files.v[k];
    for (size_t k = 0; k < w->ndirs; k++)
        qsort(f + w->dirs[k].first, w->dirs[k].count, sizeof *f, cmp_str);
    *sorted = f;
    return TDM_OK;
}

/* ---- checking each file's header ------------------------------------------------------- */

/* Reads the header of the file at path (its first TDM_IMAGE_PROBE_BYTES into buf, or all of
 * it when the header lies further in): TDM_OK, or an error naming the file. O_NONBLOCK: a
 * FIFO named .jpg is refused, not waited on. */
static int probe_file(const char *path, unsigned char *buf) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return tdm_raise(TDM_ERR_IO, "image '%s': cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        return close(fd), tdm_raise(TDM_ERR_IO, "image '%s': not a regular file", path);
    size_t got = 0;
    while (got < TDM_IMAGE_PROBE_BYTES) {
        ssize_t k = pread(fd, buf + got, TDM_IMAGE_PROBE_BYTES - got, (off_t)got);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0)
            return close(fd),
                   tdm_raise(TDM_ERR_IO, "image '%s': read failed: %s", path, strerror(errno));
        if (k == 0) break;
        got += (size_t)k;
    }
    close(fd);
    tdm_image_info info;
    int rc = tdm_image_probe(buf, got, path, &info);
    /* a JPEG's SOF may come after large APPn segments (EXIF, ICC): read on for those only */
    bool jpeg = got >= 3 && buf[0] == 0xff && buf[1] == 0xd8 && buf[2] == 0xff;
    if (rc != TDM_ERR_FORMAT || got == (size_t)st.st_size || !jpeg) return rc;
    char *all = NULL;
    size_t n = 0;
    tdm_clear_error();
    if (tdm_ds_read_file(path, "image", &all, &n)) return tdm_last_status();
    rc = tdm_image_probe(all, n, path, &info);
    free(all);
    return rc;
}

/* Adds the sample root/rel of class label, or skips it (skip_bad) when its header does not
 * read. */
static int add_sample(folder_impl *m, const char *rel, int32_t label, bool skip_bad,
                      unsigned char *buf) {
    char path[MAX_PATH];
    if (!full_path(path, m->root, rel))
        return tdm_raise(TDM_ERR_ARG, OP ": the path %s/%s is too long", m->root, rel);
    int rc = probe_file(path, buf);
    if (rc == TDM_ERR_NOMEM) return rc;
    if (rc && skip_bad) {
        m->skipped++;
        tdm_clear_error();
        return TDM_OK;
    }
    if (rc) {
        char why[1024];
        snprintf(why, sizeof why, "%s", tdm_last_error());
        return tdm_raise(rc, OP ": %s (skip_bad leaves such files out)", why);
    }
    if ((int64_t)m->n >= MAX_SAMPLES)
        return tdm_raise(TDM_ERR_ARG, OP ": %s: more than %lld images", m->root,
                         (long long)MAX_SAMPLES);
    if (m->n == m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 1024;
        folder_sample *s = (folder_sample *)realloc(m->samples, cap * sizeof *s);
        if (!s) return walk_nomem();
        m->samples = s, m->cap = cap;
    }
    size_t at = arena_put(&m->paths, rel, strlen(rel));
    if (at == (size_t)-1) return walk_nomem();
    m->samples[m->n++] = (folder_sample){.path = at, .label = label};
    return TDM_OK;
}

/* Lists class label's folder (name) and adds its files in torchvision's order. */
static int add_class(folder_impl *m, walk *w, const char *name, int32_t label, bool skip_bad,
                     unsigned char *buf) {
    w->names.len = 0, w->ndirs = 0, w->files.n = 0;
    size_t rel = arena_put(&w->names, name, strlen(name));
    if (rel == (size_t)-1) return walk_nomem();
    const char **files = NULL;
    int rc = walk_folder(w, rel, 0);
    if (!rc) rc = walk_sort(w, &files);
    for (size_t d = 0; !rc && d < w->ndirs; d++) {
        for (size_t k = 0; !rc && k < w->dirs[d].count; k++) {
            char path[MAX_PATH];
            int len =
                snprintf(path, sizeof path, "%s/%s", w->dirs[d].s, files[w->dirs[d].first + k]);
            rc = len >= 0 && len < MAX_PATH
                     ? add_sample(m, path, label, skip_bad, buf)
                     : tdm_raise(TDM_ERR_ARG, OP ": a path below %s/%s is too long", m->root,
                                 w->dirs[d].s);
        }
    }
    free(files);
    return rc;
}

/* ---- opening ------------------------------------------------------------------------------ */

/* The subfolders of root, sorted: m->class_names and m->class_at. */
static int list_classes(folder_impl *m) {
    DIR *d = opendir(m->root);
    if (!d) return tdm_raise(TDM_ERR_IO, OP ": cannot read %s: %s", m->root, strerror(errno));
    offsets at = {0};
    struct dirent *e;
    int rc = TDM_OK;
    while (!rc && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !entry_is_dir(d, e)) continue;
        size_t k = arena_put(&m->class_names, e->d_name, strlen(e->d_name));
        rc = k == (size_t)-1 ? walk_nomem() : offsets_push(&at, k);
    }
    closedir(d);
    if (!rc && at.n == 0)
        rc = tdm_raise(TDM_ERR_FORMAT,
                       OP ": %s: no class folders (ImageFolder wants one folder of images per "
                          "class)",
                       m->root);
    const char **names = rc ? NULL : (const char **)malloc(at.n * sizeof *names);
    if (!rc && !names) rc = walk_nomem();
    if (!rc) {
        for (size_t k = 0; k < at.n; k++) names[k] = m->class_names.p + at.v[k];
        qsort(names, at.n, sizeof *names, cmp_str);
        for (size_t k = 0; k < at.n; k++) at.v[k] = (size_t)(names[k] - m->class_names.p);
        m->class_at = at.v, m->classes = (int64_t)at.n;
        at.v = NULL;
    }
    free(names);
    free(at.v);
    return rc;
}

/* Every class's samples; an error names the classes left without any (torchvision's
 * "Found no valid file for the classes ..."). */
static int add_classes(folder_impl *m, bool skip_bad) {
    walk w = {.root = m->root};
    unsigned char *buf = (unsigned char *)malloc(TDM_IMAGE_PROBE_BYTES);
    char empty[512] = "";
    size_t len = 0;
    int rc = buf ? TDM_OK : walk_nomem();
    for (int64_t k = 0; !rc && k < m->classes; k++) {
        size_t before = m->n;
        const char *name = m->class_names.p + m->class_at[k];
        rc = add_class(m, &w, name, (int32_t)k, skip_bad, buf);
        if (!rc && m->n == before && len < sizeof empty)
            len += (size_t)snprintf(empty + len, sizeof empty - len, "%s%s", len ? ", " : "", name);
    }
    if (!rc && len)
        rc = tdm_raise(TDM_ERR_FORMAT,
                       OP ": %s: found no valid file for the classes %s (Tandem reads .jpg, .jpeg "
                          "and .png files, any case%s)",
                       m->root, empty, m->skipped ? "; skip_bad left some out" : "");
    free(buf);
    free(w.names.p);
    free(w.dirs);
    free(w.files.v);
    return rc;
}

/* "imagefolder:DIR", keeping DIR's end when it is long */
static void folder_name(char *out, size_t size, const char *dir) {
    size_t n = strlen(dir), room = size - 1 - strlen("imagefolder:");
    if (n <= room)
        snprintf(out, size, "imagefolder:%s", dir);
    else
        snprintf(out, size, "imagefolder:...%s", dir + n - (room - 3));
}

static int check_open_args(const char *dir, const tdm_image_folder_opts *o) {
    struct stat st;
    if (!dir) return tdm_raise(TDM_ERR_ARG, OP ": dir is NULL");
    if (o->channels != 1 && o->channels != 3)
        return tdm_raise(TDM_ERR_ARG, OP ": %s: channels must be 1 or 3, got %d", dir, o->channels);
    if (stat(dir, &st) != 0)
        return tdm_raise(TDM_ERR_IO, OP ": cannot open %s: %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return tdm_raise(TDM_ERR_IO,
                         OP ": %s is not a folder (ImageFolder wants a folder of "
                            "class folders)",
                         dir);
    return TDM_OK;
}

tdm_dataset *tdm_image_folder_open(const char *dir, const tdm_image_folder_opts *o) {
    tdm_image_folder_opts opts = o ? *o : tdm_image_folder_defaults();
    if (check_open_args(dir, &opts)) return NULL;
    folder_impl *m = (folder_impl *)calloc(1, sizeof *m);
    if (m) m->root = strdup(dir);
    if (!m || !m->root) {
        free(m);
        return tdm_raise_null(TDM_ERR_NOMEM, OP ": out of memory");
    }
    for (size_t n = strlen(m->root); n > 1 && m->root[n - 1] == '/'; n--) m->root[n - 1] = '\0';
    m->channels = opts.channels;
    char name[64];
    folder_name(name, sizeof name, m->root);
    tdm_dataset *ds = NULL;
    if (!list_classes(m) && !add_classes(m, opts.skip_bad)) ds = tdm_ds_new(&folder_ops, m, name);
    if (!ds) {
        folder_free_impl(m);
        return NULL;
    }
    ds->n = (int64_t)m->n;
    ds->sample_shape = TDM_SHAPE(opts.channels, 0, 0);
    ds->x_dtype = TDM_F32;
    ds->target_shape = TDM_SHAPE0;
    ds->num_classes = m->classes;
    return ds;
}
