"""Kernel TCP transport with a per-socket congestion control (the paper's baselines).

Wire format (network byte order)::

    HELLO  = b"LTPH" | u16 host_len | host | u16 port      (once, by the connecting side)
    FRAME  = b"LTPF" | u64 tag | u64 length | payload[length]

Each direction of a peer pair uses its own connection: A sends to B over the
connection A opened to B's listening address, and announces its own listening
address in HELLO, so the receiver can name the sender by the address it
published in the rendezvous store.  Reports have the LTP shape with
``delivered_fraction == 1.0`` and no bubbles, so experiments compare like with
like.  The congestion control (``cubic``, ``bbr``, ``reno`` ...) is set with
``TCP_CONGESTION`` on every socket; a kernel without it fails loudly.

Theory of operation.  The baseline moves bytes the way a careful TCP program
does, so that comparisons with LTP are fair: a send hands the caller's buffer
to the kernel as it is (``sock_sendall`` of the view: no copy in user space),
and a receive posted before its message's header arrives gets the payload
read by the kernel straight into its buffer (:class:`~.mailbox.Claim`: one
copy, as LTP's in-place receive), and so does one that arrives before its
receive is posted when :meth:`TcpTransport.expect` named its buffer (a hint,
as LTP's placement hints; the PS gives one per worker's gradient: before
session 58 early gradients were buffered and copied).  Small frames are parsed
out of a per-connection stage of ``STAGE_BYTES``; any other message nobody has
asked for yet is read into a private buffer and matched later, counted against
``max_receive_memory`` *before* it is read, and a frame longer than that
closes the connection (``dropped["too_large"]``): nothing a peer says commits
memory beyond the bound.  Until 2026-12-06 both directions went through
asyncio streams, which copied every message twice more into fresh memory
(``docs/performance.md``, session 57).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import Sequence

from ..errors import ConfigError, PeerGone, TransportError, TransportTimeout
from .base import COMPLETE, Address, CloseReason, RecvReport, SendReport, Transport, as_bytes_view, gather_by_recv
from .mailbox import Mailbox, PeerClosed

_FRAME = struct.Struct("!4sQQ")
_HELLO_HEAD = struct.Struct("!4sH")
#: bytes of a connection's parse buffer: frames up to this size are read with their neighbours in one ``recv``
STAGE_BYTES = 256 * 1024
#: the longest host name a HELLO may announce (DNS names are at most 253 characters)
MAX_HOST_BYTES = 255
_FRAME_MAGIC = b"LTPF"
_HELLO_MAGIC = b"LTPH"
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)


def available_congestion_controls() -> list[str]:
    """What this kernel offers (``/proc/sys/net/ipv4/tcp_available_congestion_control``)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


def set_congestion_control(sock: socket.socket, cc: str | None) -> None:
    if not cc:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, cc.encode())
    except OSError as exc:
        raise ConfigError(
            f"cannot use TCP congestion control {cc!r} ({exc}); available here: "
            f"{available_congestion_controls() or 'unknown'}; load it with `modprobe tcp_{cc}` "
            f"or pick another with --cc") from exc


class _EOF(Exception):
    """The connection ended (orderly or not) while a frame was being read."""


class _Reader:
    """Reads one non-blocking socket: small pieces out of a stage, large payloads straight into their buffer.

    Every ``recv`` into a buffer runs in the same step as the check of where the bytes go: a claimed receive
    abandoned while the reader waited (:meth:`Mailbox.abandon`) is never written again."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.stage = bytearray(STAGE_BYTES)
        self.sv = memoryview(self.stage)
        self.start = self.end = 0  # unparsed bytes: stage[start:end]

    async def _readable(self) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fd = self.sock.fileno()
        loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            loop.remove_reader(fd)

    async def _recv_into(self, pick) -> int:
        """``recv_into(pick())`` once data is there; ``pick`` names the buffer at the moment of the call."""
        while True:
            try:
                n = self.sock.recv_into(pick())
            except (BlockingIOError, InterruptedError):
                await self._readable()
                continue
            if n == 0:
                raise _EOF()
            return n

    async def take(self, n: int) -> memoryview:
        """The next ``n`` (<= STAGE_BYTES) bytes, from the stage."""
        while self.end - self.start < n:
            if self.start:
                k = self.end - self.start
                self.sv[:k] = self.sv[self.start:self.end]
                self.start, self.end = 0, k
            self.end += await self._recv_into(lambda: self.sv[self.end:])
        out = self.sv[self.start:self.start + n]
        self.start += n
        return out

    def _from_stage(self, dest: memoryview) -> int:
        k = min(self.end - self.start, dest.nbytes)
        if k:
            dest[:k] = self.sv[self.start:self.start + k]
            self.start += k
        return k

    async def read_into(self, dest: memoryview) -> None:
        filled = self._from_stage(dest)
        while filled < dest.nbytes:
            filled += await self._recv_into(lambda: dest[filled:])

    async def read_into_claim(self, claim) -> None:
        """The claimed message's payload into ``claim.dest`` (the receive's buffer, or its private copy)."""
        claim.filled = self._from_stage(claim.dest[:claim.length])
        while claim.filled < claim.length:
            claim.filled += await self._recv_into(lambda: claim.dest[claim.filled:claim.length])

    async def skip(self, n: int) -> None:
        """Read and drop ``n`` bytes (a message over the memory bound)."""
        k = min(n, self.end - self.start)
        self.start += k
        n -= k
        while n > 0:
            self.start = self.end = 0
            n -= await self._recv_into(lambda: self.sv[:min(n, STAGE_BYTES)])


def _still_open(sock: socket.socket) -> bool:
    """Whether an outbound connection may still carry a frame: its peer never sends on it, so anything to read
    (its FIN, a reset) means the peer closed it, and a frame written now would be lost after ``send`` returned."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return True  # nothing to read: open
    except OSError:
        return False
    return False  # its FIN (b"") or bytes it should never have sent


