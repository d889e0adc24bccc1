"""The asyncio adapter: one UDP socket, one :class:`~ltp.engine.Engine`, one timer.

Theory of operation. This is the only module of the transport that does I/O.
It owns a non-blocking UDP socket wrapped in :class:`UdpIO` (batched
``recvmmsg``/GRO receive and GSO/``sendmmsg`` send, compiled in ``ltp_ext``).
When the socket is readable it drains up to ``max_batches_per_wakeup``
batches, hands each run of datagrams from one source to
:meth:`Engine.receive_batch`, then *flushes*: it sends what
:meth:`Engine.datagrams_to_send` returns, turns engine events into the results
of awaiting calls, and re-arms a single ``loop.call_at`` timer at
:meth:`Engine.get_timer` (clamped so the engine never sees a timer early, and
never closer than the loop's timer resolution, :func:`timer_delay`; ACKs that timer could only
send late go out early, :meth:`Engine.flush_acks`). While batches keep coming (at least
``DRAIN_MIN_DATAGRAMS``) a wake-up reads until the socket is empty, so datagrams that arrive
while a batch is processed cost no second wake-up.
**Bulk drain** (:attr:`Endpoint.bulk_drain`): while bulk receives are open (:meth:`Engine.bulk_flows`: past
their first segments; one, or the several of a gather), their DATA goes from the socket straight into the
flows' windows in compiled code, batch after batch (``UdpIO.drain_flows``), and the engine accounts for each
flow once per drain (:meth:`Engine.bulk_ingested`); the first datagram that is anything else ends the drain,
and the rest of its batch takes the per-batch path.
**Connected endpoints** (``open_endpoint(peer=...)``): the socket is ``connect()``ed to its one peer, so the
kernel finds the socket and route of that peer's datagrams by early demux instead of per datagram, and drops
every other host's; :meth:`_resolve` refuses any other peer before anything is sent.
**Peer sockets** (``Config.peer_sockets``, Linux): an endpoint that serves several peers gets the same for each
peer a receive names (``recv(peer=)``, ``gather``, ``expect``; up to ``peer_sockets`` of them, for the endpoint's
life): one more socket, bound to the endpoint's own address and port and connected to that peer. Linux prefers a
connected socket to an unconnected one on the same port for datagrams from its peer (a 4-tuple match scores
higher), and finds it by early demux, on a receive queue of its own (docs/design.md, "Peer sockets", says
what that saves, measured). The peer still sees one address, every socket feeds the one engine, and
everything is still sent from the first socket (an ICMP report about a datagram sent to that peer is queued on
its peer socket, whose error queue is read too). Two sockets can share a port only while every socket on it has
``SO_REUSEPORT`` set, and Linux lets a new socket join when the first one it meets there has it set: so every
socket of the endpoint has it cleared, except during the few system calls of :meth:`_open_peer_socket`, and no
other socket can bind the port meanwhile. A peer socket that cannot be made (out of descriptors) is counted in
``loop_stats["peer_socket_errors"]``, and that peer's datagrams keep arriving on the first socket.
**Flushes are coalesced**: a send or receive asks for a flush once the loop has run the callbacks already due
(:meth:`_flush_soon`), so the transfers that tasks start together (a broadcast's per-peer sends) all go out
in one flush.
**Receive polling** (``Config.receive_polling``, as NAPI does for a NIC): a socket that wakes the
loop ``POLL_ENTER_WAKEUPS`` times within one loop tick stops being watched and is read on the
endpoint's timer instead, once per tick; a tick that finds fewer than ``POLL_EXIT_DATAGRAMS``
datagrams watches the socket again. Two kinds of stream wake a receiver that often: a paced flow at
100 Mbit/s-1 Gbit/s, one datagram per wake-up, and an unlimited bulk receive, a few dozen (the
sender's softirq wakes the receiver as soon as it sleeps); each wake-up costs tens of microseconds of
loop, Python, ``epoll`` and an ACK datagram, which a tick's read of a few hundred datagrams pays once.
Wake-ups that read batches count only while a receive past its first segments is open
(``Engine.streaming``): a burst of small messages must not leave the next one waiting a tick. Sparse
arrivals (control messages, a slow flow) never enter it, so their latency is unchanged; neither
does an endpoint with a send open or a receive in its first segments (``Engine.sending``,
``Engine.quickacking``), whose ACKs someone is waiting for. Polling adds at most a tick to when a
bulk flow's datagrams are read and acknowledged; BBR's ACK-aggregation allowance (``ltp/bbr.py``,
two ticks of BtlBw) keeps its sender's window open across it.
The engine gets ``time.monotonic()`` as ``now``, not ``loop.time()``: uvloop's
loop clock is cached per iteration at millisecond resolution, which would
quantise every RTT and delivery-rate sample. Each received datagram also
carries its kernel arrival time (``SO_TIMESTAMPNS``): when the loop reads a
backlog of ACKs late, each is still timed by when it arrived, so BBR's
delivery-rate samples are not compressed into one instant. If the kernel refuses more data
(EAGAIN), the rest waits in a queue drained when the socket is writable. The socket has
``IP_RECVERR`` on: ICMP unreachable reports about datagrams we sent are read from its error
queue (with the peer's address) and fed to :meth:`Engine.peer_unreachable`, so a peer whose
process died fails its transfers within a round trip. Until that queue is read the socket
signals EPOLLERR, which libuv (uvloop) treats as fatal for a watched descriptor: it runs the
callbacks once and silently drops the watch, and the endpoint would never read again after its
first dead peer. So the loop does not watch the socket itself: :class:`_SocketWatch` puts it
in two private epoll sets (one for reading, one for writing) and the loop watches those,
whose own descriptors only ever become readable.

uvloop is not installed here: pick it at your entry point (:func:`ltp.run`
does, when it is available).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import math
import os
import random
import select
import socket
import sys
import time
from collections import deque

from ltp_ext import load as _load

from .config import Config
from .early_close import GroupClock
from . import liveness
from .engine import Engine, ReceiveDone, SendDone
from .path import SegmentTransmit, Transmit
from .regimes import Regime
from .errors import BroadcastError, LocalProtocolError, TransferTimeout

_udpio = _load("udpio")
log = logging.getLogger("ltp")

__all__ = ["Endpoint", "open_endpoint"]

_now = time.monotonic
#: how many IP-literal peers :meth:`Endpoint._resolve` remembers (cleared when full): parsing an address
#: with ``ipaddress`` costs a few microseconds, and a parameter server names the same peers every round
LITERAL_PEER_CACHE = 4096
# Python's socket module does not export these (Linux values, asm-generic/socket.h)
_SO_SNDBUFFORCE = 32 if sys.platform.startswith("linux") else None
_SO_RCVBUFFORCE = 33 if sys.platform.startswith("linux") else None
#: peer sockets share the endpoint's port through SO_REUSEPORT, whose Linux meaning (the connected socket is
#: preferred for its peer's datagrams) they rely on
_SO_REUSEPORT = getattr(socket, "SO_REUSEPORT", None) if sys.platform.startswith("linux") else None


def _v4_mapped(host: str) -> bool:
    """Whether ``host`` is an IPv4-mapped IPv6 address (``::ffff:a.b.c.d``)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.version == 6 and ip.ipv4_mapped is not None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _SocketWatch:
    """Readable / writable callbacks for a socket with an error queue, safe on every event loop.

    The loop watches a private epoll set per direction (the socket registered in it), not the
    socket: an ICMP report then makes the set readable, never the loop's watch fail (see the
    module docstring).  Without ``select.epoll`` (not Linux) the socket is watched directly.
    """

    def __init__(self, loop, fd: int, on_readable, on_writable) -> None:
        self._loop, self._fd = loop, fd
        self._extra: list = []  # peer sockets' descriptors, in the reading set beside ``fd``
        self._on_writable = on_writable
        self._rset = self._wset = None
        if hasattr(select, "epoll"):
            self._rset = select.epoll(1)
            self._rset.register(fd, select.EPOLLIN)
            # the socket joins the writing set only while room is wanted: an epoll entry on the
            # socket's wait queue is woken by every datagram the kernel frees (sock_wfree), a
            # per-packet cost on the sending path for an entry nobody reads
            self._wset = select.epoll(1)
        self._rfd = self._rset.fileno() if self._rset is not None else fd
        self._on_readable = on_readable
        self._loop.add_reader(self._rfd, on_readable)
        self.reading = True
        self.writing = False

    @property
    def can_add(self) -> bool:
        """Whether :meth:`add_readable` can watch more descriptors (it needs the private epoll set)."""
        return self._rset is not None

    def add_readable(self, fd: int) -> None:
        """Watch one more socket for reading, with the same callback (a peer socket)."""
        self._extra.append(fd)
        if self.reading:
            self._rset.register(fd, select.EPOLLIN)

    def want_readable(self, on: bool) -> None:
        """Start (True) or stop (False) calling ``on_readable`` when datagrams arrive (receive polling
        stops it and reads on a timer)."""
        if on == self.reading:
            return
        self.reading = on
        if on:
            if self._rset is not None:
                for fd in (self._fd, *self._extra):
                    self._rset.register(fd, select.EPOLLIN)  # level-triggered: ready at once if data waits
            self._loop.add_reader(self._rfd, self._on_readable)
        else:
            self._loop.remove_reader(self._rfd)
            if self._rset is not None:
                # off the socket's wait queue too: every datagram the kernel queues would otherwise call
                # the set's wake-up (a lock and a ready-list entry) for a watch nobody reads
                for fd in (self._fd, *self._extra):
                    try:
                        self._rset.unregister(fd)
                    except OSError:  # the socket is already closed (closing removed it from the set)
                        pass

    def want_writable(self, on: bool) -> None:
        """Start (True) or stop (False) calling ``on_writable`` while the socket can take data."""
        if on == self.writing:
            return
        self.writing = on
        if self._wset is None:
            (self._loop.add_writer(self._fd, self._on_writable) if on else self._loop.remove_writer(self._fd))
        elif on:
            self._wset.register(self._fd, select.EPOLLOUT)
            self._loop.add_reader(self._wset.fileno(), self._on_writable)
        else:
            self._loop.remove_reader(self._wset.fileno())
            self._wset.unregister(self._fd)

    def close(self) -> None:
        self.want_writable(False)
        self.want_readable(False)
        for s in (self._rset, self._wset):
            if s is not None:
                s.close()


