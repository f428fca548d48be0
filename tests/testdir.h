/* What the tests that write files or run the `tandem` command share: a scratch directory, file
 * contents, and a child process with its output captured. Include after check.h. */
#ifndef TDM_TESTDIR_H
#define TDM_TESTDIR_H

#include <dirent.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

/* The scratch directory, made by tmpdir_make. */
static char tmpdir[64];

/* Makes /tmp/tandem_<name>_XXXXXX; 0, or -1 after printing why. */
static inline int tmpdir_make(const char *name) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/tandem_%s_XXXXXX", name);
    if (mkdtemp(tmpdir)) return 0;
    perror("mkdtemp");
    return -1;
}

/* Removes the scratch directory when every check passed (kept after a failure, for a look). */
static inline void tmpdir_remove(void) {
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (check_failed == 0 && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
}

/* A file's bytes with a '\0' after them (*len: their count, may be NULL), or NULL. */
static inline char *slurp_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = calloc(1, (size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) s[0] = '\0';
    fclose(f);
    if (len) *len = (size_t)n;
    return s;
}

/* Writes bytes[0, n) to path (replacing it); whether all of it was written. */
static inline bool file_write(const char *path, const void *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    bool ok = f && fwrite(bytes, 1, n, f) == n;
    return f && fclose(f) == 0 && ok;
}

/* Whether the file at path holds exactly bytes[0, n): an input a command must not change. */
static inline bool file_holds(const char *path, const void *bytes, size_t n) {
    size_t len = 0;
    char *s = slurp_file(path, &len);
    bool same = s && len == n && memcmp(s, bytes, n) == 0;
    free(s);
    return same;
}

/* The ckpt-* entries of a checkpoint directory. */
static inline int count_ckpts(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) n += strncmp(e->d_name, "ckpt-", 5) == 0;
    if (d) closedir(d);
    return n;
}

/* Starts argv (NULL-terminated; argv[0] the program) with stdout and stderr written to
 * tmpdir/stdout and tmpdir/stderr. */
static inline pid_t spawn_captured(const char *const *argv) {
    pid_t pid = fork();
    if (pid == 0) {
        char out[200], err[200];
        snprintf(out, sizeof out, "%s/stdout", tmpdir);
        snprintf(err, sizeof err, "%s/stderr", tmpdir);
        int fo = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        int fe = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fo < 0 || fe < 0) _exit(126);
        dup2(fo, 1);
        dup2(fe, 2);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

/* What a captured child printed: "stdout" or "stderr" (never NULL). */
static inline char *captured(const char *which) {
    char p[200];
    snprintf(p, sizeof p, "%s/%s", tmpdir, which);
    char *s = slurp_file(p, NULL);
    return s ? s : calloc(1, 1);
}

/* Waits for pid: its exit status, or -1 when it did not exit normally (a crash, a kill: the
 * signal is printed on stderr, so that a failure says which). */
static inline int wait_status(pid_t pid) {
    int st = 0;
    if (pid <= 0 || waitpid(pid, &st, 0) != pid) return -1;
    if (WIFSIGNALED(st)) fprintf(stderr, "(pid %d ended by signal %d)\n", (int)pid, WTERMSIG(st));
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#endif
