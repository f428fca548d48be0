/* TensorBoard event files: CRC-32C against its check value, a written file read back by a
 * reader of its own here (framing checksums, the file_version event, every scalar's tag, step,
 * value and wall time), records byte for byte those of TensorBoard's own writer, any changed
 * byte or a cut end caught by that reader, write failures and bad arguments reported with the
 * file's name.
 *
 *     test_tensorboard                       the checks above
 *     test_tensorboard --python PY SCRIPT    writes a file and has TensorBoard's own reader
 *                                            (tests/tensorboard_read.py, run by PY) read it;
 *                                            exits 77 (skipped) when PY or its `tensorboard`
 *                                            package is missing
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "testdir.h"
#include "io/io_internal.h"
#include "tandem/tensorboard.h"

#define SKIPPED 77 /* CTest's SKIP_RETURN_CODE for test_tensorboard_reader */

#define TAG10 "0123456789"
#define LONG_TAG                                                                                   \
    "long/" TAG10 TAG10 TAG10 TAG10 TAG10 TAG10 TAG10 TAG10 TAG10 TAG10 TAG10 TAG10 TAG10

/* What the tests write: steps ascending (EventAccumulator drops events that go back in steps),
 * varints of one, two, six and ten bytes (negative), a tag longer than 127 bytes (two-byte
 * length), a UTF-8 tag, and values that a float stores inexactly, NaN and infinity. */
static const struct {
    const char *tag;
    int64_t step;
    double value, wall_time;
} scalars[] = {
    {"loss/train", -3, 2.302585, 1700000000.5}, {"loss/train", 0, 1.25, 1700000001.25},
    {"accuracy/val", 0, 0.875, 1700000002.0},   {"\xce\xbb/grad norm", 127, 1e30, 1700000003.125},
    {LONG_TAG, 128, -0.1, 1700000004.0625},     {"weird", 300, NAN, 1700000005.0},
    {"weird", 301, -INFINITY, 1700000006.0},    {"lr", (int64_t)1 << 40, 3e-4, 1700000007.75},
};
#define N_SCALARS (int)(sizeof scalars / sizeof scalars[0])

/* ---- a reader of our own: TFRecord framing and the Event fields we write ------------------- */

typedef struct {
    char tag[256];
    int64_t step;
    float value;
    double wall_time;
} scalar;

typedef struct {
    char version[32]; /* the first event's file_version */
    double version_time;
    int n;
    scalar s[64];
} events;

/* A protobuf message being read: the bytes [p, end). */
typedef struct {
    const uint8_t *p, *end;
} pb;