class _Reader:
    """A socket the endpoint reads, its ``UdpIO`` (None for the endpoint's own socket, whose io is
    ``Endpoint._io``), and when the socket's error queue was read."""

    __slots__ = ("sock", "io", "icmp_seen", "errq_next")

    def __init__(self, sock, io) -> None:
        self.sock = sock
        self.io = io
        self.icmp_seen = 0
        self.errq_next = 0.0


def _set_buffers(sock: socket.socket, size: int) -> None:
    """Ask for ``size`` bytes of socket buffer each way (beyond ``net.core.[rw]mem_max`` where allowed)."""
    for opt, force in ((socket.SO_RCVBUF, _SO_RCVBUFFORCE), (socket.SO_SNDBUF, _SO_SNDBUFFORCE)):
        sock.setsockopt(socket.SOL_SOCKET, opt, size)
        if force is not None and sock.getsockopt(socket.SOL_SOCKET, opt) < size:
            try:  # with CAP_NET_ADMIN the *FORCE options may exceed net.core.[rw]mem_max
                sock.setsockopt(socket.SOL_SOCKET, force, size)
            except OSError:
                pass


class Endpoint:
    """An LTP endpoint on one UDP socket. Create it with :func:`open_endpoint`."""

    max_batches_per_wakeup = 32
    #: feed the DATA of a lone bulk receive from the socket straight into its window (``UdpIO.drain``);
    #: False: every batch goes through :meth:`Engine.receive_batch` (tests and benchmarks compare the two)
    bulk_drain = True
    #: hand the kernel each DATA message as one buffer copied into a cache-sized stage, not two buffers per packet
    #: (``UdpIO(stage_sends=...)``; read when the endpoint opens; benchmarks compare the two)
    stage_sends = True

    def __init__(self, sock: socket.socket, config: Config, rng: random.Random) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self.config = config
        self._io = _udpio.UdpIO(sock, batch=config.io_batch, max_datagram=max(2048, config.mtu),
                                send_threads=config.send_threads if config.gather_send else 0,
                                stage_sends=self.stage_sends)
        self._local_addr = sock.getsockname()[:2]
        # the engine stamps REGs with the wall clock: tell it how far that is from our `now`;
        # DATA goes out by gather send: headers from the engine, payload straight from the message
        self.engine = Engine(config, rng=rng, local_addr=self._local_addr, wall_offset=time.time() - _now(),
                             gather_send=config.gather_send)
        self._wildcard = self._local_addr[0] in ("0.0.0.0", "::")
        self._peer: tuple | None = None  # the one peer of a connected endpoint (open_endpoint(peer=...))
        self._sources: dict = {}
        self._waiters: dict = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._pending: deque = deque()
        self._closed = False
        self._closing = False  # close(linger=...) is answering peers a last time
        self._flush_due = False  # a _due_flush is scheduled (_flush_soon)
        self._family = sock.family
        self._literal_peers: dict = {}  # (host, port) -> _resolve's answer, IP literals only (names may move)
        #: wake-ups of this endpoint by cause (socket readable, timer, socket writable); ``polls``: timer
        #: wake-ups that read the socket while polling, ``poll_entries``: switches to receive polling;
        #: ``drained``: DATA datagrams fed straight into a bulk receive's window (:attr:`bulk_drain`)
        self.loop_stats = {"readable": 0, "timer": 0, "writable": 0, "stalled_timeouts": 0, "polls": 0,
                           "poll_entries": 0, "drained": 0}
        self._polling = False  # receive polling: the socket is read on the timer, not watched
        self._poll_at = 0.0  # while polling: when the next read is due (engine clock)
        self._tick_wakeups = 0  # readable wake-ups since _tick_since, within one loop tick
        self._tick_since = 0.0
        self._watch = _SocketWatch(self._loop, sock.fileno(), self._on_readable, self._on_writable)
        self._own_reader = _Reader(sock, None)  # the endpoint's own socket's error-queue state (its io is ``_io``)
        self._peer_readers: dict = {}  # peer -> its peer socket's _Reader (``Config.peer_sockets``)
        self._peer_socket_failed: set = set()  # peers whose socket could not be made: not tried again

    # ------------------------------------------------------------------ properties
    @property
    def local_addr(self) -> tuple:
        """The bound ``(host, port)``."""
        return self._local_addr

    @property
    def peer(self) -> tuple | None:
        """The one peer this endpoint exchanges datagrams with (``open_endpoint(peer=...)``), or None: any peer."""
        return self._peer

    @property
    def stats(self):
        """:class:`~ltp.reports.EndpointStats` of the engine (drop counters included)."""
        return self.engine.stats

    @property
    def io_stats(self) -> dict:
        """Counters of the batched socket layer (syscalls, EAGAIN, ICMP errors...) of the endpoint's own socket,
        which sends everything and receives what no peer socket does."""
        return self._io.stats

    @property
    def peer_sockets(self) -> dict:
        """``{peer: counters}`` of each peer socket (``Config.peer_sockets``): the datagrams of ``peer`` it
        received (``datagrams_in``) and its system calls, in the form of :attr:`io_stats`."""
        return {peer: r.io.stats for peer, r in self._peer_readers.items()}

    def _clock(self) -> float:
        """``now`` (monotonic), with the engine's wall-clock offset brought up to date: REGs are stamped, and
        peers' REG stamps checked, on the wall clock (``ltp/admission.py``), and a wall clock stepped since this
        endpoint opened (NTP) must not leave this host's stamps behind its peers' clocks."""
        now = _now()
        self.engine.wall_offset = time.time() - now
        return now

    # ------------------------------------------------------------------ API
    async def send(self, peer, data, *, reliable: bool = False, critical=(), element_size: int | None = None,
                   tag: int = 0, timeout: float | None = None):
        """Send one message to ``peer``; returns a :class:`~ltp.reports.SendReport`.

        ``element_size`` (bytes) defaults to the item size of ``data`` (8 for a
        float64 array, 1 for bytes): no element is ever split between packets."""
        _check_timeout(timeout)
        return await self._send_resolved(await self._resolve(peer), data, reliable=reliable, critical=critical,
                                         element_size=element_size, tag=tag, timeout=timeout)

    async def _send_resolved(self, peer: tuple, data, *, reliable, critical, element_size, tag, timeout):
        """:meth:`send` to a peer :meth:`_resolve` already checked (broadcast resolves each peer once)."""
        self._check_open()
        self._note_source(peer)
        handle = self.engine.send(peer, data, now=self._clock(), reliable=reliable, critical=critical,
                                  element_size=element_size, tag=tag)
        return await self._wait(handle, timeout)

    async def recv(self, into, *, peer=None, tag=None, timeout: float | None = None):
        """Receive one message into ``into``; returns a :class:`~ltp.reports.RecvReport`.

        Raises :class:`~ltp.errors.TransferTimeout` when nothing arrived before ``timeout``.
        """
        _check_timeout(timeout)
        peer = None if peer is None else await self._resolve(peer)
        self._check_open()
        if peer is not None:
            self._open_peer_socket(peer)
        handle = self.engine.post_receive([(peer, tag, into)], now=_now(), timeout=timeout)
        reports = await self._wait(handle, None)
        rep = reports[0]
        if rep.regime == Regime.TIMEOUT and rep.received_bytes == 0:
            raise TransferTimeout(rep.cause or f"no message from {peer or 'any peer'} after {rep.duration_s:.3f} s")
        return rep

    async def gather(self, peers, into, *, tag=None, timeout: float | None = None,
                     clock: GroupClock | str = GroupClock.FIRST) -> list:
        """Receive one message from each peer into the matching buffer, with one Early Close deadline.

        ``clock``: where that deadline's clock starts: ``"first"``, the first registration (the paper's batch
        synchronisation), or ``"all"``, once every peer's message has registered, for peers that may start
        late (still computing): until then nothing is closed early (:class:`ltp.early_close.GroupClock`)."""
        _check_timeout(timeout)
        peers = list(peers)
        into = list(into)
        if not peers:
            raise LocalProtocolError("gather got no peers: pass the (host, port) of every peer to receive from "
                                     "and one buffer per peer")
        if len(peers) != len(into):
            raise LocalProtocolError(f"gather got {len(peers)} peers but {len(into)} buffers; pass one buffer per peer")
        peers = [await self._resolve(p) for p in peers]
        if len(set(peers)) != len(peers):
            dup = next(p for p in peers if peers.count(p) > 1)
            raise LocalProtocolError(f"gather got peer {dup} more than once: one message per peer and tag is "
                                     f"received; list each peer once (use recv() for several messages of one peer)")
        self._check_open()
        for p in peers:
            self._open_peer_socket(p)
        handle = self.engine.post_receive([(p, tag, b) for p, b in zip(peers, into)], now=_now(),
                                          timeout=timeout, clock=clock)
        return await self._wait(handle, None)

    async def expect(self, peer, into, *, tag: int) -> None:
        """Say ahead of :meth:`recv`/:meth:`gather` that the message ``tag`` from ``peer`` goes into ``into``.

        Posting a receive early would start its clock early; a hint starts nothing. If the message arrives
        before its receive is posted, it is written straight into ``into`` (not into an internal buffer that
        the receive then copies), and a receive posted later on the same buffer finds it in place. From this
        call until that receive completes, ``into`` belongs to the endpoint: do not read or write it. A hint is
        used once; posting the receive drops an unused one (:mod:`ltp.placement`)."""
        peer = await self._resolve(peer)
        self._check_open()
        self._open_peer_socket(peer)
        self.engine.expect(peer, tag, into, now=_now())
        self._flush()  # a superseded message's STOP goes now

    async def broadcast(self, peers, data, *, tag: int = 0, critical=(), element_size: int | None = None,
                        timeout: float | None = None, return_exceptions: bool = False) -> list:
        """Send ``data`` reliably to every peer in parallel; one report per peer, in order.

        Every peer's send runs to its end (delivered, refused, timed out, peer gone) before this
        returns: one failed peer never abandons or hides the others.  If any failed, raises
        :class:`~ltp.errors.BroadcastError` (``.failed``: peer -> exception, ``.outcomes``: one
        report or exception per peer), or with ``return_exceptions=True`` returns that list.
        Every peer address is checked before anything is sent, so a misuse
        (:class:`~ltp.errors.LocalProtocolError`) sends nothing."""
        peers = list(peers)
        if not peers:
            raise LocalProtocolError("broadcast got no peers: pass the (host, port) of every peer to send to")
        _check_timeout(timeout)
        resolved = [await self._resolve(p) for p in peers]
        self._check_open()
        outcomes = list(await asyncio.gather(*[
            self._send_resolved(p, data, reliable=True, critical=critical, element_size=element_size, tag=tag,
                                timeout=timeout)
            for p in resolved], return_exceptions=True))
        for o in outcomes:  # a misuse or a cancellation is not a peer's failure: raise it as it is
            if isinstance(o, LocalProtocolError) or (isinstance(o, BaseException) and not isinstance(o, Exception)):
                raise o
        if return_exceptions or not any(isinstance(o, BaseException) for o in outcomes):
            return outcomes
        raise BroadcastError(peers, outcomes)

    async def close(self, *, linger: float = 0.0) -> None:
        """Abort open transfers, tell peers, close the socket.

        ``linger`` (seconds, default 0) keeps the endpoint answering for that long first, as TCP's TIME_WAIT
        does. A receive that completed just before the close may have lost its last ACKs and its STOP on the
        way back; the sender then probes again, and a closed port answers that probe with an ICMP unreachable,
        which fails the sender's send with :class:`~ltp.errors.PeerUnreachable` although its message arrived
        whole. Every close therefore sends the STOP of each flow received in the last second once more just before
        the socket closes (:data:`ltp.engine.CLOSING_STOP_WINDOW_S`); a lingering endpoint also answers the probe,
        so the send fails only if neither arrives. Transfers still open may finish
        while it lingers, and new calls are refused; what is left when the time is up is aborted as without
        ``linger``. A lingering close that is cancelled still closes; a second close during the linger, with
        or without ``linger``, closes at once. A few round trips of the path (or, on a
        lossy path, several probe intervals) are enough; ``ltp-bench``'s receiver lingers 0.5 s."""
        if self._closed:
            return
        check_linger(linger)
        if linger > 0 and not self._closing:
            self._closing = True
            try:
                await asyncio.sleep(linger)
            finally:
                self._close_now()
            return
        self._close_now()

    def _close_now(self) -> None:
        if self._closed:
            return
        self.engine.close(now=_now())
        self._flush()
        self._closed = True
        self._watch.close()
        if self._timer is not None:
            self._timer.cancel()
        self._io.stop_send_threads()  # the DATA they still hold goes out before the socket closes
        self._sock.close()
        for r in self._peer_readers.values():
            r.sock.close()
        for fut in self._waiters.values():
            if not fut.done():
                fut.cancel()

    async def __aenter__(self) -> "Endpoint":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise LocalProtocolError("endpoint is closed; open a new one with ltp.open_endpoint()")
        if self._closing:
            raise LocalProtocolError("endpoint is closing (close(linger=...) answers its peers a last time and "
                                     "takes no new calls); open a new one with ltp.open_endpoint()")

    async def _resolve(self, peer) -> tuple:
        """Validate and resolve a peer address up front: nothing a caller passes may reach the socket layer.
        A connected endpoint refuses every peer but its own."""
        resolved = await self._resolve_address(peer)
        if self._peer is not None and resolved != self._peer:
            raise LocalProtocolError(
                f"this endpoint is connected to {self._peer[0]}:{self._peer[1]} (open_endpoint(peer=...)) and "
                f"exchanges datagrams with that peer only, so it cannot reach {resolved[0]}:{resolved[1]}; open an "
                "endpoint without peer= to talk to several peers")
        return resolved

    async def _connect(self, peer) -> None:
        """Connect the socket to ``peer`` (``open_endpoint(peer=...)``): see :func:`open_endpoint`."""
        resolved = await self._resolve_address(peer)
        try:
            self._sock.connect(resolved)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot connect the LTP endpoint at {self._local_addr[0]}:"
                                     f"{self._local_addr[1]} to its peer {resolved[0]}:{resolved[1]}: "
                                     f"{exc.strerror}") from None
        self._peer = resolved

    def _open_peer_socket(self, peer: tuple) -> None:
        """Give ``peer`` (resolved) a peer socket if it has none and one may be made (module docstring, "Peer
        sockets"). Never raises: a socket that cannot be made leaves ``peer``'s datagrams on the first socket."""
        if peer in self._peer_readers or self._peer is not None or len(self._peer_readers) >= self.config.peer_sockets \
                or peer in self._peer_socket_failed or _SO_REUSEPORT is None or not self._watch.can_add:
            return
        ours = [self._sock, *(r.sock for r in self._peer_readers.values())]
        ps = None
        try:
            ps = socket.socket(self._family, socket.SOCK_DGRAM)
            _set_buffers(ps, self.config.socket_buffer_bytes)
            try:
                for s in (ps, *ours):
                    s.setsockopt(socket.SOL_SOCKET, _SO_REUSEPORT, 1)
                ps.bind(self._sock.getsockname())
                ps.connect(peer)
            finally:  # the port is closed to other sockets again before anything else runs
                for s in (*ours, ps):
                    try:
                        s.setsockopt(socket.SOL_SOCKET, _SO_REUSEPORT, 0)
                    except OSError:  # never seen; the socket's own error is the one to report
                        log.warning("ltp: could not clear SO_REUSEPORT on a socket of the endpoint at %s",
                                    self._local_addr)
            ps.setblocking(False)
            io = _udpio.UdpIO(ps, batch=self.config.io_batch, max_datagram=max(2048, self.config.mtu),
                              send_threads=0, stage_sends=self.stage_sends)
            self._watch.add_readable(ps.fileno())
        except OSError as exc:
            self._peer_socket_failed.add(peer)
            self.loop_stats["peer_socket_errors"] = self.loop_stats.get("peer_socket_errors", 0) + 1
            log.debug("ltp: no peer socket for %s (%s); its datagrams arrive on the endpoint's socket", peer, exc)
            if ps is not None:
                ps.close()
            return
        self._peer_readers[peer] = _Reader(ps, io)

    async def _resolve_address(self, peer) -> tuple:
        if not isinstance(peer, tuple) or len(peer) < 2:
            raise LocalProtocolError(f"peer must be a (host, port) tuple, got {peer!r}")
        host, port = peer[0], peer[1]
        if not isinstance(host, str) or not host:
            raise LocalProtocolError(f"peer host must be a non-empty str (an IP or a name), got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise LocalProtocolError(f"peer port must be an int in 1..65535, got {port!r}")
        six = self._family == socket.AF_INET6
        known = self._literal_peers.get((host, port))
        if known is not None:  # an IP literal checked before (a PS names the same peers every round)
            return known
        if _is_ip(host):
            ip = ipaddress.ip_address(host)
            if ip.version == 6 and not six:
                raise LocalProtocolError(f"peer {host!r} is IPv6 but this endpoint is bound to IPv4 "
                                         f"{self._local_addr}; open the endpoint on '::' to reach IPv6 peers")
            if ip.version == 4 and six and not self._wildcard and not _v4_mapped(self._local_addr[0]):
                raise LocalProtocolError(f"peer {host!r} is IPv4 but this endpoint is bound to the IPv6 address "
                                         f"{self._local_addr[0]!r}; open it on '::' (both families) or on an IPv4 "
                                         "address")
            if ip.version == 4 and six:
                resolved = (f"::ffff:{ip}", port)
            elif ip.version == 6 and ip.ipv4_mapped is not None:  # the kernel writes these dotted: so must we
                resolved = (f"::ffff:{ip.ipv4_mapped}", port)
            else:
                resolved = (str(ip), port)
            if len(self._literal_peers) >= LITERAL_PEER_CACHE:
                self._literal_peers.clear()
            self._literal_peers[(host, port)] = resolved
            return resolved
        try:
            infos = await self._loop.getaddrinfo(host, port, family=self._family, type=socket.SOCK_DGRAM,
                                                 flags=socket.AI_V4MAPPED if six else 0)  # an IPv4-only name too
        except socket.gaierror as exc:
            raise LocalProtocolError(f"cannot resolve peer host {host!r}: {exc.strerror}; "
                                     "check the name or pass an IP address") from None
        if not infos:
            raise LocalProtocolError(f"cannot resolve {host!r}")
        return infos[0][4][:2]

    def _note_source(self, peer) -> None:
        """Bound to a wildcard address: tell the engine which source IP the kernel routes to ``peer`` from."""
        if not self._wildcard or self.config.job_key is None or peer in self._sources:
            return
        probe = socket.socket(self._family, socket.SOCK_DGRAM)
        try:
            probe.connect(peer)  # no packet is sent: this only asks the routing table
            ip = probe.getsockname()[0]
        except OSError:
            ip = self._local_addr[0]
        finally:
            probe.close()
        self._sources[peer] = (ip, self._local_addr[1])
        self.engine.set_source(peer, self._sources[peer])

    async def _wait(self, handle: int, timeout: float | None):
        fut = self._loop.create_future()
        self._waiters[handle] = fut
        self._flush_soon()
        started = _now()
        # the caller's timeout is one loop timer, re-armed at each tick, that fails ``fut`` (not wait_for + shield:
        # two more futures and a task per call, on every send of a small message)
        timer: list = [None]  # the armed TimerHandle (each tick re-arms it; the own-stall rule moves its deadline)
        if timeout is not None:
            self._arm_caller_tick(fut, timer, started + timeout, timeout, started)
        try:
            return await fut
        except TransferTimeout:
            raise  # the engine's own verdict (peer silent...), with its cause: never relabel it
        except _CallerTimeout:
            self._waiters.pop(handle, None)
            self.engine.cancel(handle, now=_now())
            self._flush()
            raise TransferTimeout(f"transfer did not finish within the caller's timeout of {timeout} s "
                                  f"(gave up after {_now() - started:.3f} s); it was cancelled") from None
        except asyncio.CancelledError:
            self._waiters.pop(handle, None)  # the caller is gone: nobody retrieves the engine's verdict
            fut.cancel()
            if not self._closed:
                self.engine.cancel(handle, now=_now())
                self._flush()
            raise
        finally:
            self._waiters.pop(handle, None)
            if timer[0] is not None:
                timer[0].cancel()

    def _flush_soon(self) -> None:
        """Flush once the loop has run the callbacks already due: the transfers that tasks started in the same
        loop iteration (a broadcast's or a gather's per-peer sends, the receives posted beside them) then go
        out in one flush, so every flow is open before the first DATA leaves. One flush per call instead put
        the first peer's whole first flight on the wire (on a veth path, through the receiving host too)
        before the next peer's send was even opened: a 4-peer broadcast of 150 kB started its last flow
        2-3 ms after its first."""
        if not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._due_flush)

    def _due_flush(self) -> None:
        self._flush_due = False
        self._flush()

    def _arm_caller_tick(self, fut, timer: list, deadline: float, timeout: float, now: float) -> None:
        """Arm the next tick of a send's caller timeout: at its ``deadline``, or :data:`CALLER_TICK_S` from ``now``
        if that is sooner."""
        due = min(deadline, now + CALLER_TICK_S)
        timer[0] = self._loop.call_later(max(0.0, due - now), self._caller_tick, fut, timer, due, deadline, timeout)

    def _caller_tick(self, fut, timer: list, due: float, deadline: float, timeout: float) -> None:
        """A tick of a send's caller timeout (armed for ``due``): fail the send at its ``deadline``, unless the
        own-stall rule (:mod:`ltp.liveness`) says this process did not run for part of the window; the transfer
        then gets the whole window again, counted from now. A stall counts for one window only.

        The timeout ticks every :data:`CALLER_TICK_S` so that it sees a stall itself: a tick over
        ``liveness.OWN_STALL_S`` late is one, whatever the engine had armed. With one timer at the deadline, a stop
        that ended just before the deadline was seen only if the engine's own timer ran late and noticed it
        (``Engine.own_stall_at``, which still counts). CI found a PS stopped for 10 s that failed two 10 s sends
        10.005 s after they began, no stall noticed before its timer ran: its engine had no deadline early in the stop.

        At the deadline the socket is read before the send is failed: the ACKs that finish it may be waiting there
        (the peer sent them while this process did not run, and uvloop runs due timers before it reads).
        """
        if fut.done():
            return
        now = _now()
        at = self.engine.own_stall_at
        if liveness.stalled(due, now) or (at is not None and at > deadline - timeout):
            self.loop_stats["stalled_timeouts"] += 1
            self._arm_caller_tick(fut, timer, now + timeout, timeout, now)
            return
        if deadline - now > LOOP_TIMER_RESOLUTION_S:  # a tick before the deadline (or the loop's rounding of it)
            self._arm_caller_tick(fut, timer, deadline, timeout, now)
            return
        if not self._closed:
            self._receive_pending()
            self._flush()
            if fut.done():
                return
        fut.set_exception(_CallerTimeout())

    def _on_readable(self) -> None:
        self.loop_stats["readable"] += 1
        n = self._receive_pending(woken=True)
        if self.config.receive_polling and not self._closed:
            self._note_wakeup(n)
        self._flush()

    def _note_wakeup(self, n: int) -> None:
        """Count a readable wake-up that read ``n`` datagrams; start receive polling after
        ``POLL_ENTER_WAKEUPS`` of them within one loop tick. A wake-up counts when it read at most
        ``POLL_SMALL_READ`` datagrams (a paced trickle), or any number while a bulk receive is open
        (``Engine.streaming``); none counts while a send is open or a receive is in its first segments
        (``Engine.sending``, ``Engine.quickacking``)."""
        eng = self.engine
        if eng.sending or eng.quickacking or (n > POLL_SMALL_READ and not eng.streaming):
            # a sender or a cold receive must not poll; nor a burst of small messages (their next one would
            # wait a tick to be read)
            self._tick_wakeups = 0
            return
        now = _now()
        if now - self._tick_since > LOOP_TIMER_RESOLUTION_S:
            self._tick_since, self._tick_wakeups = now, 0
        self._tick_wakeups += 1
        if self._tick_wakeups >= POLL_ENTER_WAKEUPS:
            self._tick_wakeups = 0
            self._polling = True
            self._poll_at = now + LOOP_TIMER_RESOLUTION_S
            self._watch.want_readable(False)
            self.loop_stats["poll_entries"] += 1

    def _polled(self, n: int, now: float) -> None:
        """A timer wake-up while polling read ``n`` datagrams: poll again a tick later, or watch the socket
        again when the tick brought fewer than ``POLL_EXIT_DATAGRAMS``."""
        self.loop_stats["polls"] += 1
        if n < POLL_EXIT_DATAGRAMS:
            self._stop_polling()
        else:
            self._poll_at = now + LOOP_TIMER_RESOLUTION_S

    def _stop_polling(self) -> None:
        self._polling = False
        self._watch.want_readable(True)  # level-triggered: what arrived since the last read wakes it at once

    def _receive_pending(self, woken: bool = False) -> int:
        """Read what arrived on every socket (the endpoint's, then its peer sockets); returns the number of
        datagrams read. ``woken``: the loop said a socket is ready (an empty read then means an error report
        is waiting, which is read at once so the watch stops firing)."""
        readers = self._peer_readers
        if not readers:
            total = self._read_socket(self._io, self._own_reader, woken)
            if total:  # the kernel's count of datagrams this socket dropped for want of room (SO_RXQ_OVFL)
                self.engine.stats.socket_drops = self._io.socket_drops
            return total
        # not ``woken``: which socket woke us is unknown, and each error-queue read is a syscall
        total = self._read_socket(self._io, self._own_reader, False)
        for r in readers.values():
            if self._closed:
                return total
            total += self._read_socket(r.io, r, False)
        if total:
            self.engine.stats.socket_drops = self._io.socket_drops + sum(r.io.socket_drops for r in readers.values())
        elif woken:  # a wake-up that found no datagram anywhere: an error report is waiting on one of them
            for io in (self._io, *(r.io for r in readers.values())):
                if io.recverr_enabled:
                    self._read_errors(io)
        return total

    def _read_socket(self, io, reader: "_Reader", woken: bool) -> int:
        """Read what arrived on ``io``'s socket (``reader``: its error-queue state); returns the number of
        datagrams read.

        While bulk receives are open (:meth:`Engine.bulk_flows`) their DATA goes from the socket straight
        into the flows' windows in compiled code (``UdpIO.drain_flows``), batch after batch, and the engine
        accounts for each flow once per drain (:meth:`Engine.bulk_ingested`); any other datagram ends the
        drain and takes the per-batch path below."""
        eng = self.engine
        empty = woken
        total = 0
        left = self.max_batches_per_wakeup
        drain = self.bulk_drain
        while left > 0:
            flows = eng.bulk_flows() if drain else None
            try:
                if flows:
                    batches, n, used, nbytes, resume = io.drain_flows([f.window for f in flows], [f.peer for f in flows],
                                                                      left, DRAIN_MIN_DATAGRAMS)
                    left -= batches
                    now = self._clock()
                    for flow, k, b in zip(flows, used, nbytes):
                        if not k:
                            continue
                        self.loop_stats["drained"] += k
                        try:
                            eng.bulk_ingested(flow, k, b, now)
                        except Exception:  # a bug must not kill the loop; count and log it
                            eng.stats.drop("internal_error", k)
                            log.exception("ltp: error while accounting for drained datagrams from %s", flow.peer)
                    n_last = len(io)
                else:
                    left -= 1
                    n = n_last = io.recv_batch()
                    resume = 0
            except OSError as exc:  # socket-level failure: count it, never raise into the loop
                eng.stats.drop(f"socket_error_{exc.errno}")
                break
            except Exception:  # a bug in the drain must not kill the loop: count it, log it, read per batch from now
                eng.stats.drop("internal_error")
                log.exception("ltp: error while draining a bulk receive; this endpoint reads per batch from now on")
                self.bulk_drain = False
                break
            if n == 0:
                break
            empty = False
            total += n
            if resume < n_last:
                self._process_batch(io, resume)
            if n_last < io.batch and n_last < DRAIN_MIN_DATAGRAMS:
                break  # datagrams arrive slower than we process them: another read would find none
            # a short batch of several datagrams does not end the wake-up: the sender's softirq
            # keeps filling the socket while we process, and a read that finds more now saves a
            # sleep and a wake-up (measured on the lab path: 37% fewer wake-ups, a third fewer
            # ACKs); the empty read ends it
        if io.recverr_enabled:
            # an ICMP report also sets the socket error, which the receive above met and counted:
            # read the error queue only then (each read is a syscall), and every so often anyway
            now = _now()
            if empty or io.icmp_errors != reader.icmp_seen or now >= reader.errq_next:
                reader.icmp_seen = io.icmp_errors
                reader.errq_next = now + _ERRQ_POLL_S
                self._read_errors(io)
        return total

    def _process_batch(self, io, start: int) -> None:
        """Hand the engine the datagrams of ``io``'s last batch from index ``start`` on, run by run."""
        eng = self.engine
        now = self._clock()
        buf, offs, lens = io.buffer, io.offsets, io.lengths
        times = shift = None
        if io.timestamps_enabled:
            # kernel arrival times (CLOCK_REALTIME), moved onto the monotonic clock by the
            # engine for the datagrams that need them (not every DATA datagram)
            times, shift = io.times, eng.wall_offset
        for addr, a, b in io.runs(start):
            try:
                eng.receive_batch(buf, offs, lens, a, b, addr[:2], now, times, times_offset=shift)
            except Exception:  # a bug must not kill the loop; count and log it
                eng.stats.drop("internal_error", b - a)
                log.exception("ltp: error while processing datagrams from %s", addr)

    def _read_errors(self, io=None) -> None:
        """Feed ICMP unreachable reports (IP_RECVERR error queue of ``io``'s socket, the endpoint's own by default)
        to the engine: a dead peer is noticed within a round trip of our next datagram to it, not after a timeout."""
        try:
            reports = (self._io if io is None else io).recv_errors()  # not ``io or``: an empty batch is falsy
        except OSError:
            return
        for addr, err, _origin, _type, _code in reports:
            cause = _UNREACHABLE_CAUSES.get(err)
            if cause is None:
                continue  # e.g. EMSGSIZE from path-MTU discovery: not a dead peer
            peer = tuple(addr[:2])
            try:
                self.engine.peer_unreachable(peer, now=_now(), cause=cause.format(port=peer[1]))
            except Exception:  # a bug must not kill the loop
                self.engine.stats.drop("internal_error")
                log.exception("ltp: error while handling an ICMP report about %s", peer)

    def _on_timer(self) -> None:
        self.loop_stats["timer"] += 1
        self._timer = None
        self._timer_at = None
        # read what already arrived first: a loss timer must not fire on ACKs that are
        # sitting in the socket buffer because the loop ran this callback before the reader
        n = self._receive_pending()
        now = self._clock()
        if self._polling:
            self._polled(n, now)
            due = self.engine.get_timer()
            if due is None or due > now:  # this wake-up was the poll only: the engine's deadline is later
                self._flush()
                return
        try:
            self.engine.handle_timer(now)
        except Exception:
            self.engine.stats.drop("internal_error")
            log.exception("ltp: error in timer")
        self._flush()

    def _on_writable(self) -> None:
        self.loop_stats["writable"] += 1
        if self._closed:
            return
        if not self._drain_pending() and self._io.recverr_enabled:
            self._read_errors()  # woken by an error report rather than room: read it, or the watch spins
        if not self._pending and self._watch.writing:
            self._watch.want_writable(False)
            self._flush()

    def _drain_pending(self) -> bool:
        io = self._io
        while self._pending:
            addr, data, seg = self._pending[0]
            sent = io.send(addr, data, seg)
            if sent >= len(data):
                self._pending.popleft()
                continue
            self._pending[0] = (addr, data[sent:], seg)
            return False
        return True

    def _thread_pacing(self, tx) -> tuple:
        """``(pace_rate, pace_quantum)`` for one peer's DATA batch: paced in a sender thread (``Config.thread_pacing_s``)
        when its path's rate puts more than ``THREAD_PACING_MIN_TICK_PACKETS`` packets in a loop tick, which the
        loop's timer cannot space; ``(0.0, 0)``: sent as it is. A path paced by its receiver's grant carries no
        rate (``SegmentTransmit.pace_rate``): it sends 2-packet bursts already."""
        q = self.config.thread_pacing_s
        rate = tx.pace_rate
        if q <= 0 or not self._io.send_threads or rate * LOOP_TIMER_RESOLUTION_S <= \
                THREAD_PACING_MIN_TICK_PACKETS * tx.segment_size:
            return 0.0, 0
        return rate, max(THREAD_PACING_MIN_TICK_PACKETS * tx.segment_size, int(rate * q))

    def _send_run(self, txs: list, i: int, refused: dict) -> int:
        """Send the run of single-datagram transmits (ACKs, REGs, STOPs...) that starts at ``txs[i]`` in
        one ``sendmmsg``; returns how many went out. 0 when the run is a lone datagram or the kernel took
        none of it: the caller then sends ``txs[i]`` on its own, which meets and records the refusal or the
        full socket (an error stops ``send_many`` at the item it hit, so every item before it went out)."""
        j = i
        while j < len(txs) and j - i < SEND_RUN_MAX and _one_datagram(txs[j]) and txs[j].addr not in refused:
            j += 1
        if j - i < 2:
            return 0
        try:
            return self._io.send_many([(tx.addr, tx.data, tx.segment_size) for tx in txs[i:j]])
        except OSError:  # the first item's own error: the caller's single send meets it again
            return 0

    def _flush(self) -> None:
        if self._closed:
            return
        eng = self.engine
        io = self._io
        now = _now()
        # ACKs our timer could only send late (it fires a loop tick out at the earliest) go now
        eng.flush_acks(now, due_by=now + LOOP_TIMER_RESOLUTION_S)
        refused: dict = {}  # peer -> the kernel's refusal of a send to it
        txs = eng.datagrams_to_send(now)
        # sender threads take the DATA while sends to several peers are open (a broadcast, a PS's pushes): their
        # kernel work then runs on more cores than the loop's; one peer's sends stay on the loop's thread, where
        # a hand-off would only add its cost (docs/performance.md, "Change 10")
        background = io.send_threads > 0 and eng.sending_to_several
        # one peer's large batches: cut across the sender threads in the parts the engine built them for
        # (SegmentTransmit.parts, Config.spread_sends), so that one flow's kernel path runs on more than one core
        spreading = not background and io.send_threads > 1
        skip = 0  # the next ``skip`` transmits went out in one send_many already
        for i, tx in enumerate(txs):
            if skip:
                skip -= 1
                continue
            if tx.addr in refused:
                continue
            if not self._pending and _one_datagram(tx):
                skip = self._send_run(txs, i, refused)
                if skip:
                    skip -= 1  # this one is among them
                    continue
            if self._pending:
                self._pending.append((tx.addr, bytes(tx.data), tx.segment_size))
                continue
            try:
                if isinstance(tx, SegmentTransmit):
                    rate, quantum = (0.0, 0) if background else self._thread_pacing(tx)
                    parts = tx.parts if spreading and rate == 0.0 and tx.parts <= io.send_threads else 1
                    k = io.send_segments(tx.addr, tx.headers, tx.payload, tx.seqs, tx.seg_size, tx.total,
                                         background=background, pace_rate=rate, pace_quantum=quantum,
                                         parts=parts)
                    if k < len(tx):  # the socket buffer is full: keep the rest, assembled, for on_writable
                        self._pending.append((tx.addr, tx.assemble(k), tx.segment_size))
                    continue
                data = tx.data
                sent = io.send(tx.addr, data, tx.segment_size)
            except OSError as exc:  # the kernel will not send there (a broadcast address: EACCES; no route)
                refused[tx.addr] = exc
                continue
            if sent < len(data):
                self._pending.append((tx.addr, bytes(data[sent:]), tx.segment_size))
        for peer, exc in refused.items():  # never raised into the loop: the transfers with that peer fail
            self.loop_stats["send_refused"] = self.loop_stats.get("send_refused", 0) + 1
            eng.peer_unreachable(peer, now=now, cause=f"the kernel refused to send there ({exc.strerror or exc}); "
                                                      f"check the address (a broadcast or unroutable one?)")
        if self._pending and not self._watch.writing:
            self._watch.want_writable(True)
        if io.send_threads:
            io.reap()  # release the message buffers of batches the sender threads finished
        while True:
            ev = eng.next_event()
            if ev is None:
                break
            fut = self._waiters.get(ev.handle)
            if fut is None or fut.done():
                continue
            if ev.error is not None:
                fut.set_exception(ev.error)
            elif isinstance(ev, SendDone):
                fut.set_result(ev.report)
            elif isinstance(ev, ReceiveDone):
                fut.set_result(ev.reports)
        when = eng.get_timer()
        if self._polling and (eng.sending or eng.quickacking):
            # a sender's ACK wake-ups are its chances to send between pacing ticks; a flow's first segments
            # are acknowledged at once (its sender may be in a slow-start round)
            self._stop_polling()
        if self._polling:  # the timer also reads the socket, at least once a tick
            when = self._poll_at if when is None else min(when, self._poll_at)
        if when is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
                self._timer_at = None
            return
        if self._timer is not None and self._timer_at == when:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_later(timer_delay(when, now), self._on_timer)


