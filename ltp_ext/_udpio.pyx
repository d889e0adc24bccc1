# cython: language_level=3
"""Batched, non-blocking UDP socket I/O with the GIL released (compiled).

Twin: ``ltp_ext._udpio_py`` (same API, same exceptions, same stats keys).

Theory of operation
-------------------
Receive.  One ``recvmmsg(2)`` fills up to ``batch`` preallocated *slots* of
one contiguous buffer.  A slot is ``max_datagram`` bytes, or 65536 bytes when
UDP GRO is on, because the kernel may then hand one slot a coalesced run of
up to 64 (locally: 128) equal-sized datagrams from one source, with a
``SOL_UDP/UDP_GRO`` control message carrying the segment size.  After the
syscall a C loop (still without Python objects) cuts every slot into its
datagrams and writes their offsets and lengths into two preallocated int64
arrays, so callers always see individual datagrams.  Each datagram remembers
its slot; the slot's raw ``sockaddr`` is only turned into a Python tuple when
``addr(i)`` or ``runs()`` asks, through a small cache.

Send.  ``send``/``send_many`` first validate everything (addresses are
encoded to ``sockaddr`` once and cached, buffers are acquired), then walk a
cursor ``(item, byte offset)`` over the items and fill up to ``max(batch, 64)``
``mmsghdr`` entries per ``sendmmsg(2)``.  With GSO each entry is a
super-datagram of at most 64 segments / 65000 bytes carrying a
``UDP_SEGMENT`` control message; without GSO each entry is one datagram.
When the kernel takes only ``k`` entries, the cursor moves to entry ``k`` and
the error of that entry decides:

* ``EAGAIN``/``ENOBUFS``: stop, return what was accepted;
* an ICMP-reported error (``ECONNREFUSED``, ``EHOSTUNREACH``, ``ENETUNREACH``,
  ``EHOSTDOWN``): counted; the pending socket error is consumed by the failed
  call, so the entry is retried once, and dropped (counted as accepted, as a
  loss would be) if it fails again;
* ``EINVAL``/``EIO`` on a GSO entry (no checksum offload, ``SO_NO_CHECK``,
  segment larger than the route MTU): counted, the rest of the call is sent
  without GSO; ``EIO`` also turns GSO off for good (``gso_enabled = False``);
* anything else: raised as ``OSError`` if nothing was accepted yet in this
  call, otherwise counted and the accepted amount returned (the next call
  meets the error again and raises).

Staged sends (``stage_sends=True``, the default).  A gather message of
``send_segments`` is two iovecs per packet: the 16-byte header, then the
segment straight from the caller's message.  The kernel's copy into the socket
buffer walks them one by one, paying the user-copy entry cost for each, and on
the lab's path that made the sending process's copy cost about 1.8 times kernel
TCP's per byte (docs/performance.md, session 55).  So just before each
``sendmmsg`` (in the caller and in the sender threads) as many whole messages as
fit in ``LTP_STAGE_BYTES`` (256 kB, well inside a core's cache) are copied into a
stage, packet after packet, and the kernel gets one iovec per message.  The
bytes on the wire are the same; a message the stage cannot hold goes out as it
was built, and so do the per-packet fallbacks.

The GIL is released around every ``recvmmsg``/``sendmmsg``; nothing in the
per-datagram loops touches Python objects.

Sender threads (``send_threads`` > 0, started by the first ``send_segments``).
Each is a C thread that never takes the GIL and owns a ring of
``SEND_QUEUE_DEPTH`` jobs.  ``send_segments`` builds the call's GSO messages
into a free job of the thread serving the destination (assigned at first use
to the thread serving the fewest destinations, so one destination's packets
keep their order), copies the 16-byte headers into it, keeps the payload's
buffer exported, and queues it; it returns at once with every packet
accepted, and waits (GIL released) only while that thread holds a full ring.
A batch sent in *parts* (``send_segments(parts=k)``) is cut into ``k``
contiguous parts, one per thread, starting with the destination's own: one
flow's kernel work then runs on several cores, and its parts may interleave.
The thread sends on its own ``dup`` of the socket, so the caller closing the
socket cannot hand the descriptor to someone else mid-batch; it waits in
``poll`` when the socket is full, retries an ICMP-reported error once and then
drops that message, sends a GSO message the kernel refuses packet by packet,
and drops a message on any other error, counting every errno.  The caller's
thread *reaps* finished jobs (``reap``, ``stats``, its next ``send_segments``):
their counts join ``stats`` and their payload buffers are released.  On the
lab's veth path the sending syscall also runs the receiving host's softirq,
so a second core takes most of the per-packet kernel work off the event loop's.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBuffer_IsContiguous, PyBUF_STRIDES, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.errno cimport errno, EAGAIN, EINTR, ENOBUFS, EINVAL, EIO
from libc.stdint cimport int64_t, uint8_t, uint16_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memset, memcpy, memcmp

from ._datapath cimport RecvWindow
from posix.unistd cimport getpid

import errno as _errno
import operator as _operator
import os as _os
import socket as _socket
import struct as _struct

import numpy as np

from .constants import SEND_PACE_CREDIT_S, SEND_QUEUE_DEPTH, SEND_THREADS_MAX

# the queue depth as a C int (named in ltp_ext/constants.py)
cdef int _QDEPTH = SEND_QUEUE_DEPTH

cdef extern from *:
    """
    #include <sys/types.h>
    #include <sys/socket.h>
    #include <sys/uio.h>
    #include <netinet/in.h>
    #include <arpa/inet.h>
    #include <errno.h>
    #include <string.h>
    #ifndef SOL_UDP
    #define SOL_UDP 17
    #endif
    #ifndef UDP_SEGMENT
    #define UDP_SEGMENT 103
    #endif
    #ifndef UDP_GRO
    #define UDP_GRO 104
    #endif
    #define LTP_CMSG_SIZE 64    /* send: >= CMSG_SPACE(sizeof(uint16_t)) */
    #define LTP_RCMSG_SIZE 256  /* receive: the UDP_GRO cmsg plus room for timestamps, pktinfo... */

    /* Segment size from a UDP_GRO control message, 0 when absent. */
    static int ltp_gro_size(struct msghdr *m) {
        struct cmsghdr *c;
        int v = 0;
        if (m->msg_controllen == 0) return 0;
        for (c = CMSG_FIRSTHDR(m); c != NULL; c = CMSG_NXTHDR(m, c)) {
            if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
                memcpy(&v, CMSG_DATA(c), sizeof(int));
                return v;
            }
        }
        return 0;
    }

    /* Kernel receive time (SO_TIMESTAMPNS, CLOCK_REALTIME seconds), -1.0 when absent. */
    static double ltp_rx_time(struct msghdr *m) {
        struct cmsghdr *c;
        struct timespec ts;
        if (m->msg_controllen == 0) return -1.0;
        for (c = CMSG_FIRSTHDR(m); c != NULL; c = CMSG_NXTHDR(m, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_TIMESTAMPNS) {
                memcpy(&ts, CMSG_DATA(c), sizeof(ts));
                return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
            }
        }
        return -1.0;
    }

    /* The socket's cumulative drop count (SO_RXQ_OVFL, a uint32), -1 when the message carries none. */
    static long long ltp_rx_drops(struct msghdr *m) {
        struct cmsghdr *c;
        uint32_t v;
        if (m->msg_controllen == 0) return -1;
        for (c = CMSG_FIRSTHDR(m); c != NULL; c = CMSG_NXTHDR(m, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == 40 /* SO_RXQ_OVFL */) {
                memcpy(&v, CMSG_DATA(c), sizeof(v));
                return (long long)v;
            }
        }
        return -1;
    }

    /* Attach a UDP_SEGMENT control message (cbuf must hold LTP_CMSG_SIZE bytes). */
    static void ltp_set_gso(struct msghdr *m, char *cbuf, uint16_t seg) {
        struct cmsghdr *c;
        memset(cbuf, 0, CMSG_SPACE(sizeof(uint16_t)));
        m->msg_control = cbuf;
        m->msg_controllen = CMSG_SPACE(sizeof(uint16_t));
        c = CMSG_FIRSTHDR(m);
        c->cmsg_level = SOL_UDP;
        c->cmsg_type = UDP_SEGMENT;
        c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        memcpy(CMSG_DATA(c), &seg, sizeof(uint16_t));
    }

    /* Staged sends.  A gather message is two iovecs per packet (its 16-byte header, then its segment of
       the caller's message), and the kernel's copy into the socket buffer walks them one by one: per
       packet a short copy and a long one, each paying the user-copy entry cost.  Measured (session 55),
       that walk made a sender's copy into the kernel ~1.8x kernel TCP's per byte.  So just before each
       sendmmsg the messages are copied, packet after packet, into one stage buffer small enough to stay in
       the core's cache (LTP_STAGE_BYTES), and the kernel is handed one iovec per message.  The bytes on the
       wire are the same; a message larger than the stage goes out as it was built. */
    #define LTP_STAGE_BYTES (256 * 1024)
    #define LTP_STAGE_MSGS 64
    typedef struct {
        char *buf;                                   /* LTP_STAGE_BYTES, or NULL: staging off */
        struct mmsghdr msgs[LTP_STAGE_MSGS];
        struct iovec iov[LTP_STAGE_MSGS];
    } ltp_stage;

    static int ltp_stage_init(ltp_stage *st, int on) {
        memset(st, 0, sizeof(*st));
        if (!on) return 0;
        st->buf = (char *)malloc(LTP_STAGE_BYTES);
        return st->buf == NULL ? ENOMEM : 0;
    }

    static void ltp_stage_free(ltp_stage *st) {
        free(st->buf);
        st->buf = NULL;
    }

    /* A message's bytes: the sum of its iovecs. */
    static long long ltp_msg_bytes(const struct msghdr *h) {
        long long b = 0;
        size_t i;
        for (i = 0; i < h->msg_iovlen; i++) b += (long long)h->msg_iov[i].iov_len;
        return b;
    }

    /* Copy msgs[0..nm) into the stage, each message's iovecs back to back as one iovec of st->msgs (name
       and control kept); returns how many fit: 0 when staging is off or the first alone does not fit. */
    static int ltp_stage_msgs(ltp_stage *st, const struct mmsghdr *msgs, int nm) {
        size_t used = 0, len, t;
        int i;
        char *dst;
        if (st->buf == NULL) return 0;
        for (i = 0; i < nm && i < LTP_STAGE_MSGS; i++) {
            const struct msghdr *h = &msgs[i].msg_hdr;
            len = (size_t)ltp_msg_bytes(h);
            if (used + len > LTP_STAGE_BYTES) break;
            dst = st->buf + used;
            for (t = 0; t < h->msg_iovlen; t++) {
                memcpy(dst, h->msg_iov[t].iov_base, h->msg_iov[t].iov_len);
                dst += h->msg_iov[t].iov_len;
            }
            st->msgs[i].msg_hdr = *h;
            st->iov[i].iov_base = st->buf + used;
            st->iov[i].iov_len = len;
            st->msgs[i].msg_hdr.msg_iov = &st->iov[i];
            st->msgs[i].msg_hdr.msg_iovlen = 1;
            st->msgs[i].msg_len = 0;
            used += len;
        }
        return i;
    }

    /* sockaddr -> numeric host text (as Python's socket module formats it), port, flowinfo, scope. */
    static int ltp_decode_addr(const struct sockaddr_storage *ss, char *host, size_t hostlen,
                               unsigned int *port, unsigned int *flowinfo, unsigned int *scope) {
        if (ss->ss_family == AF_INET) {
            const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
            if (inet_ntop(AF_INET, &a->sin_addr, host, hostlen) == NULL) return -1;
            *port = ntohs(a->sin_port); *flowinfo = 0; *scope = 0;
            return AF_INET;
        }
        if (ss->ss_family == AF_INET6) {
            const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
            if (inet_ntop(AF_INET6, &a->sin6_addr, host, hostlen) == NULL) return -1;
            *port = ntohs(a->sin6_port); *flowinfo = ntohl(a->sin6_flowinfo); *scope = a->sin6_scope_id;
            return AF_INET6;
        }
        return -1;
    }

    /* Whether two sockaddrs name the same host and port (flowinfo and scope id are not compared). */
    static int ltp_same_host_port(const struct sockaddr_storage *a, socklen_t la,
                                  const struct sockaddr_storage *b, socklen_t lb) {
        if (a->ss_family != b->ss_family) return 0;
        if (a->ss_family == AF_INET) {
            const struct sockaddr_in *x = (const struct sockaddr_in *)a, *y = (const struct sockaddr_in *)b;
            return la >= sizeof(*x) && lb >= sizeof(*y) && x->sin_port == y->sin_port
                   && x->sin_addr.s_addr == y->sin_addr.s_addr;
        }
        if (a->ss_family == AF_INET6) {
            const struct sockaddr_in6 *x = (const struct sockaddr_in6 *)a, *y = (const struct sockaddr_in6 *)b;
            return la >= sizeof(*x) && lb >= sizeof(*y) && x->sin6_port == y->sin6_port
                   && memcmp(&x->sin6_addr, &y->sin6_addr, sizeof(x->sin6_addr)) == 0;
        }
        return 0;
    }

    /* Numeric host text + port (+ flowinfo, scope) -> sockaddr; returns its length or 0. */
    static int ltp_encode_addr(int family, const char *host, unsigned int port, unsigned int flowinfo,
                               unsigned int scope, struct sockaddr_storage *ss) {
        memset(ss, 0, sizeof(*ss));
        if (family == AF_INET) {
            struct sockaddr_in *a = (struct sockaddr_in *)ss;
            if (inet_pton(AF_INET, host, &a->sin_addr) != 1) return 0;
            a->sin_family = AF_INET; a->sin_port = htons((uint16_t)port);
            return (int)sizeof(*a);
        }
        if (family == AF_INET6) {
            struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
            if (inet_pton(AF_INET6, host, &a->sin6_addr) != 1) return 0;
            a->sin6_family = AF_INET6; a->sin6_port = htons((uint16_t)port);
            a->sin6_flowinfo = htonl(flowinfo); a->sin6_scope_id = scope;
            return (int)sizeof(*a);
        }
        return 0;
    }
    """
    int SOL_UDP
    int UDP_SEGMENT
    int UDP_GRO
    int LTP_CMSG_SIZE
    int LTP_RCMSG_SIZE
    int MSG_CTRUNC
    int AF_INET
    int AF_INET6
    int MSG_DONTWAIT
    int MSG_TRUNC
    int ENETUNREACH
    int EHOSTUNREACH
    int ECONNREFUSED
    int EHOSTDOWN
    int EWOULDBLOCK
    ctypedef unsigned int socklen_t
    struct sockaddr:
        pass
    struct sockaddr_storage:
        unsigned short ss_family
    struct iovec:
        void *iov_base
        size_t iov_len
    struct msghdr:
        void *msg_name
        socklen_t msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    struct mmsghdr:
        msghdr msg_hdr
        unsigned int msg_len
    struct timespec:
        pass
    int recvmmsg(int fd, mmsghdr *msgs, unsigned int vlen, int flags, timespec *timeout) nogil
    int sendmmsg(int fd, mmsghdr *msgs, unsigned int vlen, int flags) nogil
    int ltp_gro_size(msghdr *m) nogil
    double ltp_rx_time(msghdr *m) nogil
    long long ltp_rx_drops(msghdr *m) nogil
    void ltp_set_gso(msghdr *m, char *cbuf, uint16_t seg) nogil
    int ltp_decode_addr(const sockaddr_storage *ss, char *host, size_t hostlen,
                        unsigned int *port, unsigned int *flowinfo, unsigned int *scope) nogil
    int ltp_encode_addr(int family, const char *host, unsigned int port, unsigned int flowinfo,
                        unsigned int scope, sockaddr_storage *ss) nogil
    int ltp_same_host_port(const sockaddr_storage *a, socklen_t la, const sockaddr_storage *b,
                           socklen_t lb) nogil
    ctypedef struct ltp_stage:
        mmsghdr *msgs
    int LTP_STAGE_BYTES
    int ltp_stage_init(ltp_stage *st, int on) nogil
    void ltp_stage_free(ltp_stage *st) nogil
    int ltp_stage_msgs(ltp_stage *st, const mmsghdr *msgs, int nm) nogil

# ---------------------------------------------------------------------------- send threads
# A sender thread owns a ring of jobs; a job is one send_segments() call built into its own
# mmsghdr/iovec/header arrays (the caller's headers are copied, the payload is referenced and
# the caller's Python buffer is held until the job is reaped).  The thread runs entirely in C,
# never takes the GIL and blocks (poll) when the socket buffer is full, so every packet handed
# to it goes out unless the kernel refuses it (counted per errno, dropped like a loss).
cdef extern from *:
    """
    #include <pthread.h>
    #include <poll.h>
    #include <signal.h>
    #include <stdlib.h>
    #include <unistd.h>
    #include <time.h>
    #include <sys/prctl.h>

    #define LTP_TX_ERRS 4            /* distinct errnos a job records */
    #define LTP_TX_FULL_WAIT_MS 20   /* a full socket: wait this long for room, then try again */
    #define LTP_TX_SLEEP_SLICE 0.01  /* a paced thread sleeps at most this long (s) between looks at `stop` */

    typedef struct {
        struct mmsghdr *msgs;    /* one per GSO super-datagram (or packet without GSO) */
        struct iovec *iov;       /* two per packet: header, payload segment */
        char *hdrs;              /* the packets' 16-byte headers, copied */
        char *cmsg;              /* LTP_CMSG_SIZE per message */
        int *nseg;               /* packets per message */
        int cap_msgs, cap_pkts;
        int nm;
        double rate;             /* paced: bytes per second (datagram bytes); 0: as fast as the socket takes them */
        long long quantum;       /* paced: the most bytes one sub-burst sends back to back */
        double credit;           /* paced: how far (s) a thread behind its timeline may catch up */
        struct sockaddr_storage name;
        /* results, written by the thread, read by the owner after the job is done */
        long long dgrams, syscalls, eagain;
        long long paced_sleeps;  /* sub-bursts that waited for the timeline */
        double paced_late;       /* seconds of lateness beyond `credit` forgiven (the rate lost for good) */
        int err_code[LTP_TX_ERRS];
        long long err_count[LTP_TX_ERRS];
        int gso_failed;          /* 1: EINVAL on a GSO message; 2: EIO (GSO unusable) */
    } ltp_tx_job;

    typedef struct {
        pthread_t thread;
        pthread_mutex_t mu;
        pthread_cond_t cv_work, cv_done;
        int fd;                  /* a dup of the socket: closing the caller's socket cannot pull it away */
        int depth;
        ltp_tx_job *jobs;
        long long head;          /* jobs submitted (owner, under mu) */
        long long done;          /* jobs finished (thread, under mu) */
        int stop;                /* 1: finish the queued jobs and exit; 2: drop what a full socket holds up */
        int running;
        double pace_next;        /* thread only: CLOCK_MONOTONIC time the next paced sub-burst may leave */
        ltp_stage stage;         /* thread only: staged sends (ltp_stage_msgs) */
    } ltp_tx_worker;

    static double ltp_tx_clock(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    }

    /* Sleep until CLOCK_MONOTONIC time t, in slices that look at `stop` (a closing owner stops pacing). */
    static void ltp_tx_sleep_until(ltp_tx_worker *w, double t) {
        struct timespec ts;
        double now = ltp_tx_clock(), until;
        while (now < t && !__atomic_load_n(&w->stop, __ATOMIC_RELAXED)) {
            until = t < now + LTP_TX_SLEEP_SLICE ? t : now + LTP_TX_SLEEP_SLICE;
            ts.tv_sec = (time_t)until;
            ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
            clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);   /* EINTR: look again */
            now = ltp_tx_clock();
        }
    }

    static int ltp_tx_is_icmp(int e) {
        return e == ECONNREFUSED || e == EHOSTUNREACH || e == ENETUNREACH || e == EHOSTDOWN;
    }

    static void ltp_tx_count(ltp_tx_job *j, int e) {
        int i;
        for (i = 0; i < LTP_TX_ERRS; i++) {
            if (j->err_count[i] == 0) j->err_code[i] = e;
            if (j->err_code[i] == e) { j->err_count[i]++; return; }
        }
        j->err_count[LTP_TX_ERRS - 1]++;   /* more distinct errnos than slots: lumped with the last */
    }

    /* The socket is full: wait for room.  Returns 0 to try again, -1 when the owner is dropping. */
    static int ltp_tx_wait_room(ltp_tx_worker *w, ltp_tx_job *j, int e) {
        struct pollfd p;
        j->eagain++;
        if (e == ENOBUFS) ltp_tx_count(j, e);
        if (__atomic_load_n(&w->stop, __ATOMIC_RELAXED) == 2) return -1;
        if (e == ENOBUFS) { usleep(100); return 0; }  /* the device queue, not the socket: poll says writable */
        p.fd = w->fd; p.events = POLLOUT; p.revents = 0;
        poll(&p, 1, LTP_TX_FULL_WAIT_MS);
        return 0;
    }

    /* Message k without GSO: its packets one by one (a kernel that refused the super-datagram). */
    static void ltp_tx_singles(ltp_tx_worker *w, ltp_tx_job *j, int k) {
        struct msghdr h;
        int p = 0, r, e;
        struct iovec *iov = j->msgs[k].msg_hdr.msg_iov;
        while (p < j->nseg[k]) {
            memset(&h, 0, sizeof(h));
            h.msg_name = j->msgs[k].msg_hdr.msg_name;
            h.msg_namelen = j->msgs[k].msg_hdr.msg_namelen;
            h.msg_iov = iov + 2 * p;
            h.msg_iovlen = 2;
            r = (int)sendmsg(w->fd, &h, 0);
            j->syscalls++;
            if (r >= 0) { j->dgrams++; p++; continue; }
            e = errno;
            if (e == EINTR) continue;
            if (e == EAGAIN || e == EWOULDBLOCK || e == ENOBUFS) {
                if (ltp_tx_wait_room(w, j, e) < 0) return;
                continue;
            }
            ltp_tx_count(j, e);
            p++;   /* refused: this packet is lost */
        }
    }

    /* A paced job leaves in sub-bursts of at most `quantum` bytes (at least one message), the worker's
       timeline advancing by each message's bytes / rate.  A thread that runs behind its timeline sends at
       once, back to back, until it has caught up by at most `credit` seconds (SEND_PACE_CREDIT_S): a thread
       descheduled for longer than a sub-burst's gap would otherwise lose that rate for good. */
    static void ltp_tx_run(ltp_tx_worker *w, ltp_tx_job *j) {
        int k = 0, retry_at = -1, r, i, e, lim, ns;
        long long burst;
        double now;
        while (k < j->nm) {
            lim = j->nm;
            if (j->rate > 0 && !__atomic_load_n(&w->stop, __ATOMIC_RELAXED)) {
                now = ltp_tx_clock();
                if (w->pace_next > now) {
                    ltp_tx_sleep_until(w, w->pace_next);
                    j->paced_sleeps++;
                } else if (w->pace_next < now - j->credit) {
                    /* later than that: forgiven (SEND_PACE_CREDIT_S), unless the thread merely sat idle */
                    if (k > 0) j->paced_late += now - j->credit - w->pace_next;
                    w->pace_next = now - j->credit;
                }
                burst = ltp_msg_bytes(&j->msgs[k].msg_hdr);
                for (lim = k + 1; lim < j->nm; lim++) {
                    long long b = ltp_msg_bytes(&j->msgs[lim].msg_hdr);
                    if (burst + b > j->quantum) break;
                    burst += b;
                }
            }
            ns = ltp_stage_msgs(&w->stage, j->msgs + k, lim - k);
            if (ns > 0) r = sendmmsg(w->fd, w->stage.msgs, (unsigned int)ns, 0);
            else r = sendmmsg(w->fd, j->msgs + k, (unsigned int)(lim - k), 0);
            j->syscalls++;
            if (r > 0) {
                for (i = 0; i < r; i++) {
                    j->dgrams += j->nseg[k + i];
                    if (j->rate > 0) w->pace_next += (double)ltp_msg_bytes(&j->msgs[k + i].msg_hdr) / j->rate;
                }
                k += r;
                continue;
            }
            e = errno;
            if (e == EINTR) continue;
            if (e == EAGAIN || e == EWOULDBLOCK || e == ENOBUFS) {
                if (ltp_tx_wait_room(w, j, e) < 0) return;
                continue;
            }
            ltp_tx_count(j, e);
            if (ltp_tx_is_icmp(e)) {
                /* the failed call consumed the pending ICMP report: retry once, then drop like a loss */
                if (retry_at == k) { k++; retry_at = -1; } else retry_at = k;
                continue;
            }
            if (j->nseg[k] > 1 && (e == EINVAL || e == EIO)) {
                if (e == EIO) j->gso_failed = 2; else if (!j->gso_failed) j->gso_failed = 1;
                ltp_tx_singles(w, j, k);
                k++;
                continue;
            }
            k++;   /* anything else (EMSGSIZE, EPERM...): this message is lost */
        }
    }

    static void *ltp_tx_main(void *arg) {
        ltp_tx_worker *w = (ltp_tx_worker *)arg;
        ltp_tx_job *j;
        sigset_t all;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, NULL);   /* signals belong to the interpreter's thread */
        prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);   /* a paced sleep ends when asked, not 50 us later */
        pthread_mutex_lock(&w->mu);
        for (;;) {
            while (w->done == w->head && !w->stop) pthread_cond_wait(&w->cv_work, &w->mu);
            if (w->done == w->head) break;
            j = &w->jobs[w->done % w->depth];
            pthread_mutex_unlock(&w->mu);
            ltp_tx_run(w, j);
            pthread_mutex_lock(&w->mu);
            w->done++;
            pthread_cond_broadcast(&w->cv_done);
        }
        pthread_mutex_unlock(&w->mu);
        return NULL;
    }

    static void ltp_tx_free_jobs(ltp_tx_worker *w) {
        int i;
        ltp_stage_free(&w->stage);
        if (w->jobs == NULL) return;
        for (i = 0; i < w->depth; i++) {
            free(w->jobs[i].msgs); free(w->jobs[i].iov); free(w->jobs[i].hdrs);
            free(w->jobs[i].cmsg); free(w->jobs[i].nseg);
        }
        free(w->jobs);
        w->jobs = NULL;
    }

    /* 0 on success, else an errno (nothing left allocated or running). */
    static int ltp_tx_start(ltp_tx_worker *w, int fd, int depth, int stage) {
        int e;
        memset(w, 0, sizeof(*w));
        w->depth = depth;
        w->jobs = (ltp_tx_job *)calloc((size_t)depth, sizeof(ltp_tx_job));
        if (w->jobs == NULL) return ENOMEM;
        if (ltp_stage_init(&w->stage, stage) != 0) { ltp_tx_free_jobs(w); return ENOMEM; }
        w->fd = dup(fd);
        if (w->fd < 0) { e = errno; ltp_tx_free_jobs(w); return e; }
        pthread_mutex_init(&w->mu, NULL);
        pthread_cond_init(&w->cv_work, NULL);
        pthread_cond_init(&w->cv_done, NULL);
        e = pthread_create(&w->thread, NULL, ltp_tx_main, w);
        if (e != 0) {
            close(w->fd);
            pthread_mutex_destroy(&w->mu); pthread_cond_destroy(&w->cv_work); pthread_cond_destroy(&w->cv_done);
            ltp_tx_free_jobs(w);
            return e;
        }
        w->running = 1;
        return 0;
    }

    /* Room for a job of n packets in nm messages in the slot `slot`; 0 or ENOMEM. */
    static int ltp_tx_reserve(ltp_tx_job *j, int nm, int n) {
        void *p;
        if (nm > j->cap_msgs) {
            p = realloc(j->msgs, (size_t)nm * sizeof(struct mmsghdr)); if (!p) return ENOMEM; j->msgs = p;
            p = realloc(j->cmsg, (size_t)nm * LTP_CMSG_SIZE); if (!p) return ENOMEM; j->cmsg = p;
            p = realloc(j->nseg, (size_t)nm * sizeof(int)); if (!p) return ENOMEM; j->nseg = p;
            j->cap_msgs = nm;
        }
        if (n > j->cap_pkts) {
            p = realloc(j->iov, (size_t)n * 2 * sizeof(struct iovec)); if (!p) return ENOMEM; j->iov = p;
            p = realloc(j->hdrs, (size_t)n * 16); if (!p) return ENOMEM; j->hdrs = p;
            j->cap_pkts = n;
        }
        return 0;
    }

    static void ltp_tx_submit(ltp_tx_worker *w) {
        pthread_mutex_lock(&w->mu);
        w->head++;
        pthread_cond_signal(&w->cv_work);
        pthread_mutex_unlock(&w->mu);
    }

    static long long ltp_tx_done(ltp_tx_worker *w) {
        long long d;
        if (!w->running) return w->done;   /* joined: nothing runs concurrently */
        pthread_mutex_lock(&w->mu);
        d = w->done;
        pthread_mutex_unlock(&w->mu);
        return d;
    }

    /* Block until more than `reaped` jobs are done (or all submitted ones are); returns done. */
    static long long ltp_tx_wait(ltp_tx_worker *w, long long reaped, int all) {
        long long d;
        if (!w->running) return w->done;
        pthread_mutex_lock(&w->mu);
        while (all ? w->done < w->head : w->done <= reaped) pthread_cond_wait(&w->cv_done, &w->mu);
        d = w->done;
        pthread_mutex_unlock(&w->mu);
        return d;
    }

    /* Stop the thread (mode 1: after its queued jobs; 2: dropping what a full socket holds up) and join it. */
    static void ltp_tx_stop(ltp_tx_worker *w, int mode) {
        if (!w->running) return;
        pthread_mutex_lock(&w->mu);
        __atomic_store_n(&w->stop, mode, __ATOMIC_RELAXED);
        pthread_cond_signal(&w->cv_work);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->thread, NULL);
        close(w->fd);
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv_work);
        pthread_cond_destroy(&w->cv_done);
        w->running = 0;
    }

    /* Whether a read of the error queue could find anything: poll reports POLLERR for a UDP socket
       whose error queue holds a report or whose error is set (one cheap syscall, no exception). */
    static int ltp_errq_pending(int fd) {
        struct pollfd p;
        p.fd = fd; p.events = 0; p.revents = 0;
        if (poll(&p, 1, 0) < 0) return 1;   /* cannot tell: read it */
        return (p.revents & POLLERR) != 0;
    }
    """
    int LTP_TX_ERRS
    ctypedef struct ltp_tx_job:
        mmsghdr *msgs
        iovec *iov
        char *hdrs
        char *cmsg
        int *nseg
        int nm
        double rate
        long long quantum
        double credit
        sockaddr_storage name
        long long dgrams
        long long syscalls
        long long eagain
        long long paced_sleeps
        double paced_late
        int err_code[4]
        long long err_count[4]
        int gso_failed
    ctypedef struct ltp_tx_worker:
        int depth
        ltp_tx_job *jobs
        long long head
        long long done
        int running
    int ltp_tx_start(ltp_tx_worker *w, int fd, int depth, int stage) nogil
    int ltp_tx_reserve(ltp_tx_job *j, int nm, int n) nogil
    void ltp_tx_submit(ltp_tx_worker *w) nogil
    long long ltp_tx_done(ltp_tx_worker *w) nogil
    long long ltp_tx_wait(ltp_tx_worker *w, long long reaped, int all) nogil
    void ltp_tx_stop(ltp_tx_worker *w, int mode) nogil
    void ltp_tx_free_jobs(ltp_tx_worker *w) nogil
    int ltp_errq_pending(int fd) nogil


#: Errno values that ICMP reports on UDP sockets; counted and ignored, never raised.
ICMP_ERRNOS = frozenset({_errno.ECONNREFUSED, _errno.EHOSTUNREACH, _errno.ENETUNREACH, _errno.EHOSTDOWN})
#: setsockopt option number of SO_TIMESTAMPNS (Linux; not exported by Python's socket module)
SO_TIMESTAMPNS_OPT = 35
#: setsockopt option number of SO_RXQ_OVFL (Linux): every datagram read carries the socket's drop count
SO_RXQ_OVFL_OPT = 40
#: Most segments per GSO super-datagram.
GSO_MAX_SEGMENTS = 64


def _try_sol_socket(sock, opt):
    """Turn on the SOL_SOCKET option ``opt``; False where the kernel refuses it."""
    try:
        sock.setsockopt(_socket.SOL_SOCKET, opt, 1)
    except OSError:
        return False
    return True


#: Most payload bytes per GSO super-datagram.
GSO_MAX_BYTES = 65000
#: Largest UDP payload over IPv4; the upper bound of ``segment_size``.
MAX_SEGMENT_SIZE = 65507
#: Receive slot size when GRO is on (the largest coalesced datagram).
GRO_SLOT_SIZE = 65536
#: Most ``mmsghdr`` entries per syscall accepted by the kernel (UIO_MAXIOV).
MAX_BATCH = 1024

# the GSO limits as C values, for the message builder below
cdef Py_ssize_t _GSO_SEGS = GSO_MAX_SEGMENTS
cdef Py_ssize_t _GSO_BYTES = GSO_MAX_BYTES


cdef Py_ssize_t _gather_message(msghdr *h, iovec *iov, char *cbuf, char *hbuf, char *pbuf,
                                const int64_t[::1] sv, Py_ssize_t j, Py_ssize_t n, Py_ssize_t seg_size,
                                Py_ssize_t total, bint gso_ok, sockaddr_storage *name, int namelen,
                                Py_ssize_t max_segs) noexcept nogil:
    """Fill ``h`` with one message of gather packets from packet ``j``; returns the packets it took (>= 1).

    Packet ``k`` is the header at ``hbuf + 16k`` and segment ``sv[k]`` of ``pbuf``: two entries of ``iov`` each.
    Under GSO the message takes equal-sized packets (a short one ends it) up to GSO_MAX_SEGMENTS and
    GSO_MAX_BYTES (and ``max_segs``), with its UDP_SEGMENT control message in ``cbuf`` (LTP_CMSG_SIZE bytes);
    without GSO, one packet.  The caller-side send and the sender threads' jobs both cut their packets here.
    """
    cdef Py_ssize_t k = j, m_pkts = 0, m_bytes = 0, first_len = -1, seq, plen
    h.msg_iov = iov
    if not gso_ok:
        max_segs = 1
    elif max_segs > _GSO_SEGS or max_segs < 1:
        max_segs = _GSO_SEGS
    while j < n and m_pkts < max_segs:
        seq = sv[j]
        plen = total - seq * seg_size
        if plen > seg_size:
            plen = seg_size
        if first_len >= 0 and (plen > first_len or m_bytes + 16 + plen > _GSO_BYTES):
            break
        iov[2 * (j - k)].iov_base = hbuf + j * 16
        iov[2 * (j - k)].iov_len = 16
        iov[2 * (j - k) + 1].iov_base = pbuf + seq * seg_size
        iov[2 * (j - k) + 1].iov_len = <size_t>plen
        m_pkts += 1
        m_bytes += 16 + plen
        j += 1
        if first_len < 0:
            first_len = plen
        elif plen < first_len:
            break  # a short packet ends the batch
    h.msg_iovlen = <size_t>(2 * m_pkts)
    if namelen > 0:
        h.msg_name = name
        h.msg_namelen = namelen
    else:
        h.msg_name = NULL
        h.msg_namelen = 0
    if m_pkts > 1:
        ltp_set_gso(h, cbuf, <uint16_t>(16 + first_len))
    else:
        h.msg_control = NULL
        h.msg_controllen = 0
    h.msg_flags = 0
    return m_pkts

#: IP_RECVERR / IPV6_RECVERR (Linux): ICMP errors queued on the socket with the peer's address
IP_RECVERR_OPT = 11
IPV6_RECVERR_OPT = 25
_MSG_ERRQUEUE = 0x2000
_EXT_ERR = _struct.Struct("@IBBBBII")  # struct sock_extended_err
_ERRQ_PAYLOAD = 64
_ERRQ_ANC = 512

cdef int _ADDR_CACHE_MAX = 4096
cdef int _ICMP_RETRIES = 4


cdef inline bint _is_icmp(int e) noexcept nogil:
    return e == ECONNREFUSED or e == EHOSTUNREACH or e == ENETUNREACH or e == EHOSTDOWN


def _check_pacing(double pace_rate, Py_ssize_t pace_quantum, int send_threads):
    if not (pace_rate >= 0 and pace_rate < float("inf")):
        raise ValueError(f"pace_rate must be a finite number of bytes per second >= 0, got {pace_rate}")
    if pace_rate > 0 and send_threads <= 0:
        raise ValueError("pace_rate needs sender threads: create the UdpIO with send_threads >= 1, or pass pace_rate=0")
    if pace_rate > 0 and pace_quantum <= 0:
        raise ValueError(f"pace_quantum must be > 0 bytes when pace_rate is set, got {pace_quantum}")


def _check_parts(Py_ssize_t parts, double pace_rate, int send_threads):
    if parts < 1 or parts > max(1, send_threads):
        raise ValueError(f"parts must be 1..send_threads ({send_threads}), got {parts}")
    if parts > 1 and pace_rate > 0:
        raise ValueError("parts > 1 sends unpaced parts side by side: pass pace_rate=0, or parts=1")


def _closed_error():
    return OSError(_errno.EBADF, "UdpIO: the socket is closed; create a new socket and a new UdpIO")


def _check_addr(int family, addr):
    """Validate an address tuple for ``family``; return ``(host, port, flowinfo, scope_id)``."""
    six = family == _socket.AF_INET6
    if not isinstance(addr, tuple) or not (2 <= len(addr) <= 4 if six else len(addr) == 2):
        raise TypeError("address must be a tuple (host, port" + ("[, flowinfo[, scope_id]]" if six else "")
                        + f") for this socket, got {addr!r:.80}")
    host = addr[0]
    port = _operator.index(addr[1])
    flowinfo = _operator.index(addr[2]) if len(addr) > 2 else 0
    scope = _operator.index(addr[3]) if len(addr) > 3 else 0
    if not isinstance(host, str):
        raise TypeError(f"address host must be a str, got {type(host).__name__}")
    if not 0 <= port <= 0xFFFF:
        raise OverflowError(f"port must be 0-65535, got {port}")
    if not 0 <= flowinfo <= 0xFFFFF:
        raise OverflowError(f"flowinfo must be 0-1048575, got {flowinfo}")
    if not 0 <= scope <= 0xFFFFFFFF:
        raise OverflowError(f"scope_id must be 0-4294967295, got {scope}")
    return host, port, flowinfo, scope


cdef class UdpIO:
    """Batched, non-blocking UDP I/O on an existing socket (IPv4 and IPv6).

    The socket is switched to non-blocking mode and must stay open while the
    ``UdpIO`` is used; the ``UdpIO`` does not own it (close the socket yourself).
    ``gro=True`` enables ``UDP_GRO`` on the socket; ``gso=True`` uses
    ``UDP_SEGMENT`` when the kernel offers it (``gso_enabled`` says whether).
    ``stage_sends=True`` (default) hands the kernel each gather message of
    ``send_segments`` as one buffer, copied into a cache-sized stage just
    before the syscall, instead of two buffers per packet (the same bytes on
    the wire; see the module's theory of operation).
    ``stats`` counts syscalls, datagrams in and out, receive/send calls that
    met EAGAIN (or ENOBUFS), and ``errors`` by errno name: ICMP-reported
    errors, ``EMSGSIZE`` for dropped oversized datagrams, ``EINVAL``/``EIO``
    for GSO fallbacks, ``ENOBUFS``; and ``MSG_CTRUNC`` for receives dropped
    because other control messages left no room for the GRO one.  Not
    thread-safe: use one ``UdpIO`` per thread (the GIL is released during
    syscalls).
    """

    cdef object _sock
    cdef readonly int family
    cdef readonly int batch
    cdef readonly int max_datagram
    cdef readonly bint gso_enabled
    cdef readonly bint gro_enabled
    cdef readonly bint timestamps_enabled
    cdef readonly bint recverr_enabled
    cdef readonly bint drops_enabled
    cdef readonly bint stage_sends
    cdef readonly long long icmp_errors
    cdef readonly long long socket_drops
    cdef Py_ssize_t _slot_size
    # receive side
    cdef object _buf_arr
    cdef char *_buf
    cdef object _buffer_view
    cdef mmsghdr *_rmsgs
    cdef iovec *_riov
    cdef sockaddr_storage *_rnames
    cdef char *_rcmsg
    cdef object _off_arr
    cdef object _len_arr
    cdef object _slot_arr
    cdef object _time_arr
    cdef double[::1] _time
    cdef int64_t[::1] _off
    cdef int64_t[::1] _len
    cdef int64_t[::1] _slot
    cdef Py_ssize_t _cap
    cdef Py_ssize_t _n
    cdef dict _addr_cache
    # send side
    cdef int _scap
    cdef mmsghdr *_smsgs
    cdef iovec *_siov
    cdef char *_scmsg
    cdef Py_ssize_t *_m_item
    cdef Py_ssize_t *_m_off
    cdef Py_ssize_t *_m_len
    cdef Py_ssize_t *_m_nseg
    cdef bint *_m_gso
    cdef mmsghdr *_gmsgs  # gather sends: own headers, their msg_iov point into _giov per call
    cdef ltp_stage *_stage  # the caller-side gather send's stage (ltp_stage_msgs)
    cdef iovec *_giov
    cdef Py_ssize_t *_g_first
    cdef dict _name_cache
    # stats
    cdef int64_t _syscalls
    cdef int64_t _dgrams_in
    cdef int64_t _slots_in
    cdef int64_t _dgrams_out
    cdef int64_t _eagain
    cdef int64_t _paced_sleeps
    cdef double _paced_late
    cdef dict _errors
    # sender threads
    cdef readonly int send_threads
    cdef ltp_tx_worker *_tx
    cdef Py_buffer *_tx_bufs      # per worker, SEND_QUEUE_DEPTH payload buffers held until reaped
    cdef long long *_tx_reaped    # per worker: jobs whose results were folded in and buffers released
    cdef int _tx_started
    cdef long _tx_pid
    cdef dict _tx_assign          # destination sockaddr bytes -> its thread
    cdef int *_tx_load            # destinations assigned per thread
    cdef int _tx_assign_max       # destinations remembered before the idle ones are forgotten

    def __cinit__(self):
        self._tx = NULL
        self._tx_bufs = NULL
        self._tx_reaped = NULL
        self._tx_started = 0
        self._tx_load = NULL
        self.send_threads = 0
        self._rmsgs = NULL
        self._riov = NULL
        self._rnames = NULL
        self._rcmsg = NULL
        self._smsgs = NULL
        self._siov = NULL
        self._scmsg = NULL
        self._m_item = NULL
        self._m_off = NULL
        self._m_len = NULL
        self._m_nseg = NULL
        self._m_gso = NULL
        self._gmsgs = NULL
        self._giov = NULL
        self._g_first = NULL
        self._stage = NULL

    def __init__(self, sock, *, int batch=64, int max_datagram=2048, bint gso=True, bint gro=True,
                 bint timestamps=True, bint recverr=True, bint drops=True, int send_threads=0,
                 bint stage_sends=True):
        if self._rmsgs != NULL:
            raise RuntimeError("UdpIO.__init__ called twice; create a new UdpIO instead")
        if not isinstance(sock, _socket.socket):
            raise TypeError(f"UdpIO needs a socket.socket, got {type(sock).__name__}")
        if sock.fileno() < 0:
            raise _closed_error()
        if sock.type != _socket.SOCK_DGRAM or sock.family not in (_socket.AF_INET, _socket.AF_INET6):
            raise ValueError("UdpIO needs an AF_INET or AF_INET6 SOCK_DGRAM (UDP) socket, "
                             f"got family={sock.family!r} type={sock.type!r}")
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch must be in 1..{MAX_BATCH}, got {batch}")
        if not 1 <= max_datagram <= 65535:
            raise ValueError(f"max_datagram must be in 1..65535, got {max_datagram}")
        if not 0 <= send_threads <= SEND_THREADS_MAX:
            raise ValueError(f"send_threads must be in 0..{SEND_THREADS_MAX} (0: send in the caller), "
                             f"got {send_threads}")
        self._sock = sock
        self.family = int(sock.family)
        self.batch = batch
        self.stage_sends = stage_sends
        self.max_datagram = max_datagram
        sock.setblocking(False)
        self.gro_enabled = False
        if gro:
            try:
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.gro_enabled = True
            except OSError:
                pass
        else:
            try:
                sock.setsockopt(SOL_UDP, UDP_GRO, 0)
            except OSError:
                pass
        self.gso_enabled = False
        if gso:
            try:
                sock.getsockopt(SOL_UDP, UDP_SEGMENT)
                self.gso_enabled = True
            except OSError:
                pass
        self.timestamps_enabled = timestamps and _try_sol_socket(sock, SO_TIMESTAMPNS_OPT)
        self.drops_enabled = drops and _try_sol_socket(sock, SO_RXQ_OVFL_OPT)
        self.socket_drops = 0
        self.recverr_enabled = False
        if recverr:
            try:
                if sock.family == _socket.AF_INET6:
                    sock.setsockopt(_socket.IPPROTO_IPV6, IPV6_RECVERR_OPT, 1)
                sock.setsockopt(_socket.IPPROTO_IP, IP_RECVERR_OPT, 1)
                self.recverr_enabled = True
            except OSError:
                self.recverr_enabled = sock.family == _socket.AF_INET6 and bool(
                    sock.getsockopt(_socket.IPPROTO_IPV6, IPV6_RECVERR_OPT))
        self._slot_size = max(max_datagram, GRO_SLOT_SIZE) if self.gro_enabled else max_datagram

        # receive buffers: one contiguous byte buffer cut into `batch` slots
        self._buf_arr = np.zeros(self._slot_size * batch, dtype=np.uint8)
        cdef unsigned char[::1] bv = self._buf_arr
        self._buf = <char *>&bv[0]
        self._buffer_view = memoryview(self._buf_arr).cast("B")
        self._rmsgs = <mmsghdr *>calloc(batch, sizeof(mmsghdr))
        self._riov = <iovec *>calloc(batch, sizeof(iovec))
        self._rnames = <sockaddr_storage *>calloc(batch, sizeof(sockaddr_storage))
        self._rcmsg = <char *>calloc(batch, LTP_RCMSG_SIZE)
        # send buffers
        self._scap = max(batch, GSO_MAX_SEGMENTS)
        self._smsgs = <mmsghdr *>calloc(self._scap, sizeof(mmsghdr))
        self._siov = <iovec *>calloc(self._scap, sizeof(iovec))
        self._scmsg = <char *>calloc(self._scap, LTP_CMSG_SIZE)
        self._m_item = <Py_ssize_t *>calloc(self._scap, sizeof(Py_ssize_t))
        self._m_off = <Py_ssize_t *>calloc(self._scap, sizeof(Py_ssize_t))
        self._m_len = <Py_ssize_t *>calloc(self._scap, sizeof(Py_ssize_t))
        self._m_nseg = <Py_ssize_t *>calloc(self._scap, sizeof(Py_ssize_t))
        self._m_gso = <bint *>calloc(self._scap, sizeof(bint))
        self._gmsgs = <mmsghdr *>calloc(self._scap, sizeof(mmsghdr))
        self._giov = <iovec *>calloc(self._scap * 2 * GSO_MAX_SEGMENTS, sizeof(iovec))
        self._g_first = <Py_ssize_t *>calloc(self._scap + 1, sizeof(Py_ssize_t))
        self._stage = <ltp_stage *>calloc(1, sizeof(ltp_stage))
        if self._stage == NULL or ltp_stage_init(self._stage, stage_sends) != 0:
            raise MemoryError()
        if (self._rmsgs == NULL or self._riov == NULL or self._rnames == NULL or self._rcmsg == NULL
                or self._smsgs == NULL or self._siov == NULL or self._scmsg == NULL
                or self._m_item == NULL or self._m_off == NULL or self._m_len == NULL
                or self._m_nseg == NULL or self._m_gso == NULL or self._gmsgs == NULL or self._giov == NULL
                or self._g_first == NULL):
            raise MemoryError()
        cdef int i
        for i in range(batch):
            self._riov[i].iov_base = self._buf + i * self._slot_size
            self._riov[i].iov_len = self._slot_size
            self._rmsgs[i].msg_hdr.msg_name = &self._rnames[i]
            self._rmsgs[i].msg_hdr.msg_iov = &self._riov[i]
            self._rmsgs[i].msg_hdr.msg_iovlen = 1
            self._rmsgs[i].msg_hdr.msg_control = self._rcmsg + i * LTP_RCMSG_SIZE
        for i in range(self._scap):
            self._smsgs[i].msg_hdr.msg_iov = &self._siov[i]
            self._smsgs[i].msg_hdr.msg_iovlen = 1
        self._alloc_out(batch * GSO_MAX_SEGMENTS if self.gro_enabled else batch)
        self._n = 0
        self._addr_cache = {}
        self._name_cache = {}
        self._syscalls = 0
        self._dgrams_in = 0
        self._slots_in = 0
        self._dgrams_out = 0
        self._eagain = 0
        self._paced_sleeps = 0
        self._paced_late = 0.0
        self._errors = {}
        self._tx_assign = {}
        self._tx_assign_max = _ADDR_CACHE_MAX
        self.send_threads = send_threads  # started by the first send_segments

    cdef _start_send_threads(self):
        cdef int i, e = 0, n = self.send_threads, fd = self._fd()
        if self._tx == NULL:
            self._tx = <ltp_tx_worker *>calloc(n, sizeof(ltp_tx_worker))
            self._tx_bufs = <Py_buffer *>calloc(n * _QDEPTH, sizeof(Py_buffer))
            self._tx_reaped = <long long *>calloc(n, sizeof(long long))
            self._tx_load = <int *>calloc(n, sizeof(int))
            if self._tx == NULL or self._tx_bufs == NULL or self._tx_reaped == NULL or self._tx_load == NULL:
                raise MemoryError()
        self._tx_pid = getpid()
        for i in range(n):
            e = ltp_tx_start(&self._tx[i], fd, _QDEPTH, self.stage_sends)
            if e != 0:
                break
            self._tx_started += 1
        if e != 0:
            self._stop_threads(2)
            raise OSError(e, f"UdpIO: cannot start a sender thread: {_os.strerror(e)}; pass send_threads=0")

    cdef void _stop_threads(self, int mode, bint fold=True):
        """Stop and join the threads (mode: ``ltp_tx_stop``'s), release every buffer they held, free their jobs.

        ``fold``: fold their counts into the stats (not from ``__dealloc__``, where the stats may be gone).
        In a forked child the threads do not exist: nothing is joined, only this copy's memory released.
        """
        cdef int i
        cdef long long k
        cdef bint ours = getpid() == self._tx_pid
        for i in range(self._tx_started):
            if ours:
                with nogil:
                    ltp_tx_stop(&self._tx[i], mode)
        if ours and fold:
            self._reap_all()
        for i in range(self._tx_started):
            k = self._tx_reaped[i]
            while k < self._tx[i].head:  # not folded (or never run, in a child): release their buffers
                PyBuffer_Release(&self._tx_bufs[i * _QDEPTH + <int>(k % _QDEPTH)])
                k += 1
            self._tx_reaped[i] = k
            ltp_tx_free_jobs(&self._tx[i])
        self._tx_started = 0
        self.send_threads = 0

    def __dealloc__(self):
        if self._tx != NULL:
            self._stop_threads(2, False)
        free(self._tx)
        free(self._tx_bufs)
        free(self._tx_reaped)
        free(self._tx_load)
        free(self._rmsgs)
        free(self._riov)
        free(self._rnames)
        free(self._rcmsg)
        free(self._smsgs)
        free(self._siov)
        free(self._scmsg)
        free(self._m_item)
        free(self._m_off)
        free(self._m_len)
        free(self._m_nseg)
        free(self._m_gso)
        free(self._gmsgs)
        free(self._giov)
        free(self._g_first)
        if self._stage != NULL:
            ltp_stage_free(self._stage)
        free(self._stage)

    cdef _alloc_out(self, Py_ssize_t cap):
        self._cap = cap
        self._off_arr = np.zeros(cap, dtype=np.int64)
        self._len_arr = np.zeros(cap, dtype=np.int64)
        self._slot_arr = np.zeros(cap, dtype=np.int64)
        self._time_arr = np.full(cap, -1.0, dtype=np.float64)
        self._time = self._time_arr
        self._off = self._off_arr
        self._len = self._len_arr
        self._slot = self._slot_arr

    cdef int _fd(self) except -1:
        cdef int fd = self._sock.fileno()
        if fd < 0:
            raise _closed_error()
        return fd

    cdef void _count_error(self, int e):
        if _is_icmp(e):
            self.icmp_errors += 1
        self._count_error_name(_errno.errorcode.get(e, str(e)))

    cdef bint _send_full_or_count(self, int e):
        """Count a failed send; True when the socket buffer is full (EAGAIN/ENOBUFS): stop for now."""
        if e == EAGAIN or e == EWOULDBLOCK or e == ENOBUFS:
            self._eagain += 1
            if e == ENOBUFS:
                self._count_error(e)
            return True
        self._count_error(e)
        return False

    cdef void _count_error_name(self, str name):
        self._errors[name] = self._errors.get(name, 0) + 1

    # ------------------------------------------------------------------ sender threads

    cdef void _reap(self, int w):
        """Fold the results of sender thread ``w``'s finished jobs into the stats; release their buffers."""
        cdef ltp_tx_worker *wk = &self._tx[w]
        cdef long long done = ltp_tx_done(wk)
        cdef ltp_tx_job *j
        cdef int slot, i, c
        while self._tx_reaped[w] < done:
            slot = <int>(self._tx_reaped[w] % wk.depth)
            j = &wk.jobs[slot]
            self._syscalls += j.syscalls
            self._dgrams_out += j.dgrams
            self._eagain += j.eagain
            self._paced_sleeps += j.paced_sleeps
            self._paced_late += j.paced_late
            for i in range(LTP_TX_ERRS):
                for c in range(j.err_count[i]):
                    self._count_error(j.err_code[i])
            if j.gso_failed == 2:
                self.gso_enabled = False
            PyBuffer_Release(&self._tx_bufs[w * _QDEPTH + slot])
            self._tx_reaped[w] += 1

    cdef void _reap_all(self):
        cdef int w
        for w in range(self._tx_started):
            self._reap(w)

    def reap(self):
        """Fold finished background sends into ``stats`` and release the buffers they held.

        Returns how many ``send_segments`` batches the sender threads still
        hold (0 without sender threads).  ``send_segments`` and ``stats`` reap
        by themselves; call it when a payload buffer must be released (a
        ``bytearray`` cannot be resized while a batch of it is queued).
        """
        cdef int w
        cdef long long queued = 0
        self._reap_all()
        for w in range(self._tx_started):
            queued += self._tx[w].head - self._tx_reaped[w]
        return queued

    def wait_sent(self):
        """Block (GIL released) until the sender threads sent every batch handed to them, then reap."""
        cdef int w
        for w in range(self._tx_started):
            with nogil:
                ltp_tx_wait(&self._tx[w], 0, 1)
        self._reap_all()

    def stop_send_threads(self):
        """Let the sender threads send what they hold, stop them and reap; later sends run in the caller.

        Call it before closing the socket.  Idempotent; a no-op without sender threads.
        """
        if self._tx_started:
            self._stop_threads(1)
        self.send_threads = 0

    cdef int _tx_enqueue(self, sockaddr_storage *name, int namelen, char *hbuf, char *pbuf,
                         const int64_t[::1] sv, Py_ssize_t n, Py_ssize_t seg_size, Py_ssize_t total,
                         bint gso_ok, Py_buffer *pv, double pace_rate, Py_ssize_t pace_quantum,
                         int part=0) except -1:
        """Build ``send_segments``' packets into a job of one sender thread and queue it; takes over ``pv``.

        ``part`` k > 0 (the k-th part of a batch sent in parts) goes to the thread ``k`` after the destination's
        own."""
        cdef int w = 0, slot, nm = 0, e, i
        cdef Py_ssize_t j, m_pkts, max_segs = 0
        cdef ltp_tx_worker *wk
        cdef ltp_tx_job *job
        if self._tx_started == 0:
            self._start_send_threads()
        if getpid() != self._tx_pid:
            raise RuntimeError("UdpIO: this process was forked from the one that started the sender threads; "
                               "create the UdpIO (and its endpoint) in the process that uses it")
        if n > 0x3fffffff:
            raise ValueError(f"send_segments: {n} packets in one call is too many for a sender thread")
        # one destination, one thread (its packets keep their order); a new one goes to the least loaded
        key = PyBytes_FromStringAndSize(<char *>name, namelen)
        entry = self._tx_assign.get(key)
        if entry is None:
            if len(self._tx_assign) >= self._tx_assign_max:
                self._tx_forget_idle()
            for i in range(1, self._tx_started):
                if self._tx_load[i] < self._tx_load[w]:
                    w = i
            self._tx_load[w] += 1
            entry = [w, 0, None]  # its thread, the job count that includes its latest batch there, parts elsewhere
            self._tx_assign[key] = entry
        else:
            w = entry[0]
        if part:
            w = (w + part) % self._tx_started
        wk = &self._tx[w]
        self._reap(w)
        while wk.head - self._tx_reaped[w] >= wk.depth:
            with nogil:
                ltp_tx_wait(wk, self._tx_reaped[w], 0)
            self._reap(w)
        slot = <int>(wk.head % wk.depth)
        job = &wk.jobs[slot]
        if ltp_tx_reserve(job, <int>n, <int>n) != 0:
            raise MemoryError()
        memcpy(job.hdrs, hbuf, n * 16)
        if namelen > 0:
            memcpy(&job.name, name, namelen)
        if pace_rate > 0:  # no GSO message larger than a sub-burst
            max_segs = max(1, pace_quantum // (16 + seg_size))
        j = 0
        while j < n:
            m_pkts = _gather_message(&job.msgs[nm].msg_hdr, &job.iov[2 * j], job.cmsg + nm * LTP_CMSG_SIZE,
                                     job.hdrs, pbuf, sv, j, n, seg_size, total, gso_ok, &job.name, namelen,
                                     max_segs)
            job.nseg[nm] = <int>m_pkts
            j += m_pkts
            nm += 1
        job.nm = nm
        job.rate = pace_rate
        job.quantum = pace_quantum
        job.credit = SEND_PACE_CREDIT_S
        job.dgrams = 0
        job.syscalls = 0
        job.eagain = 0
        job.paced_sleeps = 0
        job.paced_late = 0.0
        for e in range(LTP_TX_ERRS):
            job.err_count[e] = 0
            job.err_code[e] = 0
        job.gso_failed = 0
        self._tx_bufs[w * _QDEPTH + slot] = pv[0]
        ltp_tx_submit(wk)
        if w == entry[0]:
            entry[1] = wk.head
        else:  # a part on another thread: remembered so that _tx_busy sees it too
            if entry[2] is None:
                entry[2] = {}
            entry[2][w] = wk.head
        return 0

    cdef int _tx_parts(self, sockaddr_storage *name, int namelen, char *hbuf, char *pbuf,
                        const int64_t[::1] sv, Py_ssize_t n, Py_ssize_t seg_size, Py_ssize_t total,
                        bint gso_ok, Py_buffer *pv, payload, int parts) except -1:
        """Queue ``parts`` contiguous parts of one batch to as many sender threads; takes over ``pv`` (the
        first part's export of ``payload``; every other part holds an export of its own)."""
        cdef Py_buffer extra
        cdef Py_ssize_t a = 0, b
        cdef int k
        for k in range(parts):
            b = n * (k + 1) // parts
            if k == 0:
                self._tx_enqueue(name, namelen, hbuf, pbuf, sv[a:b], b - a, seg_size, total, gso_ok, pv,
                                 0.0, 0, 0)
            else:
                PyObject_GetBuffer(payload, &extra, PyBUF_SIMPLE)
                try:
                    self._tx_enqueue(name, namelen, hbuf + 16 * a, pbuf, sv[a:b], b - a, seg_size, total, gso_ok,
                                     &extra, 0.0, 0, k)
                except BaseException:
                    PyBuffer_Release(&extra)
                    raise
            a = b
        return 0

    cdef bint _tx_busy(self, sockaddr_storage *name, int namelen) except -1:
        """Whether a batch for this destination is still queued or being sent (a send beside it must queue too)."""
        if not self._tx_started:
            return False
        entry = self._tx_assign.get(PyBytes_FromStringAndSize(<char *>name, namelen))
        if entry is None:
            return False
        return self._entry_busy(entry)

    cdef bint _entry_busy(self, list entry) except -1:
        """Whether any thread still holds a batch (or a part of one) of the destination of ``entry``."""
        cdef int w = entry[0]
        self._reap(w)
        if self._tx_reaped[w] < <long long>entry[1]:
            return True
        if entry[2]:
            for w, head in entry[2].items():
                self._reap(w)
                if self._tx_reaped[w] < <long long>head:
                    return True
        return False

    cdef int _tx_forget_idle(self) except -1:
        """The destination table is full: forget every destination no thread holds a batch of. One with a batch
        queued keeps its thread, so that its next batch queues behind it in order and a send beside it still
        sees it busy; those are at most ``send_threads`` x ``SEND_QUEUE_DEPTH``, so the table stays bounded."""
        idle = [key for key, entry in self._tx_assign.items() if not self._entry_busy(entry)]
        for key in idle:
            entry = self._tx_assign.pop(key)
            self._tx_load[<int>entry[0]] -= 1
        return 0

    @property
    def thread_destinations(self):
        """How many destinations the sender threads remember (each keeps one thread while it is remembered)."""
        return len(self._tx_assign)

    @property
    def thread_destinations_max(self):
        """Destinations remembered before those with nothing queued are forgotten (a forgotten one gets a thread
        afresh, the least loaded, with its next batch). Settable: an int of at least 1."""
        return self._tx_assign_max

    @thread_destinations_max.setter
    def thread_destinations_max(self, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"thread_destinations_max must be an int >= 1, got {value!r}")
        self._tx_assign_max = <int>min(value, 1 << 30)

    # ------------------------------------------------------------------ receive

    @property
    def buffer(self):
        """The receive buffer (a ``memoryview`` of bytes), valid until the next ``recv_batch``."""
        return self._buffer_view

    @property
    def offsets(self):
        """int64 offsets in ``buffer`` of the datagrams of the last ``recv_batch``."""
        return self._off_arr[:self._n]

    @property
    def lengths(self):
        """int64 lengths of the datagrams of the last ``recv_batch``."""
        return self._len_arr[:self._n]

    @property
    def times(self):
        """float64 kernel receive times (CLOCK_REALTIME seconds) of the last batch; -1.0 where unknown."""
        return self._time_arr[:self._n]

    @property
    def stats(self):
        """Counters: syscalls, datagrams_in, slots_in (receive buffers the kernel filled: a coalesced GRO run
        counts once, its datagrams each count in datagrams_in), datagrams_out, eagain, errors (errno name -> count);
        for paced sends (``pace_rate``), paced_sleeps (sub-bursts that waited for their time) and paced_late_s
        (seconds a thread ran behind its timeline beyond ``SEND_PACE_CREDIT_S`` within a batch: that rate was not
        sent). Sender threads' batches count once they are finished (``wait_sent`` waits for them)."""
        if self._tx_started:
            self._reap_all()
        return {
            "syscalls": self._syscalls,
            "datagrams_in": self._dgrams_in,
            "slots_in": self._slots_in,
            "datagrams_out": self._dgrams_out,
            "eagain": self._eagain,
            "paced_sleeps": self._paced_sleeps,
            "paced_late_s": self._paced_late,
            "errors": dict(self._errors),
            "socket_drops": self.socket_drops,
        }

    def __len__(self):
        """Number of datagrams from the last ``recv_batch``."""
        return self._n

    def recv_batch(self):
        """Receive without blocking; return the number of datagrams (0 when none is waiting).

        One ``recvmmsg`` fills up to ``batch`` slots; with GRO a slot may hold a
        coalesced run, which is split back into its datagrams, so the count can
        exceed ``batch``.  Datagrams longer than ``max_datagram`` (without GRO)
        are dropped and counted as ``errors['EMSGSIZE']``.  After the call,
        datagram ``i`` is ``buffer[offsets[i]:offsets[i] + lengths[i]]`` from
        ``addr(i)``.
        """
        return self._recv_once()

    cdef Py_ssize_t _recv_once(self) except -1:
        cdef int fd = self._fd()
        cdef int r = -1, e = 0, i, tries = 0, g
        cdef unsigned int vlen = self.batch
        cdef Py_ssize_t n, L, base, pos, need
        cdef int64_t *off
        cdef int64_t *lens
        cdef int64_t *slots
        cdef double *times
        cdef double t
        cdef long long d
        self._n = 0
        while True:
            for i in range(self.batch):
                self._rmsgs[i].msg_hdr.msg_namelen = sizeof(sockaddr_storage)
                self._rmsgs[i].msg_hdr.msg_controllen = LTP_RCMSG_SIZE
                self._rmsgs[i].msg_hdr.msg_flags = 0
            with nogil:
                r = recvmmsg(fd, self._rmsgs, vlen, MSG_DONTWAIT, NULL)
                if r < 0:
                    e = errno
            self._syscalls += 1
            if r >= 0:
                break
            if e == EINTR:
                continue
            if e == EAGAIN or e == EWOULDBLOCK:
                self._eagain += 1
                return 0
            if _is_icmp(e):
                # the pending socket error was consumed by this call; try again
                self._count_error(e)
                tries += 1
                if tries <= _ICMP_RETRIES:
                    continue
                return 0
            raise OSError(e, f"UdpIO.recv_batch: recvmmsg failed: {_os.strerror(e)}")
        self._slots_in += r
        # how many datagrams, then make sure the output arrays are big enough
        need = 0
        for i in range(r):
            L = self._rmsgs[i].msg_len
            g = ltp_gro_size(&self._rmsgs[i].msg_hdr)
            if g > 0 and L > g:
                need += (L + g - 1) // g
            else:
                need += 1
        if need > self._cap:
            self._alloc_out(need)
        off = &self._off[0]
        lens = &self._len[0]
        slots = &self._slot[0]
        times = &self._time[0]
        n = 0
        for i in range(r):
            L = self._rmsgs[i].msg_len
            base = i * self._slot_size
            t = ltp_rx_time(&self._rmsgs[i].msg_hdr)
            d = ltp_rx_drops(&self._rmsgs[i].msg_hdr)
            if d >= 0:
                self.socket_drops = d
            if self._rmsgs[i].msg_hdr.msg_flags & MSG_TRUNC:
                self._count_error(_errno.EMSGSIZE)
                continue
            g = ltp_gro_size(&self._rmsgs[i].msg_hdr)
            if g == 0 and self.gro_enabled and self._rmsgs[i].msg_hdr.msg_flags & MSG_CTRUNC:
                # the UDP_GRO cmsg may have been cut off: the slot could be a coalesced run
                # that cannot be split, so drop it rather than deliver glued datagrams
                self._count_error_name("MSG_CTRUNC")
                continue
            if g > 0 and L > g:
                pos = 0
                while pos < L:
                    off[n] = base + pos
                    lens[n] = g if L - pos > g else L - pos
                    slots[n] = i
                    times[n] = t
                    n += 1
                    pos += g
            else:
                off[n] = base
                lens[n] = L
                slots[n] = i
                times[n] = t
                n += 1
        self._n = n
        self._dgrams_in += n
        return n

    cdef object _decode(self, Py_ssize_t slot):
        cdef sockaddr_storage *ss = &self._rnames[slot]
        cdef socklen_t nl = self._rmsgs[slot].msg_hdr.msg_namelen
        cdef char host[64]
        cdef unsigned int port = 0, flowinfo = 0, scope = 0
        cdef int fam
        key = PyBytes_FromStringAndSize(<char *>ss, nl)
        t = self._addr_cache.get(key)
        if t is not None:
            return t
        fam = ltp_decode_addr(ss, host, sizeof(host), &port, &flowinfo, &scope)
        if fam == AF_INET:
            t = (host.decode("ascii"), port)
        elif fam == AF_INET6:
            t = (host.decode("ascii"), port, flowinfo, scope)
        else:
            t = (int(ss.ss_family), key)
        if len(self._addr_cache) >= _ADDR_CACHE_MAX:
            self._addr_cache.clear()
        self._addr_cache[key] = t
        return t

    def recv_errors(self, limit=64):
        """Drain the socket's error queue (``IP_RECVERR``): ICMP reports about datagrams we sent.

        Returns up to ``limit`` tuples ``(addr, errno, origin, icmp_type, icmp_code)``:
        ``addr`` is the destination of the datagram the report is about (the
        peer), ``errno`` e.g. ``ECONNREFUSED`` for ICMP port unreachable,
        ``origin`` 2 (ICMP) or 3 (ICMPv6). Empty when ``recverr`` is off or
        nothing is queued; never raises for an empty queue."""
        cdef list out = []
        if not self.recverr_enabled:
            return out
        sock = self._sock
        if not ltp_errq_pending(self._fd()):  # _fd() raises for a closed socket
            return out  # the common case (an empty wake-up reads it): no recvmsg, no BlockingIOError
        for _ in range(limit):
            try:
                _data, anc, _flags, address = sock.recvmsg(_ERRQ_PAYLOAD, _ERRQ_ANC,
                                                            _MSG_ERRQUEUE | _socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            for level, kind, cdata in anc:
                if ((level == _socket.IPPROTO_IP and kind == IP_RECVERR_OPT)
                        or (level == _socket.IPPROTO_IPV6 and kind == IPV6_RECVERR_OPT)) \
                        and len(cdata) >= _EXT_ERR.size:
                    e, origin, typ, code, _pad, _info, _d = _EXT_ERR.unpack_from(cdata)
                    out.append((address, e, origin, typ, code))
        return out

    def addr(self, Py_ssize_t i):
        """Source address of datagram ``i`` of the last batch, as the socket module returns it."""
        if i < 0 or i >= self._n:
            raise IndexError(f"datagram index {i} out of range for a batch of {self._n}")
        return self._decode(self._slot[i])

    cdef inline bint _same_source(self, Py_ssize_t a, Py_ssize_t b):
        cdef socklen_t la, lb
        if a == b:
            return True
        la = self._rmsgs[a].msg_hdr.msg_namelen
        lb = self._rmsgs[b].msg_hdr.msg_namelen
        return la == lb and memcmp(&self._rnames[a], &self._rnames[b], la) == 0

    def runs(self, Py_ssize_t start=0):
        """``[(addr, start, stop), ...]``: maximal runs of consecutive datagrams from one source,
        from datagram ``start`` of the batch on (after :meth:`drain`: its ``resume``)."""
        cdef Py_ssize_t j
        out = []
        if start < 0:
            raise ValueError(f"start must be non-negative, got {start}")
        if start >= self._n:
            return out
        for j in range(start + 1, self._n + 1):
            if j == self._n or not self._same_source(self._slot[start], self._slot[j]):
                out.append((self._decode(self._slot[start]), start, j))
                start = j
        return out


    def drain(self, window, addr, int max_batches, int min_datagrams=0):
        """Receive batch after batch and feed one flow's DATA straight into ``window``.

        :meth:`drain_flows` for one flow. Returns ``(batches, read, consumed, consumed_bytes,
        resume)``: receives made, datagrams read, datagrams the window consumed (its duplicates
        and bad ones included) and their bytes, and the index of the last batch's first datagram
        not consumed (``len(self)`` when none is left)."""
        batches, read, consumed, cbytes, resume = self.drain_flows((window,), (addr,), max_batches, min_datagrams)
        return batches, read, consumed[0], cbytes[0], resume

    def drain_flows(self, windows, addrs, int max_batches, int min_datagrams=0):
        """Receive batch after batch and feed several flows' DATA straight into their windows.

        The bulk-receive loop of an endpoint without a Python call per batch: up to
        ``max_batches`` receives (:meth:`recv_batch`; an empty one counts), each batch's
        datagrams handed, run by run of one source, to the window of that source (``addrs[k]``,
        same host and port, is the sender of ``windows[k]``; several windows may share a source,
        and the first that consumes a run's first datagram takes the run): for a compiled
        :class:`~ltp_ext._datapath.RecvWindow` its C loop, with the GIL held.
        It stops after

        * an empty batch, or one of fewer than ``min_datagrams`` datagrams (and fewer than
          ``batch``: the socket is drained);
        * a datagram from no listed source, or that no window of its source consumes (another
          flow's, not DATA, a full ACK buffer): the batch then stays readable as after
          :meth:`recv_batch`, and ``runs(resume)`` lists what is left of it;
        * a batch that completed a window (every segment received).

        Returns ``(batches, read, consumed, consumed_bytes, resume)``: receives made,
        datagrams read, per window the datagrams it consumed (its duplicates and bad ones
        included) and their bytes (two lists, in ``windows`` order), and the index of the last
        batch's first datagram not consumed (``len(self)`` when none is left). A socket error is
        raised as by :meth:`recv_batch` when it comes first; after consumed batches it ends the
        drain, and the next receive meets it."""
        cdef Py_ssize_t nw, n = 0, i = 0, j, lim, slot, batches = 0, read = 0, k, m
        cdef int err = 0
        cdef bint done = False
        cdef RecvWindow w
        cdef list wl
        cdef Py_ssize_t blen = self._slot_size * self.batch
        cdef sockaddr_storage *names = NULL
        cdef socklen_t *name_lens = NULL
        cdef int64_t *counts = NULL  # per window: datagrams consumed, then their bytes (nw each)
        if max_batches < 1:
            raise ValueError(f"max_batches must be at least 1, got {max_batches}")
        wl = list(windows)
        addrs = list(addrs)
        nw = len(wl)
        if nw < 1 or nw != len(addrs):
            raise ValueError(f"drain_flows needs one source address per window and at least one window "
                             f"(got {nw} windows, {len(addrs)} addresses)")
        for window in wl:
            if not isinstance(window, RecvWindow) and not hasattr(window, "ingest"):
                raise TypeError(f"drain needs a RecvWindow (with ingest()), got {type(window).__name__}")
        names = <sockaddr_storage *>malloc(nw * sizeof(sockaddr_storage))
        name_lens = <socklen_t *>malloc(nw * sizeof(socklen_t))
        counts = <int64_t *>calloc(2 * nw, sizeof(int64_t))
        if names == NULL or name_lens == NULL or counts == NULL:
            free(names)
            free(name_lens)
            free(counts)
            raise MemoryError()
        try:
            for k in range(nw):
                name_lens[k] = <socklen_t>self._encode_name(addrs[k], &names[k])
            self._n = 0
            while batches < max_batches:
                i = 0
                try:
                    n = self._recv_once()
                except OSError:
                    if batches == 0:
                        raise
                    self._n = 0
                    break  # what was consumed is reported now; the next receive meets the error again
                batches += 1
                if n == 0:
                    break
                read += n
                while i < n:
                    slot = self._slot[i]
                    lim = i + 1
                    while lim < n and self._same_source(slot, self._slot[lim]):
                        lim += 1
                    j = i
                    for k in range(nw):
                        if not ltp_same_host_port(&self._rnames[slot], self._rmsgs[slot].msg_hdr.msg_namelen,
                                                  &names[k], name_lens[k]):
                            continue
                        window = wl[k]
                        if isinstance(window, RecvWindow):
                            w = <RecvWindow>window
                            j = w._run(<const uint8_t *>self._buf, blen, <const char *>&self._off[0],
                                       sizeof(int64_t), <const char *>&self._len[0], sizeof(int64_t), i, lim, &err)
                            if err:
                                raise RuntimeError(f"UdpIO.drain: datagram {j} lies outside the receive buffer")
                            if j > i and w.received >= w.seg_count:
                                done = True
                        else:
                            j = window.ingest(self._buffer_view, self._off_arr, self._len_arr, i, lim)
                            if j > i and window.received >= window.seg_count:
                                done = True
                        if j > i:
                            counts[k] += j - i
                            for m in range(i, j):
                                counts[nw + k] += self._len[m]
                            break
                    if j == i:
                        break  # a datagram for the caller's own path
                    i = j
                if i < n or done:
                    break  # left for the caller, or a window is complete: the caller closes it now
                if n < self.batch and n < min_datagrams:
                    break
            consumed = [counts[k] for k in range(nw)]
            cbytes = [counts[nw + k] for k in range(nw)]
        finally:
            free(names)
            free(name_lens)
            free(counts)
        return batches, read, consumed, cbytes, i

    # ------------------------------------------------------------------ send

    cdef int _encode_name(self, addr, sockaddr_storage *ss) except -1:
        """Encode an address tuple into ``ss``; returns the sockaddr length (0 for None)."""
        cdef bytes raw
        if addr is None:
            return 0
        raw = self._name_cache.get(addr)
        if raw is None:
            raw = self._resolve(addr)
            if len(self._name_cache) >= _ADDR_CACHE_MAX:
                self._name_cache.clear()
            self._name_cache[addr] = raw
        memcpy(ss, PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw))
        return <int>PyBytes_GET_SIZE(raw)

    cdef bytes _resolve(self, addr):
        cdef sockaddr_storage ss
        cdef int n
        cdef unsigned int flowinfo, scope
        host, port, flowinfo, scope = _check_addr(self.family, addr)
        try:
            hb = host.encode("ascii")
        except UnicodeEncodeError:
            hb = b""
        if b"\0" in hb:
            hb = b""
        n = ltp_encode_addr(self.family, hb, port, flowinfo, scope, &ss)
        if n == 0:
            # not a numeric address: resolve like the socket module would
            infos = _socket.getaddrinfo(host, port, self.family, _socket.SOCK_DGRAM)
            sa = infos[0][4]
            if self.family == AF_INET6 and len(addr) <= 3:
                scope = sa[3]
            n = ltp_encode_addr(self.family, sa[0].encode("ascii"), port, flowinfo, scope, &ss)
            if n == 0:
                raise OSError(_errno.EINVAL, f"cannot encode address {addr!r}")
        return PyBytes_FromStringAndSize(<char *>&ss, n)

    def send(self, addr, data, segment_size):
        """Send ``data`` to ``addr`` as datagrams of ``segment_size`` bytes (the last may be shorter).

        ``data`` is any C-contiguous buffer; ``addr`` is an address tuple, or
        ``None`` for the peer of a connected socket.  Non-blocking: returns the
        number of bytes accepted, a multiple of ``segment_size`` unless
        everything was sent; stops early on EAGAIN/ENOBUFS.  Empty ``data``
        sends nothing and returns 0.
        """
        return self._send(addr, data, segment_size, None, False)

    def send_many(self, items):
        """Send several ``(addr, data, segment_size)`` items; return how many were sent completely.

        Items go out in order, batched into as few syscalls as possible.  When
        it stops early (EAGAIN/ENOBUFS), the first item not counted may have
        had some of its datagrams sent.  All items are validated before
        anything is sent.
        """
        return self._send(None, None, None, items, True)

    def send_segments(self, addr, headers, payload, seqs, Py_ssize_t seg_size, Py_ssize_t total,
                      bint background=True, double pace_rate=0.0, Py_ssize_t pace_quantum=0, Py_ssize_t parts=1):
        """Gather-send DATA packets without assembling them: header ``k`` + payload segment ``seqs[k]``.

        Packet ``k`` is the 16 bytes at ``headers[16k:16k+16]`` followed by
        ``payload[seqs[k]*seg_size : min(total, (seqs[k]+1)*seg_size)]``, straight
        from the caller's buffers (one kernel copy, as TCP).  Consecutive
        packets of equal size share one GSO super-datagram; a short packet
        ends its batch.  Non-blocking: returns the number of packets
        accepted (all of them unless EAGAIN/ENOBUFS stopped it); a packet the
        destination refuses twice (ICMP) is counted as sent, as a loss.

        With sender threads (``send_threads`` > 0) and ``background`` (the
        default) the packets are queued to the thread that serves ``addr``
        (one destination, one thread, in order) and all are accepted at once;
        the thread waits for room in a full socket.  ``payload`` is held (its
        buffer exported) until the batch is reaped; ``headers`` is copied.
        The call waits only when that thread already holds
        ``SEND_QUEUE_DEPTH`` batches.  ``background=False`` sends in the
        caller, unless a batch for ``addr`` is still with its thread (then it
        queues behind it, so the destination's packets keep their order).

        ``pace_rate`` > 0 (bytes per second, datagram bytes) paces the batch in
        its thread: it leaves in sub-bursts of at most ``pace_quantum`` bytes
        (GSO messages no larger), spaced so that the thread's sends run at
        ``pace_rate``; a thread behind its schedule sends at once and catches
        up by at most ``SEND_PACE_CREDIT_S``.  It needs sender threads and
        implies ``background``.

        ``parts`` (unpaced; 1..``send_threads``) cuts the batch into that many
        contiguous parts (part ``k``: packets ``n*k//parts`` to
        ``n*(k+1)//parts``), one per sender thread, queued like ``background``
        batches, so that one destination's kernel work runs on several cores.
        Each part keeps its order; the parts may interleave on the wire, with
        each other and with the destination's other batches (the sender's
        loss detection must count each part apart: ``SendWindow.build(lanes=)``).
        """
        cdef Py_buffer hv, pv
        cdef bint pv_given = False
        cdef const int64_t[::1] sv = np.ascontiguousarray(seqs, dtype=np.int64)
        cdef Py_ssize_t n = sv.shape[0], k = 0, j, nm, m_pkts, accepted = 0
        cdef Py_ssize_t gi, staged
        cdef int64_t q
        cdef sockaddr_storage name
        cdef int namelen
        cdef int fd = self._fd()
        cdef int r, e, ns
        cdef Py_ssize_t retry_at = -1
        cdef bint gso_ok = self.gso_enabled
        cdef char *hbuf
        cdef char *pbuf
        if seg_size <= 0 or seg_size + 16 > MAX_SEGMENT_SIZE:
            raise ValueError(f"seg_size must be in 1..{MAX_SEGMENT_SIZE - 16}, got {seg_size}")
        _check_pacing(pace_rate, pace_quantum, self.send_threads)
        _check_parts(parts, pace_rate, self.send_threads)
        if n == 0:
            return 0
        namelen = self._encode_name(addr, &name)
        PyObject_GetBuffer(headers, &hv, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(payload, &pv, PyBUF_SIMPLE)
        except BaseException:
            PyBuffer_Release(&hv)
            raise
        try:
            if hv.len < n * 16:
                raise ValueError(f"headers hold {hv.len} bytes, {n} packets need {n * 16}")
            if total > pv.len or total <= 0:
                raise ValueError(f"total={total} must be in 1..len(payload)={pv.len}")
            for j in range(n):
                q = sv[j]
                if q < 0 or q * seg_size >= total:
                    raise ValueError(f"segment {q} is outside a {total}-byte message of {seg_size}-byte segments")
            hbuf = <char *>hv.buf
            pbuf = <char *>pv.buf
            if parts > 1 and n >= parts:
                self._tx_parts(&name, namelen, hbuf, pbuf, sv, n, seg_size, total, gso_ok, &pv, payload, parts)
                pv_given = True
                return n
            if self.send_threads and (background or pace_rate > 0 or self._tx_busy(&name, namelen)):
                self._tx_enqueue(&name, namelen, hbuf, pbuf, sv, n, seg_size, total, gso_ok, &pv,
                                 pace_rate, pace_quantum)
                pv_given = True
                return n
            while k < n:
                # fill up to _scap messages, each a GSO batch of equal-size packets; staged, no more than the
                # stage takes (a message built past it would only be built again for the next call)
                nm = 0
                gi = 0
                j = k
                staged = 0
                while nm < self._scap and j < n:
                    self._g_first[nm] = j
                    m_pkts = _gather_message(&self._gmsgs[nm].msg_hdr, &self._giov[gi], self._scmsg + nm * LTP_CMSG_SIZE,
                                             hbuf, pbuf, sv, j, n, seg_size, total, gso_ok, &name, namelen, 0)
                    if self.stage_sends:
                        staged += m_pkts * (16 + seg_size)  # at most its bytes
                        if nm > 0 and staged > LTP_STAGE_BYTES:
                            break
                    gi += 2 * m_pkts
                    j += m_pkts
                    self._m_nseg[nm] = m_pkts
                    self._m_gso[nm] = m_pkts > 1
                    nm += 1
                self._g_first[nm] = j
                e = 0
                with nogil:
                    ns = ltp_stage_msgs(self._stage, self._gmsgs, nm)
                    if ns > 0:
                        r = sendmmsg(fd, self._stage.msgs, ns, MSG_DONTWAIT)
                    else:
                        r = sendmmsg(fd, self._gmsgs, nm, MSG_DONTWAIT)
                    if r < 0:
                        e = errno
                self._syscalls += 1
                if r > 0:
                    for j in range(r):
                        self._dgrams_out += self._m_nseg[j]
                    accepted += self._g_first[r] - k
                    k = self._g_first[r]
                    continue
                if e == EINTR:
                    continue
                if self._send_full_or_count(e):
                    break
                if _is_icmp(e):
                    if retry_at == k:
                        # refused twice in a row: the destination is unreachable, drop it like a loss
                        accepted += self._g_first[1] - k
                        k = self._g_first[1]
                        retry_at = -1
                    else:
                        retry_at = k
                    continue
                if self._m_gso[0] and (e == EINVAL or e == EIO):
                    gso_ok = False
                    if e == EIO:
                        self.gso_enabled = False
                    continue
                if accepted > 0:
                    break
                raise OSError(e, f"UdpIO.send_segments: sendmmsg failed: {_os.strerror(e)}")
        finally:
            if not pv_given:
                PyBuffer_Release(&pv)
            PyBuffer_Release(&hv)
        return accepted

    cdef object _send(self, addr1, data1, seg1, list_items, bint many):
        cdef Py_ssize_t n_items, i, it = 0, off, L, seg, rem, chunk, per, nm, k, j, accepted = 0
        cdef Py_ssize_t *lens = NULL
        cdef Py_ssize_t *segs = NULL
        cdef char **ptrs = NULL
        cdef int *namelens = NULL
        cdef sockaddr_storage *names = NULL
        cdef Py_buffer *views = NULL
        cdef Py_ssize_t nviews = 0
        cdef Py_ssize_t one_len = 0, one_seg = 0
        cdef char *one_ptr = NULL
        cdef int one_namelen = 0
        cdef sockaddr_storage one_name
        cdef Py_buffer one_view
        cdef int fd = self._fd()
        cdef int r, e, retry_at_item = -1
        cdef Py_ssize_t retry_at_off = -1
        cdef bint gso_ok = self.gso_enabled, use_gso
        cdef msghdr *h
        if many:
            items = list(list_items)
            n_items = len(items)
        else:
            items = None
            n_items = 1
        if n_items == 0:
            return 0
        if n_items == 1:
            # the common case (one message, one ACK): no heap allocation
            lens, segs, ptrs = &one_len, &one_seg, &one_ptr
            namelens, names, views = &one_namelen, &one_name, &one_view
        else:
            lens = <Py_ssize_t *>malloc(n_items * sizeof(Py_ssize_t))
            segs = <Py_ssize_t *>malloc(n_items * sizeof(Py_ssize_t))
            ptrs = <char **>malloc(n_items * sizeof(char *))
            namelens = <int *>malloc(n_items * sizeof(int))
            names = <sockaddr_storage *>malloc(n_items * sizeof(sockaddr_storage))
            views = <Py_buffer *>malloc(n_items * sizeof(Py_buffer))
        try:
            if lens == NULL or segs == NULL or ptrs == NULL or namelens == NULL or names == NULL or views == NULL:
                raise MemoryError()
            # 1. validate everything before any I/O
            for i in range(n_items):
                if many:
                    item = items[i]
                    if not isinstance(item, tuple) or len(item) != 3:
                        raise TypeError(f"item {i} must be a tuple (addr, data, segment_size), got {item!r:.80}")
                    addr, data, segment_size = item
                else:
                    addr, data, segment_size = addr1, data1, seg1
                segment_size = _operator.index(segment_size)
                if not 0 < segment_size <= MAX_SEGMENT_SIZE:
                    raise ValueError(f"segment_size must be in 1..{MAX_SEGMENT_SIZE} (a UDP payload), "
                                     f"got {segment_size}")
                seg = segment_size
                PyObject_GetBuffer(data, &views[nviews], PyBUF_STRIDES)
                nviews += 1
                if not PyBuffer_IsContiguous(&views[nviews - 1], b'C'):
                    raise ValueError("data must be a C-contiguous buffer; pass bytes(x) or numpy.ascontiguousarray(x)")
                namelens[i] = self._encode_name(addr, &names[i])
                lens[i] = views[i].len
                segs[i] = seg
                ptrs[i] = <char *>views[i].buf
            # 2. walk a cursor (it, off) over the items, sendmmsg per batch of messages
            it = 0
            off = 0
            while it < n_items:
                nm = 0
                i = it
                L = off
                while nm < self._scap and i < n_items:
                    if L >= lens[i]:
                        i += 1
                        L = 0
                        continue
                    seg = segs[i]
                    rem = lens[i] - L
                    use_gso = False
                    if gso_ok and rem > seg:
                        per = GSO_MAX_BYTES // seg
                        if per > GSO_MAX_SEGMENTS:
                            per = GSO_MAX_SEGMENTS
                        if per >= 2:
                            use_gso = True
                            chunk = per * seg
                            if chunk > rem:
                                chunk = rem
                        else:
                            chunk = seg
                    else:
                        chunk = seg if rem > seg else rem
                    h = &self._smsgs[nm].msg_hdr
                    if namelens[i] > 0:
                        h.msg_name = &names[i]
                        h.msg_namelen = namelens[i]
                    else:
                        h.msg_name = NULL
                        h.msg_namelen = 0
                    self._siov[nm].iov_base = ptrs[i] + L
                    self._siov[nm].iov_len = chunk
                    if use_gso:
                        ltp_set_gso(h, self._scmsg + nm * LTP_CMSG_SIZE, <uint16_t>seg)
                    else:
                        h.msg_control = NULL
                        h.msg_controllen = 0
                    h.msg_flags = 0
                    self._m_item[nm] = i
                    self._m_off[nm] = L
                    self._m_len[nm] = chunk
                    self._m_nseg[nm] = (chunk + seg - 1) // seg
                    self._m_gso[nm] = use_gso
                    nm += 1
                    L += chunk
                if nm == 0:
                    it = n_items
                    break
                e = 0
                with nogil:
                    r = sendmmsg(fd, self._smsgs, nm, MSG_DONTWAIT)
                    if r < 0:
                        e = errno
                self._syscalls += 1
                k = r if r > 0 else 0
                for j in range(k):
                    accepted += self._m_len[j]
                    self._dgrams_out += self._m_nseg[j]
                if k == nm:
                    it = i
                    off = L
                    continue
                # entry k was not sent: move the cursor there
                it = self._m_item[k]
                off = self._m_off[k]
                if r > 0:
                    continue  # the next call reports entry k's error, if any
                if e == EINTR:
                    continue
                if self._send_full_or_count(e):
                    break
                if _is_icmp(e):
                    if retry_at_item == it and retry_at_off == off:
                        # failed twice in a row: the destination is unreachable, drop it like a loss
                        accepted += self._m_len[k]
                        off += self._m_len[k]
                        retry_at_item = -1
                    else:
                        retry_at_item = it
                        retry_at_off = off
                    continue
                if self._m_gso[k] and (e == EINVAL or e == EIO):
                    gso_ok = False
                    if e == EIO:
                        self.gso_enabled = False
                    continue
                if accepted > 0 or it > 0:
                    break
                raise OSError(e, f"UdpIO.send: sendmmsg failed: {_os.strerror(e)}"
                              + (" (is segment_size larger than the path allows?)" if e == _errno.EMSGSIZE else ""))
        finally:
            for i in range(nviews):
                PyBuffer_Release(&views[i])
            if n_items > 1:
                free(lens)
                free(segs)
                free(ptrs)
                free(namelens)
                free(names)
                free(views)
        # every item before the cursor went out completely (zero-length items included)
        if many:
            return it
        return accepted
