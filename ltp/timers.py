"""The engine's timers, named once: what can wake it, and the table that picks the next deadline.

Theory of operation. The sans-IO :class:`~ltp.engine.Engine` never sleeps; the
adapter asks :meth:`Engine.get_timer` for the earliest time anything can
change without new input and calls :meth:`Engine.handle_timer` then. That
time is the minimum over a fixed set of timer kinds (:class:`Timer`), each
armed from the state it belongs to:

* per path — ``PACING`` (the pacer's next send time);
* per send flow — ``REG_REPEAT`` (an unconfirmed REG is sent again),
  ``TAIL_LOSS`` (the probe timeout: in-flight data and no ACK for a PTO),
  ``REORDER`` (RACK: a transmission that a later one overtook is lost a round
  trip and a reordering window after it was sent, :meth:`Path.reorder_deadline`) and
  ``PEER_SILENCE`` (the dead-peer rule);
* per receive flow — ``EARLY_CLOSE`` (its Early Close decision can change with
  no new data) and ``ACK_DELAY`` (its oldest unacknowledged DATA waited
  ``ack_delay_s``, or a REG answer held for company did: :mod:`ltp.admission`);
* per receive group — ``RECEIVE_GROUP`` (its deadline for slots nobody
  registered for, and the caller's timeout);
* per endpoint — ``REGISTRATION_EXPIRY`` (the oldest pending registration,
  kept in a :class:`DeadlineHeap`), ``IDLE_SCAN`` (the next scan of receive
  flows for silent senders) and ``CLAIM_COPY`` (due at once while an unexpected
  message is being copied into the receive that claimed it, a step per call:
  :mod:`ltp.matching`), ``SPARE_EXPIRY`` (the oldest spare internal
  buffer is dropped: :mod:`ltp.buffer_pool`) and ``UNCLAIMED_EXPIRY`` (the
  oldest message no receive claimed has waited ``unclaimed_ttl_s``: its
  internal buffer goes, even on an endpoint nothing else wakes).

:class:`TimerTable` keeps the earliest deadline of each kind, so the next
deadline is their minimum and a test can ask which kind is due
(:meth:`Engine.timers`). Timers are level-triggered: :meth:`Engine.handle_timer`
re-checks every due condition, so a timer that fires early or twice is
harmless, and one that is re-armed later (an ACK moving the tail-loss timer)
needs no cancellation.
"""

from __future__ import annotations

import enum
import heapq

__all__ = ["Timer", "TimerTable", "DeadlineHeap"]


class Timer(enum.IntEnum):
    """The kinds of timer an engine arms (see the module comment)."""

    #: a path's pacer allows its next DATA batch
    PACING = 0
    #: an unconfirmed registration (REG) is repeated
    REG_REPEAT = 1
    #: tail-loss probe: in-flight DATA and no ACK for a PTO
    TAIL_LOSS = 2
    #: dead-peer rule: a send fails after its peer's silence limit
    PEER_SILENCE = 3
    #: a receive flow's Early Close decision can change without new data
    EARLY_CLOSE = 4
    #: a receive flow's batched ACK, or a held REG answer, has waited ack_delay_s
    ACK_DELAY = 5
    #: a receive group's deadline (unregistered slots expire) or the caller's timeout
    RECEIVE_GROUP = 6
    #: the oldest pending registration expires without DATA
    REGISTRATION_EXPIRY = 7
    #: next scan of receive flows for senders silent for idle_timeout_s
    IDLE_SCAN = 8
    #: the next step of copying a claimed unexpected message into its receive buffer (due at once)
    CLAIM_COPY = 9
    #: the oldest spare internal receive buffer is dropped (:mod:`ltp.buffer_pool`)
    SPARE_EXPIRY = 10
    #: the oldest closed message no receive claimed has waited unclaimed_ttl_s (its buffer is freed)
    UNCLAIMED_EXPIRY = 11
    #: RACK: an in-flight transmission that a later one overtook is declared lost (ltp/path.py)
    REORDER = 12


class TimerTable:
    """The earliest armed deadline of each :class:`Timer` kind (seconds, the engine's clock)."""

    __slots__ = ("_at",)

    def __init__(self, at=None) -> None:
        """``at``: the deadline (or None) of every kind, in :class:`Timer` order; default none armed."""
        if at is None:
            self._at: list = [None] * len(Timer)
        else:
            self._at = list(at)
            if len(self._at) != len(Timer):
                raise ValueError(f"TimerTable needs {len(Timer)} deadlines (one per Timer kind), got {len(self._at)}")

    def arm(self, kind: Timer, at: float | None) -> None:
        """Arm ``kind`` at ``at`` unless it is already armed earlier; None arms nothing."""
        if at is not None:
            cur = self._at[kind]
            if cur is None or at < cur:
                self._at[kind] = at

    def get(self, kind: Timer) -> float | None:
        """The earliest deadline armed for ``kind``, or None."""
        return self._at[kind]

    def next_deadline(self) -> float | None:
        """The minimum over every kind, or None when nothing is armed."""
        best = None
        for t in self._at:
            if t is not None and (best is None or t < best):
                best = t
        return best

    def due(self, now: float) -> list:
        """The kinds armed at or before ``now``, earliest first."""
        armed = [(t, k) for k, t in zip(Timer, self._at) if t is not None and t <= now]
        return [k for _, k in sorted(armed)]

    def as_dict(self) -> dict:
        """``{Timer: deadline}`` for every armed kind."""
        return {k: t for k, t in zip(Timer, self._at) if t is not None}


class DeadlineHeap:
    """Keys ordered by deadline (a min-heap), cleaned lazily.

    The owner keeps the authoritative deadline of each key elsewhere: an entry
    popped by :meth:`pop_due` may be stale (the key was removed, or its deadline
    was extended); the owner skips it or pushes the key again. Ties pop in push
    order.
    """

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list = []  # (deadline, seq, key)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, at: float, key) -> None:
        """Schedule ``key`` at ``at`` (seconds)."""
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, key))

    def next_time(self, alive=None) -> float | None:
        """The earliest scheduled deadline, or None when empty. With ``alive`` (a predicate on keys), entries
        at the front whose key is no longer alive are dropped first, so that a removed key arms no timer."""
        heap = self._heap
        if alive is not None:
            while heap and not alive(heap[0][2]):
                heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_due(self, now: float):
        """Remove and return the earliest key scheduled at or before ``now``, or None."""
        heap = self._heap
        if heap and heap[0][0] <= now:
            return heapq.heappop(heap)[2]
        return None

    def clear(self) -> None:
        """Forget every entry."""
        self._heap.clear()
