"""Matching of arrived messages with posted receives (shared by TCP and memory transports).

Theory of operation
-------------------
Two queues, both in arrival order:

* ``_arrived``: complete messages nobody asked for yet, bounded by
  ``max_bytes`` (beyond it the message is dropped and counted in
  ``dropped["memory"]``, like ``ltp.Config.max_receive_memory``);
* ``_waiting``: posted receives ``(peer, tag, future)``.

Invariants: (1) a message is never both buffered and matched: ``deliver``
first tries the waiting receives (oldest first) and buffers only if none
matches; (2) ``post`` first scans the buffered messages (oldest first); (3) a
closed peer fails every receive that names it with :class:`PeerClosed`, and a
receive with ``peer=None`` is left waiting.

**Placement.** A receive may be posted with its destination (``post(into=)``).
When a message's header arrives, :meth:`claim` hands the transport the
receive that :meth:`deliver` would give the message to (the oldest waiting one
that matches), if it is posted with a buffer the message fits: the transport
then reads the payload straight into it and completes the receive with
its length as the payload ("in place").  Until then the receive is *claimed*.  A
claimed receive that is given up (its caller timed out or was cancelled) is
:meth:`abandon`-ed before its caller runs again: the bytes placed so far are
copied into a private buffer, where the rest of the message goes, and the
message is then buffered like any other, so the caller's buffer is never
written after its receive returned.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any


class PeerClosed(ConnectionError):
    """The peer closed its connection while we waited for its message."""


class Claim:
    """A waiting receive that one arriving message is being read into (:meth:`Mailbox.claim`)."""

    __slots__ = ("peer", "tag", "fut", "view", "length", "filled", "private")

    def __init__(self, peer, tag, fut, view, length: int):
        self.peer, self.tag, self.fut, self.view, self.length = peer, tag, fut, view, length
        self.filled = 0  # payload bytes placed so far (the reader keeps this up to date)
        self.private: memoryview | None = None  # where the rest goes once the receive is abandoned

    @property
    def dest(self) -> memoryview:
        """Where the message's bytes go now: the receive's buffer, or the private copy once abandoned."""
        return self.private if self.private is not None else self.view

    def detach(self) -> None:
        """The receive was given up: from now on the message goes to a private buffer (the bytes so far copied)."""
        if self.private is None:
            buf = memoryview(bytearray(self.length))
            buf[:self.filled] = self.view[:self.filled]
            self.private = buf


class Mailbox:
    def __init__(self, max_bytes: int = 1 << 31):
        self.max_bytes = max_bytes
        self._arrived: collections.deque = collections.deque()  # (peer, tag, payload, meta)
        self._arrived_bytes = 0
        self._reserved = 0  # bytes of messages being read into private buffers (counted against max_bytes)
        self._waiting: list = []  # (peer, tag, future, view or None)
        self._claims: dict = {}  # future -> Claim
        self._closed_peers: set = set()
        self.dropped: collections.Counter = collections.Counter()

    @staticmethod
    def _match(want_peer, want_tag, peer, tag) -> bool:
        return (want_peer is None or tuple(want_peer) == tuple(peer)) and (want_tag is None or want_tag == tag)

    def deliver(self, peer, tag: int, payload, meta: Any = None) -> None:
        for i, (wp, wt, fut, _view) in enumerate(self._waiting):
            if fut.done():
                continue
            if self._match(wp, wt, peer, tag):
                del self._waiting[i]
                fut.set_result((peer, tag, payload, meta))
                return
        size = len(payload)
        if not self._room(size):
            self.dropped["memory"] += 1
            return
        self._arrived.append((peer, tag, payload, meta))
        self._arrived_bytes += size

    def post(self, peer=None, tag=None, *, into: memoryview | None = None) -> asyncio.Future:
        """A future resolving to ``(peer, tag, payload, meta)``; ``payload`` is an int, the message's length, when
        the message was read straight into ``into`` (a flat byte view; placement, module comment)."""
        fut = asyncio.get_running_loop().create_future()
        for i, (p, t, payload, meta) in enumerate(self._arrived):
            if self._match(peer, tag, p, t):
                del self._arrived[i]
                self._arrived_bytes -= len(payload)
                fut.set_result((p, t, payload, meta))
                return fut
        if peer is not None and tuple(peer) in self._closed_peers:
            fut.set_exception(PeerClosed(f"peer {peer} closed its connection"))
            return fut
        self._waiting = [w for w in self._waiting if not w[2].done()]
        self._waiting.append((peer, tag, fut, into))
        return fut

    # -- placement -----------------------------------------------------------
    def claim(self, peer, tag: int, length: int) -> Claim | None:
        """The receive the message ``(peer, tag)`` of ``length`` bytes goes to, claimed for reading in place;
        None when that receive (the oldest waiting match) has no buffer or too small a one, or none waits."""
        for i, (wp, wt, fut, view) in enumerate(self._waiting):
            if fut.done() or not self._match(wp, wt, peer, tag):
                continue
            if view is None or view.nbytes < length:
                return None  # deliver() gives it to this receive, which copies (or refuses a message too large)
            del self._waiting[i]
            c = self._claims[fut] = Claim(wp, wt, fut, view, length)
            return c
        return None

    def finish(self, claim: Claim, peer, tag: int, meta: Any = None) -> None:
        """``claim``'s message is complete: its receive gets it in place, or, abandoned, it is buffered."""
        self._claims.pop(claim.fut, None)
        if claim.private is None and not claim.fut.done():
            claim.fut.set_result((peer, tag, claim.length, meta))
        else:
            self.deliver(peer, tag, claim.private if claim.private is not None else bytes(claim.view[:claim.length]),
                         meta)

    def unclaim(self, claim: Claim, exc: BaseException) -> None:
        """``claim``'s message will never complete (its connection closed): a receive that named that peer
        fails with ``exc``, one from any peer waits again (first in line)."""
        self._claims.pop(claim.fut, None)
        if claim.fut.done() or claim.private is not None:
            return
        if claim.peer is None:
            self._waiting.insert(0, (None, claim.tag, claim.fut, claim.view))
        else:
            claim.fut.set_exception(exc)

    def abandon(self, fut: asyncio.Future) -> None:
        """The receive of ``fut`` is given up: a message being read into its buffer moves to a private one now,
        before the receive's caller runs again (module comment)."""
        c = self._claims.get(fut)
        if c is not None:
            c.detach()

    def _room(self, n: int) -> bool:
        """Whether ``n`` more bytes fit the bound beside the buffered and the reserved ones."""
        return self._arrived_bytes + self._reserved + n <= self.max_bytes

    def reserve(self, n: int) -> bool:
        """Count ``n`` bytes of a message read into a private buffer against ``max_bytes``; False if over."""
        if not self._room(n):
            return False
        self._reserved += n
        return True

    def release(self, n: int) -> None:
        self._reserved -= n

    def discard_before(self, tag: int) -> int:
        """Drop buffered messages with ``tag < tag`` (late arrivals of finished rounds)."""
        keep = collections.deque(m for m in self._arrived if m[1] >= tag)
        n = len(self._arrived) - len(keep)
        if n:
            self._arrived = keep
            self._arrived_bytes = sum(len(m[2]) for m in keep)
            self.dropped["late"] += n
        return n

    def peer_closed(self, peer) -> None:
        peer = tuple(peer)
        self._closed_peers.add(peer)
        keep = []
        for wp, wt, fut, view in self._waiting:
            if wp is not None and tuple(wp) == peer and not fut.done():
                fut.set_exception(PeerClosed(f"peer {peer} closed its connection"))
            else:
                keep.append((wp, wt, fut, view))
        self._waiting = keep

    def peer_opened(self, peer) -> None:
        self._closed_peers.discard(tuple(peer))

    def close(self, exc: BaseException) -> None:
        for _, _, fut, _ in self._waiting:
            if not fut.done():
                fut.set_exception(exc)
        for fut, c in self._claims.items():
            c.detach()  # a reader still running writes its own buffer, never the caller's, from now on
            if not fut.done():
                fut.set_exception(exc)
        self._claims.clear()
        self._waiting.clear()
        self._arrived.clear()
        self._arrived_bytes = 0
