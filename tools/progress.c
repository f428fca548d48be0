/* Progress display. On a terminal one line is redrawn in place (\r, then erase to the end of
 * the line), throttled to ~10 redraws a second so printing never shows up in the step time;
 * when stdout is a file or a pipe, the trainer prints plain lines so logs stay readable. */
#include "progress.h"

#include "tandem/runtime.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#define REDRAW_SECONDS 0.1
#define BAR_WIDTH      24

double progress_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CLOCK_BOOTTIME: the clock /proc/<pid>/stat's start time is counted on (ticks since boot). */
static double boottime_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The process's start in boot-time seconds from /proc/self/stat's field 22, or NAN. The
 * command name (field 2) may hold spaces and parentheses, so fields are counted from the
 * last ')'. */
static double proc_start_time(void) {
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    long ticks = sysconf(_SC_CLK_TCK);
    if (!p || ticks <= 0) return NAN;
    for (int field = 2; field < 22 && p; field++) p = strchr(p + 1, ' ');
    return p ? strtod(p + 1, NULL) / (double)ticks : NAN;
}

static double process_start; /* boot-time seconds, set before main */

/* Runs when the program is loaded, before main: the fallback start is as early as it gets. */
__attribute__((constructor)) static void mark_process_start(void) {
    double loaded = boottime_now(), started = proc_start_time();
    /* exec to load takes milliseconds: a start in the future or long before means the two
     * clocks disagree (a time namespace), and the load time is the better guess */
    process_start = started <= loaded && started > loaded - 60 ? started : loaded;
}

double progress_wall_s(void) {
    return boottime_now() - process_start;
}

void progress_init(progress *p, FILE *out, bool quiet, const char *unit) {
    *p = (progress){.out = out, .quiet = quiet, .unit = unit};
    p->tty = isatty(fileno(out)) == 1;
}

void progress_epoch_begin(progress *p, int epoch, int epochs, int64_t steps, double now) {
    p->epoch = epoch;
    p->epochs = epochs;
    p->steps = steps;
    p->t_start = now;
    p->t_drawn = -1e30;
}

/* "1:05" or "1:02:05" */
static void format_duration(char *buf, size_t n, double s) {
    if (!(s >= 0) || s > 1e7) {
        snprintf(buf, n, "--:--");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else
        snprintf(buf, n, "%ld:%02ld", t / 60, t % 60);
}

static void draw_bar(progress *p, int64_t step, double loss, double rate, double eta) {
    char bar[BAR_WIDTH + 1], left[32];
    int full = p->steps > 0 ? (int)(BAR_WIDTH * step / p->steps) : BAR_WIDTH;
    for (int i = 0; i < BAR_WIDTH; i++) bar[i] = i < full ? '#' : '.';
    bar[BAR_WIDTH] = '\0';
    format_duration(left, sizeof left, eta);
    /* \033[K erases what a longer previous line left behind */
    fprintf(p->out, "\repoch %d/%d [%s] %lld/%lld  loss %.4f  %.0f %s/s  ETA %s\033[K", p->epoch,
            p->epochs, bar, (long long)step, (long long)p->steps, loss, rate, p->unit, left);
    fflush(p->out);
    p->drawn = true;
}

/* Seconds left in the epoch at the pace so far; -1 before the first step. */
static double eta_of(const progress *p, int64_t step, double now) {
    return step > 0 ? (now - p->t_start) / (double)step * (double)(p->steps - step) : -1;
}

void progress_update(progress *p, int64_t step, double loss, double units, double now) {
    if (p->quiet || !p->tty) return;
    if (now - p->t_drawn < REDRAW_SECONDS && step < p->steps) return;
    double elapsed = now - p->t_start;
    p->t_drawn = now;
    draw_bar(p, step, loss, elapsed > 0 ? units / elapsed : 0, eta_of(p, step, now));
}

void progress_line(progress *p, int64_t step, double loss, double lr, double ms_per_step,
                   double rate, double now) {
    if (p->quiet || p->tty) return;
    char left[32];
    format_duration(left, sizeof left, eta_of(p, step, now));
    fprintf(p->out,
            "epoch %d/%d  step %lld/%lld  loss %.4f  lr %.3g  %.1f ms/step  %.0f %s/s  ETA %s\n",
            p->epoch, p->epochs, (long long)step, (long long)p->steps, loss, lr, ms_per_step, rate,
            p->unit, left);
    fflush(p->out);
}

void progress_clear(progress *p) {
    if (!p->drawn) return;
    fprintf(p->out, "\r\033[K");
    fflush(p->out);
    p->drawn = false;
}

#if defined(__x86_64__)
/* The XSAVE state the OS enables (xgetbv 0); cpuid 1 says OSXSAVE first. */
static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

/* What cpuid says: bit 0 AVX512_BF16 (leaf 7.1 eax bit 5, with the ZMM and opmask state),
 * bit 1 AMX-BF16 (leaf 7.0 edx bit 22, with the tile state). */
static int bf16_cpuid(void) {
    int found = 0;
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;
    uint64_t xcr = xcr0();
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    unsigned max_sub = a;
    if ((d & (1u << 22)) && (xcr & 0x60000) == 0x60000) found |= 2;
    bool avx512 = (b & (1u << 16)) && (xcr & 0xE6) == 0xE6;
    if (avx512 && max_sub >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)))
        found |= 1;
#endif
    return found;
}

bool progress_bf16_native(char *how, size_t cap) {
    int found = bf16_cpuid();
    if (!found) {
        snprintf(how, cap, "no AVX512_BF16 or AMX on this CPU");
        return false;
    }
    /* oneDNN's own cap on the kernels it may pick: below avx512_core_bf16 it emulates */
    const char *isa = getenv("ONEDNN_MAX_CPU_ISA");
    if (!isa) isa = getenv("DNNL_MAX_CPU_ISA");
    if (isa && *isa && strcasecmp(isa, "ALL") && strncasecmp(isa, "AVX512_CORE_BF16", 16) &&
        strncasecmp(isa, "AVX512_CORE_AMX", 15)) {
        snprintf(how, cap, "ONEDNN_MAX_CPU_ISA=%s masks this CPU's bf16 instructions", isa);
        return false;
    }
    snprintf(how, cap, "%s",
             found == 3   ? "AVX512_BF16 and AMX"
             : found == 1 ? "AVX512_BF16"
                          : "AMX");
    return true;
}

void progress_print_compute(FILE *out) {
    char gemm[128];
    fprintf(out, "compute   %s\n", tdm_gemm_describe(gemm, sizeof gemm));
    const char *warn = tdm_gemm_warning();
    if (warn) {
        fflush(out);
        fprintf(stderr, "tandem: warning: %s\n", warn);
    }
}