class _CallerTimeout(Exception):
    """A send's caller timeout expired (raised into its waiter only; the caller sees TransferTimeout)."""


#: at most this many control datagrams (ACKs, REGs, STOPs) of one flush go out in one sendmmsg
SEND_RUN_MAX = 64


def _one_datagram(tx) -> bool:
    """Whether ``tx`` is one assembled datagram (control or a lone DATA packet), which a flush batches."""
    return type(tx) is Transmit and len(tx.data) <= tx.segment_size


#: a read that returns fewer datagrams than the batch holds but at least this many is followed by
#: another before the wake-up ends (at 5 Gbit/s a read returns 20-40; at 100 Mbit/s one, and a
#: second read would be an empty syscall per datagram)
DRAIN_MIN_DATAGRAMS = 8

#: receive polling (``Config.receive_polling``): this many readable wake-ups within one loop tick switch
#: the endpoint to reading on its timer, once a tick (a paced 100 Mbit/s flow wakes a receiver ~8 times a
#: millisecond, one datagram each; an unlimited 4 Gbit/s flow 15-20 times, a few dozen each); wake-ups
#: that read more than POLL_SMALL_READ datagrams count only while a bulk receive is open; a polling
#: tick that reads fewer than POLL_EXIT_DATAGRAMS switches it back (sparse traffic is read at once again)
POLL_ENTER_WAKEUPS = 4
POLL_SMALL_READ = 2
POLL_EXIT_DATAGRAMS = 2

