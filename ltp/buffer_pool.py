"""Spare internal receive buffers, kept for the next unexpected message of the same size.

Theory of operation. A message that arrives before a receive is posted for it
(a worker's gradient while the PS is still broadcasting; the next round's
parameters while a worker still computes) is *unexpected*: the engine buffers
it in an internal buffer of the message's size until a receive claims it
(:mod:`ltp.matching`). A fresh ``bytearray`` is zero-filled when it is made
and handed back to the kernel when it is freed, on the event loop both times.
For a 100 MB gradient that stalled the PS's loop for 0.25-0.45 s at a time on
a loaded 2-core host: its peers went unheard meanwhile, and a worker's
gradient lost most of its Early Close window to it (loopback ResNet-50 job,
1 PS + 4 workers, 0 % loss). Training sends the same sizes every round, so a
freed internal buffer is kept here and the next unexpected message of exactly
that size takes it.

A reused buffer is not cleared. Nothing reads an internal buffer before its
flow closes, and the close zero-fills every byte the flow did not receive
(``FlowReceiver.close``), so no byte of an earlier message, from whichever
peer, reaches the receive that claims it. A buffer is given back only once no
open flow can write into it (its flow is closed and out of the engine's flow
table).

Bounds. Spares add up to at most ``cap_bytes`` (the engine passes its
``Config.max_receive_memory``: what it may hold on peers' behalf anyway), and
only buffers of :data:`SPARE_MIN_BYTES` or more are kept (a small one costs
nothing worth saving to allocate, and the pool's bookkeeping per spare, which
the cap does not count, stays under half a percent of what it holds); a
spare unused for :data:`SPARE_TTL_S` is dropped (the engine's
``SPARE_EXPIRY`` timer); :meth:`BufferPool.clear` drops them all. Sans-IO:
the caller passes ``now``.
"""

from __future__ import annotations

from collections import deque

__all__ = ["BufferPool", "SPARE_TTL_S", "SPARE_MIN_BYTES"]

#: a spare buffer not taken again within this long is dropped (seconds): longer than a training round, so
#: a PS or worker keeps its buffers across rounds, short enough that an idle endpoint gives the memory back
SPARE_TTL_S = 5.0
#: smaller internal buffers are not kept (the engine's pool; a READY note is 8 bytes, a gradient megabytes)
SPARE_MIN_BYTES = 64 << 10


class BufferPool:
    """Freed internal buffers by size, newest taken first; at most ``cap_bytes`` in all, none under
    ``min_bytes``."""

    def __init__(self, cap_bytes: int, min_bytes: int = 1) -> None:
        if cap_bytes < 0:
            raise ValueError("cap_bytes must be >= 0")
        self.cap_bytes = int(cap_bytes)
        self.min_bytes = max(1, int(min_bytes))
        self.bytes = 0  # bytes held in spares
        self.reused = 0  # buffers handed out again (not allocated)
        self._by_size: dict = {}  # size -> deque of entries [buffer, given_at, kept], oldest left
        self._order: deque = deque()  # every entry in the order given (expiry, oldest first); taken ones lazily

    def take(self, size: int) -> bytearray:
        """A buffer of exactly ``size`` bytes: the newest spare of that size (contents undefined), else a new
        zero-filled one."""
        spares = self._by_size.get(size)
        if spares:
            entry = spares.pop()
            if not spares:
                del self._by_size[size]
            entry[2] = False
            self.bytes -= size
            self.reused += 1
            return entry[0]
        return bytearray(size)

    def give(self, buf, now: float) -> None:
        """Keep ``buf`` (no longer written by anyone) for a later :meth:`take`, unless it is under ``min_bytes``
        or would exceed the cap."""
        size = len(buf)
        if size < self.min_bytes or self.bytes + size > self.cap_bytes:
            return
        entry = [buf, now, True]
        self._by_size.setdefault(size, deque()).append(entry)
        self._order.append(entry)
        self.bytes += size

    def next_expiry(self) -> float | None:
        """When the oldest spare is due to be dropped, or None with none kept."""
        order = self._order
        while order and not order[0][2]:
            order.popleft()
        return order[0][1] + SPARE_TTL_S if order else None

    def trim(self, now: float) -> None:
        """Drop the spares given back :data:`SPARE_TTL_S` or more before ``now``."""
        order = self._order
        while order and (not order[0][2] or order[0][1] + SPARE_TTL_S <= now):
            entry = order.popleft()
            if entry[2]:  # the oldest kept entry of its size: the left end of that size's deque
                entry[2] = False
                size = len(entry[0])
                spares = self._by_size[size]
                spares.popleft()
                if not spares:
                    del self._by_size[size]
                self.bytes -= size

    def clear(self) -> None:
        """Drop every spare."""
        self._by_size.clear()
        self._order.clear()
        self.bytes = 0
