/*
 * ltp-lab delayer: hold every packet of an NFQUEUE for delay +- jitter, then ACCEPT it.
 *
 * Theory of operation
 *   The kernel has no netem, so one-way delay is emulated in user space. An iptables-legacy
 *   rule (-j NFQUEUE --queue-num Q) hands each packet's metadata to this process. We never
 *   copy the payload (NFQNL_COPY_META) and accept GSO packets as they are (NFQA_CFG_F_GSO),
 *   so the cost per packet is one netlink message in. Each packet id goes into a min-heap
 *   keyed by (release time, arrival number); when its time has come the packet is released
 *   with an ACCEPT verdict. Without jitter packets leave in arrival order, which is also
 *   id order, so all due packets are released with ONE batch verdict (nfq_set_verdict_batch).
 *   With jitter each packet gets its own verdict, and packets may be reordered exactly like
 *   netem with jitter reorders them.
 *   The queue is large (--maxlen, default 100000) and the netlink receive buffer is 64 MiB so
 *   a 1 Gbit/s link (~85 kpkt/s of 1500 B) with 10+ ms delay never overflows it.
 *
 * Usage: ltp-delayer --queue Q --delay-us D [--jitter-us J] [--maxlen M] [--seed S]
 * Prints "ready" on stdout once bound; on SIGTERM/SIGINT prints one stats line on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <linux/netfilter.h>
#include <linux/netlink.h>
#include <libnetfilter_queue/libnetfilter_queue.h>

#ifndef SOL_NETLINK
#define SOL_NETLINK 270
#endif

typedef struct { uint64_t when; uint64_t seq; uint32_t id; } item_t;

static item_t *heap;
static size_t heap_len, heap_cap;
static uint64_t arrivals, released, max_held;
static int64_t delay_ns, jitter_ns;
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static volatile sig_atomic_t stop_flag;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t xorshift(void) {
    uint64_t x = rng_state;
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    return rng_state = x;
}

static int before(const item_t *a, const item_t *b) {
    return a->when < b->when || (a->when == b->when && a->seq < b->seq);
}

static void heap_push(item_t it) {
    if (heap_len == heap_cap) {
        heap_cap = heap_cap ? heap_cap * 2 : 65536;
        heap = realloc(heap, heap_cap * sizeof(item_t));
        if (!heap) { perror("realloc"); exit(1); }
    }
    size_t i = heap_len++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!before(&it, &heap[p])) break;
        heap[i] = heap[p];
        i = p;
    }
    heap[i] = it;
    if (heap_len > max_held) max_held = heap_len;
}

static item_t heap_pop(void) {
    item_t top = heap[0], last = heap[--heap_len];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= heap_len) break;
        if (c + 1 < heap_len && before(&heap[c + 1], &heap[c])) c++;
        if (!before(&heap[c], &last)) break;
        heap[i] = heap[c];
        i = c;
    }
    if (heap_len) heap[i] = last;
    return top;
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa, void *data) {
    (void)qh; (void)msg; (void)data;
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    if (!ph) return 0;
    uint64_t t = now_ns();
    int64_t d = delay_ns;
    if (jitter_ns > 0) d += (int64_t)(xorshift() % (uint64_t)(2 * jitter_ns + 1)) - jitter_ns;
    if (d < 0) d = 0;
    item_t it = { t + (uint64_t)d, arrivals++, ntohl(ph->packet_id) };
    heap_push(it);
    return 0;
}

static void on_signal(int sig) { (void)sig; stop_flag = 1; }

static void usage(void) {
    fprintf(stderr, "usage: ltp-delayer --queue Q --delay-us D [--jitter-us J] [--maxlen M] [--seed S]\n");
    exit(2);
}

int main(int argc, char **argv) {
    long queue = -1, maxlen = 100000;
    double delay_us = -1, jitter_us = 0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) usage();
        if (!strcmp(argv[i], "--queue")) queue = atol(argv[++i]);
        else if (!strcmp(argv[i], "--delay-us")) delay_us = atof(argv[++i]);
        else if (!strcmp(argv[i], "--jitter-us")) jitter_us = atof(argv[++i]);
        else if (!strcmp(argv[i], "--maxlen")) maxlen = atol(argv[++i]);
        else if (!strcmp(argv[i], "--seed")) rng_state = strtoull(argv[++i], NULL, 0) | 1;
        else usage();
    }
    if (queue < 0 || queue > 65535 || delay_us < 0 || jitter_us < 0 || maxlen <= 0) usage();
    delay_ns = (int64_t)(delay_us * 1000.0);
    jitter_ns = (int64_t)(jitter_us * 1000.0);

    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);  /* wake at the release time, not up to 50 us later */

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    struct nfq_handle *h = nfq_open();
    if (!h) { perror("nfq_open (needs CAP_NET_ADMIN and nfnetlink_queue)"); return 1; }
    nfq_unbind_pf(h, AF_INET);            /* legacy kernels only; errors are harmless */
    nfq_bind_pf(h, AF_INET);
    struct nfq_q_handle *qh = nfq_create_queue(h, (uint16_t)queue, &on_packet, NULL);
    if (!qh) { fprintf(stderr, "nfq_create_queue(%ld) failed: is another delayer bound to it?\n", queue); return 1; }
    if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0) { perror("nfq_set_mode"); return 1; }
    if (nfq_set_queue_maxlen(qh, (uint32_t)maxlen) < 0) perror("nfq_set_queue_maxlen");
    nfq_set_queue_flags(qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO);
    nfnl_rcvbufsiz(nfq_nfnlh(h), 64u << 20);
    int fd = nfq_fd(h);
    int one = 1;
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);

    printf("ready\n");
    fflush(stdout);

    static char buf[65536] __attribute__((aligned));
    while (!stop_flag) {
        /* 1. release every packet whose time has come */
        uint64_t t = now_ns();
        if (heap_len && heap[0].when <= t) {
            if (jitter_ns == 0) {
                uint32_t last = 0;
                while (heap_len && heap[0].when <= t) { last = heap_pop().id; released++; }
                nfq_set_verdict_batch(qh, last, NF_ACCEPT);
            } else {
                while (heap_len && heap[0].when <= t) {
                    nfq_set_verdict(qh, heap_pop().id, NF_ACCEPT, 0, NULL);
                    released++;
                }
            }
        }
        /* 2. wait for a packet or for the next release time */
        struct timespec to, *top = NULL;
        if (heap_len) {
            uint64_t w = heap[0].when > t ? heap[0].when - t : 0;
            to.tv_sec = (time_t)(w / 1000000000ull);
            to.tv_nsec = (long)(w % 1000000000ull);
            top = &to;
        }
        struct pollfd pfd = { fd, POLLIN, 0 };
        int r = ppoll(&pfd, 1, top, NULL);
        if (r < 0) { if (errno == EINTR) continue; perror("ppoll"); break; }
        if (r == 0) continue;
        /* 3. drain the socket; bounded so due packets are not starved at very high rates */
        for (int n = 0; n < 4096; n++) {
            ssize_t len = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
            if (len < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
                if (errno == ENOBUFS) continue;
                perror("recv");
                stop_flag = 1;
                break;
            }
            nfq_handle_packet(h, buf, (int)len);
        }
    }
    fprintf(stderr, "ltp-delayer: queue=%ld arrivals=%llu released=%llu max_held=%llu\n", queue,
            (unsigned long long)arrivals, (unsigned long long)released, (unsigned long long)max_held);
    nfq_destroy_queue(qh);
    nfq_close(h);
    return 0;
}
