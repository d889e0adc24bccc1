"""Early Close (§III-B): when a receiver stops waiting for the rest of a flow.

Theory of operation. Two thresholds on time, measured from the start of the
receive group — the first registration of a gather (the start of the batch
synchronisation, Fig. 7's "the transmission has proceeded for 200 ms"), or
the flow's own registration when it is received alone. *Choice*: anchoring at
the group rather than at each flow keeps a worker that starts late (still
computing) from looking fast on its link, which would make the shared
deadline too early for the whole incast:

* the **LT threshold** of the flow's link. Before it the receiver waits for
  everything. It starts at ``1.5·RTprop + size/BtlBw`` from the estimates the
  sender carries in packet headers (the sender sends none until its model
  has left STARTUP, when its BtlBw is still a growing lower bound). The
  formula is anchored once, when valid estimates first arrive: elapsed time +
  ``1.5·RTprop + remaining/BtlBw`` — at registration exactly the paper's
  formula. Once the link (peer address) has delivered a message of this size,
  the threshold becomes the shortest full-delivery time among the last
  ``window`` deliveries (:class:`LinkThresholds`) plus half an RTprop — the
  margin the initial formula keeps over the expected completion time, so a
  transfer exactly as fast as the best one before it is not cut a packet
  short. *Choices*: the paper takes "the shortest 100% transmission time
  during every epoch"; the transport knows no epochs, so a sliding window
  stands in for one. A flow that Early Close cut contributes its *projected*
  full-delivery time (time of its last arrival ÷ fraction delivered): when
  flows nearly complete this equals what they took, and when senders run
  slower than their own BtlBw (a CPU-bound host) it keeps the threshold from
  cutting away most of every message round after round. Before any estimate
  or history exists the threshold is unknown and the receiver waits for all
  (bounded by the caller's timeout); the first message on a link measures it.
* the **deadline**, shared by all links of one receive group (a gather, or a
  single receive): ``t0 + max(LT) + C`` where ``t0`` is the first registration
  in the group and ``C`` the configured slack (30 ms DCN, 100 ms WAN).

Between the two, a flow closes as soon as its received fraction reaches
``lt_fraction`` (80% by default) *and* every critical segment is in *and*
the flow is in its long tail (see below) (*choice*: the fraction is per
flow, each link having its own LT threshold). At the deadline it closes
whatever it holds (unless stretched, below). A complete flow closes at once. Reliable flows never
close early. :func:`decide` is a pure function so the policy can be tested
without any protocol state.

**Progress and evidence of loss** (*choice*, issues 7/8/10). The paper's LT
threshold assumes the sender runs at its BtlBw, so that by the threshold its
first pass over the message is over and only retransmissions (the long tail)
are missing. A CPU-starved sender runs below its own estimate: at the
threshold it is still sending new data, in order, and nothing was lost; the
paper's rule then cuts 10-30% of every message on a loss-free network. So
the receiver also watches each flow (:class:`FlowProgress`, computed from the
flow's segment bitmap):

* *gaps* — a missing normal (non-critical) segment below the highest normal
  segment received: the sender sends normal segments in order and
  retransmits only after its first pass, so a gap is a loss (or a
  reordering, which LTP's paths do not produce); gaps / segments up to the
  highest received is the flow's observed *loss rate*;
* *first pass done* — the last normal segment has arrived: what is still
  missing can only come from retransmissions, the tail Early Close cuts;
* *advancing* — a segment arrived within the stall window
  ``max(STALL_MIN_S, C, STALL_RTPROPS·RTprop, STALL_GAPS·mean inter-arrival)``
  of the flow (C: the deadline slack, the time the paper allows a straggler).

After the LT threshold a flow closes *early* only when it is in its long
tail (its first pass is done or it stopped advancing) or its loss rate
exceeds ``STRETCH_MAX_LOSS`` (the paper's rule, unchanged on a congested
path). At the group deadline a flow closes if it is in its long tail, or
its loss rate exceeds ``STRETCH_MAX_LOSS`` (a congested path: waiting would
only add to the incast); otherwise it is a slow sender still in its first
pass, and it stays open while it keeps advancing, up to the **hard deadline**
``t0 + HARD_STRETCH·(deadline − t0)`` (and always within the caller's
timeout), and closes the moment its first pass ends. A lost packet thus
costs its own bytes, never a retransmission round trip, and a slow sender
is not cut: without loss every flow of a slow-but-steady sender is delivered
whole.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from .regimes import Regime

__all__ = ["LinkThresholds", "FlowProgress", "decide", "stall_window", "COMPLETE", "EARLY", "DEADLINE",
           "STALL_MIN_S", "STALL_RTPROPS", "STALL_GAPS", "HARD_STRETCH", "STRETCH_MAX_LOSS"]

#: the regimes :func:`decide` returns (members of :class:`ltp.regimes.Regime`)
COMPLETE = Regime.COMPLETE
EARLY = Regime.EARLY
DEADLINE = Regime.DEADLINE

#: a flow that received nothing for this long has stopped advancing (seconds; floor of the stall window:
#: a few scheduler time slices of a loaded host, so a descheduled sender is not taken for a stalled flow)
STALL_MIN_S = 0.020
#: ... nor for this many RTprops (a retransmission round trip)
STALL_RTPROPS = 2.0
#: ... nor for this many of its own mean inter-arrival gaps (a slow sender's pace)
STALL_GAPS = 8.0
#: a flow still in its first pass may run past the group deadline up to t0 + HARD_STRETCH·(deadline − t0)
HARD_STRETCH = 3.0
#: ... unless its observed loss rate (gaps / segments up to the highest received) exceeds this: random
#: loss up to 10% stretches, a congested queue (the simulator's 8-way incast loses ~27%) does not
STRETCH_MAX_LOSS = 0.15


class LinkThresholds:
    """LT thresholds per (link, message size), bounded in memory (LRU)."""

    def __init__(self, window: int = 32, max_links: int = 4096) -> None:
        self.window = window
        self.max_links = max_links
        self._full: OrderedDict = OrderedDict()

    @staticmethod
    def initial(rtprop_s: float, size: int, btlbw_bps: float) -> float:
        """The paper's initial LT threshold: ``1.5·RTprop + size/BtlBw``."""
        return 1.5 * rtprop_s + size / btlbw_bps

    def threshold(self, link, size: int, rtprop_s: float = 0.0, btlbw_bps: float = 0.0) -> float | None:
        """LT threshold in seconds for a flow starting now, or None when nothing is known yet."""
        hist = self.history(link, size)
        if hist is not None:
            return hist + 0.5 * rtprop_s
        if rtprop_s > 0 and btlbw_bps > 0:
            return self.initial(rtprop_s, size, btlbw_bps)
        return None

    def history(self, link, size: int) -> float | None:
        """Only the measured part: the shortest recent full delivery, or None."""
        hist = self._full.get((link, size))
        if not hist:
            return None
        self._full.move_to_end((link, size))
        return min(hist)

    def record_full(self, link, size: int, duration_s: float) -> None:
        """Record one complete delivery of ``size`` bytes over ``link`` taking ``duration_s``."""
        key = (link, size)
        hist = self._full.get(key)
        if hist is None:
            hist = self._full[key] = deque(maxlen=self.window)
            while len(self._full) > self.max_links:
                self._full.popitem(last=False)
        hist.append(duration_s)


