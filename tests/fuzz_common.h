/* Shared by the fuzz targets (tests/fuzz_*.c): a temporary file for the readers that take a
 * path, and, under FUZZ_REPLAY_MAIN, the plain main() of the `fuzz_*_replay` programs that
 * feed every file of a corpus through the target's LLVMFuzzerTestOneInput (the CTest tests
 * replay the committed corpora in every build, sanitized or not). */
#ifndef TANDEM_TESTS_FUZZ_COMMON_H
#define TANDEM_TESTS_FUZZ_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create */
#endif
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A file in memory (memfd; an unlinked file under $TMPDIR or /tmp where memfd is missing), made
 * on first use (declare it static with .fd = -1) and rewritten for each input; its path opens
 * like any other. */
typedef struct {
    int fd;
    char path[256];
} fuzz_file;

/* Replaces the contents of f with data; returns f->path, or aborts (the harness failed). */
static inline const char *fuzz_file_write(fuzz_file *f, const void *data, size_t size) {
    if (f->fd < 0) {
        f->fd = memfd_create("tandem-fuzz", MFD_CLOEXEC);
        if (f->fd >= 0) {
            snprintf(f->path, sizeof f->path, "/proc/self/fd/%d", f->fd);
        } else {
            const char *dir = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
            snprintf(f->path, sizeof f->path, "%s/tandem-fuzz-XXXXXX", dir);
            f->fd = mkstemp(f->path);
            if (f->fd < 0) abort();
            unlink(f->path); /* gone when the process ends */
            snprintf(f->path, sizeof f->path, "/proc/self/fd/%d", f->fd);
        }
    }
    if (ftruncate(f->fd, 0) != 0) abort();
    const char *p = (const char *)data;
    size_t left = size;
    off_t at = 0;
    while (left) {
        ssize_t w = pwrite(f->fd, p, left, at);
        if (w <= 0) abort();
        p += w, left -= (size_t)w, at += w;
    }
    return f->path;
}

/* A file's bytes (*len: their count), malloc'ed; aborts when it cannot be read (the harness's
 * own files). */
static inline char *fuzz_read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) abort();
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (!b || fread(b, 1, (size_t)n, f) != (size_t)n) abort();
    fclose(f);
    *len = (size_t)n;
    return b;
}

#ifdef FUZZ_REPLAY_MAIN
static int fuzz_replay_file(const char *path) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return 1;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    size_t got = buf ? fread(buf, 1, (size_t)n, fp) : 0;
    fclose(fp);
    if (!buf || got != (size_t)n) {
        free(buf);
        return 1;
    }
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    return 0;
}

/* Replays every FILE, and every file of every DIR, given; fails on an unreadable one or on
 * none at all (a corpus gone missing). */
int main(int argc, char **argv) {
    const char *me = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    int files = 0, failed = 0;
    for (int a = 1; a < argc; a++) {
        struct stat st;
        if (stat(argv[a], &st) != 0) {
            fprintf(stderr, "%s: cannot read %s\n", me, argv[a]);
            return 1;
        }
        if (!S_ISDIR(st.st_mode)) {
            failed += fuzz_replay_file(argv[a]);
            files++;
            continue;
        }
        DIR *d = opendir(argv[a]);
        struct dirent *e;
        while (d && (e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.') continue;
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", argv[a], e->d_name);
            failed += fuzz_replay_file(p);
            files++;
        }
        if (d) closedir(d);
    }
    printf("%s: %d inputs replayed, %d unreadable\n", me, files, failed);
    return failed || files == 0;
}
#endif

#endif