static uint64_t le(const uint8_t *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static bool pb_varint(pb *m, uint64_t *v) {
    *v = 0;
    for (int shift = 0; m->p < m->end && shift < 64; shift += 7) {
        uint8_t b = *m->p++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return true;
    }
    return false;
}

/* A field's key: its number and wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32). */
#define KEY(field, wire) ((field) << 3 | (wire))

/* The next field of m: its key, and its payload as a number (varint, fixed64, fixed32) or as
 * the bytes *sub (length-delimited). False on a malformed field. */
static bool pb_field(pb *m, int *key, uint64_t *v, pb *sub) {
    uint64_t k;
    if (!pb_varint(m, &k) || k > 0xffff) return false;
    *key = (int)k;
    int wire = (int)(k & 7), fixed = wire == 1 ? 8 : wire == 5 ? 4 : 0;
    *sub = (pb){NULL, NULL};
    if (wire == 0) return pb_varint(m, v);
    if (fixed) {
        if (m->end - m->p < fixed) return false;
        *v = le(m->p, fixed);
        m->p += fixed;
        return true;
    }
    if (wire != 2 || !pb_varint(m, v) || *v > (uint64_t)(m->end - m->p)) return false;
    *sub = (pb){m->p, m->p + *v};
    m->p += *v;
    return true;
}

static bool copy_string(pb s, char *dst, size_t cap) {
    size_t n = (size_t)(s.end - s.p);
    if (n >= cap) return false;
    memcpy(dst, s.p, n);
    dst[n] = '\0';
    return true;
}

/* Summary.Value {1 tag: string, 2 simple_value: float} into *s. */
static bool parse_value(pb m, scalar *s) {
    int key;
    uint64_t v;
    pb sub;
    bool tag = false, value = false;
    while (m.p < m.end) {
        if (!pb_field(&m, &key, &v, &sub)) return false;
        if (key == KEY(1, 2)) {
            tag = copy_string(sub, s->tag, sizeof s->tag);
        } else if (key == KEY(2, 5)) {
            uint32_t bits = (uint32_t)v;
            memcpy(&s->value, &bits, sizeof bits);
            value = true;
        } else {
            return false;
        }
    }
    return tag && value;
}

/* Summary {1 value: Summary.Value}: exactly one value, as the writer makes them. */
static bool parse_summary(pb m, scalar *s) {
    int key;
    uint64_t v;
    pb sub;
    return pb_field(&m, &key, &v, &sub) && key == KEY(1, 2) && m.p == m.end && parse_value(sub, s);
}

/* One Event {1 wall_time: double, 2 step: int64, 3 file_version: string, 5 summary}: the
 * file_version one (first) or a scalar one (every later one). */
static bool parse_event(pb m, events *ev, bool first) {
    int key;
    uint64_t v;
    pb sub, summary = {NULL, NULL}, version = {NULL, NULL};
    double wall_time = 0;
    int64_t step = 0;
    while (m.p < m.end) {
        if (!pb_field(&m, &key, &v, &sub)) return false;
        if (key == KEY(1, 1))
            memcpy(&wall_time, &v, sizeof v);
        else if (key == KEY(2, 0))
            step = (int64_t)v;
        else if (key == KEY(3, 2))
            version = sub;
        else if (key == KEY(5, 2))
            summary = sub;
        else
            return false;
    }
    if (first) {
        ev->version_time = wall_time;
        return version.p && !summary.p && copy_string(version, ev->version, sizeof ev->version);
    }
    if (!summary.p || version.p || ev->n == 64) return false;
    scalar *s = &ev->s[ev->n++];
    s->step = step;
    s->wall_time = wall_time;
    return parse_summary(summary, s);
}

/* Reads the n bytes of a file's records into *ev. Returns NULL, or what is wrong first. */
static const char *parse_records(const uint8_t *b, size_t n, events *ev) {
    memset(ev, 0, sizeof *ev);
    size_t at = 0;
    for (int i = 0; at < n; i++) {
        if (n - at < 12) return "a record's length is cut off";
        uint64_t len = le(b + at, 8);
        uint32_t crc = tdm_crc32c(b + at, 8);
        if (le(b + at + 8, 4) != ((crc >> 15) | (crc << 17)) + 0xa282ead8u)
            return "a length's checksum is wrong";
        if (len > n - at - 12 || n - at - 12 - len < 4) return "a record's data is cut off";
        const uint8_t *data = b + at + 12;
        crc = tdm_crc32c(data, len);
        if (le(data + len, 4) != ((crc >> 15) | (crc << 17)) + 0xa282ead8u)
            return "a record's data checksum is wrong";
        if (!parse_event((pb){data, data + len}, ev, i == 0)) return "an event is malformed";
        at += 12 + len + 4;
    }
    return ev->version[0] ? NULL : "no file_version event";
}

/* Reads the file at path into *ev. Returns NULL, or what is wrong first. */
static const char *read_events(const char *path, events *ev) {
    size_t n = 0;
    uint8_t *b = (uint8_t *)slurp_file(path, &n);
    const char *why = b ? parse_records(b, n, ev) : "cannot read the file";
    free(b);
    return why;
}

/* ---- writing ------------------------------------------------------------------------------- */

/* A writer in tmpdir/sub (made with its parents); its file's path into path (600 bytes). NULL,
 * and a failed check, when it cannot be opened. */
static tdm_tb_writer *open_in(const char *sub, char *path) {
    char dir[300];
    snprintf(dir, sizeof dir, "%s/%s", tmpdir, sub);
    tdm_tb_writer *w = tdm_tb_open(dir);
    CHECK(w != NULL, "open '%s': %s", dir, tdm_last_error());
    snprintf(path, 600, "%s", w ? tdm_tb_path(w) : "");
    return w;
}

/* Writes the table into a new file under tmpdir/sub; the file's path into path (600 bytes). */
static bool write_table(const char *sub, char *path) {
    tdm_tb_writer *w = open_in(sub, path);
    if (!w) return false;
    for (int i = 0; i < N_SCALARS; i++)
        CHECK(tdm_tb_add_scalar(w, scalars[i].tag, scalars[i].step, scalars[i].value,
                                scalars[i].wall_time) == TDM_OK,
              "scalar %d: %s", i, tdm_last_error());
    int rc = tdm_tb_close(w);
    CHECK(rc == TDM_OK, "close: %s", tdm_last_error());
    return rc == TDM_OK;
}

/* The same float, NaN included. */
static bool same_float(float a, float b) {
    return a == b || (isnan(a) && isnan(b));
}

/* ---- the tests ----------------------------------------------------------------------------- */

static void test_crc(void) {
    CHECK(tdm_crc32c("123456789", 9) == 0xE3069283u, "crc32c(\"123456789\") = 0x%08X",
          tdm_crc32c("123456789", 9));
    CHECK(tdm_crc32c("", 0) == 0, "crc32c of nothing");
    /* RFC 3720 (iSCSI), B.4: 32 bytes of zeros */
    uint8_t zeros[32] = {0};
    CHECK(tdm_crc32c(zeros, 32) == 0x8A9136AAu, "crc32c(32 zeros) = 0x%08X", tdm_crc32c(zeros, 32));
}

static void test_round_trip(void) {
    char path[600];
    double t0 = (double)time(NULL);
    if (!write_table("runs/nested", path)) return; /* parents made too */
    char host[256] = "";
    gethostname(host, sizeof host);
    const char *name = strrchr(path, '/') + 1;
    CHECK(strncmp(name, "events.out.tfevents.", 20) == 0 && strstr(name, host),
          "file name '%s' (host %s)", name, host);
    events ev;
    const char *why = read_events(path, &ev);
    CHECK(why == NULL, "reading '%s': %s", path, why);
    if (!why) {
        CHECK(strcmp(ev.version, "brain.Event:2") == 0, "file_version '%s'", ev.version);
        CHECK(ev.version_time >= t0 - 1 && ev.version_time <= t0 + 60,
              "file_version event at %.3f, opened at %.0f", ev.version_time, t0);
        CHECK(ev.n == N_SCALARS, "%d scalars read back, %d written", ev.n, N_SCALARS);
        for (int i = 0; i < ev.n && i < N_SCALARS; i++) {
            const scalar *s = &ev.s[i];
            CHECK(strcmp(s->tag, scalars[i].tag) == 0 && s->step == scalars[i].step &&
                      same_float(s->value, (float)scalars[i].value) &&
                      s->wall_time == scalars[i].wall_time,
                  "scalar %d: read '%s' %lld %.9g %.17g, wrote '%s' %lld %.9g %.17g", i, s->tag,
                  (long long)s->step, s->value, s->wall_time, scalars[i].tag,
                  (long long)scalars[i].step, scalars[i].value, scalars[i].wall_time);
        }
    }
}

/* Records byte for byte as TensorBoard's own writer makes them (tensorboard 2.21,
 * tensorboard.summary.writer.event_file_writer.EventFileWriter given the same Events): a
 * check that does not go through the reader above. The second has step 0, which protobuf
 * leaves out. */
static void test_known_bytes(void) {
    static const uint8_t loss[] =
        "\x20\x00\x00\x00\x00\x00\x00\x00\x29\xed\xa9\x50\x09\x00\x00\x20\x40\xfc\x54\xd9"
        "\x41\x10\x05\x2a\x13\x0a\x11\x0a\x0a\x6c\x6f\x73\x73\x2f\x74\x72\x61\x69\x6e\x15"
        "\x00\x00\x80\x3e\xd9\x50\x8f\xe1";
    static const uint8_t lr[] =
        "\x16\x00\x00\x00\x00\x00\x00\x00\x4f\x61\xbe\x28\x09\x00\x00\x40\x40\xfc\x54\xd9"
        "\x41\x2a\x0b\x0a\x09\x0a\x02\x6c\x72\x15\x6f\x12\x83\x3a\xcd\x91\x2d\x8d";
    char path[600];
    tdm_tb_writer *w = open_in("known", path);
    if (!w) return;
    CHECK(tdm_tb_add_scalar(w, "loss/train", 5, 0.25, 1700000000.5) == TDM_OK &&
              tdm_tb_add_scalar(w, "lr", 0, 1e-3, 1700000001.0) == TDM_OK &&
              tdm_tb_close(w) == TDM_OK,
          "%s", tdm_last_error());
    size_t n = 0;
    uint8_t *b = (uint8_t *)slurp_file(path, &n);
    size_t first = b && n >= 8 ? 16 + (size_t)le(b, 8) : n; /* the file_version record */
    bool same = b && n == first + sizeof loss - 1 + sizeof lr - 1 &&
                memcmp(b + first, loss, sizeof loss - 1) == 0 &&
                memcmp(b + first + sizeof loss - 1, lr, sizeof lr - 1) == 0;
    CHECK(same, "the records differ from TensorBoard's (%zu bytes after the first record)",
          n - first);
    free(b);
}

/* Every changed byte and every cut end is caught: the reader above is a check that can fail. */
static void test_corruption(void) {
    char path[600];
    if (!write_table("corrupt", path)) return;
    size_t n = 0;
    uint8_t *b = (uint8_t *)slurp_file(path, &n);
    if (!b) return;
    events ev;
    int missed = -1;
    for (size_t i = 0; i < n; i++) {
        b[i] ^= 0x10;
        if (!parse_records(b, n, &ev) && missed < 0) missed = (int)i;
        b[i] ^= 0x10;
    }
    CHECK(missed < 0, "changing byte %d of %zu went unnoticed", missed, n);
    for (size_t cut = 1; cut < 20 && cut < n; cut++)
        CHECK(parse_records(b, n - cut, &ev) != NULL, "a file cut %zu bytes short was read", cut);
    CHECK(parse_records(b, n, &ev) == NULL, "the file itself still reads");
    free(b);
}

static void test_wall_time_now(void) {
    char path[600];
    tdm_tb_writer *w = open_in("now", path);
    if (!w) return;
    struct timespec a, z;
    clock_gettime(CLOCK_REALTIME, &a);
    CHECK(tdm_tb_add_scalar(w, "loss", 7, 0.5, 0) == TDM_OK, "%s", tdm_last_error());
    clock_gettime(CLOCK_REALTIME, &z);
    CHECK(tdm_tb_flush(w) == TDM_OK, "flush: %s", tdm_last_error());
    events ev;
    const char *why = read_events(path, &ev); /* while open: flush put the event in the file */
    CHECK(why == NULL && ev.n == 1, "reading after flush: %s", why ? why : "");
    if (!why && ev.n == 1)
        CHECK(ev.s[0].wall_time >= a.tv_sec + a.tv_nsec * 1e-9 - 1e-6 &&
                  ev.s[0].wall_time <= z.tv_sec + z.tv_nsec * 1e-9 + 1e-6,
              "wall_time 0 became %.6f, not the time of the call", ev.s[0].wall_time);
    CHECK(tdm_tb_close(w) == TDM_OK, "close: %s", tdm_last_error());
}

static void test_bad_arguments(void) {
    CHECK_ERROR(tdm_tb_open(NULL) == NULL, "NULL or empty directory");
    CHECK_ERROR(tdm_tb_open("") == NULL, "NULL or empty directory");
    char file[300], under[400];
    snprintf(file, sizeof file, "%s/plain-file", tmpdir);
    FILE *f = fopen(file, "w");
    if (f) fclose(f);
    snprintf(under, sizeof under, "%s/runs", file);
    tdm_tb_writer *w = tdm_tb_open(under);
    CHECK(w == NULL && tdm_last_status() == TDM_ERR_IO && strstr(tdm_last_error(), under) &&
              strstr(tdm_last_error(), strerror(ENOTDIR)),
          "a directory under a regular file: got %p, \"%s\"", (void *)w, tdm_last_error());
    tdm_tb_close(w);
    tdm_clear_error();

    char path[600];
    w = open_in("args", path);
    CHECK_ERROR(tdm_tb_add_scalar(NULL, "x", 0, 1, 0) == TDM_ERR_ARG, "NULL writer");
    CHECK_ERROR(tdm_tb_add_scalar(w, NULL, 0, 1, 0) == TDM_ERR_ARG, "empty tag");
    CHECK_ERROR(tdm_tb_add_scalar(w, "", 0, 1, 0) == TDM_ERR_ARG, "empty tag");
    CHECK_ERROR(tdm_tb_add_scalar(w, "bad\xff", 0, 1, 0) == TDM_ERR_ARG, "not UTF-8");
    CHECK_ERROR(tdm_tb_flush(NULL) == TDM_ERR_ARG, "NULL writer");
    CHECK(tdm_tb_path(NULL) == NULL, "path of NULL");
    CHECK(tdm_tb_close(w) == TDM_OK && tdm_tb_close(NULL) == TDM_OK, "close: %s", tdm_last_error());
    /* the refused calls wrote nothing: the file holds its first event only */
    events ev;
    CHECK(read_events(path, &ev) == NULL && ev.n == 0, "after refused calls");
}

/* A file that cannot grow (RLIMIT_FSIZE: writes past it fail with EFBIG) makes flush, every
 * later call and close fail, naming the file and the cause. */
static void test_write_failure(void) {
    char path[600];
    tdm_tb_writer *w = open_in("full", path);
    if (!w) return;
    struct rlimit old, small;
    getrlimit(RLIMIT_FSIZE, &old);
    small = old;
    small.rlim_cur = 1000;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN); /* EFBIG instead of the signal */
    setrlimit(RLIMIT_FSIZE, &small);
    int rc = TDM_OK;
    for (int i = 0; i < 1000 && rc == TDM_OK; i++) rc = tdm_tb_add_scalar(w, "loss", i, 1.0, 0);
    if (rc == TDM_OK) rc = tdm_tb_flush(w);
    CHECK(rc == TDM_ERR_IO && strstr(tdm_last_error(), path) &&
              strstr(tdm_last_error(), strerror(EFBIG)),
          "writing past the size limit: %d \"%s\"", rc, tdm_last_error());
    CHECK_ERROR(tdm_tb_add_scalar(w, "loss", 0, 1.0, 0) == TDM_ERR_IO, strerror(EFBIG));
    CHECK_ERROR(tdm_tb_flush(w) == TDM_ERR_IO, strerror(EFBIG));
    rc = tdm_tb_close(w);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    CHECK(rc == TDM_ERR_IO && strstr(tdm_last_error(), path) &&
              strstr(tdm_last_error(), strerror(EFBIG)),
          "close after a failed write: %d \"%s\"", rc, tdm_last_error());
    tdm_clear_error();
}

