"""The receiving side of one flow, and the receive slots applications post.

Theory of operation. A :class:`FlowReceiver` is created when a valid REG
arrives. It owns a :class:`RecvWindow` kernel that writes payload straight into
the destination (the application's buffer when a matching receive was posted,
else a bounded internal buffer) and queues one ACK entry per datagram. The
flow is OPEN until Early Close (``ltp.early_close.decide``) or completion
closes it; closing zero-fills the missing segments (packet bubbles), records a
full-delivery time for the LT threshold when the flow was complete, and
produces a :class:`RecvReport`.

A :class:`RecvSlot` is one posted receive (``recv`` posts one, ``gather`` posts
one per peer). Slots of one call form a :class:`RecvGroup` which shares the
Early Close deadline and completes when every slot has a report.
"""

from __future__ import annotations

import numpy as np

from ltp_ext import load as _load

from . import wire
from .bubbles import bubble_byte_ranges
from .early_close import GroupClock
from .regimes import Regime
from .reports import RecvReport

_dp = _load("datapath")

__all__ = ["FlowReceiver", "RecvSlot", "RecvGroup"]


class RecvGroup:
    """Receives posted by one call; they share one Early Close deadline."""

    def __init__(self, handle: int, now: float, timeout_at: float | None,
                 clock: GroupClock = GroupClock.FIRST) -> None:
        self.handle = handle
        self.slots: list = []
        self.clock = clock
        #: where the Early Close clock starts (``clock``): the first registration among the slots (``ALL``: the
        #: one that completed the group), never before ``posted``; None until then
        self.t0: float | None = None
        self.posted = now
        self.timeout_at = timeout_at
        self.wake: float | None = None  # next group-level timer (deadline for unregistered slots)
        self.done = False

    def remaining(self) -> int:
        return sum(1 for s in self.slots if s.report is None)


class RecvSlot:
    """One posted receive: a destination buffer and what may fill it."""

    def __init__(self, group: RecvGroup, index: int, peer, tag, dest) -> None:
        self.group = group
        self.index = index
        self.peer = peer
        self.tag = tag
        self.dest = dest
        self.flow: FlowReceiver | None = None
        self.report: RecvReport | None = None
        self.error: Exception | None = None

    def matches(self, peer, tag: int) -> bool:
        return (self.flow is None and self.report is None and (self.peer is None or self.peer == peer)
                and (self.tag is None or self.tag == tag))


class FlowReceiver:
    """Receive state of one flow."""

    def __init__(self, *, key, peer, flow_id: int, token: int, total: int, seg_size: int, element_size: int,
                 tag: int, reliable: bool, critical_runs, dest, internal: bool, now: float,
                 est: tuple, padding: int) -> None:
        self.key = key
        self.peer = peer
        self.flow_id = flow_id
        self.token = token
        self.total = total
        self.seg_size = seg_size
        self.element_size = element_size
        self.tag = tag
        self.reliable = reliable
        count = (total + seg_size - 1) // seg_size
        mask = None
        if critical_runs:
            mask = np.zeros(count, np.uint8)
            for a, b in critical_runs:
                mask[a:b] = 1
        self.window = _dp.RecvWindow(dest, total, seg_size, flow_id, token, mask)
        self.seg_count = count
        self.dest = dest
        self.internal = internal
        self.placed = False  # an unexpected message written into the buffer a caller hinted (ltp.placement)
        #: REG copies of this flow read (its pending registration's, and any after): more than one says its sender
        #: takes copies, i.e. its path showed loss (``ltp.path.CLEAN_PATH_PACKETS``), and the flow's completing ACK
        #: gets a guard STOP behind it (``Engine._close_rx``)
        self.copies = 1
        self.claimed = 0  # an internal buffer's bytes already copied into the slot that claimed it
        self.slot: RecvSlot | None = None
        self.start = now
        self.last_arrival = now
        self.paused_s = 0.0  # this process's own pauses while the flow was open (start moved on by them)
        self.ack_since: float | None = None
        self.rtprop_us, self.btlbw = est
        self.padding = padding
        self.regime: Regime | None = None
        self.closed_at: float | None = None
        self.report: RecvReport | None = None
        self.lt: float | None = None
        self.lt_anchor: float | None = None  # initial LT, fixed when valid estimates first arrive
        self.deadline: float | None = None
        self.next_check = 0.0  # a reliable flow: when new data next runs its Early Close check (ltp.engine)

    @property
    def anchor(self) -> float:
        """Where this flow's Early Close clock starts: its receive group's ``t0`` (the first registration, the
        start of the batch synchronisation, or the last under :attr:`GroupClock.ALL`; not before the group was
        posted), or its own registration when received alone or before the group's clock started."""
        if self.slot is not None and self.slot.group.t0 is not None:
            return self.slot.group.t0
        return self.start

    @property
    def fraction(self) -> float:
        return self.window.received / self.seg_count

    @property
    def complete(self) -> bool:
        return self.window.received >= self.seg_count

    @property
    def critical_ok(self) -> bool:
        return self.window.critical_received >= self.window.critical_total

    def update_estimates(self) -> None:
        """Take the sender's newest RTprop and BtlBw from the last DATA header seen (each where it is known:
        a sender advertises RTprop from its first RTT sample, BtlBw only once it stopped growing)."""
        w3 = self.window.last_word3
        if w3:
            rt, bw = wire.split_estimates(w3)
            if rt:
                self.rtprop_us = rt
            if bw:
                self.btlbw = bw

    def pause(self, seconds: float, now: float) -> None:
        """This process did not run for ``seconds`` before ``now`` (the own-pause rule, :mod:`ltp.liveness`): the
        flow's Early Close clock (its start, and its last arrival as progress evidence) moves on by them, since
        its sender was waiting for our ACKs. The report's ``duration_s`` still counts them."""
        self.start += seconds
        self.paused_s += seconds
        self.last_arrival = min(now, self.last_arrival + seconds)

    def close(self, now: float, regime: Regime) -> RecvReport:
        """Zero-fill what is missing and build the report."""
        self.update_estimates()  # the newest the sender advertised, whenever the last check ran
        self.regime = regime
        self.closed_at = now
        runs = self.window.missing_runs() if not self.complete else []
        if runs:
            self.window.zero_fill_missing()
        w = self.window
        self.report = RecvReport(
            peer=self.peer, tag=self.tag, total_bytes=self.total, received_bytes=w.received_bytes,
            delivered_fraction=w.received_bytes / self.total,
            bubbles=bubble_byte_ranges(runs, self.seg_size, self.total),
            critical_complete=self.critical_ok, regime=regime,
            duration_s=(self.last_arrival if regime == Regime.COMPLETE else now) - self.start + self.paused_s,
            duplicates=w.duplicates, rtprop_s=self.rtprop_us / 1e6, btlbw_bps=float(self.btlbw),
            lt_threshold_s=self.lt, deadline_s=None if self.deadline is None else self.deadline - self.anchor,
            reliable=self.reliable, padding_bytes_per_packet=self.padding)
        return self.report
