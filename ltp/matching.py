"""Receive-group matching: which posted receive a message fills, and when a group is done.

Theory of operation. An application posts receives in *groups*
(:class:`~ltp.receiver.RecvGroup`: one ``recv`` is a group of one slot, a
``gather`` one slot per peer); each :class:`~ltp.receiver.RecvSlot` names a
peer (or any) and a tag (or any) and brings its own buffer. Messages arrive
as flows that registered (REG) and sent their first DATA. The
:class:`ReceiveMatcher` pairs them, first come first served on both sides:

1. a new flow takes the oldest *waiting* slot it matches (``waiting_slot``);
   the flow then writes straight into the slot's buffer;
2. a flow that finds no slot is *unexpected*: it fills an internal buffer
   (bounded by admission's memory caps) and waits, oldest first, for a slot
   posted later (``find_unexpected``); a message larger than a slot's buffer
   never matches it, and a slot for one peer and one tag that finds only such
   messages of that peer and tag fails at once (``unfit_unexpected``), as it
   does when the message registers after it was posted, and the engine then
   refuses that message as it refuses a late one (RESET ``too_large`` while it
   still arrives; its internal buffer goes at once);
3. a slot bound to an unexpected flow that has closed receives a copy of the
   message and then its report (``claim``); none is needed when the message
   was written into the slot's own memory, as a placement hint asked
   (:mod:`ltp.placement`). The copy goes in steps of at most
   :data:`CLAIM_STEP_BYTES`, one per call: a 553 MB message copied in one call
   held its event loop for 4 s on a loaded 2-core machine, and the sender,
   hearing no ACK and no STOP meanwhile, declared the receiver dead. The
   engine runs the steps (its ``CLAIM_COPY`` timer, due at once while a copy is
   unfinished), so the loop reads, acknowledges and sends between them;
4. a slot with no flow by the group's deadline or timeout *expires*: its
   buffer is zero-filled and it gets an empty report (``expire``);
5. a group is *settled* when every slot has a report or an error; it is then
   finished once (``finish``), its slots leave the waiting list and the engine
   emits one :class:`~ltp.engine.ReceiveDone` with the reports in slot order.

Binding a flow to a slot sets the group's ``t0`` (its first registration, or
the group's posting if a message registered before the receive was posted),
where Early Close starts the group's clock; a group posted with
:attr:`~ltp.early_close.GroupClock.ALL` sets it only once no slot waits for a
message, at the latest registration among its slots
(:meth:`ReceiveMatcher.start_clock`). The matcher holds no clock and no
policy of its own: the engine decides when a slot expires (Early Close, the
caller's timeout, an unreachable peer) and what a closed flow reports.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .early_close import GroupClock
from .placement import same_memory
from .receiver import FlowReceiver, RecvGroup, RecvSlot
from .regimes import Regime
from .reports import RecvReport

__all__ = ["ReceiveMatcher", "empty_report", "expiry_cause", "CLAIM_STEP_BYTES"]

#: bytes of an unexpected message copied into its receive buffer per claim step (a few ms of memcpy):
#: the event loop runs between steps
CLAIM_STEP_BYTES = 8 << 20


def empty_report(slot: RecvSlot, regime: Regime, cause: str = "", now: float | None = None) -> RecvReport:
    """The report of a slot that received nothing: all of its buffer is one bubble."""
    n = len(slot.dest)
    waited = 0.0 if now is None else now - slot.group.posted
    return RecvReport(peer=slot.peer, tag=slot.tag, total_bytes=n, received_bytes=0, delivered_fraction=0.0,
                      bubbles=[(0, n)], critical_complete=False, regime=regime, duration_s=waited,
                      duplicates=0, rtprop_s=0.0, btlbw_bps=0.0, lt_threshold_s=None, deadline_s=None,
                      cause=cause)


def expiry_cause(slot: RecvSlot, now: float) -> str:
    """Why ``slot`` expired at ``now`` with nothing registered: its group's timeout or deadline."""
    group = slot.group
    who = "any peer" if slot.peer is None else f"peer {slot.peer}"
    waited = now - group.posted
    if group.timeout_at is not None and now >= group.timeout_at:
        return f"no message from {who} within the {group.timeout_at - group.posted:g} s timeout " \
               f"(waited {waited:.3f} s)"
    return f"no message from {who} registered before the gather's Early Close deadline " \
           f"(waited {waited:.3f} s)"