#: seconds: the event loop's timer resolution. uvloop (libuv) keeps timers in whole milliseconds
#: and rounds a shorter delay to zero, so a timer armed 0.5 ms ahead fires at once, finds nothing
#: due, is re-armed, fires at once again... a busy loop until the deadline (measured: 12,967 timer
#: wake-ups and 8,399 empty reads per 800 MB on a receiver waiting out its ACK delay)
LOOP_TIMER_RESOLUTION_S = 0.001
#: thread pacing (``Config.thread_pacing_s``) starts where the loop's own pacer would send more than this many
#: packets per loop tick in one burst; below it the loop's timer spaces the bursts finely enough
THREAD_PACING_MIN_TICK_PACKETS = 2
#: seconds added to every delay so the loop never fires a hair before the engine's deadline
_TIMER_MARGIN_S = 1e-6


def timer_delay(when: float, now: float) -> float:
    """The delay to give ``loop.call_later`` for an engine deadline ``when`` (both on the engine's clock).

    Never early (the engine must not see a timer before its deadline) and, for a deadline still
    ahead, never shorter than :data:`LOOP_TIMER_RESOLUTION_S`: a timer due within the loop's
    resolution waits one tick (as asyncio's own loop does, which rounds up) instead of spinning.
    A deadline already passed runs on the next loop iteration."""
    if when <= now:
        return _TIMER_MARGIN_S
    return max(when - now + _TIMER_MARGIN_S, LOOP_TIMER_RESOLUTION_S)


