"""In-memory transport with LTP-like loss semantics, for deterministic tests.

A :class:`MemoryNetwork` connects any number of :class:`MemoryTransport`
endpoints inside one event loop.  Loss-tolerant sends (``reliable=False``)
are cut into ``segment_size``-byte segments; each non-critical segment is lost
with probability ``loss`` (seeded ``random.Random``), and the receiver gets the
message with the lost segments zero-filled and listed as ``bubbles`` -- what
LTP's bubble-filling delivers.  Segments overlapping a critical byte range are
always delivered.  ``kill(addr)`` makes an endpoint vanish (sends to it fail,
its pending transfers never complete), like a crashed process.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Sequence

from ..errors import PeerGone, TransportError, TransportTimeout
from .base import (COMPLETE, EARLY, Address, CloseReason, RecvReport, SendReport, Transport, as_bytes_view,
                   gather_by_recv)
from .mailbox import Mailbox


def _overlaps(a0, a1, ranges) -> bool:
    return any(a0 < e and s < a1 for s, e in ranges)


class MemoryNetwork:
    def __init__(self, *, loss: float = 0.0, segment_size: int = 1024, seed: int = 0, buffered_sends: bool = False,
                 jitter_s: float = 0.0):
        """``buffered_sends``: a send to a stalled endpoint completes at once, as kernel TCP's socket buffers take
        it for a stopped process (its endpoints then say ``sends_confirm_peer`` False); by default it waits for
        the peer, as an LTP send waits for the peer's own ACKs.  ``jitter_s``: each send waits a seeded uniform
        0..``jitter_s`` seconds before delivery, so sends overlap and finish out of order as on a loaded machine."""
        if jitter_s < 0:
            raise ValueError(f"jitter_s={jitter_s}: must be >= 0")
        self.jitter_s = jitter_s
        self.loss = loss
        self.buffered_sends = buffered_sends
        self.segment_size = segment_size
        self.rng = random.Random(seed)
        self.endpoints: dict = {}
        self.dead: set = set()
        self.stalled: set = set()  # endpoints that neither send nor take delivery (a stopped process): stall()
        self._next = 1

    def endpoint(self) -> "MemoryTransport":
        addr = ("mem", self._next)
        self._next += 1
        ep = MemoryTransport(self, addr)
        self.endpoints[addr] = ep
        return ep

    def kill(self, addr: Address) -> None:
        self.dead.add(tuple(addr))
        ep = self.endpoints.get(tuple(addr))
        for other in self.endpoints.values():
            if other is not ep:
                other._mailbox.peer_closed(tuple(addr))

    def stall(self, addr: Address) -> None:
        """Freeze ``addr`` as SIGSTOP would: its sends wait, sends to it wait (and time out) until :meth:`resume`."""
        self.stalled.add(tuple(addr))

    def resume(self, addr: Address) -> None:
        self.stalled.discard(tuple(addr))

    async def _wait_unstalled(self, addrs, timeout, what: str) -> None:
        t0 = time.monotonic()
        while any(a in self.stalled for a in addrs):
            if timeout is not None and time.monotonic() - t0 >= timeout:
                raise TransportTimeout(f"{what}: the peer did not answer within {timeout} s (stalled)")
            await asyncio.sleep(0.005)

    def lose(self, data: memoryview, critical) -> tuple:
        """Return ``(payload, bubbles)`` after dropping segments."""
        if self.loss <= 0:
            return bytes(data), ()
        buf = bytearray(data)
        bubbles = []
        seg = self.segment_size
        for s in range(0, len(buf), seg):
            e = min(s + seg, len(buf))
            if _overlaps(s, e, critical):
                continue
            if self.rng.random() < self.loss:
                buf[s:e] = bytes(e - s)
                if bubbles and bubbles[-1][1] == s:
                    bubbles[-1] = (bubbles[-1][0], e)
                else:
                    bubbles.append((s, e))
        return bytes(buf), tuple(bubbles)


class MemoryTransport(Transport):
    name = "memory"

    @property
    def sends_confirm_peer(self) -> bool:
        return not self.net.buffered_sends

    def __init__(self, net: MemoryNetwork, addr: Address):
        self.net = net
        self._addr = addr
        self._mailbox = Mailbox()
        self._closed = False

    @property
    def local_addr(self) -> Address:
        return self._addr

    async def send(self, peer, data, *, reliable=False, critical=(), element_size=4, tag=0, timeout=None):
        if self._closed or self._addr in self.net.dead:
            raise TransportError("transport is closed")
        view = as_bytes_view(data)
        if element_size and view.nbytes % element_size:
            raise ValueError(f"send: {view.nbytes} bytes is not a multiple of element_size={element_size}")
        peer = tuple(peer)
        dst = self.net.endpoints.get(peer)
        if dst is None or peer in self.net.dead or dst._closed:
            raise PeerGone(f"send to {peer} failed: no such endpoint (dead?)")
        if self.net.stalled:
            await self.net._wait_unstalled((self._addr,), None, f"send from {self._addr}")  # a stopped sender
            if not self.net.buffered_sends:
                await self.net._wait_unstalled((peer,), timeout, f"send to {peer}")
        if reliable:
            payload, bubbles = bytes(view), ()
        else:
            payload, bubbles = self.net.lose(view, critical)
        lost = sum(e - s for s, e in bubbles)
        await asyncio.sleep(self.net.rng.random() * self.net.jitter_s if self.net.jitter_s else 0)
        dst._mailbox.deliver(self._addr, tag, payload, bubbles)
        n = view.nbytes
        frac = (n - lost) / n if n else 1.0
        return SendReport(peer=peer, tag=tag, total_bytes=n, delivered_bytes=n - lost,
                          delivered_fraction=frac,
                          close_reason=CloseReason.COMPLETE if not lost else CloseReason.EARLY,
                          reliable=reliable)

    async def recv(self, into, *, peer=None, tag=None, timeout=None):
        view = as_bytes_view(into)
        t0 = time.monotonic()
        fut = self._mailbox.post(peer, tag)
        try:
            src, t, payload, bubbles = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError as exc:
            raise TransportTimeout(f"no message (peer={peer}, tag={tag}) within {timeout} s") from exc
        n = len(payload)
        if n > view.nbytes:
            raise TransportError(f"message of {n} bytes does not fit the {view.nbytes}-byte buffer")
        view[:n] = payload
        lost = sum(e - s for s, e in bubbles)
        return RecvReport(peer=src, tag=t, total_bytes=n, received_bytes=n - lost,
                          delivered_fraction=(n - lost) / n if n else 1.0, bubbles=tuple(bubbles),
                          critical_complete=True, regime=EARLY if bubbles else COMPLETE,
                          duration_s=time.monotonic() - t0)

    async def gather(self, peers: Sequence[Address], into: Sequence, *, tag, timeout=None, clock="first"):
        return await gather_by_recv(self, peers, into, tag=tag, timeout=timeout)

    async def close(self):
        self._closed = True
        self._mailbox.close(TransportError("transport closed"))
