/* TensorBoard event files, encoded by hand (include/tandem/tensorboard.h says what is written).
 *
 * A file is a sequence of TFRecords:
 *     u64 LE  length n of the data
 *     u32 LE  masked CRC-32C of those 8 length bytes
 *     n bytes the data: one serialized tensorflow.Event
 *     u32 LE  masked CRC-32C of the data
 * masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8: TFRecord masks its checksums because
 * a CRC over bytes that themselves hold CRCs is weak.
 *
 * The protobuf messages (tensorflow/core/util/event.proto, framework/summary.proto), only the
 * fields written here:
 *     Event          1 wall_time: double (wire type 1, fixed64)   2 step: int64 (varint)
 *                    3 file_version: string   5 summary: Summary
 *     Summary        1 value: repeated Summary.Value
 *     Summary.Value  1 tag: string   2 simple_value: float (wire type 5, fixed32)
 * A field is a key varint (field number << 3 | wire type), then its payload: a varint, 8 or 4
 * little-endian bytes, or a varint length and that many bytes (strings, messages). A message's
 * length must be known before its bytes, so each event's size is computed first and the event
 * is then encoded front to back into the writer's buffer.
 */
#include "io/io_internal.h"

#include <assert.h>
#include <errno.h>
#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tandem/tensorboard.h"

#define FILE_VERSION "brain.Event:2" /* what TensorFlow and PyTorch write (event.proto) */

/* ---- CRC-32C --------------------------------------------------------------------------------- */

/* The CRC of each 4-bit value, so a byte takes two lookups: 64 bytes of table instead of 1 KiB
 * (events are a few dozen bytes; speed does not matter here). */
static const uint32_t crc_nibble[16] = {
    0x00000000, 0x105ec76f, 0x20bd8ede, 0x30e349b1, 0x417b1dbc, 0x5125dad3, 0x61c69362, 0x7198540d,
    0x82f63b78, 0x92a8fc17, 0xa24bb5a6, 0xb21572c9, 0xc38d26c4, 0xd3d3e1ab, 0xe330a81a, 0xf36e6f75,
};

uint32_t tdm_crc32c(const void *data, size_t n) {
    const uint8_t *p = data;
    uint32_t crc = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        crc = (crc >> 4) ^ crc_nibble[crc & 15];
        crc = (crc >> 4) ^ crc_nibble[crc & 15];
    }
    return ~crc;
}

static uint32_t masked_crc(const void *data, size_t n) {
    uint32_t crc = tdm_crc32c(data, n);
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

/* ---- protobuf encoding ----------------------------------------------------------------------- */

enum { WIRE_VARINT = 0, WIRE_FIXED64 = 1, WIRE_LEN = 2, WIRE_FIXED32 = 5 };
enum { EVENT_WALL_TIME = 1, EVENT_STEP = 2, EVENT_FILE_VERSION = 3, EVENT_SUMMARY = 5 };
enum { SUMMARY_VALUE = 1 };
enum { VALUE_TAG = 1, VALUE_SIMPLE_VALUE = 2 };

/* Every field number here is below 16, so every key is one byte. */
#define KEY_BYTES 1

static size_t varint_size(uint64_t v) {
    size_t n = 1;
    for (; v >= 0x80; v >>= 7) n++;
    return n;
}

static uint8_t *put_varint(uint8_t *p, uint64_t v) {
    for (; v >= 0x80; v >>= 7) *p++ = (uint8_t)(v | 0x80);
    *p++ = (uint8_t)v;
    return p;
}

/* The low `bytes` bytes of v, least significant first. */
static uint8_t *put_le(uint8_t *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) *p++ = (uint8_t)(v >> (8 * i));
    return p;
}

static uint8_t *put_key(uint8_t *p, int field, int wire) {
    return put_varint(p, (uint64_t)(field << 3 | wire));
}

/* The key and length of a length-delimited field; its n bytes of payload follow. */
static uint8_t *put_len(uint8_t *p, int field, size_t n) {
    return put_varint(put_key(p, field, WIRE_LEN), n);
}

/* The size of a whole length-delimited field of n payload bytes. */
static size_t len_field_size(size_t n) {
    return KEY_BYTES + varint_size(n) + n;
}

static uint8_t *put_double(uint8_t *p, int field, double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    return put_le(put_key(p, field, WIRE_FIXED64), bits, 8);
}

static uint8_t *put_float(uint8_t *p, int field, float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return put_le(put_key(p, field, WIRE_FIXED32), bits, 4);
}

