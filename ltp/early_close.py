"""Early Close (§III-B): when a receiver stops waiting for the rest of a flow.

Theory of operation. Two thresholds on time, measured from the start of the
receive group — the first registration of a gather (the start of the batch
synchronisation, Fig. 7's "the transmission has proceeded for 200 ms"), or
the flow's own registration when it is received alone. *Choice*: anchoring at
the group rather than at each flow keeps a worker that starts late (still
computing) from looking fast on its link, which would make the shared
deadline too early for the whole incast. *Choice*: the group's clock starts
no earlier than the group was posted. A message that registered before its
receiver asked for it (a worker pushing while its PS was still broadcasting
to the others) says nothing about the batch synchronisation's start: a PS
that posted its gather 0.95 s after the first worker's push, on a 2-core host,
found the deadline (0.32 s after that push) long past, and cut the last
worker's gradient at 49 % the moment it registered. *Choice*: a message
nobody has posted a receive for yet (an *unexpected* message, buffered
internally) is never closed early: no one is waiting for it, so it has no
tail to cut, and the receive that claims it may come after the sender has
finished. Before this, such a message ran on its own clock and was cut at its
link's LT threshold while the PS was still broadcasting; the gather that
claimed it later found a quarter to all of it missing (loopback, 4 workers,
ResNet-50 size, 0 % loss: delivered 0.55-0.70 a run). Its clock starts when a
receive claims it, as the claiming group's:

* the **LT threshold** of the flow's link. Before it the receiver waits for
  everything. It starts at ``1.5·RTprop + size/BtlBw`` from the estimates the
  sender carries in packet headers (BtlBw only once it stopped growing: in
  STARTUP it is a lower bound the flow outruns; RTprop from the sender's
  first RTT sample, see :meth:`EarlyClose.rtprop_of`). The
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

**When the group's clock starts** (:class:`GroupClock`, chosen per gather).
``FIRST`` is the paper's: the first registration (not before the posting).
``ALL`` (*choice*, for a parameter server whose workers compute before they
push) starts it when the last slot of the group has registered, at that
registration; until then no flow of the group is closed early and no slot
expires before the caller's timeout. A worker still computing is not a
network long tail. Under ``FIRST`` the PS had to learn that every worker was
done from a tiny reliable READY message per worker and round, and post its
gather only then: a third of the messages of a digits round, each costing
LTP about as much CPU as a gradient's control path (docs/performance.md,
session 54).

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

**Critical segments at the deadline** (*choice*). The paper delivers critical
data reliably, and Early Close before the deadline already waits for it. At
the group deadline a flow still missing a critical segment (its first copy was
lost, and its sender registered late, so the retransmission is a round trip
away) stays open until the segment arrives, up to the hard deadline, and then
closes at once: closed without it the message is worth nothing to its receiver
(the parameter server cannot use a gradient whose header is missing), so the
deadline would throw away everything that did arrive. Simulator, 4 senders of
160 kB, one starting 20-40 ms late with its header lost: cut at 99.1 %
delivered without the header, before this.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque

import numpy as np

from .regimes import Regime

__all__ = ["GroupClock", "EarlyClose", "LinkThresholds", "FlowProgress", "decide", "stall_window", "group_deadline",
           "hard_deadline", "projected_full_duration", "COMPLETE", "EARLY", "DEADLINE", "STALL_MIN_S",
           "STALL_RTPROPS", "STALL_GAPS", "HARD_STRETCH", "STRETCH_MAX_LOSS", "HISTORY_RTPROP_MARGIN",
           "INITIAL_RTPROPS"]


class GroupClock(str, enum.Enum):
    """Where a receive group's Early Close clock (``t0``) starts (see the module docstring)."""

    #: the group's first registration, not before it was posted (the paper's batch synchronisation)
    FIRST = "first"
    #: the registration that completes the group: every slot has a message (a barrier: senders that were
    #: still computing are not a network tail)
    ALL = "all"


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
#: the initial LT threshold allows this many RTprops on top of size/BtlBw (the paper's 1.5)
INITIAL_RTPROPS = 1.5
#: a measured LT threshold (shortest recent full delivery) gets this many RTprops of margin
HISTORY_RTPROP_MARGIN = 0.5