/* ---- TensorBoard's own reader -------------------------------------------------------------- */

/* Runs PY SCRIPT FILE, its stdout and stderr into out (cap bytes). Returns its exit status. */
static int run_reader(const char *py, const char *script, const char *file, char *out, size_t cap) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' 2>&1", py, script, file);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The lines tests/tensorboard_read.py prints for the table. */
static void expected_lines(char *out, size_t cap) {
    size_t at = (size_t)snprintf(out, cap, "file_version brain.Event:2\n");
    for (int i = 0; i < N_SCALARS && at < cap; i++)
        at += (size_t)snprintf(out + at, cap - at, "scalar %s %lld %.9g %.17g\n", scalars[i].tag,
                               (long long)scalars[i].step, (float)scalars[i].value,
                               scalars[i].wall_time);
}

/* Flips bits of the byte `back` bytes before the end of the file at path. */
static bool corrupt_byte(const char *path, long back) {
    FILE *f = fopen(path, "r+b");
    if (!f) return false;
    int c = EOF;
    bool ok = fseek(f, -back, SEEK_END) == 0 && (c = fgetc(f)) != EOF &&
              fseek(f, -back, SEEK_END) == 0 && fputc(c ^ 0x10, f) != EOF;
    return fclose(f) == 0 && ok;
}