/* Sizes of one scalar Event, from the innermost message out. */
typedef struct {
    size_t value;   /* Summary.Value {tag, simple_value} */
    size_t summary; /* Summary {value} */
    size_t event;   /* Event {wall_time, step, summary} */
} scalar_sizes;

static scalar_sizes scalar_event_sizes(size_t tag_len, int64_t step) {
    scalar_sizes s;
    s.value = len_field_size(tag_len) + KEY_BYTES + 4;
    s.summary = len_field_size(s.value);
    /* a negative step is its 64-bit two's complement, ten varint bytes, as protobuf's int64;
     * step 0 is left out, as protobuf (proto3) leaves out every field at its default: so the
     * bytes are those that TensorBoard's and PyTorch's writers make */
    size_t step_size = step ? KEY_BYTES + varint_size((uint64_t)step) : 0;
    s.event = KEY_BYTES + 8 + step_size + len_field_size(s.summary);
    return s;
}

static uint8_t *put_scalar_event(uint8_t *p, scalar_sizes s, double wall_time, int64_t step,
                                 const char *tag, size_t tag_len, float value) {
    p = put_double(p, EVENT_WALL_TIME, wall_time);
    if (step) p = put_varint(put_key(p, EVENT_STEP, WIRE_VARINT), (uint64_t)step);
    p = put_len(p, EVENT_SUMMARY, s.summary);
    p = put_len(p, SUMMARY_VALUE, s.value);
    p = put_len(p, VALUE_TAG, tag_len);
    memcpy(p, tag, tag_len);
    return put_float(p + tag_len, VALUE_SIMPLE_VALUE, value);
}

static size_t version_event_size(void) {
    return KEY_BYTES + 8 + len_field_size(strlen(FILE_VERSION));
}

static uint8_t *put_version_event(uint8_t *p, double wall_time) {
    p = put_double(p, EVENT_WALL_TIME, wall_time);
    p = put_len(p, EVENT_FILE_VERSION, strlen(FILE_VERSION));
    memcpy(p, FILE_VERSION, strlen(FILE_VERSION));
    return p + strlen(FILE_VERSION);
}

/* ---- the writer ------------------------------------------------------------------------------ */

#define RECORD_HEAD 12 /* u64 length + u32 its masked CRC */
#define RECORD_TAIL 4  /* u32 the data's masked CRC */

struct tdm_tb_writer {
    FILE *f;
    char *path;
    uint8_t *buf; /* one record: head, event, tail */
    size_t cap;
    int err; /* errno of the first failed write; 0 while none failed */
};

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The first write failure, again: every call after it reports it. */
static int write_error(const tdm_tb_writer *w) {
    return tdm_raise(TDM_ERR_IO, "tensorboard '%s': cannot write: %s", w->path, strerror(w->err));
}

static int write_failed(tdm_tb_writer *w, int err) {
    if (!w->err) w->err = err ? err : EIO; /* a short write that left errno unset */
    return write_error(w);
}

/* Room for a record of an n-byte event in w->buf. */
static int reserve(tdm_tb_writer *w, size_t n) {
    size_t need = RECORD_HEAD + n + RECORD_TAIL;
    if (need <= w->cap) return TDM_OK;
    size_t cap = w->cap ? w->cap : 256;
    while (cap < need) cap *= 2;
    uint8_t *b = realloc(w->buf, cap);
    if (!b)
        return tdm_raise(TDM_ERR_NOMEM, "tensorboard '%s': out of memory for a %zu-byte event",
                         w->path, n);
    w->buf = b;
    w->cap = cap;
    return TDM_OK;
}

/* Frames the n-byte event already encoded at w->buf + RECORD_HEAD and hands the record to
 * stdio (buffered). */
static int write_record(tdm_tb_writer *w, size_t n) {
    uint8_t *head = w->buf, *data = w->buf + RECORD_HEAD;
    put_le(head, n, 8);
    put_le(head + 8, masked_crc(head, 8), 4);
    put_le(data + n, masked_crc(data, n), 4);
    size_t total = RECORD_HEAD + n + RECORD_TAIL;
    errno = 0;
    if (fwrite(w->buf, 1, total, w->f) != total) return write_failed(w, errno);
    return TDM_OK;
}

static void writer_free(tdm_tb_writer *w) {
    free(w->buf);
    free(w->path);
    free(w);
}

