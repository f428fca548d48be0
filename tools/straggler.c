/* straggler_of (straggler.h). */
#include "straggler.h"

#include <stdlib.h>

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int straggler_of(const double *seconds, const double *wait_s, int n) {
    double *work = malloc(sizeof *work * (size_t)n), most = -1;
    if (!work) return -1;
    int who = -1;
    for (int r = 0; r < n; r++) {
        work[r] = seconds[r] - wait_s[r];
        if (work[r] > most) most = work[r], who = r;
    }
    qsort(work, (size_t)n, sizeof *work, by_value);
    double median = n % 2 ? work[n / 2] : 0.5 * (work[n / 2 - 1] + work[n / 2]);
    free(work);
    return most > STRAGGLER_RATIO * median && most - median > STRAGGLER_S ? who : -1;
}