static int python_check(const char *py, const char *script) {
    if (strchr(py, '\'') || strchr(script, '\'')) {
        fprintf(stderr, "test_tensorboard: quotes in '%s' or '%s'\n", py, script);
        return 1;
    }
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "'%s' -c 'import tensorboard' 2>/dev/null", py);
    if (access(py, X_OK) != 0 || system(cmd) != 0) {
        printf("skipped: no python with the tensorboard package at %s (scripts/setup installs "
               "it; TANDEM_TEST_VENV moves it)\n",
               py);
        return SKIPPED;
    }
    char path[600], got[8192], want[8192];
    if (!write_table("python", path)) return check_summary();
    int st = run_reader(py, script, path, got, sizeof got);
    expected_lines(want, sizeof want);
    bool same = st == 0 && strcmp(got, want) == 0;
    CHECK(same, "TensorBoard's reader (exit %d) printed:\n%s\nexpected:\n%s", st, got, want);
    if (same) printf("%s", got);
    /* the same check fails on a file with one changed byte in its last event */
    bool changed = corrupt_byte(path, 6);
    st = run_reader(py, script, path, got, sizeof got);
    CHECK(changed && st != 0 && strstr(got, "crc32"),
          "TensorBoard's reader passed a corrupted file (exit %d):\n%s", st, got);
    return check_summary();
}

int main(int argc, char **argv) {
    if (tmpdir_make("test_tb") != 0) return 1;
    int rc;
    if (argc == 4 && strcmp(argv[1], "--python") == 0) {
        rc = python_check(argv[2], argv[3]);
    } else {
        test_crc();
        test_round_trip();
        test_known_bytes();
        test_corruption();
        test_wall_time_now();
        test_bad_arguments();
        test_write_failure();
        rc = check_summary();
    }
    if (rc != 1) tmpdir_remove();
    return rc;
}
