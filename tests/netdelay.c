/* A network switch in user space that delays and drops frames: latency and loss for the
 * multi-host test (tests/multihost.sh) on kernels without netem, tc or iptables.
 *
 *   netdelay [--delay MS] [--loss PERCENT] [--seed N] IFACE IFACE...
 *
 * Each IFACE is one end of a veth pair whose other end is a host's interface. Every frame a
 * host sends is read here (an AF_PACKET socket on its port), held for MS milliseconds, and
 * sent out of the port that leads to its destination MAC (learned from source addresses), or
 * out of every other port while that is unknown; PERCENT of frames are dropped instead. The
 * delay is one-way, so a round trip between two hosts takes 2 MS. Frames keep their order.
 *
 * Frames cross with their virtio-net header (PACKET_VNET_HDR): a host's TCP hands the veth
 * segments of up to 64 KiB with checksums left to the hardware, and the header carries both
 * facts to the other host, which would otherwise get an over-long frame or a bad checksum.
 * A dropped frame is thus up to 44 such segments at once, as a lost GRO batch would be.
 * Runs until SIGTERM or SIGINT; exits 1 naming the interface it cannot open. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef PACKET_IGNORE_OUTGOING
#define PACKET_IGNORE_OUTGOING 23
#endif

#define MAX_PORTS 16
#define MAX_FRAME (10 + 65536 + 64) /* virtio-net header + the largest GSO frame */
#define MAX_MACS  64

typedef struct frame {
    struct frame *next;
    int64_t due_ns;
    int from, to; /* to: a port, or -1 for every port but `from` */
    size_t len;
    unsigned char data[];
} frame;

static int ports[MAX_PORTS], nports;
static int64_t delay_ns;
static double loss;
static frame *head, *tail;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ready = PTHREAD_COND_INITIALIZER;
static unsigned char macs[MAX_MACS][6];
static int mac_port[MAX_MACS], nmacs;
static unsigned seed = 1;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* An AF_PACKET socket on interface `name` that sees every frame arriving there. -1 if not. */
static int port_open(const char *name) {
    int fd = socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)), on = 1;
    unsigned idx = if_nametoindex(name);
    if (fd < 0 || !idx) {
        fprintf(stderr, "netdelay: %s: %s\n", name, fd < 0 ? strerror(errno) : "no such interface");
        if (fd >= 0) close(fd);
        return -1;
    }
    struct sockaddr_ll a = {.sll_family = AF_PACKET, .sll_protocol = htons(ETH_P_ALL)};
    a.sll_ifindex = (int)idx;
    struct packet_mreq m = {.mr_ifindex = (int)idx, .mr_type = PACKET_MR_PROMISC};
    if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &on, sizeof on) ||
        setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &on, sizeof on) ||
        setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &m, sizeof m) ||
        bind(fd, (struct sockaddr *)&a, sizeof a)) {
        fprintf(stderr, "netdelay: %s: %s\n", name, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

/* The port that leads to `mac` (learning `src` arrived on `port`); -1 if not known yet. */
static int route(const unsigned char *dst, const unsigned char *src, int port) {
    int to = -1, known = 0;
    for (int i = 0; i < nmacs; i++) {
        if (!memcmp(macs[i], src, 6)) mac_port[i] = port, known = 1;
        if (!memcmp(macs[i], dst, 6)) to = mac_port[i];
    }
    if (!known && nmacs < MAX_MACS && !(src[0] & 1)) {
        memcpy(macs[nmacs], src, 6);
        mac_port[nmacs++] = port;
    }
    return dst[0] & 1 ? -1 : to; /* broadcast and multicast go everywhere */
}

/* Reads port `p`'s frames into the queue, due `delay_ns` from now. */
static void *port_read(void *arg) {
    int p = (int)(intptr_t)arg;
    unsigned char buf[MAX_FRAME];
    for (;;) {
        ssize_t n = recv(ports[p], buf, sizeof buf, 0);
        if (n < 10 + 14) continue; /* an error or a runt: nothing to forward */
        pthread_mutex_lock(&lock);
        if (loss > 0 && rand_r(&seed) < loss * ((double)RAND_MAX + 1)) {
            pthread_mutex_unlock(&lock);
            continue;
        }
        frame *f = malloc(sizeof *f + (size_t)n);
        if (!f) abort();
        *f = (frame){.due_ns = now_ns() + delay_ns, .from = p, .len = (size_t)n};
        memcpy(f->data, buf, (size_t)n);
        f->to = route(buf + 10, buf + 16, p);
        if (tail)
            tail->next = f;
        else
            head = f;
        tail = f;
        pthread_cond_signal(&ready);
        pthread_mutex_unlock(&lock);
    }
    return NULL;
}

/* Sends each queued frame when it is due, in the order the frames arrived. */
static void *send_due(void *arg) {
    (void)arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!head) pthread_cond_wait(&ready, &lock);
        int64_t wait = head->due_ns - now_ns();
        if (wait > 0) {
            pthread_mutex_unlock(&lock);
            struct timespec t = {wait / 1000000000, wait % 1000000000};
            nanosleep(&t, NULL);
            pthread_mutex_lock(&lock);
            continue;
        }
        frame *f = head;
        head = f->next;
        if (!head) tail = NULL;
        pthread_mutex_unlock(&lock);
        for (int q = 0; q < nports; q++)
            if (q == f->to || (f->to < 0 && q != f->from)) send(ports[q], f->data, f->len, 0);
        free(f);
        pthread_mutex_lock(&lock);
    }
    return NULL;
}

static void usage(void) {
    fprintf(stderr, "usage: netdelay [--delay MS] [--loss PERCENT] [--seed N] IFACE IFACE...\n");
    exit(2);
}

int main(int argc, char **argv) {
    int i = 1;
    for (; i < argc && !strncmp(argv[i], "--", 2); i += 2) {
        char *end;
        if (i + 1 >= argc) usage();
        double v = strtod(argv[i + 1], &end);
        if (*end || v < 0) {
            fprintf(stderr, "netdelay: %s %s: not a non-negative number\n", argv[i], argv[i + 1]);
            return 2;
        }
        if (!strcmp(argv[i], "--delay"))
            delay_ns = (int64_t)(v * 1e6);
        else if (!strcmp(argv[i], "--loss") && v <= 100)
            loss = v / 100;
        else if (!strcmp(argv[i], "--seed"))
            seed = (unsigned)v;
        else
            usage();
    }
    if (argc - i < 2 || argc - i > MAX_PORTS) usage();
    for (; i < argc; i++)
        if ((ports[nports++] = port_open(argv[i])) < 0) return 1;
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGTERM);
    sigaddset(&s, SIGINT);
    pthread_sigmask(SIG_BLOCK, &s, NULL); /* the threads inherit it; main waits for one */
    pthread_t t;
    for (int p = 0; p < nports; p++)
        if (pthread_create(&t, NULL, port_read, (void *)(intptr_t)p)) return 1;
    if (pthread_create(&t, NULL, send_due, NULL)) return 1;
    int sig;
    sigwait(&s, &sig);
    return 0;
}
