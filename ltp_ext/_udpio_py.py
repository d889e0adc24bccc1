"""Batched, non-blocking UDP socket I/O, pure-Python twin of ``ltp_ext._udpio``.

Same API, same exceptions, same stats keys as the compiled module. It exercises
the same kernel features (UDP_GRO receive, UDP_SEGMENT send) but makes one
Python-level syscall per receive slot or send message, so it receives several
times slower than the compiled ``recvmmsg`` path (see ``python -m
ltp_tools.udpio_bench``); GSO sends, where the kernel does the work, come close.

Theory of operation
-------------------
Receive.  ``socket.recvmsg_into`` is called up to ``batch`` times per
``recv_batch``, each call filling its own *slot* of one preallocated buffer
(``max_datagram`` bytes, or 65536 with GRO).  With ``UDP_GRO`` enabled the
kernel may deliver a coalesced run of equal-sized datagrams in one slot,
together with a ``SOL_UDP/UDP_GRO`` control message carrying the segment
size; the slot is then cut back into its datagrams, so callers always see
individual datagrams.  Offsets and lengths go into int64 arrays exactly as
in the compiled module.

Send.  Everything is validated first (address tuples, segment sizes,
C-contiguous buffers).  A cursor ``(item, byte offset)`` then walks the items;
each step sends one message with ``socket.sendmsg``: with GSO a
super-datagram of at most 64 segments / 65000 bytes with a ``UDP_SEGMENT``
control message, otherwise one datagram (the compiled module batches these
with ``sendmmsg``; Python has no ``sendmmsg``).  Errors are handled exactly
as in the compiled module: ``EAGAIN``/``ENOBUFS`` stop the call; ICMP-reported
errors are counted, the message retried once and then dropped as a loss;
``EINVAL``/``EIO`` on a GSO message make the rest of the call go without GSO
(``EIO`` for good); anything else raises unless something was already
accepted in this call.

Staged sends (``stage_sends=True``, the default).  A gather message (``send_segments``) is a header and a
segment per packet; it goes to the kernel as one buffer, the pieces joined first, instead of two buffers per
packet.  The compiled module copies a few messages at a time into a stage small enough to stay in cache, because
the kernel's copy walks a message's buffers one by one and pays its entry cost per buffer (docs/performance.md,
session 55).  The bytes on the wire are the same either way.

Errors.  With ``recverr=True`` (default) ``IP_RECVERR`` is set, so the kernel
queues every ICMP error about a datagram we sent, *with the peer's address*
(an unconnected socket otherwise only sees a bare errno); ``recv_errors()``
drains that queue (``MSG_ERRQUEUE``) so the caller can tell which peer is gone.

Sender threads (``send_threads`` > 0).  ``send_segments`` copies the
headers, keeps a view of the payload and queues the batch to the thread that
serves its destination (assigned at first use to the thread serving the
fewest destinations, so one destination's packets keep their order); the
call returns with every packet accepted and waits only when that thread holds
``SEND_QUEUE_DEPTH`` batches.  A batch sent in parts (``parts=k``) is cut into
``k`` contiguous parts, one per thread, whose packets may interleave.  The thread sends on its own duplicate of the
socket and waits for room when the socket is full, so a batch handed to it
goes out unless the kernel refuses a packet (counted per errno, dropped as a
loss).  Finished batches are *reaped* by the caller's thread (``reap``,
``stats``, the next ``send_segments``): their counts join ``stats`` and their
payload views are released.  The compiled module runs the same design in C
threads that never hold the GIL.
"""

from __future__ import annotations

import errno as _errno
import mmap as _mmap
import operator as _operator
import os as _os
import queue as _queue
import select as _select
import socket as _socket
import sys
import struct as _struct
import threading as _threading
import time as _time

import numpy as np

from .constants import SEND_PACE_CREDIT_S, SEND_QUEUE_DEPTH, SEND_THREADS_MAX

__all__ = [
    "UdpIO",
    "ICMP_ERRNOS",
    "GSO_MAX_SEGMENTS",
    "GSO_MAX_BYTES",
    "MAX_SEGMENT_SIZE",
    "GRO_SLOT_SIZE",
    "MAX_BATCH",
    "SEND_THREADS_MAX",
    "SEND_QUEUE_DEPTH",
]

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104

#: Errno values that ICMP reports on UDP sockets; counted and ignored, never raised.
ICMP_ERRNOS = frozenset({_errno.ECONNREFUSED, _errno.EHOSTUNREACH, _errno.ENETUNREACH, _errno.EHOSTDOWN})
#: Most segments per GSO super-datagram.
GSO_MAX_SEGMENTS = 64
#: Most payload bytes per GSO super-datagram.
GSO_MAX_BYTES = 65000
#: Largest UDP payload over IPv4; the upper bound of ``segment_size``.
MAX_SEGMENT_SIZE = 65507
#: Receive slot size when GRO is on (the largest coalesced datagram).
GRO_SLOT_SIZE = 65536
#: Most ``mmsghdr`` entries per syscall accepted by the kernel (UIO_MAXIOV).
MAX_BATCH = 1024

_ADDR_CACHE_MAX = 4096
_TX_SLEEP_SLICE_S = 0.01  # a paced thread sleeps at most this long between looks at the stop flag
_ICMP_RETRIES = 4
#: setsockopt option number of SO_TIMESTAMPNS (Linux; not exported by Python's socket module)
SO_TIMESTAMPNS_OPT = 35
#: setsockopt option number of SO_RXQ_OVFL (Linux): every datagram read carries the socket's drop count
SO_RXQ_OVFL_OPT = 40
_TIMESPEC = _struct.Struct("@qq")


def _try_sol_socket(sock, opt: int) -> bool:
    """Turn on the SOL_SOCKET option ``opt``; False where the kernel refuses it."""
    try:
        sock.setsockopt(_socket.SOL_SOCKET, opt, 1)
    except OSError:
        return False
    return True


