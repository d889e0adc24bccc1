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

**Hints** (:meth:`hint`, the transports' ``expect``): the buffer a message
``(peer, tag)`` will be received into, given before its receive is posted. A
message whose header arrives while no receive waits for it is claimed for the
hint and read straight into that buffer (:class:`_Placed`), so the receive
posted later on the same buffer finds it in place and nothing is copied or
held in the mailbox's memory; a receive on another buffer gets a copy. A
receive posted while its hinted message is still being read takes the claim
over (same buffer) or detaches it (another buffer: the rest goes to a private
copy), so the hint buffer is not written after that receive returns either.
A hint is used once; posting a receive for ``(peer, tag)`` drops an unused
one, and :meth:`discard_before` drops those of finished rounds. Before session
58 the TCP transport ignored hints, and a VGG-16 PS buffered every early
gradient (four model-sized private buffers a round, then a copy each).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any


class PeerClosed(ConnectionError):
    """The peer closed its connection while we waited for its message."""


class Claim:
    """A waiting receive (or a hint) that one arriving message is being read into (:meth:`Mailbox.claim`)."""

    __slots__ = ("peer", "tag", "fut", "view", "length", "filled", "private", "hinted")

    def __init__(self, peer, tag, fut, view, length: int, hinted: bool = False):
        self.peer, self.tag, self.fut, self.view, self.length = peer, tag, fut, view, length
        self.filled = 0  # payload bytes placed so far (the reader keeps this up to date)
        self.private: memoryview | None = None  # where the rest goes once the receive is abandoned
        self.hinted = hinted  # read into a hint's buffer: no receive waits for it (yet)

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


class _Placed:
    """A buffered message that was read in place into a hint's buffer: its bytes are ``view[:length]``, and it
    takes none of the mailbox's memory."""

    __slots__ = ("view", "length")

    def __init__(self, view: memoryview, length: int):
        self.view, self.length = view, length


def _size(payload) -> int:
    """Bytes a buffered payload holds in the mailbox's memory (a placed one: none)."""
    return 0 if isinstance(payload, _Placed) else len(payload)


def _address(view: memoryview) -> int | None:
    """Where a flat, writable byte view starts in memory (None for an empty or read-only one)."""
    import ctypes

    if view.nbytes == 0 or view.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _same_buffer(a: memoryview | None, b: memoryview) -> bool:
    """Whether ``a`` starts where ``b`` does (a receive's buffer and a hint's: the same memory)."""
    if a is None:
        return False
    start = _address(a)
    return start is not None and start == _address(b)


def _for_receive(payload, into: memoryview | None):
    """What a receive posted on ``into`` gets for ``payload``: a placed message already in ``into`` is its length
    (in place); in another buffer, a view of its bytes to copy; anything else as it is."""
    if not isinstance(payload, _Placed):
        return payload
    if _same_buffer(into, payload.view):
        return payload.length
    return payload.view[:payload.length]


class Mailbox:
    def __init__(self, max_bytes: int = 1 << 31):
        self.max_bytes = max_bytes
        self._arrived: collections.deque = collections.deque()  # (peer, tag, payload, meta)
        self._arrived_bytes = 0
        self._reserved = 0  # bytes of messages being read into private buffers (counted against max_bytes)
        self._waiting: list = []  # (peer, tag, future, view or None)
        self._claims: dict = {}  # future -> Claim
        self._hints: dict = {}  # (peer, tag) -> the buffer that message will be received into (hint())
        self._closed_peers: set = set()
        self.dropped: collections.Counter = collections.Counter()

    @staticmethod
    def _match(want_peer, want_tag, peer, tag) -> bool:
        return (want_peer is None or tuple(want_peer) == tuple(peer)) and (want_tag is None or want_tag == tag)

    def deliver(self, peer, tag: int, payload, meta: Any = None) -> None:
        for i, (wp, wt, fut, view) in enumerate(self._waiting):
            if fut.done():
                continue
            if self._match(wp, wt, peer, tag):
                del self._waiting[i]
                fut.set_result((peer, tag, _for_receive(payload, view), meta))
                return
        size = _size(payload)
        if size and not self._room(size):
            self.dropped["memory"] += 1
            return
        self._arrived.append((peer, tag, payload, meta))
        self._arrived_bytes += size

    def post(self, peer=None, tag=None, *, into: memoryview | None = None) -> asyncio.Future:
        """A future resolving to ``(peer, tag, payload, meta)``; ``payload`` is an int, the message's length, when
        the message was read straight into ``into`` (a flat byte view; placement, module comment)."""
        fut = asyncio.get_running_loop().create_future()
        if peer is not None and tag is not None:
            self._hints.pop((tuple(peer), tag), None)  # the receive's own buffer is used from now on
        for i, (p, t, payload, meta) in enumerate(self._arrived):
            if self._match(peer, tag, p, t):
                del self._arrived[i]
                self._arrived_bytes -= _size(payload)
                fut.set_result((p, t, _for_receive(payload, into), meta))
                return fut
        for c in list(self._claims.values()):  # its hinted message is being read now
            if c.hinted and not c.fut.done() and self._match(peer, tag, c.peer, c.tag):
                if c.private is None and _same_buffer(into, c.view) and into.nbytes >= c.length:
                    del self._claims[c.fut]  # the receive takes the claim over: in place, abandon()-able
                    c.fut, c.hinted = fut, False
                    self._claims[fut] = c
                    return fut
                c.detach()  # another buffer: the hint's is not written after this receive returns
                break
        if peer is not None and tuple(peer) in self._closed_peers:
            fut.set_exception(PeerClosed(f"peer {peer} closed its connection"))
            return fut
        self._waiting = [w for w in self._waiting if not w[2].done()]
        self._waiting.append((peer, tag, fut, into))
        return fut

    # -- placement -----------------------------------------------------------
    def claim(self, peer, tag: int, length: int) -> Claim | None:
        """The receive the message ``(peer, tag)`` of ``length`` bytes goes to, claimed for reading in place;
        with none waiting, the buffer hinted for it (:meth:`hint`). None when that receive (the oldest waiting
        match) or that hint has no buffer or too small a one, or neither exists."""
        for i, (wp, wt, fut, view) in enumerate(self._waiting):
            if fut.done() or not self._match(wp, wt, peer, tag):
                continue
            if view is None or view.nbytes < length:
                return None  # deliver() gives it to this receive, which copies (or refuses a message too large)
            del self._waiting[i]
            c = self._claims[fut] = Claim(wp, wt, fut, view, length)
            return c
        view = self._hints.pop((tuple(peer), tag), None)
        if view is None or view.nbytes < length:
            return None
        fut = asyncio.get_running_loop().create_future()  # stands for the receive not posted yet
        c = self._claims[fut] = Claim(tuple(peer), tag, fut, view, length, hinted=True)
        return c

    def hint(self, peer, tag: int, into: memoryview) -> None:
        """The message ``(peer, tag)`` will be received into ``into`` (a flat, writable byte view): if it arrives
        before its receive is posted, it is read straight into it (module comment)."""
        self._hints[(tuple(peer), tag)] = into

    def finish(self, claim: Claim, peer, tag: int, meta: Any = None) -> None:
        """``claim``'s message is complete: its receive gets it in place, or, abandoned, it is buffered."""
        self._claims.pop(claim.fut, None)
        if claim.hinted:  # no receive waited for it when it arrived: buffered where it lies, or as copied
            self.deliver(peer, tag, claim.private[:claim.length] if claim.private is not None
                         else _Placed(claim.view, claim.length), meta)
        elif claim.private is None and not claim.fut.done():
            claim.fut.set_result((peer, tag, claim.length, meta))
        else:
            self.deliver(peer, tag, claim.private if claim.private is not None else bytes(claim.view[:claim.length]),
                         meta)

    def unclaim(self, claim: Claim, exc: BaseException) -> None:
        """``claim``'s message will never complete (its connection closed): a receive that named that peer
        fails with ``exc``, one from any peer waits again (first in line)."""
        self._claims.pop(claim.fut, None)
        if claim.hinted or claim.fut.done() or claim.private is not None:
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
        self._hints = {k: v for k, v in self._hints.items() if k[1] >= tag}
        keep = collections.deque(m for m in self._arrived if m[1] >= tag)
        n = len(self._arrived) - len(keep)
        if n:
            self._arrived = keep
            self._arrived_bytes = sum(_size(m[2]) for m in keep)
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
        self._hints.clear()
        self._waiting.clear()
        self._arrived.clear()
        self._arrived_bytes = 0