class LinkThresholds:
    """LT thresholds per (link, message size), bounded in memory (LRU)."""

    def __init__(self, window: int = 32, max_links: int = 4096) -> None:
        self.window = window
        self.max_links = max_links
        self._full: OrderedDict = OrderedDict()

    @staticmethod
    def initial(rtprop_s: float, size: int, btlbw_bps: float) -> float:
        """The paper's initial LT threshold: ``1.5·RTprop + size/BtlBw``."""
        return INITIAL_RTPROPS * rtprop_s + size / btlbw_bps

    def threshold(self, link, size: int, rtprop_s: float = 0.0, btlbw_bps: float = 0.0) -> float | None:
        """LT threshold in seconds for a flow starting now, or None when nothing is known yet.

        The same computation as :meth:`flow_threshold` (which the engine runs) for a
        flow that has received nothing and fixed no anchor yet."""
        return self.flow_threshold(link, size, rtprop_s, btlbw_bps)[0]

    def flow_threshold(self, link, size: int, rtprop_s: float = 0.0, btlbw_bps: float = 0.0, *,
                       elapsed_s: float = 0.0, remaining: int | None = None,
                       anchor: float | None = None) -> tuple:
        """LT threshold of one live flow: ``(lt, anchor)``, seconds after the flow's Early Close start.

        With a measured history for ``(link, size)``: the shortest recent full
        delivery plus ``HISTORY_RTPROP_MARGIN·RTprop``. Otherwise the initial
        formula, fixed (*anchored*) the first time valid estimates are seen:
        ``elapsed_s + 1.5·RTprop + remaining/BtlBw`` (``remaining``: bytes not yet
        received, default ``size``) — at registration exactly the paper's
        formula. ``anchor`` is the value fixed by an earlier call for this flow
        (None before); the caller keeps the returned ``anchor`` and passes it
        back. ``lt`` is None while nothing is known.
        """
        hist = self.history(link, size)
        if hist is not None:
            return hist + HISTORY_RTPROP_MARGIN * rtprop_s, anchor
        if anchor is None and rtprop_s > 0 and btlbw_bps > 0:
            anchor = elapsed_s + self.initial(rtprop_s, size if remaining is None else remaining, btlbw_bps)
        return anchor, anchor

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

    def record_closed(self, link, size: int, regime, *, anchor: float, start: float, last_arrival: float,
                      received_bytes: int) -> None:
        """Record what a closed flow says about its link's full-delivery time.

        ``anchor``: the flow's Early Close start (its group's clock; a flow that registered before the clock
        started is timed from its own registration); ``start``: its own registration; ``last_arrival``: its last DATA (all on
        the engine's clock). A complete flow records what it took; a flow cut by
        Early Close (``early``/``deadline``) that received anything records its
        projected full-delivery time (:func:`projected_full_duration`). Other
        regimes say nothing about the link.
        """
        anchor = min(anchor, start)
        if regime == Regime.COMPLETE:
            self.record_full(link, size, last_arrival - anchor)
        elif regime in (Regime.EARLY, Regime.DEADLINE) and received_bytes > 0:
            self.record_full(link, size, projected_full_duration(start - anchor, last_arrival - start,
                                                                 received_bytes / size))


def projected_full_duration(start_offset_s: float, arrival_span_s: float, fraction: float) -> float:
    """How long all of a cut flow would have taken at the rate it arrived (seconds after its start).

    ``fraction`` (> 0) of it arrived within ``arrival_span_s`` of its registration,
    which came ``start_offset_s`` after its Early Close start."""
    return start_offset_s + arrival_span_s / fraction


def group_deadline(t0: float, worst_lt: float | None, slack_s: float) -> float | None:
    """The receive group's Early Close deadline ``t0 + max(LT) + C`` from the largest LT threshold of
    its links (``worst_lt``; 0.0 when no link counts), or None while an LT is unknown (None)."""
    return None if worst_lt is None else t0 + worst_lt + slack_s


def hard_deadline(start: float, deadline: float, timeout_at: float | None = None) -> float:
    """The latest a flow still in its first pass may stay open: ``start + HARD_STRETCH·(deadline − start)``,
    and never after the caller's timeout ``timeout_at``."""
    hard = start + HARD_STRETCH * max(0.0, deadline - start)
    return hard if timeout_at is None else min(hard, timeout_at)


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
        if hard_deadline is None:
            return DEADLINE, None
        if not critical_ok:  # closed now it would be worth nothing: wait for the critical retransmission
            return None, hard_deadline
        if lossy or not advancing or first_pass_done:
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