_ANC_SIZE = 256   # the UDP_GRO cmsg plus room for timestamps, pktinfo... (as the compiled module)
_INT = _struct.Struct("@i")
#: IP_RECVERR / IPV6_RECVERR (Linux): ICMP errors queued on the socket with the peer's address
IP_RECVERR_OPT = 11
IPV6_RECVERR_OPT = 25
_MSG_ERRQUEUE = 0x2000
_EXT_ERR = _struct.Struct("@IBBBBII")  # struct sock_extended_err
_ERRQ_PAYLOAD = 64
_ERRQ_ANC = 512
_U16 = _struct.Struct("@H")


def _check_pacing(pace_rate: float, pace_quantum: int, send_threads: int) -> None:
    if not (pace_rate >= 0 and pace_rate < float("inf")):
        raise ValueError(f"pace_rate must be a finite number of bytes per second >= 0, got {pace_rate}")
    if pace_rate > 0 and send_threads <= 0:
        raise ValueError("pace_rate needs sender threads: create the UdpIO with send_threads >= 1, or pass pace_rate=0")
    if pace_rate > 0 and pace_quantum <= 0:
        raise ValueError(f"pace_quantum must be > 0 bytes when pace_rate is set, got {pace_quantum}")


def _check_parts(parts: int, pace_rate: float, send_threads: int) -> None:
    if parts < 1 or parts > max(1, send_threads):
        raise ValueError(f"parts must be 1..send_threads ({send_threads}), got {parts}")
    if parts > 1 and pace_rate > 0:
        raise ValueError("parts > 1 sends unpaced parts side by side: pass pace_rate=0, or parts=1")


def _closed_error() -> OSError:
    return OSError(_errno.EBADF, "UdpIO: the socket is closed; create a new socket and a new UdpIO")


def _check_addr(family: int, addr) -> tuple:
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


