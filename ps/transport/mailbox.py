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
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any


class PeerClosed(ConnectionError):
    """The peer closed its connection while we waited for its message."""


class Mailbox:
    def __init__(self, max_bytes: int = 1 << 31):
        self.max_bytes = max_bytes
        self._arrived: collections.deque = collections.deque()  # (peer, tag, payload, meta)
        self._arrived_bytes = 0
        self._waiting: list = []  # (peer, tag, future)
        self._closed_peers: set = set()
        self.dropped: collections.Counter = collections.Counter()

    @staticmethod
    def _match(want_peer, want_tag, peer, tag) -> bool:
        return (want_peer is None or tuple(want_peer) == tuple(peer)) and (want_tag is None or want_tag == tag)

    def deliver(self, peer, tag: int, payload, meta: Any = None) -> None:
        for i, (wp, wt, fut) in enumerate(self._waiting):
            if fut.done():
                continue
            if self._match(wp, wt, peer, tag):
                del self._waiting[i]
                fut.set_result((peer, tag, payload, meta))
                return
        size = len(payload)
        if self._arrived_bytes + size > self.max_bytes:
            self.dropped["memory"] += 1
            return
        self._arrived.append((peer, tag, payload, meta))
        self._arrived_bytes += size

    def post(self, peer=None, tag=None) -> asyncio.Future:
        """A future resolving to ``(peer, tag, payload, meta)``."""
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
        self._waiting.append((peer, tag, fut))
        return fut

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
        for wp, wt, fut in self._waiting:
            if wp is not None and tuple(wp) == peer and not fut.done():
                fut.set_exception(PeerClosed(f"peer {peer} closed its connection"))
            else:
                keep.append((wp, wt, fut))
        self._waiting = keep

    def peer_opened(self, peer) -> None:
        self._closed_peers.discard(tuple(peer))

    def close(self, exc: BaseException) -> None:
        for _, _, fut in self._waiting:
            if not fut.done():
                fut.set_exception(exc)
        self._waiting.clear()
        self._arrived.clear()
        self._arrived_bytes = 0