#: seconds between two ticks of a send's caller timeout: a tick that runs over ``liveness.OWN_STALL_S`` late tells
#: of a stall of this process (the own-stall rule), which the timeout does not count
CALLER_TICK_S = 0.5

#: the error queue is read when a socket call met an ICMP error, and at least this often (seconds)
_ERRQ_POLL_S = 0.05

_UNREACHABLE_CAUSES = {
    errno.ECONNREFUSED: "ICMP port unreachable: nothing listens on UDP port {port} there any more "
                        "(the peer process exited or closed its endpoint)",
    errno.EHOSTUNREACH: "ICMP host unreachable: the peer's host is down or cannot be reached",
    errno.ENETUNREACH: "ICMP network unreachable: no route to the peer's network",
    errno.EHOSTDOWN: "host down: the peer's host does not answer",
}


def _check_timeout(timeout) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout >= 0):
        raise LocalProtocolError(f"timeout={timeout!r}: pass None (no limit) or a number of seconds >= 0")


def check_linger(linger) -> None:
    """Raise :class:`~ltp.errors.LocalProtocolError` unless ``linger`` is a finite number of seconds >= 0."""
    if isinstance(linger, bool) or not isinstance(linger, (int, float)) or not 0 <= linger < math.inf:
        raise LocalProtocolError(f"linger={linger!r}: pass a finite number of seconds >= 0 (0: close at once)")