class TcpTransport(Transport):
    """Kernel TCP endpoint over non-blocking sockets; create with ``await TcpTransport.open(...)``."""

    name = "tcp"
    sends_confirm_peer = False  # the kernel buffers a send for a paused peer

    def __init__(self, cc: str | None = "cubic", *, max_receive_memory: int = 1 << 31,
                 connect_timeout: float = 10.0):
        self.cc = cc
        self.connect_timeout = connect_timeout  # seconds
        self._mailbox = Mailbox(max_receive_memory)
        self._lsock: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._addr: Address | None = None
        self._out: dict = {}  # peer -> connected socket
        self._out_locks: dict = {}
        self._in_tasks: set = set()
        self._closed = False

    @classmethod
    async def open(cls, host: str = "127.0.0.1", port: int = 0, *, cc: str | None = "cubic",
                   advertise_host: str | None = None, **kw) -> "TcpTransport":
        """Listen on ``(host, port)``; ``advertise_host`` is the address peers should dial."""
        self = cls(cc, **kw)
        if cc:  # fail early, before anything listens
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                set_congestion_control(probe, cc)
            finally:
                probe.close()
        family = socket.AF_INET6 if ":" in (host or "") else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((host or "0.0.0.0", port))
            lsock.listen(512)
            lsock.setblocking(False)
            set_congestion_control(lsock, cc)  # inherited by every accepted connection
        except BaseException:
            lsock.close()
            raise
        self._lsock = lsock
        self._accept_task = asyncio.ensure_future(self._accept_loop())
        bound = lsock.getsockname()
        adv = advertise_host or (bound[0] if bound[0] not in ("0.0.0.0", "::", "") else "127.0.0.1")
        self._addr = (adv, bound[1])
        return self

    @property
    def local_addr(self) -> Address:
        return self._addr

    @property
    def dropped(self):
        return self._mailbox.dropped

    # -- receiving -------------------------------------------------------
    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                conn, _ = await loop.sock_accept(self._lsock)
            except asyncio.CancelledError:
                return
            except OSError:
                if self._closed:
                    return
                await asyncio.sleep(0.01)  # EMFILE and friends: do not spin
                continue
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.ensure_future(self._serve(conn))
            self._in_tasks.add(task)
            task.add_done_callback(self._in_tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        """Read one inbound connection: HELLO, then frames, each to its receive (in place) or the mailbox."""
        rd = _Reader(conn)
        peer = None
        claim = None
        reserved = 0
        box = self._mailbox
        try:
            magic, hl = _HELLO_HEAD.unpack(await rd.take(_HELLO_HEAD.size))
            if magic != _HELLO_MAGIC or not 0 < hl <= MAX_HOST_BYTES:
                box.dropped["bad_hello"] += 1
                return
            host = bytes(await rd.take(hl)).decode("ascii", "replace")
            (port,) = struct.unpack("!H", await rd.take(2))
            peer = (host, port)
            box.peer_opened(peer)
            while True:
                magic, tag, length = _FRAME.unpack(await rd.take(_FRAME.size))
                if magic != _FRAME_MAGIC:
                    box.dropped["bad_frame"] += 1
                    return
                if length > box.max_bytes:  # refused before a byte of it is read or a buffer is made
                    box.dropped["too_large"] += 1
                    return
                t0 = time.monotonic()
                claim = box.claim(peer, tag, length)
                if claim is not None:
                    await rd.read_into_claim(claim)
                    c, claim = claim, None
                    box.finish(c, peer, tag, time.monotonic() - t0)
                elif box.reserve(length):
                    reserved = length
                    buf = memoryview(bytearray(length))
                    await rd.read_into(buf)
                    box.release(reserved)
                    reserved = 0
                    box.deliver(peer, tag, buf, time.monotonic() - t0)
                else:
                    box.dropped["memory"] += 1
                    await rd.skip(length)
        except (_EOF, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            if reserved:
                box.release(reserved)
            if claim is not None:
                box.unclaim(claim, PeerClosed(f"peer {peer} closed its connection mid-message"))
            if peer is not None and not self._closed:
                box.peer_closed(peer)
            conn.close()

    async def recv(self, into, *, peer: Address | None = None, tag: int | None = None,
                   timeout: float | None = None) -> RecvReport:
        self._check_open()
        view = as_bytes_view(into)
        if view.readonly:
            raise ValueError("recv: the buffer must be writable")
        t0 = time.monotonic()
        fut = self._mailbox.post(peer, tag, into=view)
        try:
            src, t, payload, _ = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError as exc:
            self._mailbox.abandon(fut)  # before the caller runs again: its buffer is not written after this
            raise TransportTimeout(f"no message (peer={peer}, tag={tag}) within {timeout} s") from exc
        except asyncio.CancelledError:
            self._mailbox.abandon(fut)
            raise
        if isinstance(payload, int):  # read in place (a claimed receive): view[:payload] holds it
            n = payload
        else:
            n = len(payload)
            if n > view.nbytes:
                raise TransportError(f"message of {n} bytes from {src} (tag {t}) does not fit the "
                                     f"{view.nbytes}-byte receive buffer; the peers disagree on the model size")
            view[:n] = payload
        return RecvReport(peer=src, tag=t, total_bytes=n, received_bytes=n, delivered_fraction=1.0,
                          bubbles=(), critical_complete=True, regime=COMPLETE,
                          duration_s=time.monotonic() - t0)

    async def gather(self, peers: Sequence[Address], into: Sequence, *, tag: int,
                     timeout: float | None = None, clock: str = "first") -> list[RecvReport]:
        self._check_open()
        return await gather_by_recv(self, peers, into, tag=tag, timeout=timeout)

    async def expect(self, peer: Address, into, *, tag: int) -> None:
        """A hint (:meth:`Transport.expect`): the message ``tag`` from ``peer`` is read straight into ``into`` if it
        arrives before its receive is posted, as a receive posted in time would be (``Mailbox.hint``)."""
        self._check_open()
        view = as_bytes_view(into)
        if view.readonly:
            raise ValueError("expect: the buffer must be writable")
        self._mailbox.hint(peer, tag, view)

    # -- sending ---------------------------------------------------------
    async def _connect(self, peer: Address) -> socket.socket:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in str(peer[0]) else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            set_congestion_control(sock, self.cc)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.wait_for(loop.sock_connect(sock, tuple(peer)), self.connect_timeout)
            host = self._addr[0].encode()
            await loop.sock_sendall(sock, _HELLO_HEAD.pack(_HELLO_MAGIC, len(host)) + host
                                    + struct.pack("!H", self._addr[1]))
        except BaseException:
            sock.close()
            raise
        return sock

    async def send(self, peer: Address, data, *, reliable: bool = False, critical=(),
                   element_size: int = 4, tag: int = 0, timeout: float | None = None) -> SendReport:
        self._check_open()
        peer = tuple(peer)
        view = as_bytes_view(data)
        if element_size and view.nbytes % element_size:
            raise ValueError(f"send: {view.nbytes} bytes is not a multiple of element_size={element_size}")
        lock = self._out_locks.setdefault(peer, asyncio.Lock())
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()

        async def go():
            async with lock:
                sock = self._out.get(peer)
                if sock is not None and not _still_open(sock):  # the peer went away (restarted, closed): redial
                    self._drop_conn(peer)
                    sock = None
                if sock is None:
                    sock = self._out[peer] = await self._connect(peer)
                try:
                    head = _FRAME.pack(_FRAME_MAGIC, tag, view.nbytes)
                    if view.nbytes <= STAGE_BYTES:  # one syscall for a small message
                        await loop.sock_sendall(sock, head + view.tobytes())
                    else:
                        await loop.sock_sendall(sock, head)
                        await loop.sock_sendall(sock, view)  # from the caller's buffer, no copy
                except BaseException:
                    # a frame cut off in the middle (timeout, error) leaves the stream unusable: reconnect next time
                    self._drop_conn(peer)
                    raise

        try:
            await asyncio.wait_for(go(), timeout)
        except asyncio.TimeoutError as exc:
            self._drop_conn(peer)
            raise TransportTimeout(f"send to {peer} (tag {tag}) not done within {timeout} s") from exc
        except (ConnectionError, OSError) as exc:
            self._drop_conn(peer)
            raise PeerGone(f"send to {peer} failed: {exc}") from exc
        return SendReport(peer=peer, tag=tag, total_bytes=view.nbytes, delivered_bytes=view.nbytes,
                          delivered_fraction=1.0, duration_s=time.monotonic() - t0,
                          close_reason=CloseReason.COMPLETE, reliable=True)

    def _drop_conn(self, peer):
        sock = self._out.pop(peer, None)
        if sock is not None:
            sock.close()

    def _check_open(self):
        if self._closed:
            raise TransportError("transport is closed")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._mailbox.close(TransportError("transport closed"))
        if self._accept_task is not None:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
        if self._lsock is not None:
            self._lsock.close()
        for peer in list(self._out):
            self._drop_conn(peer)
        for t in list(self._in_tasks):
            t.cancel()
        if self._in_tasks:
            await asyncio.gather(*self._in_tasks, return_exceptions=True)
