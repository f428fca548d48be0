/* A minimal test harness: CHECK records a failure with its location and goes on; each test
 * program ends with check_summary(), which prints "N passed, N failed" and returns the exit
 * status for main. */
#ifndef TDM_CHECK_H
#define TDM_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/tandem.h"

static int check_passed, check_failed;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (cond) {                                                                                \
            check_passed++;                                                                        \
        } else {                                                                                   \
            check_failed++;                                                                        \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)

/* CPU tensors made from test data (copied). */
static inline tdm_tensor *f32(tdm_shape s, const float *v) {
    return tdm_from_data(s, TDM_F32, tdm_cpu(0), v);
}
static inline tdm_tensor *i64(tdm_shape s, const int64_t *v) {
    return tdm_from_data(s, TDM_I64, tdm_cpu(0), v);
}

/* |a - b| <= atol + rtol * |b| */
#define CHECK_CLOSE(a, b, atol, rtol)                                                              \
    do {                                                                                           \
        double ca_ = (a), cb_ = (b);                                                               \
        CHECK(fabs(ca_ - cb_) <= (atol) + (rtol)*fabs(cb_), "%s = %.9g, expected %.9g", #a, ca_,   \
              cb_);                                                                                \
    } while (0)

/* Checks that expr failed (NULL or nonzero status) with a message containing substr. */
#define CHECK_ERROR(failed, substr)                                                                \
    do {                                                                                           \
        bool f_ = (failed);                                                                        \
        CHECK(f_ &&strstr(tdm_last_error(), substr) != NULL,                                       \
              "expected an error containing \"%s\", got \"%s\"", substr, tdm_last_error());        \
        tdm_clear_error();                                                                         \
    } while (0)

/* Element-wise comparison of a tensor with expected host values. Returns mismatches. */
static inline int check_tensor_close(const tdm_tensor *t, const float *expected, double atol,
                                     double rtol, const char *what) {
    int64_t n = tdm_numel(t);
    float *got = (float *)malloc((size_t)n * sizeof(float));
    int bad = 0;
    if (!got || tdm_to_host(t, got, (size_t)n * sizeof(float)) != 0) {
        fprintf(stderr, "FAIL %s: cannot read tensor: %s\n", what, tdm_last_error());
        free(got);
        check_failed++;
        return 1;
    }
    for (int64_t i = 0; i < n; i++) {
        if (!(fabs((double)got[i] - expected[i]) <= atol + rtol * fabs((double)expected[i]))) {
            if (bad < 5)
                fprintf(stderr, "FAIL %s: element %lld = %.9g, expected %.9g\n", what, (long long)i,
                        got[i], expected[i]);
            bad++;
        }
    }
    free(got);
    if (bad)
        check_failed++;
    else
        check_passed++;
    return bad;
}

static inline int check_summary(void) {
    printf("%d passed, %d failed\n", check_passed, check_failed);
    return check_failed ? 1 : 0;
}

#endif