class EarlyClose:
    """The Early Close policy applied to live receive flows (sans-IO; the engine owns the flows).

    Theory of operation: for each flow the engine asks :meth:`check` after new
    data or when the flow's wake-up time passes. :meth:`check` computes the
    flow's LT threshold (:meth:`LinkThresholds.flow_threshold`, anchoring the
    initial formula on the flow), its group's deadline (:func:`group_deadline`
    over the LT thresholds of every unreliable link of the group; a slot not yet
    registered contributes its link's measured history, or makes the deadline
    unknown), gathers progress evidence once the LT threshold or the deadline
    has passed (:class:`FlowProgress`, :func:`stall_window`,
    :func:`hard_deadline`) and returns :func:`decide`'s ``(regime, wake)``. It
    writes ``flow.lt``, ``flow.lt_anchor`` and ``flow.deadline`` (reported in the
    flow's :class:`~ltp.reports.RecvReport`) and the group's ``wake`` (the
    deadline at which its unregistered slots expire). :meth:`on_close` feeds a
    closed flow's delivery time back into the thresholds.

    A *flow* here is any object with the attributes of
    :class:`ltp.receiver.FlowReceiver` (``peer``, ``total``, ``anchor``,
    ``start``, ``last_arrival``, ``window``, ``slot``, ...).
    """

    def __init__(self, *, slack_s: float, lt_fraction: float, window: int = 32, max_links: int = 4096,
                 rate_cap=None, rtt_of=None) -> None:
        """``slack_s``: the deadline slack C (seconds); ``lt_fraction``: the fraction a flow needs
        to close early; ``window``/``max_links``: see :class:`LinkThresholds`; ``rate_cap(flow)``: the
        payload rate (bytes/s) this receiver grants the flow's sender, 0 for none (*choice*: the initial
        formula's BtlBw is the smaller of the sender's estimate and that share, as the receiver knows N
        senders share its link; a sender's first estimate is of the link alone); ``rtt_of(peer)``: this
        receiver's own smoothed RTT to ``peer`` (seconds) or None, used where the sender advertised no
        RTprop (:meth:`rtprop_of`)."""
        self.slack_s = slack_s
        self.lt_fraction = lt_fraction
        self._rate_cap = rate_cap
        self._rtt_of = rtt_of
        self.thresholds = LinkThresholds(window, max_links)
        self._progress: dict = {}  # flow key -> FlowProgress, made once a flow passes its LT threshold

    def rtprop_of(self, flow) -> float:
        """The round trip ``flow``'s stall window and LT margin are sized by (seconds; 0 while unknown).

        The sender's advertised RTprop (from its first RTT sample; see ``Path.est_word``), else this
        receiver's own smoothed RTT to the sender (*choice*: a round trip is the same loop in either
        direction; a PS has one from its parameter broadcasts before any gradient arrives). Without either,
        a sender whose first flight left it waiting a long round trip for ACKs looked stalled after the
        30 ms slack and was cut at the deadline."""
        if flow.rtprop_us:
            return flow.rtprop_us / 1e6
        return (self._rtt_of(flow.peer) or 0.0) if self._rtt_of is not None else 0.0

    def lt_for(self, flow, now: float) -> float | None:
        """LT threshold of ``flow`` (seconds after its Early Close start), or None while unknown.

        Unknown also while no round trip to the sender is known (:meth:`rtprop_of` is 0: the sender has had
        no acknowledgement yet and this receiver never sent to it). *Choice*: a link's history alone would
        judge such a flow: a 27-packet message that arrived in one burst taught "0.5 ms", the sender's next
        message waited a round trip for the first one's ACKs, and the deadline cut it at 18 % behind a
        200 ms delay (a ring whose steps do not wait for their sends' ACKs)."""
        flow.update_estimates()
        rtprop = self.rtprop_of(flow)
        if not rtprop:
            return None
        btlbw = flow.btlbw
        if btlbw and self._rate_cap is not None:
            cap = self._rate_cap(flow)
            if cap:
                btlbw = min(btlbw, cap)
        if flow.lt_anchor is None:  # the initial formula may be anchored now: say how far the flow got
            lt, flow.lt_anchor = self.thresholds.flow_threshold(
                flow.peer, flow.total, rtprop, btlbw, elapsed_s=now - flow.anchor,
                remaining=flow.total - flow.window.received_bytes)
        else:
            lt, _ = self.thresholds.flow_threshold(flow.peer, flow.total, rtprop, btlbw, anchor=flow.lt_anchor)
        return lt

    def deadline_for(self, flow, lt: float | None, now: float) -> float | None:
        """The deadline of ``flow``'s receive group (its own, received alone), or None while unknown."""
        slot = flow.slot
        if slot is None or len(slot.group.slots) == 1:
            return group_deadline(flow.anchor, lt, self.slack_s)
        return group_deadline(slot.group.t0, self._worst_threshold(slot.group, flow, lt, now), self.slack_s)

    def _worst_threshold(self, group, flow, lt: float | None, now: float) -> float | None:
        """The largest LT threshold among the group's unreliable links (0.0: none), or None if one is
        unknown; a slot nobody registered for yet counts with its link's measured history."""
        worst = 0.0
        for s in group.slots:
            f = s.flow
            if f is not None:
                if f.reliable:
                    continue
                # a flow that ended before any check measured it (a small message on a fast path) has no lt
                # yet: its link's threshold is computed now, or the group's unregistered slots never expire
                v = lt if f is flow and lt is not None else (f.lt if f.lt is not None else self.lt_for(f, now))
            elif s.report is not None:
                continue
            else:
                v = None if s.peer is None else self.thresholds.history(s.peer, len(s.dest))
            if v is None:
                return None
            worst = max(worst, v)
        return worst

    def check(self, flow, now: float) -> tuple:
        """``(regime, wake)`` for an open, incomplete ``flow`` at ``now`` (see :func:`decide`)."""
        lt = flow.lt = self.lt_for(flow, now)
        deadline = flow.deadline = self.deadline_for(flow, lt, now)
        if deadline is not None and flow.slot is not None:
            # unregistered slots of the group expire at the same deadline
            flow.slot.group.wake = deadline
        lossy, first_pass, stall_at, hard = self._evidence(flow, lt, deadline, now)
        return decide(now, start=flow.anchor, lt=lt, deadline=deadline, fraction=flow.fraction,
                      complete=False, critical_ok=flow.critical_ok, lt_fraction=self.lt_fraction,
                      reliable=flow.reliable, lossy=lossy, first_pass_done=first_pass, stall_at=stall_at,
                      hard_deadline=hard)

    def _evidence(self, flow, lt: float | None, deadline: float | None, now: float) -> tuple:
        """Progress evidence for :func:`decide`: ``(lossy, first_pass_done, stall_at, hard_deadline)``.

        Before the LT threshold (and the deadline) only time can close the
        flow, so the bitmap is not inspected and the paper's defaults go in.
        """
        if flow.reliable or (lt is None and deadline is None) or (
                (lt is None or now < flow.anchor + lt) and (deadline is None or now < deadline)):
            return True, True, None, None
        prog = self._progress.get(flow.key)
        if prog is None:
            prog = self._progress[flow.key] = FlowProgress(flow.seg_count, flow.window.critical)
        loss_rate, first_pass = prog.observe(flow.window.bitmap, flow.window.received)
        got = flow.window.received
        mean_gap = (flow.last_arrival - flow.start) / got if got else None
        stall_at = flow.last_arrival + stall_window(self.rtprop_of(flow), mean_gap, self.slack_s)
        hard = None
        if deadline is not None:
            slot = flow.slot
            hard = hard_deadline(flow.anchor, deadline, None if slot is None else slot.group.timeout_at)
        return loss_rate > STRETCH_MAX_LOSS, first_pass, stall_at, hard

    def on_close(self, flow, regime) -> None:
        """``flow`` closed with ``regime``: forget its progress and record its delivery time."""
        self._progress.pop(flow.key, None)
        self.thresholds.record_closed(flow.peer, flow.total, regime, anchor=flow.anchor, start=flow.start,
                                      last_arrival=flow.last_arrival,
                                      received_bytes=flow.window.received_bytes)
