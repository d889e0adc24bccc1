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


class TcpTransport(Transport):
    """Asyncio-streams TCP endpoint; create with ``await TcpTransport.open(...)``."""

    name = "tcp"
    sends_confirm_peer = False  # the kernel buffers a send for a paused peer

    def __init__(self, cc: str | None = "cubic", *, max_receive_memory: int = 1 << 31,
                 connect_timeout: float = 10.0):
        self.cc = cc
        self.connect_timeout = connect_timeout  # seconds
        self._mailbox = Mailbox(max_receive_memory)
        self._server: asyncio.base_events.Server | None = None
        self._addr: Address | None = None
        self._out: dict = {}  # peer -> (reader, writer)
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
        self._server = await asyncio.start_server(self._on_conn, host, port)
        for s in self._server.sockets:
            set_congestion_control(s, cc)
        bound = self._server.sockets[0].getsockname()
        adv = advertise_host or (bound[0] if bound[0] not in ("0.0.0.0", "") else "127.0.0.1")
        self._addr = (adv, bound[1])
        return self

    @property
    def local_addr(self) -> Address:
        return self._addr

    @property
    def dropped(self):
        return self._mailbox.dropped

    # -- receiving -------------------------------------------------------
    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._in_tasks.add(task)
        peer = None
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            magic = await reader.readexactly(4)
            if magic != _HELLO_MAGIC:
                self._mailbox.dropped["bad_hello"] += 1
                return
            (hl,) = struct.unpack("!H", await reader.readexactly(2))
            host = (await reader.readexactly(hl)).decode()
            (port,) = struct.unpack("!H", await reader.readexactly(2))
            peer = (host, port)
            self._mailbox.peer_opened(peer)
            while True:
                head = await reader.readexactly(_FRAME.size)
                magic, tag, length = _FRAME.unpack(head)
                if magic != _FRAME_MAGIC:
                    self._mailbox.dropped["bad_frame"] += 1
                    return
                t0 = time.monotonic()
                payload = await reader.readexactly(length) if length else b""
                self._mailbox.deliver(peer, tag, payload, time.monotonic() - t0)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            if peer is not None and not self._closed:
                self._mailbox.peer_closed(peer)
            writer.close()
            self._in_tasks.discard(task)

    async def recv(self, into, *, peer: Address | None = None, tag: int | None = None,
                   timeout: float | None = None) -> RecvReport:
        self._check_open()
        view = as_bytes_view(into)
        if view.readonly:
            raise ValueError("recv: the buffer must be writable")
        t0 = time.monotonic()
        fut = self._mailbox.post(peer, tag)
        try:
            src, t, payload, _ = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError as exc:
            fut.cancel()
            raise TransportTimeout(f"no message (peer={peer}, tag={tag}) within {timeout} s") from exc
        except PeerClosed:
            raise
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

    # -- sending ---------------------------------------------------------
    async def _connect(self, peer: Address):
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            set_congestion_control(sock, self.cc)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.wait_for(loop.sock_connect(sock, tuple(peer)), self.connect_timeout)
        except BaseException:
            sock.close()
            raise
        reader, writer = await asyncio.open_connection(sock=sock)
        host = self._addr[0].encode()
        writer.write(_HELLO_MAGIC + struct.pack("!H", len(host)) + host + struct.pack("!H", self._addr[1]))
        return reader, writer

    async def send(self, peer: Address, data, *, reliable: bool = False, critical=(),
                   element_size: int = 4, tag: int = 0, timeout: float | None = None) -> SendReport:
        self._check_open()
        peer = tuple(peer)
        view = as_bytes_view(data)
        if element_size and view.nbytes % element_size:
            raise ValueError(f"send: {view.nbytes} bytes is not a multiple of element_size={element_size}")
        lock = self._out_locks.setdefault(peer, asyncio.Lock())
        t0 = time.monotonic()

        async def go():
            async with lock:
                conn = self._out.get(peer)
                if conn is None or conn[1].is_closing():
                    conn = self._out[peer] = await self._connect(peer)
                w = conn[1]
                w.write(_FRAME.pack(_FRAME_MAGIC, tag, view.nbytes))
                w.write(view)
                await w.drain()

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
        conn = self._out.pop(peer, None)
        if conn is not None:
            conn[1].close()

    def _check_open(self):
        if self._closed:
            raise TransportError("transport is closed")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._mailbox.close(TransportError("transport closed"))
        if self._server is not None:
            self._server.close()
        for peer in list(self._out):
            self._drop_conn(peer)
        for t in list(self._in_tasks):
            t.cancel()
        if self._in_tasks:
            await asyncio.gather(*self._in_tasks, return_exceptions=True)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except asyncio.TimeoutError:
                pass