/* DIR/events.out.tfevents.<seconds>.<host>.<pid>.<n>, malloc'd. PyTorch's name: TensorBoard
 * reads every file whose name holds "tfevents", and pid and n keep writers from colliding. */
static char *event_file_path(const char *dir) {
    static atomic_int opened;
    char host[256] = "localhost";
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "localhost");
    host[sizeof host - 1] = '\0'; /* gethostname may truncate without a terminator */
    long long secs = (long long)time(NULL);
    int n = atomic_fetch_add(&opened, 1);
    const char *fmt = "%s/events.out.tfevents.%010lld.%s.%ld.%d";
    int len = snprintf(NULL, 0, fmt, dir, secs, host, (long)getpid(), n);
    char *path = malloc((size_t)len + 1);
    if (path) snprintf(path, (size_t)len + 1, fmt, dir, secs, host, (long)getpid(), n);
    return path;
}

/* Writes the file_version event and pushes it to the file, so TensorBoard lists the run at
 * once. */
static int write_version(tdm_tb_writer *w) {
    size_t n = version_event_size();
    int rc = reserve(w, n);
    if (rc) return rc;
    put_version_event(w->buf + RECORD_HEAD, now_seconds());
    rc = write_record(w, n);
    return rc ? rc : tdm_tb_flush(w);
}

tdm_tb_writer *tdm_tb_open(const char *dir) {
    if (!dir || !*dir) return tdm_raise_null(TDM_ERR_ARG, "tensorboard: NULL or empty directory");
    if (tdm_io_mkdir_p(dir, "tensorboard")) return NULL;
    tdm_tb_writer *w = calloc(1, sizeof *w);
    if (!w || !(w->path = event_file_path(dir))) {
        free(w);
        return tdm_raise_null(TDM_ERR_NOMEM, "tensorboard '%s': out of memory", dir);
    }
    w->f = fopen(w->path, "wbxe"); /* x: never append to another writer's file; e: O_CLOEXEC */
    if (!w->f) {
        tdm_raise(TDM_ERR_IO, "tensorboard: cannot create '%s': %s", w->path, strerror(errno));
        writer_free(w);
        return NULL;
    }
    if (write_version(w)) {
        fclose(w->f);
        unlink(w->path); /* a file without its first event is not one TensorBoard can read */
        writer_free(w);
        return NULL;
    }
    return w;
}

/* Protobuf parsers reject a string field that is not UTF-8, and TensorBoard's would stop
 * reading the file there; jansson's string check is the one the library already has. */
static bool is_utf8(const char *s) {
    json_t *j = json_string(s);
    json_decref(j);
    return j != NULL;
}

int tdm_tb_add_scalar(tdm_tb_writer *w, const char *tag, int64_t step, double value,
                      double wall_time) {
    if (!w) return tdm_raise(TDM_ERR_ARG, "tensorboard add_scalar: NULL writer");
    if (!tag || !*tag)
        return tdm_raise(TDM_ERR_ARG, "tensorboard '%s': add_scalar: NULL or empty tag", w->path);
    if (!is_utf8(tag))
        return tdm_raise(TDM_ERR_ARG, "tensorboard '%s': add_scalar: tag '%.200s' is not UTF-8",
                         w->path, tag);
    if (w->err) return write_error(w);
    size_t tag_len = strlen(tag);
    scalar_sizes s = scalar_event_sizes(tag_len, step);
    int rc = reserve(w, s.event);
    if (rc) return rc;
    uint8_t *end = put_scalar_event(w->buf + RECORD_HEAD, s, wall_time ? wall_time : now_seconds(),
                                    step, tag, tag_len, (float)value);
    assert(end == w->buf + RECORD_HEAD + s.event);
    (void)end;
    return write_record(w, s.event);
}

int tdm_tb_flush(tdm_tb_writer *w) {
    if (!w) return tdm_raise(TDM_ERR_ARG, "tensorboard flush: NULL writer");
    if (w->err) return write_error(w);
    errno = 0;
    if (fflush(w->f) != 0) return write_failed(w, errno);
    return TDM_OK;
}

int tdm_tb_close(tdm_tb_writer *w) {
    if (!w) return TDM_OK;
    int rc = tdm_tb_flush(w);
    errno = 0;
    if (fclose(w->f) != 0 && !rc) rc = write_failed(w, errno);
    writer_free(w);
    return rc;
}

const char *tdm_tb_path(const tdm_tb_writer *w) {
    return w ? w->path : NULL;
}