def stall_window(rtprop_s: float, mean_gap_s: float | None, slack_s: float = 0.0) -> float:
    """Seconds without an arrival after which a flow counts as no longer advancing.

    ``slack_s`` is the deadline slack C the receiver allows a straggler (30 ms DCN,
    100 ms WAN); a flow silent for less than that is not taken for a stalled one.
    """
    w = max(STALL_MIN_S, slack_s, STALL_RTPROPS * rtprop_s)
    if mean_gap_s is not None:
        w = max(w, STALL_GAPS * mean_gap_s)
    return w


class FlowProgress:
    """What a flow's segment bitmap says about it: gaps (loss) and whether the first pass is over.

    Theory of operation: normal segments are sent in order and only
    retransmitted after the first pass (CQ -> NQ -> RQ), so among the normal
    segments received so far, a missing one below the highest is a loss, and
    the arrival of the last normal segment ends the first pass. Critical
    segments are sent first and are left out. The engine calls :meth:`observe`
    only once the LT threshold has passed. Cost: the first-pass test is O(1);
    the gap scan is O(segments) and is redone only after another
    1/:data:`GAP_SCANS` of the message arrived (or once the first pass ends),
    so a flow pays for at most ~``GAP_SCANS`` scans however it arrives.
    """

    #: gap scans per message at most (between scans the previous answer stands)
    GAP_SCANS = 64

    def __init__(self, seg_count: int, critical=None) -> None:
        if critical is not None and np.count_nonzero(critical):
            self._normal = np.flatnonzero(np.asarray(critical) == 0)
        else:
            self._normal = None
        self.seg_count = seg_count
        n_normal = seg_count if self._normal is None else self._normal.size
        self._last = (seg_count - 1 if self._normal is None else int(self._normal[-1])) if n_normal else -1
        self.first_pass_done = n_normal == 0
        self.gaps = False
        self.loss_rate = 0.0
        self._seen = -1
        self._stride = max(1, seg_count // self.GAP_SCANS)

    def observe(self, bitmap, received: int) -> tuple:
        """``(loss_rate, first_pass_done)`` for the flow's current bitmap (``received`` segments in).

        ``loss_rate``: missing normal segments below the highest one received,
        over the normal segments up to it (0.0: no gap). ``self.gaps`` is
        ``loss_rate > 0``.
        """
        if self._last < 0:
            return 0.0, True
        newly_done = False
        if not self.first_pass_done and bitmap[self._last]:
            self.first_pass_done = newly_done = True
        if self._seen >= 0 and not newly_done and received - self._seen < self._stride:
            return self.loss_rate, self.first_pass_done
        self._seen = received
        bm = np.asarray(bitmap)
        normal = bm if self._normal is None else bm[self._normal]
        got = np.flatnonzero(normal)
        span = int(got[-1]) + 1 if got.size else 0
        self.loss_rate = (span - got.size) / span if span else 0.0
        self.gaps = self.loss_rate > 0
        return self.loss_rate, self.first_pass_done


def _earliest(*times):
    ts = [t for t in times if t is not None]
    return min(ts) if ts else None


def decide(now: float, *, start: float, lt: float | None, deadline: float | None, fraction: float,
           complete: bool, critical_ok: bool, lt_fraction: float, reliable: bool,
           lossy: bool = True, first_pass_done: bool = True, stall_at: float | None = None,
           hard_deadline: float | None = None) -> tuple:
    """Early Close decision for one flow.

    Returns ``(regime, wake)``: ``regime`` is None (keep receiving),
    ``"complete"``, ``"early"`` or ``"deadline"``; ``wake`` is the next time
    the decision can change without new data (None if only data can change it).

    Progress evidence (see the module comment): ``lossy`` (the flow's loss
    rate exceeds ``STRETCH_MAX_LOSS``),
    ``first_pass_done`` (only retransmissions can still arrive), ``stall_at``
    (when the flow stops counting as advancing if nothing more arrives; None:
    never) and ``hard_deadline`` (the latest a flow in its first pass may stay
    open; None: the group deadline is hard). The defaults give the paper's
    rule unchanged.
    """
    if complete:
        return COMPLETE, None
    if reliable:
        return None, None
    if hard_deadline is not None and now >= hard_deadline:
        return DEADLINE, None
    advancing = stall_at is None or now < stall_at
    if deadline is not None and now >= deadline:
        if hard_deadline is None or lossy or not advancing or first_pass_done:
            return DEADLINE, None
        return None, _earliest(stall_at, hard_deadline)  # a slow sender still in its first pass: keep going
    wake = deadline
    if lt is not None:
        lt_at = start + lt
        if now >= lt_at:
            if fraction >= lt_fraction and critical_ok and (first_pass_done or not advancing or lossy):
                return EARLY, None
            if advancing:
                wake = _earliest(wake, stall_at)
        else:
            wake = _earliest(wake, lt_at)
    return None, wake