class UdpIO:
    """Batched, non-blocking UDP I/O on an existing socket (IPv4 and IPv6).

    The socket is switched to non-blocking mode and must stay open while the
    ``UdpIO`` is used; the ``UdpIO`` does not own it (close the socket yourself).
    ``gro=True`` enables ``UDP_GRO`` on the socket; ``gso=True`` uses
    ``UDP_SEGMENT`` when the kernel offers it (``gso_enabled`` says whether).
    ``stats`` counts syscalls, datagrams in and out, receive/send calls that
    met EAGAIN (or ENOBUFS), and ``errors`` by errno name: ICMP-reported
    errors, ``EMSGSIZE`` for dropped oversized datagrams, ``EINVAL``/``EIO``
    for GSO fallbacks, ``ENOBUFS``; and ``MSG_CTRUNC`` for receives dropped
    because other control messages left no room for the GRO one.  Not
    thread-safe: use one ``UdpIO`` per thread.
    """

    def __init__(self, sock, *, batch: int = 64, max_datagram: int = 2048, gso: bool = True, gro: bool = True,
                 timestamps: bool = True, recverr: bool = True, drops: bool = True, send_threads: int = 0,
                 stage_sends: bool = True):
        batch = _operator.index(batch)
        max_datagram = _operator.index(max_datagram)
        send_threads = _operator.index(send_threads)
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
        self._stage = bool(stage_sends)
        self._family = int(sock.family)
        self._batch = batch
        self._max_datagram = max_datagram
        sock.setblocking(False)
        self._gro = False
        if gro:
            try:
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self._gro = True
            except OSError:
                pass
        else:
            try:
                sock.setsockopt(SOL_UDP, UDP_GRO, 0)
            except OSError:
                pass
        self._gso = False
        if gso:
            try:
                sock.getsockopt(SOL_UDP, UDP_SEGMENT)
                self._gso = True
            except OSError:
                pass
        self._ts = bool(timestamps) and _try_sol_socket(sock, SO_TIMESTAMPNS_OPT)
        self._drops = bool(drops) and _try_sol_socket(sock, SO_RXQ_OVFL_OPT)
        self._socket_drops = 0
        self._recverr = False
        if recverr:
            try:
                if sock.family == _socket.AF_INET6:
                    sock.setsockopt(_socket.IPPROTO_IPV6, IPV6_RECVERR_OPT, 1)
                sock.setsockopt(_socket.IPPROTO_IP, IP_RECVERR_OPT, 1)
                self._recverr = True
            except OSError:
                self._recverr = sock.family == _socket.AF_INET6 and bool(
                    sock.getsockopt(_socket.IPPROTO_IPV6, IPV6_RECVERR_OPT))
        self._slot_size = max(max_datagram, GRO_SLOT_SIZE) if self._gro else max_datagram
        # an anonymous mapping, not a bytearray: its pages are committed only when a datagram lands in them (a
        # GRO slot is 64 kB and most datagrams fill its first page), as the compiled module's malloc'd buffer is;
        # a zero-filled bytearray committed all 4 MB at once for every socket (64 peer sockets: 260 MB)
        self._buf = _mmap.mmap(-1, self._slot_size * batch)
        self._buffer_view = memoryview(self._buf)
        self._slots = [self._buffer_view[i * self._slot_size:(i + 1) * self._slot_size] for i in range(batch)]
        self._alloc_out(batch * GSO_MAX_SEGMENTS if self._gro else batch)
        self._n = 0
        self._addrs: list = []        # source address per datagram of the last batch
        self._name_cache: dict = {}
        self._syscalls = 0
        self._dgrams_in = 0
        self._slots_in = 0
        self._dgrams_out = 0
        self._eagain = 0
        self._paced_sleeps = 0
        self._paced_late = 0.0
        self._errors: dict[str, int] = {}
        self._icmp_errors = 0
        self._send_threads = send_threads  # started by the first send_segments
        self._tx: list = []         # per thread: [job queue, thread, submitted, finished-job queue, reaped]
        self._tx_assign: dict = {}  # destination -> its thread
        self._tx_assign_max = _ADDR_CACHE_MAX  # destinations remembered before the idle ones are forgotten
        self._tx_load: list = []
        self._tx_pid = 0
        self._tx_sock = None

    # read-only attributes, as in the compiled module
    family = property(lambda self: self._family, doc="The socket family (AF_INET or AF_INET6).")
    batch = property(lambda self: self._batch, doc="Most receive slots (and at least the send entries) per syscall.")
    max_datagram = property(lambda self: self._max_datagram, doc="Largest datagram received without GRO.")
    gso_enabled = property(lambda self: self._gso, doc="UDP_SEGMENT usable (probed; False when the kernel refuses).")
    gro_enabled = property(lambda self: self._gro, doc="UDP_GRO enabled on the socket.")
    timestamps_enabled = property(lambda self: self._ts, doc="SO_TIMESTAMPNS enabled (kernel receive times).")
    icmp_errors = property(lambda self: self._icmp_errors,
                           doc="ICMP-reported errors (ECONNREFUSED, EHOSTUNREACH...) the socket calls met so far: "
                               "when it grows, recv_errors() has reports to read.")
    drops_enabled = property(lambda self: self._drops, doc="SO_RXQ_OVFL enabled (the socket's drop count).")
    stage_sends = property(lambda self: self._stage,
                           doc="a gather message goes to the kernel as one buffer (True) or one per header and segment")
    socket_drops = property(lambda self: self._socket_drops,
                            doc="The socket's cumulative count of datagrams the kernel dropped for want of room, "
                                "as the last datagram that carried it said (0 before any drop).")
    recverr_enabled = property(lambda self: self._recverr,
                               doc="IP_RECVERR enabled: ICMP reports are read with recv_errors().")
    send_threads = property(lambda self: self._send_threads,
                            doc="Sender threads that make send_segments' sends (0: the caller sends).")

    def _alloc_out(self, cap: int) -> None:
        self._cap = cap
        self._off_arr = np.zeros(cap, dtype=np.int64)
        self._len_arr = np.zeros(cap, dtype=np.int64)
        self._time_arr = np.full(cap, -1.0, dtype=np.float64)

    def _fd(self) -> int:
        fd = self._sock.fileno()
        if fd < 0:
            raise _closed_error()
        return fd

    def _send_full_or_count(self, e: int) -> bool:
        """Count a failed send; True when the socket buffer is full (EAGAIN/ENOBUFS): stop for now."""
        if e in (_errno.EAGAIN, _errno.EWOULDBLOCK, _errno.ENOBUFS):
            self._eagain += 1
            if e == _errno.ENOBUFS:
                self._count_error(e)
            return True
        self._count_error(e)
        return False

    def _count_error(self, e: int) -> None:
        if e in ICMP_ERRNOS:
            self._icmp_errors += 1
        name = _errno.errorcode.get(e, str(e))
        self._errors[name] = self._errors.get(name, 0) + 1

    # ------------------------------------------------------------------ sender threads

    def _start_send_threads(self) -> None:
        self._tx_sock = self._sock.dup()  # closing the caller's socket cannot pull it from under a thread
        for _ in range(self._send_threads):
            q: _queue.Queue = _queue.Queue(maxsize=SEND_QUEUE_DEPTH)
            done: _queue.SimpleQueue = _queue.SimpleQueue()
            # the thread holds the queues and the socket, not the UdpIO: a dropped UdpIO stops it (__del__)
            pace = {"next": 0.0, "stop": _threading.Event()}  # the thread's paced timeline; set: stop pacing
            t = _threading.Thread(target=_tx_main, args=(self._tx_sock, q, done, pace), name="ltp-udpio-send",
                                  daemon=True)
            t.start()
            self._tx.append([q, t, 0, done, 0, pace])
            self._tx_load.append(0)
        self._tx_pid = _os.getpid()

    def __del__(self) -> None:
        if getattr(self, "_tx_pid", 0) != _os.getpid():
            return  # never started, or a forked child's copy: its threads are not in this process
        for tx in self._tx:
            tx[5]["stop"].set()
            tx[0].put(None)  # the thread sends what it holds, then ends

    def _reap(self, w: int) -> None:
        tx = self._tx[w]
        while True:
            try:
                job = tx[3].get_nowait()
            except _queue.Empty:
                return
            self._syscalls += job["syscalls"]
            self._dgrams_out += job["dgrams"]
            self._eagain += job["eagain"]
            self._paced_sleeps += job["paced_sleeps"]
            self._paced_late += job["paced_late"]
            for e in job["errors"]:
                self._count_error(e)
            if job["gso_failed"] == 2:
                self._gso = False
            job["msgs"] = None
            job["payload"].release()
            tx[4] += 1

    def reap(self) -> int:
        """Fold finished background sends into ``stats`` and release the buffers they held.

        Returns how many ``send_segments`` batches the sender threads still
        hold (0 without sender threads).  ``send_segments`` and ``stats`` reap
        by themselves; call it when a payload buffer must be released (a
        ``bytearray`` cannot be resized while a batch of it is queued).
        """
        queued = 0
        for w, tx in enumerate(self._tx):
            self._reap(w)
            queued += tx[2] - tx[4]
        return queued

    def wait_sent(self) -> None:
        """Block until the sender threads sent every batch handed to them, then reap."""
        for tx in self._tx:
            tx[0].join()
        self.reap()

    def stop_send_threads(self) -> None:
        """Let the sender threads send what they hold, stop them and reap; later sends run in the caller.

        Call it before closing the socket.  Idempotent; a no-op without sender threads.
        """
        if self._tx and self._tx_pid == _os.getpid():  # a forked child's copy has no threads to stop
            for tx in self._tx:
                tx[5]["stop"].set()  # what it still holds goes out unpaced
                tx[0].put(None)
            for tx in self._tx:
                tx[1].join()
            self.reap()
        self._tx = []
        self._send_threads = 0
        if self._tx_sock is not None:
            self._tx_sock.close()
            self._tx_sock = None

    def _tx_enqueue(self, name, hv: memoryview, pv: memoryview, sv, n: int, seg_size: int, total: int,
                    gso_ok: bool, pace_rate: float = 0.0, pace_quantum: int = 0, part: int = 0) -> None:
        """Queue one batch to a sender thread; ``part`` k > 0 (the k-th part of a batch sent in parts) goes to the
        thread ``k`` after the destination's own."""
        if not self._tx:
            self._start_send_threads()
        if _os.getpid() != self._tx_pid:
            raise RuntimeError("UdpIO: this process was forked from the one that started the sender threads; "
                               "create the UdpIO (and its endpoint) in the process that uses it")
        entry = self._tx_assign.get(name)
        if entry is None:
            if len(self._tx_assign) >= self._tx_assign_max:
                self._tx_forget_idle()
            w = min(range(len(self._tx)), key=lambda i: (self._tx_load[i], i))
            self._tx_load[w] += 1
            entry = [w, 0, None]  # its thread, the job count that includes its latest batch there, parts elsewhere
            self._tx_assign[name] = entry
        w = (entry[0] + part) % len(self._tx)
        hdrs = bytes(hv[:16 * n])
        msgs, j = [], 0
        max_segs = max(1, pace_quantum // (16 + seg_size)) if pace_rate > 0 else 0  # no message over a sub-burst
        while j < n:
            msg = _gather_message(hdrs, pv, sv, j, n, seg_size, total, gso_ok, max_segs)
            msgs.append(msg)
            j += msg[2]
        job = dict(name=name, msgs=msgs, payload=pv, stage=self._stage, dgrams=0, syscalls=0, eagain=0, errors=[],
                   gso_failed=0, paced_sleeps=0, paced_late=0.0, rate=pace_rate, quantum=pace_quantum,
                   credit=SEND_PACE_CREDIT_S)
        tx = self._tx[w]
        self._reap(w)
        tx[0].put(job)  # waits while the thread holds SEND_QUEUE_DEPTH batches
        tx[2] += 1
        if w == entry[0]:
            entry[1] = tx[2]
        else:  # a part on another thread: remembered so that _tx_busy sees it too
            if entry[2] is None:
                entry[2] = {}
            entry[2][w] = tx[2]

    def _tx_parts(self, name, hv: memoryview, pv: memoryview, sv, n: int, seg_size: int, total: int,
                   gso_ok: bool, parts: int) -> None:
        """Queue ``parts`` contiguous parts of one batch to as many sender threads."""
        a = 0
        for k in range(parts):
            b = n * (k + 1) // parts
            self._tx_enqueue(name, hv[16 * a:], pv, sv[a:b], b - a, seg_size, total, gso_ok, 0.0, 0, k)
            a = b

    def _tx_busy(self, name) -> bool:
        """Whether a batch for this destination is still queued or being sent (a send beside it must queue too)."""
        entry = self._tx_assign.get(name) if self._tx else None
        if entry is None:
            return False
        return self._entry_busy(entry)

    def _entry_busy(self, entry) -> bool:
        """Whether any thread still holds a batch (or a part of one) of the destination of ``entry``."""
        self._reap(entry[0])
        if self._tx[entry[0]][4] < entry[1]:
            return True
        for w, head in (entry[2] or {}).items():
            self._reap(w)
            if self._tx[w][4] < head:
                return True
        return False

    def _tx_forget_idle(self) -> None:
        """The destination table is full: forget every destination no thread holds a batch of. One with a batch
        queued keeps its thread, so that its next batch queues behind it in order and a send beside it still
        sees it busy; those are at most ``send_threads`` x ``SEND_QUEUE_DEPTH``, so the table stays bounded."""
        idle = [name for name, entry in self._tx_assign.items() if not self._entry_busy(entry)]
        for name in idle:
            entry = self._tx_assign.pop(name)
            self._tx_load[entry[0]] -= 1

    @property
    def thread_destinations(self) -> int:
        """How many destinations the sender threads remember (each keeps one thread while it is remembered)."""
        return len(self._tx_assign)

    @property
    def thread_destinations_max(self) -> int:
        """Destinations remembered before those with nothing queued are forgotten (a forgotten one gets a thread
        afresh, the least loaded, with its next batch). Settable: an int of at least 1."""
        return self._tx_assign_max

    @thread_destinations_max.setter
    def thread_destinations_max(self, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"thread_destinations_max must be an int >= 1, got {value!r}")
        self._tx_assign_max = min(value, 1 << 30)

    # ------------------------------------------------------------------ receive

    @property
    def buffer(self) -> memoryview:
        """The receive buffer (a ``memoryview`` of bytes), valid until the next ``recv_batch``."""
        return self._buffer_view

    @property
    def offsets(self) -> np.ndarray:
        """int64 offsets in ``buffer`` of the datagrams of the last ``recv_batch``."""
        return self._off_arr[:self._n]

    @property
    def lengths(self) -> np.ndarray:
        """int64 lengths of the datagrams of the last ``recv_batch``."""
        return self._len_arr[:self._n]

    @property
    def times(self) -> np.ndarray:
        """float64 kernel receive times (CLOCK_REALTIME seconds) of the last batch; -1.0 where unknown."""
        return self._time_arr[:self._n]

    @property
    def stats(self) -> dict:
        """Counters: syscalls, datagrams_in, slots_in (receive buffers the kernel filled: a coalesced GRO run
        counts once, its datagrams each count in datagrams_in), datagrams_out, eagain, errors (errno name -> count);
        for paced sends (``pace_rate``), paced_sleeps (sub-bursts that waited for their time) and paced_late_s
        (seconds a thread ran behind its timeline beyond ``SEND_PACE_CREDIT_S`` within a batch: that rate was not
        sent). Sender threads' batches count once they are finished (``wait_sent`` waits for them)."""
        if self._tx:
            self.reap()
        return {
            "syscalls": self._syscalls,
            "datagrams_in": self._dgrams_in,
            "slots_in": self._slots_in,
            "datagrams_out": self._dgrams_out,
            "eagain": self._eagain,
            "paced_sleeps": self._paced_sleeps,
            "paced_late_s": self._paced_late,
            "errors": dict(self._errors),
            "socket_drops": self._socket_drops,
        }

    def __len__(self) -> int:
        """Number of datagrams from the last ``recv_batch``."""
        return self._n

    def recv_batch(self) -> int:
        """Receive without blocking; return the number of datagrams (0 when none is waiting).

        Up to ``batch`` receives fill one slot each; with GRO a slot may hold a
        coalesced run, which is split back into its datagrams, so the count can
        exceed ``batch``.  Datagrams longer than ``max_datagram`` (without GRO)
        are dropped and counted as ``errors['EMSGSIZE']``.  After the call,
        datagram ``i`` is ``buffer[offsets[i]:offsets[i] + lengths[i]]`` from
        ``addr(i)``.
        """
        self._fd()
        sock = self._sock
        self._n = 0
        got = []  # (slot, length, gro segment size, address)
        tries = 0
        slot = 0
        while slot < self._batch:
            try:
                nbytes, anc, flags, address = sock.recvmsg_into([self._slots[slot]], _ANC_SIZE,
                                                                  _socket.MSG_DONTWAIT)
            except InterruptedError:
                self._syscalls += 1
                continue
            except BlockingIOError:
                self._syscalls += 1
                if not got:
                    self._eagain += 1
                break
            except OSError as exc:
                self._syscalls += 1
                if exc.errno in ICMP_ERRNOS:
                    # the pending socket error was consumed by this call; try again
                    self._count_error(exc.errno)
                    tries += 1
                    if tries <= _ICMP_RETRIES:
                        continue
                    break
                if got:
                    # report it on the next call, as recvmmsg does
                    break
                raise OSError(exc.errno, f"UdpIO.recv_batch: recvmsg failed: {_os.strerror(exc.errno)}") from None
            self._syscalls += 1
            self._slots_in += 1
            if flags & _socket.MSG_TRUNC:
                self._count_error(_errno.EMSGSIZE)
                slot += 1
                continue
            g = 0
            t = -1.0
            for level, kind, cdata in anc:
                if level == SOL_UDP and kind == UDP_GRO:
                    g = _INT.unpack(cdata[:_INT.size])[0]
                elif level == _socket.SOL_SOCKET and kind == SO_TIMESTAMPNS_OPT and len(cdata) >= _TIMESPEC.size:
                    sec, nsec = _TIMESPEC.unpack(cdata[:_TIMESPEC.size])
                    t = sec + nsec * 1e-9
                elif level == _socket.SOL_SOCKET and kind == SO_RXQ_OVFL_OPT and len(cdata) >= 4:
                    self._socket_drops = int.from_bytes(cdata[:4], sys.byteorder)
            if g == 0 and self._gro and flags & _socket.MSG_CTRUNC:
                # the UDP_GRO cmsg may have been cut off: the slot could be a coalesced run
                # that cannot be split, so drop it rather than deliver glued datagrams
                self._errors["MSG_CTRUNC"] = self._errors.get("MSG_CTRUNC", 0) + 1
                slot += 1
                continue
            got.append((slot, nbytes, g, address, t))
            slot += 1
        need = sum(-(-n // g) if 0 < g < n else 1 for _, n, g, _, _ in got)
        if need > self._cap:
            self._alloc_out(need)
        off, lens, times, addrs = self._off_arr, self._len_arr, self._time_arr, []
        n = 0
        for slot, length, g, address, t in got:
            base = slot * self._slot_size
            if 0 < g < length:
                for pos in range(0, length, g):
                    off[n] = base + pos
                    lens[n] = min(g, length - pos)
                    times[n] = t
                    addrs.append(address)
                    n += 1
            else:
                off[n] = base
                lens[n] = length
                times[n] = t
                addrs.append(address)
                n += 1
        self._n = n
        self._addrs = addrs
        self._dgrams_in += n
        return n

    def recv_errors(self, limit=64):
        """Drain the socket's error queue (``IP_RECVERR``): ICMP reports about datagrams we sent.

        Returns up to ``limit`` tuples ``(addr, errno, origin, icmp_type, icmp_code)``:
        ``addr`` is the destination of the datagram the report is about (the
        peer), ``errno`` e.g. ``ECONNREFUSED`` for ICMP port unreachable,
        ``origin`` 2 (ICMP) or 3 (ICMPv6). Empty when ``recverr`` is off or
        nothing is queued; never raises for an empty queue."""
        out: list = []
        if not self.recverr_enabled:
            return out
        sock = self._sock
        if sock.fileno() < 0:
            raise _closed_error()
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

    def addr(self, i: int) -> tuple:
        """Source address of datagram ``i`` of the last batch, as the socket module returns it."""
        i = _operator.index(i)
        if i < 0 or i >= self._n:
            raise IndexError(f"datagram index {i} out of range for a batch of {self._n}")
        return self._addrs[i]

    def runs(self, start: int = 0) -> list:
        """``[(addr, start, stop), ...]``: maximal runs of consecutive datagrams from one source,
        from datagram ``start`` of the batch on (after :meth:`drain`: its ``resume``)."""
        start = _operator.index(start)
        if start < 0:
            raise ValueError(f"start must be non-negative, got {start}")
        out = []
        addrs = self._addrs
        for j in range(start + 1, self._n + 1):
            if j == self._n or addrs[j] != addrs[start]:
                out.append((addrs[start], start, j))
                start = j
        return out

    def _host_port(self, address) -> tuple:
        """``(packed host, port)`` of an address tuple: what :meth:`drain` compares."""
        return _socket.inet_pton(self._family, address[0]), address[1]

    def drain(self, window, addr, max_batches: int, min_datagrams: int = 0) -> tuple:
        """Receive batch after batch and feed one flow's DATA straight into ``window``.

        :meth:`drain_flows` for one flow. Returns ``(batches, read, consumed, consumed_bytes,
        resume)``: receives made, datagrams read, datagrams the window consumed (its duplicates
        and bad ones included) and their bytes, and the index of the last batch's first datagram
        not consumed (``len(self)`` when none is left)."""
        batches, read, consumed, cbytes, resume = self.drain_flows((window,), (addr,), max_batches, min_datagrams)
        return batches, read, consumed[0], cbytes[0], resume

    def drain_flows(self, windows, addrs, max_batches: int, min_datagrams: int = 0) -> tuple:
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
        max_batches = _operator.index(max_batches)
        min_datagrams = _operator.index(min_datagrams)
        if max_batches < 1:
            raise ValueError(f"max_batches must be at least 1, got {max_batches}")
        windows, addrs = list(windows), list(addrs)
        if not windows or len(windows) != len(addrs):
            raise ValueError(f"drain_flows needs one source address per window and at least one window "
                             f"(got {len(windows)} windows, {len(addrs)} addresses)")
        for window in windows:
            if not hasattr(window, "ingest"):
                raise TypeError(f"drain needs a RecvWindow (with ingest()), got {type(window).__name__}")
        wants = [self._host_port(self._resolve(a)) for a in addrs]
        consumed, cbytes = [0] * len(windows), [0] * len(windows)
        self._n = 0
        batches = read = i = 0
        done = False
        while batches < max_batches:
            i = 0
            try:
                n = self.recv_batch()
            except OSError:
                if batches == 0:
                    raise
                self._n = 0
                break  # what was consumed is reported now; the next receive meets the error again
            batches += 1
            if n == 0:
                break
            read += n
            lens = self._len_arr
            while i < n:
                source, _start, stop = self.runs(i)[0]
                source = self._host_port(source)
                j = i
                for k, window in enumerate(windows):
                    if wants[k] != source:
                        continue
                    j = window.ingest(self._buffer_view, self._off_arr, lens, i, stop)
                    if j > i:
                        consumed[k] += j - i
                        cbytes[k] += int(lens[i:j].sum())
                        done = done or window.received >= window.seg_count
                        break
                if j == i:
                    break  # a datagram for the caller's own path
                i = j
            if i < n or done:
                break  # left for the caller, or a window is complete: the caller closes it now
            if n < self._batch and n < min_datagrams:
                break
        return batches, read, consumed, cbytes, i

    # ------------------------------------------------------------------ send

    def _resolve(self, addr):
        if addr is None:
            return None
        try:
            return self._name_cache[addr]
        except (KeyError, TypeError):
            pass
        host, port, flowinfo, scope = _check_addr(self._family, addr)
        try:
            _socket.inet_pton(self._family, host)
        except (OSError, ValueError):
            # not a numeric address: resolve like the socket module would
            sa = _socket.getaddrinfo(host, port, self._family, _socket.SOCK_DGRAM)[0][4]
            host = sa[0]
            if self._family == _socket.AF_INET6 and len(addr) <= 3:
                scope = sa[3]
        name = (host, port) if self._family == _socket.AF_INET else (host, port, flowinfo, scope)
        if len(self._name_cache) >= _ADDR_CACHE_MAX:
            self._name_cache.clear()
        self._name_cache[addr] = name
        return name

    def send(self, addr, data, segment_size) -> int:
        """Send ``data`` to ``addr`` as datagrams of ``segment_size`` bytes (the last may be shorter).

        ``data`` is any C-contiguous buffer; ``addr`` is an address tuple, or
        ``None`` for the peer of a connected socket.  Non-blocking: returns the
        number of bytes accepted, a multiple of ``segment_size`` unless
        everything was sent; stops early on EAGAIN/ENOBUFS.  Empty ``data``
        sends nothing and returns 0.
        """
        return self._send([(addr, data, segment_size)], False)

    def send_many(self, items) -> int:
        """Send several ``(addr, data, segment_size)`` items; return how many were sent completely.

        Items go out in order, batched into as few syscalls as possible.  When
        it stops early (EAGAIN/ENOBUFS), the first item not counted may have
        had some of its datagrams sent.  All items are validated before
        anything is sent.
        """
        return self._send(list(items), True)

    def send_segments(self, addr, headers, payload, seqs, seg_size: int, total: int, background: bool = True,
                      pace_rate: float = 0.0, pace_quantum: int = 0, parts: int = 1) -> int:
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
        fd = self._fd()
        del fd
        seg_size, total = _operator.index(seg_size), _operator.index(total)
        pace_rate, pace_quantum = float(pace_rate), _operator.index(pace_quantum)
        if seg_size <= 0 or seg_size + 16 > MAX_SEGMENT_SIZE:
            raise ValueError(f"seg_size must be in 1..{MAX_SEGMENT_SIZE - 16}, got {seg_size}")
        _check_pacing(pace_rate, pace_quantum, self._send_threads)
        _check_parts(parts, pace_rate, self._send_threads)
        sv = np.ascontiguousarray(seqs, dtype=np.int64)
        n = sv.shape[0]
        if n == 0:
            return 0
        name = self._resolve(addr)
        hv = memoryview(headers).cast("B")
        pv = memoryview(payload).cast("B")
        if len(hv) < n * 16:
            raise ValueError(f"headers hold {len(hv)} bytes, {n} packets need {n * 16}")
        if total > len(pv) or total <= 0:
            raise ValueError(f"total={total} must be in 1..len(payload)={len(pv)}")
        for q in sv.tolist():
            if q < 0 or q * seg_size >= total:
                raise ValueError(f"segment {q} is outside a {total}-byte message of {seg_size}-byte segments")
        if parts > 1 and n >= parts:
            self._tx_parts(name, hv, pv, sv, n, seg_size, total, self._gso, parts)
            return n
        if self._send_threads and (background or pace_rate > 0 or self._tx_busy(name)):
            self._tx_enqueue(name, hv, pv, sv, n, seg_size, total, self._gso, pace_rate, pace_quantum)
            return n
        sock = self._sock
        gso_ok = self._gso
        accepted = 0
        k = 0
        retry_at = -1
        while k < n:
            parts, anc, m_pkts = _gather_message(hv, pv, sv, k, n, seg_size, total, gso_ok)
            if self._stage:
                parts = [b"".join(parts)]
            j = k + m_pkts
            try:
                self._syscalls += 1
                if name is None:
                    sock.sendmsg(parts, anc, _socket.MSG_DONTWAIT)
                else:
                    sock.sendmsg(parts, anc, _socket.MSG_DONTWAIT, name)
            except InterruptedError:
                continue
            except OSError as exc:
                e = exc.errno
                if self._send_full_or_count(e):
                    break
                if e in ICMP_ERRNOS:
                    if retry_at == k:
                        # refused twice in a row: the destination is unreachable, drop it like a loss
                        accepted += m_pkts
                        k = j
                        retry_at = -1
                    else:
                        retry_at = k
                    continue
                if m_pkts > 1 and e in (_errno.EINVAL, _errno.EIO):
                    gso_ok = False
                    if e == _errno.EIO:
                        self._gso = False
                    continue
                if accepted > 0:
                    break
                raise OSError(e, f"UdpIO.send_segments: sendmsg failed: {_os.strerror(e)}") from None
            accepted += m_pkts
            self._dgrams_out += m_pkts
            k = j
        return accepted

    def _send(self, items: list, many: bool) -> int:
        self._fd()
        n_items = len(items)
        if n_items == 0:
            return 0
        # 1. validate everything before any I/O
        names, views, segs = [], [], []
        for i, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) != 3:
                raise TypeError(f"item {i} must be a tuple (addr, data, segment_size), got {item!r:.80}")
            addr, data, segment_size = item
            segment_size = _operator.index(segment_size)
            if not 0 < segment_size <= MAX_SEGMENT_SIZE:
                raise ValueError(f"segment_size must be in 1..{MAX_SEGMENT_SIZE} (a UDP payload), got {segment_size}")
            mv = memoryview(data)
            if not mv.c_contiguous:
                raise ValueError("data must be a C-contiguous buffer; pass bytes(x) or numpy.ascontiguousarray(x)")
            names.append(self._resolve(addr))
            views.append(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv)
            segs.append(segment_size)
        # 2. walk a cursor (it, off) over the items, one sendmsg per message
        sock = self._sock
        gso_ok = self._gso
        accepted = 0
        it, off = 0, 0
        retry_at = None
        while it < n_items:
            mv, seg, name = views[it], segs[it], names[it]
            length = len(mv)
            if off >= length:
                it, off = it + 1, 0
                continue
            rem = length - off
            use_gso = False
            if gso_ok and rem > seg:
                per = min(GSO_MAX_BYTES // seg, GSO_MAX_SEGMENTS)
                if per >= 2:
                    use_gso = True
                    chunk = min(per * seg, rem)
                else:
                    chunk = seg
            else:
                chunk = min(seg, rem)
            anc = [(SOL_UDP, UDP_SEGMENT, _U16.pack(seg))] if use_gso else []
            try:
                self._syscalls += 1
                if name is None:
                    sock.sendmsg([mv[off:off + chunk]], anc, _socket.MSG_DONTWAIT)
                else:
                    sock.sendmsg([mv[off:off + chunk]], anc, _socket.MSG_DONTWAIT, name)
            except InterruptedError:
                continue
            except OSError as exc:
                e = exc.errno
                if self._send_full_or_count(e):
                    break
                if e in ICMP_ERRNOS:
                    if retry_at == (it, off):
                        # failed twice in a row: the destination is unreachable, drop it like a loss
                        accepted += chunk
                        off += chunk
                        retry_at = None
                    else:
                        retry_at = (it, off)
                    continue
                if use_gso and e in (_errno.EINVAL, _errno.EIO):
                    gso_ok = False
                    if e == _errno.EIO:
                        self._gso = False
                    continue
                if accepted > 0 or it > 0:
                    break
                raise OSError(e, f"UdpIO.send: sendmsg failed: {_os.strerror(e)}"
                              + (" (is segment_size larger than the path allows?)" if e == _errno.EMSGSIZE else "")
                              ) from None
            accepted += chunk
            self._dgrams_out += -(-chunk // seg)
            off += chunk
        # every item before the cursor went out completely (zero-length items included)
        if many:
            return it
        return accepted


def _gather_message(hv, pv, sv, j: int, n: int, seg_size: int, total: int, gso_ok: bool, max_segs: int = 0) -> tuple:
    """One message of gather packets from packet ``j``: ``(parts, ancillary data, packets taken)``.

    Packet ``k`` is header ``hv[16k:16k+16]`` + segment ``sv[k]`` of ``pv``.  Under GSO the message takes equal-sized
    packets (a short one ends it) up to GSO_MAX_SEGMENTS and GSO_MAX_BYTES (and ``max_segs``), with a UDP_SEGMENT
    control message; without GSO, one packet.  The caller-side send and the sender threads' jobs both cut their
    packets here.
    """
    parts, first_len, m_bytes, k = [], -1, 0, j
    if not gso_ok:
        max_segs = 1
    elif max_segs > GSO_MAX_SEGMENTS or max_segs < 1:
        max_segs = GSO_MAX_SEGMENTS
    while j < n and (j - k) < max_segs:
        seq = int(sv[j])
        plen = min(seg_size, total - seq * seg_size)
        if first_len >= 0 and (plen > first_len or m_bytes + 16 + plen > GSO_MAX_BYTES):
            break
        parts += [hv[16 * j:16 * j + 16], pv[seq * seg_size:seq * seg_size + plen]]
        m_bytes += 16 + plen
        j += 1
        if first_len < 0:
            first_len = plen
        elif plen < first_len:
            break  # a short packet ends the batch
    m_pkts = j - k
    anc = [(SOL_UDP, UDP_SEGMENT, _U16.pack(16 + first_len))] if m_pkts > 1 else []
    return parts, anc, m_pkts


# ---------------------------------------------------------------------------- sender threads (twin)
def _tx_main(sock, q, done, pace: dict) -> None:
    """A sender thread: send each queued job on ``sock`` and hand it back through ``done``."""
    while True:
        job = q.get()
        if job is None:
            q.task_done()
            return
        try:
            _tx_run(sock, job, pace)
        finally:
            done.put(job)
            q.task_done()


def _tx_wait_room(sock, job: dict, e: int) -> None:
    job["eagain"] += 1
    if e == _errno.ENOBUFS:
        job["errors"].append(e)
        _select.select([], [], [], 0.0001)  # the device queue, not the socket: it reads as writable
    else:
        _select.select([], [sock], [], 0.02)


def _tx_send(sock, job: dict, parts: list, anc: list) -> int:
    """One sendmsg of a job's message; 0 when sent, else its errno (EAGAIN-class ones already waited out)."""
    name = job["name"]
    job["syscalls"] += 1
    try:
        if name is None:
            sock.sendmsg(parts, anc)
        else:
            sock.sendmsg(parts, anc, 0, name)
    except InterruptedError:
        return _errno.EINTR
    except OSError as exc:
        e = exc.errno
        if e in (_errno.EAGAIN, _errno.EWOULDBLOCK, _errno.ENOBUFS):
            _tx_wait_room(sock, job, e)
        return e
    return 0


def _tx_sleep_until(pace: dict, t: float) -> None:
    """Sleep until monotonic time ``t``, in slices that look at the stop flag (a closing owner stops pacing)."""
    now = _time.monotonic()
    while now < t and not pace["stop"].is_set():
        _time.sleep(min(t - now, _TX_SLEEP_SLICE_S))
        now = _time.monotonic()


def _tx_pace(job: dict, pace: dict, k: int, burst: int) -> int:
    """Before message ``k`` of a paced job: wait for the timeline when ``k`` starts a sub-burst (none is open, or
    it would grow past the quantum). Returns the open sub-burst's bytes so far (0: ``k`` starts one)."""
    nbytes = _msg_bytes(job["msgs"][k])
    if burst > 0 and burst + nbytes <= job["quantum"]:
        return burst
    if pace["stop"].is_set():
        return 0
    now = _time.monotonic()
    if pace["next"] > now:
        _tx_sleep_until(pace, pace["next"])
        job["paced_sleeps"] += 1
    elif pace["next"] < now - job["credit"]:
        # later than that: forgiven (SEND_PACE_CREDIT_S), unless the thread merely sat idle
        if k > 0:
            job["paced_late"] += now - job["credit"] - pace["next"]
        pace["next"] = now - job["credit"]
    return 0


def _msg_bytes(msg: tuple) -> int:
    return sum(len(p) for p in msg[0])


def _tx_run(sock, job: dict, pace: dict) -> None:
    """Send a job's messages in order; a paced job (``rate`` > 0) in sub-bursts of at most ``quantum`` bytes, the
    thread's timeline advancing by each message's bytes / rate (see the compiled ``ltp_tx_run``)."""
    msgs = job["msgs"]
    rate = job["rate"]
    k, retry_at, burst = 0, -1, 0
    while k < len(msgs):
        parts, anc, m_pkts = msgs[k]
        if rate > 0:
            burst = _tx_pace(job, pace, k, burst)
        e = _tx_send(sock, job, [b"".join(parts)] if job["stage"] else parts, anc)
        if e == 0:
            job["dgrams"] += m_pkts
            if rate > 0:
                nbytes = _msg_bytes(msgs[k])
                burst += nbytes
                pace["next"] += nbytes / rate
            k += 1
            continue
        if e in (_errno.EINTR, _errno.EAGAIN, _errno.EWOULDBLOCK, _errno.ENOBUFS):
            continue
        job["errors"].append(e)
        if e in ICMP_ERRNOS:
            # the failed call consumed the pending ICMP report: retry once, then drop like a loss
            if retry_at == k:
                k += 1
                retry_at = -1
            else:
                retry_at = k
            continue
        if m_pkts > 1 and e in (_errno.EINVAL, _errno.EIO):
            job["gso_failed"] = 2 if e == _errno.EIO else max(job["gso_failed"], 1)
            p = 0
            while p < m_pkts:  # the kernel refused the super-datagram: its packets one by one
                e = _tx_send(sock, job, parts[2 * p:2 * p + 2], [])
                if e == 0:
                    job["dgrams"] += 1
                elif e not in (_errno.EINTR, _errno.EAGAIN, _errno.EWOULDBLOCK, _errno.ENOBUFS):
                    job["errors"].append(e)  # refused: this packet is lost
                else:
                    continue
                p += 1
        k += 1  # anything else (EMSGSIZE, EPERM...): this message is lost