async def open_endpoint(local_addr=("0.0.0.0", 0), *, config: Config | None = None,
                        rng: random.Random | None = None, peer=None) -> Endpoint:
    """Bind a UDP socket at ``local_addr`` and return a running :class:`Endpoint`.

    ``peer`` (a ``(host, port)``) makes a *connected* endpoint, for a transfer between two hosts: its socket
    is connected to ``peer``, so the kernel delivers that peer's datagrams to it without a route lookup and a
    socket lookup per datagram (early demux, as for a TCP connection; about 2-3 % of the CPU of a bulk
    transfer on the lab's path, ``docs/performance.md``), and drops every other host's.  Sending to or
    receiving from any other peer then raises :class:`~ltp.errors.LocalProtocolError`.  An endpoint that
    serves several peers (a parameter server) leaves ``peer`` out."""
    config = config or Config()
    if not isinstance(local_addr, tuple) or len(local_addr) < 2 or not isinstance(local_addr[0], str) or \
            isinstance(local_addr[1], bool) or not isinstance(local_addr[1], int) or not 0 <= local_addr[1] <= 65535:
        raise LocalProtocolError(f"local_addr must be a (host, port) tuple with a port in 0..65535 "
                                 f"(0 = any free port), got {local_addr!r}")
    host = local_addr[0]
    family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        _set_buffers(sock, config.socket_buffer_bytes)
        try:
            sock.bind(local_addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(errno.EADDRINUSE,
                              f"cannot bind the LTP endpoint to {local_addr[0]}:{local_addr[1]}: UDP port "
                              f"{local_addr[1]} is already in use there (another process or endpoint holds it); "
                              "close that one, pick another port, or pass port 0 for any free port") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise OSError(errno.EADDRNOTAVAIL,
                              f"cannot bind the LTP endpoint to {local_addr[0]}:{local_addr[1]}: no local interface "
                              "has that address; use one of this host's IPs or 0.0.0.0") from None
            raise
        sock.setblocking(False)
    except Exception:
        sock.close()
        raise
    if rng is None:
        rng = random.Random(int.from_bytes(os.urandom(16), "big"))
    ep = Endpoint(sock, config, rng)
    if peer is not None:
        try:
            await ep._connect(peer)
        except BaseException:
            await ep.close()
            raise
    return ep
