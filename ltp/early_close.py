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
``lt_fraction`` (80% by default) *and* every critical segment is in
(*choice*: the fraction is per flow, each link having its own LT threshold).
At the deadline it closes whatever it holds. A complete flow closes at once.
Reliable flows never close early. :func:`decide` is a pure function so the
policy can be tested without any protocol state.
"""

from __future__ import annotations

from collections import OrderedDict, deque

__all__ = ["LinkThresholds", "decide", "COMPLETE", "EARLY", "DEADLINE"]

COMPLETE = "complete"
EARLY = "early"
DEADLINE = "deadline"


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


def decide(now: float, *, start: float, lt: float | None, deadline: float | None, fraction: float,
           complete: bool, critical_ok: bool, lt_fraction: float, reliable: bool) -> tuple:
    """Early Close decision for one flow.

    Returns ``(regime, wake)``: ``regime`` is None (keep receiving),
    ``"complete"``, ``"early"`` or ``"deadline"``; ``wake`` is the next time
    the decision can change without new data (None if only data can change it).
    """
    if complete:
        return COMPLETE, None
    if reliable:
        return None, None
    if deadline is not None and now >= deadline:
        return DEADLINE, None
    wake = deadline
    if lt is not None:
        lt_at = start + lt
        if now >= lt_at:
            if fraction >= lt_fraction and critical_ok:
                return EARLY, None
        else:
            wake = lt_at if wake is None else min(wake, lt_at)
    return None, wake
