/* The process the others wait for (a straggler), from every process's seconds of an epoch and
 * its seconds waiting in collectives. */
#ifndef TANDEM_TOOLS_STRAGGLER_H
#define TANDEM_TOOLS_STRAGGLER_H

/* How much more compute (seconds less waits) than the median a process needs to be named: 20%,
 * and at least STRAGGLER_S seconds, so that noise between equal processes is not named. */
#define STRAGGLER_RATIO 1.2
#define STRAGGLER_S     0.05

/* The process with the most compute when it is over the median's by both margins, else -1;
 * n >= 1 processes, seconds[r] and wait_s[r] each. -1 when out of memory. */
int straggler_of(const double *seconds, const double *wait_s, int n);

#endif
