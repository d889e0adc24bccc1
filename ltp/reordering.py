"""How much reordering a path has shown, and the loss-detection thresholds that follow from it.

Theory of operation
    A sender declares a transmission lost by two rules (``ltp_ext._datapath.SendWindow``): the packet-count rule
    (``PACKET_REORDER_THRESHOLD`` = 3 later transmissions of its lane acknowledged) and RACK's time rule (RFC
    8985: a later transmission was acknowledged and the transmission's own round trip plus a *reordering window*
    has passed). Both assume the path keeps order. A real path can break it: multipath routing, link-layer
    retries, or delay jitter let later packets overtake earlier ones (the lab's delayer does it with ``--jitter``:
    on 2 ms +- 1 ms one way, 192-381 needless resends per 40 MB). Each wrong verdict costs a resend unless the
    late packet's ACK comes before the resend is built.

    The sender learns a verdict was wrong when the transmission it declared lost is acknowledged after all
    (``SendWindow.spurious_losses``). :class:`Reordering` is the path's memory of that, after RFC 8985 section 6.2,
    fed only where ``Config.learn_reordering`` is on (off by default: see its comment for what waiting for late
    packets cost on the lab's most jittery path):

    - *in order* (the start): the packet-count rule is on and the reordering window is
      ``REORDER_WINDOW_RTPROPS`` x RTprop.
    - *reordering seen* (a wrong verdict): the packet-count rule is off (0), so only the time rule declares
      losses, and each round trip with a wrong verdict widens the window by one more
      ``REORDER_WINDOW_RTPROPS`` x RTprop, up to ``REORDER_WINDOW_MULT_MAX`` of them, never past the smoothed
      RTT (a loss is then found at most about two round trips after it was sent, as RFC 8985 bounds it).
    - back *in order* after ``REORDER_PERSIST_RECOVERIES`` loss episodes in a row without a wrong verdict.

    Plain object: every input carries ``now``; nothing here reads a clock.
"""

from __future__ import annotations

from ltp_ext.constants import PACKET_REORDER_THRESHOLD

__all__ = ["Reordering", "REORDER_WINDOW_RTPROPS", "REORDER_WINDOW_MULT_MAX", "REORDER_PERSIST_RECOVERIES"]

#: RACK's reordering window (RFC 8985), in RTprops, on a path that has shown no reordering: a transmission that a
#: later one overtook (that one was acknowledged first) is lost once its own round trip and this much more have
#: passed. RFC 8985's initial value, min_rtt / 4. Without the rule a loss among a message's last three packets
#: waited for the tail-loss timer, re-armed by every ACK: about 2.5 round trips instead of 1.25 (simulator: a
#: 30 kB message on a 20 ms path lost its 20th of 21 packets and took 189 ms).
REORDER_WINDOW_RTPROPS = 0.25
#: the most multiples of the base window a path that reorders may wait (RFC 8985 leaves the bound to the
#: smoothed RTT alone; *choice*: 16 multiples of RTprop/4 = 4 RTprops, below which the SRTT cap usually binds)
REORDER_WINDOW_MULT_MAX = 16
#: loss episodes without a wrong verdict after which a path is trusted to keep order again (RFC 8985's
#: ``reo_wnd_persist``, 16 loss recoveries)
REORDER_PERSIST_RECOVERIES = 16


class Reordering:
    """One path's reordering state: whether it has reordered lately and how wide its RACK window is.

    Feed it :meth:`on_spurious` when acknowledgements prove loss verdicts wrong and :meth:`on_loss_episode`
    when an ACK brings new loss verdicts; read :attr:`packet_threshold` (for ``SendWindow.reorder_threshold``)
    and :meth:`window`."""

    __slots__ = ("seen", "mult", "spurious", "_persist", "_widen_after")

    def __init__(self) -> None:
        #: the path has reordered within the last ``REORDER_PERSIST_RECOVERIES`` loss episodes
        self.seen = False
        #: the reordering window in multiples of ``REORDER_WINDOW_RTPROPS`` x RTprop (1..REORDER_WINDOW_MULT_MAX)
        self.mult = 1
        #: loss verdicts proved wrong on this path so far
        self.spurious = 0
        self._persist = 0
        self._widen_after = float("-inf")

    @property
    def packet_threshold(self) -> int:
        """The packet-count rule's threshold: ``PACKET_REORDER_THRESHOLD``, or 0 (off) while reordering is seen."""
        return 0 if self.seen else PACKET_REORDER_THRESHOLD

    def window(self, rtprop: float, srtt: float | None) -> float:
        """The RACK reordering window in seconds: ``mult`` x ``REORDER_WINDOW_RTPROPS`` x ``rtprop``, capped at
        ``srtt`` once widened (never below the base window)."""
        base = REORDER_WINDOW_RTPROPS * rtprop
        if self.mult == 1:
            return base
        wide = self.mult * base
        return max(base, min(wide, srtt)) if srtt is not None else wide

    def on_spurious(self, n: int, now: float, srtt: float | None) -> None:
        """``n`` > 0 loss verdicts were proved wrong at ``now``: reordering is seen; the window widens by one
        multiple, at most once a smoothed round trip (RFC 8985: once per round trip)."""
        if n <= 0:
            raise ValueError(f"on_spurious needs n > 0 wrong verdicts, got {n}")
        self.spurious += n
        self.seen = True
        self._persist = REORDER_PERSIST_RECOVERIES
        if now >= self._widen_after:
            self.mult = min(self.mult + 1, REORDER_WINDOW_MULT_MAX)
            self._widen_after = now + (srtt or 0.0)

    def on_loss_episode(self) -> None:
        """An ACK brought new loss verdicts; after ``REORDER_PERSIST_RECOVERIES`` of them without a wrong one the
        path is trusted to keep order again."""
        if not self.seen:
            return
        self._persist -= 1
        if self._persist <= 0:
            self.seen = False
            self.mult = 1