class ReceiveMatcher:
    """Posted receive groups, slots waiting for a message, and messages waiting for a slot."""

    def __init__(self) -> None:
        self.groups: dict = {}  # handle -> RecvGroup, until finished
        self.waiting: list = []  # RecvSlots without a flow, FIFO
        self.unexpected: deque = deque()  # FlowReceivers with internal buffers, FIFO

    def add(self, group: RecvGroup) -> None:
        """Track a newly posted group (its slots are matched one by one with :meth:`find_unexpected`)."""
        self.groups[group.handle] = group

    def wait(self, slot: RecvSlot) -> None:
        """``slot`` found no message: it waits for a flow to register."""
        self.waiting.append(slot)

    def waiting_slot(self, peer, tag: int) -> RecvSlot | None:
        """The oldest waiting slot a message from ``peer`` with ``tag`` would fill, or None."""
        for s in self.waiting:
            if s.matches(peer, tag):
                return s
        return None

    def unwait(self, slot: RecvSlot) -> None:
        """``slot`` stops waiting (a flow registered for it)."""
        self.waiting.remove(slot)

    def waiting_for(self, peer) -> list:
        """The waiting slots that name ``peer``."""
        return [s for s in self.waiting if s.peer == peer]

    def find_unexpected(self, slot: RecvSlot) -> FlowReceiver | None:
        """The oldest unexpected message ``slot`` matches and can hold, or None."""
        for flow in self.unexpected:
            if flow.slot is None and slot.matches(flow.peer, flow.tag) and flow.total <= len(slot.dest):
                return flow
        return None

    def unfit_unexpected(self, slot: RecvSlot) -> FlowReceiver | None:
        """For a slot naming one peer and one tag: the oldest unclaimed unexpected message of exactly that peer
        and tag, when it is larger than the slot's buffer (call after :meth:`find_unexpected` found none).
        A receive for a wildcard peer or tag waits on instead: another message may still match it."""
        if slot.peer is None or slot.tag is None:
            return None
        for flow in self.unexpected:
            if flow.slot is None and flow.peer == slot.peer and flow.tag == slot.tag and flow.total > len(slot.dest):
                return flow
        return None

    def add_unexpected(self, flow: FlowReceiver) -> None:
        """``flow`` found no slot: it keeps its internal buffer until one is posted."""
        self.unexpected.append(flow)

    def bind(self, slot: RecvSlot, flow: FlowReceiver) -> bool:
        """Pair ``slot`` (no longer waiting) and ``flow``; the group's clock starts at its first registration,
        but never before the group was posted. True when this pairing started the clock of a
        :attr:`~ltp.early_close.GroupClock.ALL` group (:meth:`start_clock`), whose flows then need a check."""
        slot.flow = flow
        flow.slot = slot
        group = slot.group
        if group.clock is GroupClock.ALL:
            return self.start_clock(group)
        start = max(flow.start, group.posted)
        if group.t0 is None or start < group.t0:
            group.t0 = start
        return False

    @staticmethod
    def start_clock(group: RecvGroup, now: float | None = None) -> bool:
        """A :attr:`~ltp.early_close.GroupClock.ALL` group's clock starts once no slot waits for a message (each
        has one, or failed or expired), at the latest registration among them (never before the posting), or at
        ``now`` when the last waiting slot ended without a message (its caller's ``now``). True when it started
        with this call."""
        if group.t0 is not None or group.clock is not GroupClock.ALL:
            return False
        if any(s.flow is None and s.report is None for s in group.slots):
            return False
        group.t0 = max([group.posted] + [s.flow.start for s in group.slots if s.flow is not None]
                       + ([] if now is None else [now]))
        return True

    def claim(self, flow: FlowReceiver, budget: int = CLAIM_STEP_BYTES) -> bool:
        """Copy up to ``budget`` more bytes of a closed unexpected ``flow`` into its slot; returns True when
        the whole message is in: the slot then has the flow's report and the flow stops being unexpected.

        The caller then gives back the internal buffer's memory (``flow.total`` bytes)."""
        slot = flow.slot
        start = flow.claimed
        if start == 0 and flow.placed and same_memory(flow.dest, slot.dest[:flow.total]):
            stop = flow.total  # it was received in place (a placement hint): nothing to copy
        else:
            stop = min(flow.total, start + max(1, budget))
            slot.dest[start:stop] = flow.dest[start:stop]
        flow.claimed = stop
        if stop < flow.total:
            return False
        slot.report = flow.report
        self.unexpected.remove(flow)
        return True

    def abandon_claim(self, flow: FlowReceiver) -> None:
        """Stop copying ``flow`` (its group ended: cancelled, or the engine closed); it stops being unexpected.

        The caller gives back the internal buffer's memory."""
        if flow in self.unexpected:
            self.unexpected.remove(flow)

    def unclaimed_expiry(self, ttl_s: float) -> float | None:
        """When :meth:`pop_unclaimed` will next return a message (the head of the queue), or None."""
        q = self.unexpected
        if q and q[0].report is not None and q[0].slot is None:
            return q[0].closed_at + ttl_s
        return None

    def pop_unclaimed(self, now: float, ttl_s: float) -> FlowReceiver | None:
        """Remove and return the oldest unexpected message closed at least ``ttl_s`` ago with no
        slot, or None (only the head of the queue is looked at)."""
        q = self.unexpected
        if q and q[0].report is not None and q[0].slot is None and q[0].closed_at + ttl_s <= now:
            return q.popleft()
        return None

    def fail(self, slot: RecvSlot, error: Exception) -> None:
        """``slot`` cannot be filled (the message does not fit its buffer): it gets ``error``."""
        slot.error = error
        if slot in self.waiting:  # a slot just posted fails before it waits (``unfit_unexpected``)
            self.waiting.remove(slot)
        slot.report = empty_report(slot, Regime.CANCELLED)

    def expire(self, slot: RecvSlot, now: float, regime: Regime, cause: str = "") -> None:
        """``slot`` got no message: zero its buffer and give it an empty report."""
        np.frombuffer(slot.dest, np.uint8).fill(0)  # in place: no message-sized temporary
        slot.report = empty_report(slot, regime, cause or expiry_cause(slot, now), now)
        if slot in self.waiting:
            self.waiting.remove(slot)

    @staticmethod
    def settled(group: RecvGroup) -> bool:
        """Whether every slot of an unfinished ``group`` has a report or an error."""
        return not group.done and all(s.report is not None or s.error is not None for s in group.slots)

    def finish(self, group: RecvGroup) -> list:
        """Mark ``group`` done and forget it; returns its reports in slot order."""
        group.done = True
        for s in group.slots:
            if s in self.waiting:
                self.waiting.remove(s)
        self.groups.pop(group.handle, None)
        return [s.report for s in group.slots]
