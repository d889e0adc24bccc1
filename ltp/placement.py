"""Placement hints: where an expected message should land if it arrives before its receive is posted.

Theory of operation. A message that registers before any receive matches it is
*unexpected* (:mod:`ltp.matching`): it fills an internal buffer, and the receive
posted later gets a copy. A parameter server meets this every round: a worker
that got its parameters early sends its gradient while the PS is still
broadcasting to the others, so up to one model-sized copy per worker per round
runs on the PS's loop (4 x 102 MB for ResNet-50 with four workers).

A caller that knows which buffer the message will go to can say so ahead of
the receive: :meth:`PlacementHints.add` records ``(peer, tag) -> buffer``. An
unexpected message from ``peer`` with ``tag`` that fits then takes that buffer
as its destination instead of an internal one (:meth:`take`); it is still
unexpected in every other way (no deadline runs, it waits for its receive, it
expires unclaimed the same way), except that its bytes are not counted against
the receive-memory caps: they are the caller's, allocated before any peer said
anything (its per-segment state still is counted). When the receive posted later names
the same memory, the claim finds the bytes in place and copies nothing
(:func:`same_memory`); if it names another buffer, the claim copies as usual.

A hint is a promise by the caller: from :meth:`add` until the matching receive
completes, the buffer belongs to the transport. A hint is used at most once and
dropped when its receive is posted (the receive's own buffer rules from then
on), when a newer hint names the same ``(peer, tag)`` or a buffer at the same
address (one buffer waits for one message at a time), when the engine closes,
or, the oldest first, beyond :data:`MAX_HINTS`. A new hint also ends the
unclaimed message an older hint placed in that memory, if one is still there
(the engine cancels it: its receive was never posted, and the caller has
handed the buffer to another message). Hints come only from the local API:
nothing a peer sends creates one. Nothing here reads a clock.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict

import numpy as np

__all__ = ["PlacementHints", "MAX_HINTS", "same_memory", "overlap", "overlapping_pair"]

#: hints kept at most; adding one more drops the oldest (a peer that died never sends the message it was hinted for)
MAX_HINTS = 4096


def _address(view: memoryview) -> int:
    if not len(view):
        return 0
    if not view.readonly:  # ctypes reads a writable buffer's address in a fifth of numpy's time
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return np.frombuffer(view, np.uint8).__array_interface__["data"][0]


def same_memory(a: memoryview, b: memoryview) -> bool:
    """Whether byte views ``a`` and ``b`` start at the same address and have the same length."""
    return len(a) == len(b) and _address(a) == _address(b)


def overlap(a: memoryview, b: memoryview) -> bool:
    """Whether byte views ``a`` and ``b`` share any byte of memory."""
    if not len(a) or not len(b):
        return False
    x, y = _address(a), _address(b)
    return x < y + len(b) and y < x + len(a)


def overlapping_pair(views) -> tuple[int, int] | None:
    """The indices ``(i, j)``, ``i < j``, of two byte views in ``views`` that share memory, or None."""
    if len(views) < 2:  # a recv: one buffer
        return None
    spans = sorted((_address(v), len(v), i) for i, v in enumerate(views) if len(v))
    for (a, n, i), (b, _, j) in zip(spans, spans[1:]):
        if b < a + n:
            return min(i, j), max(i, j)
    return None


class PlacementHints:
    """``(peer, tag) -> writable byte view``, oldest first, at most :data:`MAX_HINTS`, one per buffer start."""

    def __init__(self, max_hints: int = MAX_HINTS) -> None:
        self.max_hints = max_hints
        self._hints: OrderedDict = OrderedDict()  # (peer, tag) -> (view, start address)
        self._by_start: dict = {}  # start address -> (peer, tag)
        self.used = 0  # hints a message landed in
        self.dropped = 0  # hints that expired unused (replaced, evicted, or their receive was posted first)

    def __len__(self) -> int:
        return len(self._hints)

    def add(self, peer, tag: int, dest: memoryview) -> None:
        """Expect the message ``(peer, tag)`` into ``dest``. An earlier hint for the same message, or on a buffer
        that starts at the same address (a buffer waits for one message at a time: a parameter server hints the
        same gradient buffer every round), is dropped."""
        key = (peer, tag)
        self._drop(key)
        start = _address(dest)
        old = self._by_start.get(start)
        if old is not None:
            self._drop(old)
        self._hints[key] = (dest, start)
        self._by_start[start] = key
        while len(self._hints) > self.max_hints:
            self._drop(next(iter(self._hints)))

    def _drop(self, key) -> None:
        got = self._hints.pop(key, None)
        if got is not None:
            del self._by_start[got[1]]
            self.dropped += 1

    def fits(self, peer, tag: int, total: int) -> bool:
        """Whether :meth:`take` would return a buffer (the hint is not used up)."""
        got = self._hints.get((peer, tag))
        return got is not None and len(got[0]) >= total

    def take(self, peer, tag: int, total: int) -> memoryview | None:
        """The first ``total`` bytes of the buffer hinted for ``(peer, tag)`` (the hint is used up), or None
        when there is no hint or its buffer is too small (the hint is then left for the receive to drop)."""
        if not self.fits(peer, tag, total):
            return None
        dest, start = self._hints.pop((peer, tag))
        del self._by_start[start]
        self.used += 1
        return dest[:total]

    def discard(self, peer, tag) -> None:
        """A receive for ``(peer, tag)`` was posted: its own buffer rules now."""
        self._drop((peer, tag))

    def clear(self) -> None:
        self._hints.clear()
        self._by_start.clear()
