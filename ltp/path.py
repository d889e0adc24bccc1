"""One sender→receiver path: congestion control, pacing, RTT and the flow scheduler.

Theory of operation. Every peer we send to has one :class:`Path`. It owns the
BBR model and the pacer, so consecutive messages to the same peer (one flow
each, e.g. one per training iteration) inherit the learned BtlBw/RTprop
instead of starting from scratch. Flows to the peer are served in FIFO order:
:meth:`poll` takes the first flow that has something to send and asks it for
as many segments as both the pacer's tokens and the congestion window allow,
then builds them into one contiguous buffer of equal-stride datagrams (one
GSO batch); when that flow runs out of segments before the window and the
pacer do, the engine polls again in the same turn for the next flow (the
whole budget is used, whichever flows it takes). The path also keeps the RFC 6298 smoothed RTT used for the
tail-loss probe timeout -- doubled for every timeout in a row that no
acknowledgement answered, up to :data:`PTO_BACKOFF_MAX` doublings (as TCP's
RTO and QUIC's PTO back off; a receiver that stops reading for a while must
not be sent a fresh window per probe timeout into its full socket), except
after a timeout that re-sent fewer than :data:`PTO_BACKOFF_MIN_PACKETS`
packets (a registration's repeats back off on their own, from
:meth:`Path.base_pto`) --
and the delivery-rate state (delivered bytes,
delivered time, first-sent time, app-limited mark) that turns each ACK into
a BBR sample. With ``Config.spread_sends`` a large gather batch is built in
*lanes* (:func:`spread_parts`): contiguous parts the adapter may hand to
different sender threads, whose packets then interleave on the wire; loss
detection counts each lane apart (``SendWindow.build(lanes=)``). Last, the
path says whether it is *clean* (:attr:`Path.clean`): :data:`CLEAN_PATH_PACKETS`
packets acknowledged since anything on it was declared lost or a registration
had to be repeated. The engine spends the redundant control datagrams (REG
copies, and through them the receiver's STOP behind a completing ACK) only on
paths that are not.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import numpy as np

from . import wire
from .bbr import BBR
from .config import Config
from .link_share import GRANT_TTL_S, GRANTED_MIN_BURST_PACKETS, PROVISIONAL_GRANT_S
from .pacing import Pacer
from .reordering import Reordering
from ltp_ext.constants import SPREAD_PART_MIN

__all__ = ["Path", "SegmentTransmit", "Transmit", "PTO_BACKOFF_MAX", "PTO_BACKOFF_MIN_PACKETS", "spread_parts"]


_NONE = np.empty(0, np.int64)  # no segments (read-only use)


def spread_parts(n: int, lanes: int) -> int:
    """How many lanes a batch of ``n`` packets is built in when ``lanes`` sender threads may share it: one per
    thread, each at least ``SPREAD_PART_MIN`` packets (a whole GSO message or more per part); 1 below two such
    parts."""
    k = min(lanes, n // SPREAD_PART_MIN)
    return k if k >= 2 else 1


#: the probe timeout doubles per tail-loss timeout in a row without an acknowledgement, at most this many times
#: (4 ms -> 32 ms at the default ``min_pto_s``). Without it, a PS that did not read its socket for 100 ms (busy
#: broadcasting on a 2-core host) was sent each worker's whole window again every 4 ms: its socket dropped 93-103k
#: datagrams a 12-round ResNet-50 job (loopback, 4 workers, 0 % loss), 14-22k with it. *Choice*: 3, not TCP's
#: unbounded doubling: each timeout re-sends the flow's whole window, and with 6 doublings senders whose
#: retransmissions kept losing in a shared shallow queue retried too rarely to win a place in it before the 1 s
#: dead-peer limit (simulator: 3 of 12 senders into 100 Mbit/s with a 16 kB queue)
PTO_BACKOFF_MAX = 3

#: a tail-loss timeout that declared fewer packets than this lost (over all the path's flows) does not double the
#: next: the backoff keeps a stalled receiver from being sent a window per timeout, and a handful of packets is no
#: flood. *Choice, 2026-12-06*: without it, one segment whose resends kept being lost (10 % loss of every datagram,
#: a 10 ms one-way path, the first message) waited 60, 120, 240 and 480 ms between them, and its 30 kB ring step
#: took 950 ms
PTO_BACKOFF_MIN_PACKETS = 4

#: packets a path must deliver in a row, with nothing declared lost and no registration repeated, before it counts
#: as *clean*: its sends then register with one REG (not ``Config.reg_copies``), and so their receivers send no
#: guard STOP behind the ACK that completes a message (``Engine._close_rx``). Both copies insure against a lost
#: control datagram (a lost REG costs a round trip and the first flight, a lost completing ACK a probe timeout), at
#: about a fifth of a small message's CPU on this project's 2-core machine (docs/performance.md, session 63).
#: *Choice*: 1,000, so that a path losing 1 % of its packets (P(1,000 in a row) = 4e-5) keeps the insurance, one
#: at 0.1 % keeps it about two thirds of the time, and a loss-free path drops it after about 1.5 MB.
CLEAN_PATH_PACKETS = 1000


@dataclass
class Transmit:
    """A batch of datagrams for one address: ``data`` is cut every ``segment_size`` bytes
    (the last datagram may be shorter). ``data`` is only valid until the engine's next ``datagrams_to_send``."""

    addr: tuple
    data: memoryview
    segment_size: int

    @property
    def nbytes(self) -> int:
        """Wire bytes of the batch (LTP headers included)."""
        return len(self.data)

    def datagrams(self) -> list:
        """Split into individual datagrams (for tests and simple drivers)."""
        d, s = self.data, self.segment_size
        return [bytes(d[i:i + s]) for i in range(0, len(d), s)]


class SegmentTransmit:
    """A batch of DATA datagrams described, not assembled (for a gather send).

    Datagram ``k`` is ``headers[16k:16k+16]`` followed by segment ``seqs[k]``
    of the message ``payload`` (``seg_size`` bytes, the message's last
    segment shorter).  An adapter with a gather send (``UdpIO.send_segments``)
    hands these straight to the kernel, so the payload is copied once, by the
    kernel, as with TCP; :attr:`data` assembles the same bytes for drivers that
    need them (the simulator, tests, a partial send's remainder).  Valid until
    the next poll, like :class:`Transmit`.
    """

    __slots__ = ("addr", "headers", "payload", "seqs", "seg_size", "total", "segment_size", "nbytes", "pace_rate",
                 "parts")

    def __init__(self, addr, headers: memoryview, payload: memoryview, seqs, seg_size: int, total: int,
                 nbytes: int, pace_rate: float = 0.0, parts: int = 1) -> None:
        self.addr = addr
        self.headers = headers
        self.payload = payload
        self.seqs = seqs
        self.seg_size = seg_size
        self.total = total
        self.segment_size = wire.HEADER_SIZE + seg_size  # the stride, as Transmit's
        self.nbytes = nbytes
        self.pace_rate = pace_rate  # the path's pacing rate when the batch was built (bytes/s; 0: unknown)
        #: the contiguous parts (lanes) loss detection allows to interleave on the wire (spread_parts); 1: in order
        self.parts = parts

    def __len__(self) -> int:
        return int(self.seqs.shape[0])

    def assemble(self, start: int = 0) -> bytes:
        """Datagrams ``start..`` as one contiguous buffer at :attr:`segment_size` stride."""
        h, p, seg, total = self.headers, self.payload, self.seg_size, self.total
        parts = []
        for k in range(start, len(self)):
            q = int(self.seqs[k])
            parts += [h[16 * k:16 * k + 16], p[q * seg:min(total, (q + 1) * seg)]]
        return b"".join(parts)

    @property
    def data(self) -> memoryview:
        return memoryview(self.assemble())

    def datagrams(self) -> list:
        """Split into individual datagrams (for tests and simple drivers)."""
        d, s = self.data, self.segment_size
        return [bytes(d[i:i + s]) for i in range(0, len(d), s)]


class Path:
    """Per-peer congestion control, pacing and FIFO flow scheduling."""

    def __init__(self, peer, config: Config, rng: random.Random, mss: int, *, gather_send: bool = False) -> None:
        self.peer = peer
        self.gather_send = gather_send  # poll() returns SegmentTransmit (headers only; payload stays put)
        #: lanes a large gather batch may be cut into (Config.spread_sends: one per sender thread; 1: none)
        self.spread_lanes = config.send_threads if config.spread_sends else 1
        self.config = config
        self.mss = mss
        self.bbr = BBR(mss=mss, initial_cwnd_packets=config.initial_cwnd_packets,
                       initial_rtt_s=config.initial_rtt_s,
                       probe_rtt_interval_s=config.probe_rtt_interval_s,
                       probe_rtt_duration_s=config.probe_rtt_duration_s,
                       aggregation_cap_s=config.aggregation_cap_s, rng=rng)
        self.pacer = Pacer(granularity_s=config.pacing_granularity_s,
                           min_burst_bytes=config.min_burst_packets * mss, rate=self.bbr.pacing_rate)
        self.flows: deque = deque()
        self.delivered = 0
        self.delivered_time = 0.0
        self.first_sent_time = 0.0
        self.app_limited_until = 0
        self.srtt: float | None = None
        self.rttvar = 0.0
        #: what this path's reordering has taught loss detection (the packet-count rule, the RACK window)
        self.reordering = Reordering()
        #: tail-loss timeouts in a row that no acknowledgement answered and that re-sent at least
        #: PTO_BACKOFF_MIN_PACKETS packets (the PTO backs off)
        self.pto_count = 0
        #: packets acknowledged since this path last showed loss (CLEAN_PATH_PACKETS; a new path is not clean)
        self.clean_packets = 0
        self.next_flow_id = rng.randrange(1 << 16)
        self._rng = rng
        self._out = bytearray(0)
        self.budget_left = False  # the last poll's flow ran out of segments before the window and pacer did
        self.wake: float | None = None  # when the pacer next allows a worthwhile burst
        self.last_heard = float("-inf")  # last datagram from this peer that carried one of our flows' tokens (dead-peer rule)
        #: the dead-peer rule's clock: last_heard moved on by this process's own pauses since (liveness.pause_credit)
        self.silence_from = float("-inf")
        self.grant: float | None = None  # the receiver's rate grant (datagram bytes/s; ltp/link_share.py)
        self.grant_at = float("-inf")  # when it was last renewed
        self._grant_floor: float | None = None  # the smallest grant of the current busy period
        self._grant_provisional = False  # the grant is the restart's guess (begin_busy), not the receiver's
        self.granted = False  # the pacer runs at the receiver's grant (set with the rate, by _pace)
        self.egress_share: float | None = None  # this host's link share for this path (datagram bytes/s)

    # -- estimates ---------------------------------------------------------
    def inflight_bytes(self) -> int:
        """Bytes in flight over all flows of this path."""
        return sum(f.window.inflight_bytes for f in self.flows)

    def base_pto(self) -> float:
        """Probe timeout before backoff: ``max(min_pto, srtt + 4·rttvar)``, doubled while nothing was measured
        (a registration's repeats use it: they back off on their own)."""
        if self.srtt is None:
            return max(self.config.min_pto_s, 2 * self.config.initial_rtt_s) * 2
        return max(self.config.min_pto_s, self.srtt + 4 * self.rttvar)

    @property
    def clean(self) -> bool:
        """The last :data:`CLEAN_PATH_PACKETS` packets this path acknowledged came with no loss declared and no
        registration repeated (False until then: a new path has shown nothing)."""
        return self.clean_packets >= CLEAN_PATH_PACKETS

    def note_loss(self) -> None:
        """Something sent on this path was lost (a packet declared lost, a REG sent again): it is not clean."""
        self.clean_packets = 0

    def on_tail_loss(self, declared: int) -> None:
        """This turn's tail-loss timeouts declared ``declared`` packets lost over all the path's flows: the next
        probe timeout is twice as long (``pto_count``, until an ACK answers), unless they were fewer than
        :data:`PTO_BACKOFF_MIN_PACKETS`, which floods no one."""
        if declared:
            self.note_loss()
        if declared >= PTO_BACKOFF_MIN_PACKETS:
            self.pto_count += 1

    def pto(self) -> float:
        """The tail-loss probe timeout: :meth:`base_pto`, doubled per tail-loss timeout in a row that no
        acknowledgement answered and that re-sent at least :data:`PTO_BACKOFF_MIN_PACKETS` packets (``pto_count``,
        at most :data:`PTO_BACKOFF_MAX` times)."""
        return self.base_pto() * (1 << min(self.pto_count, PTO_BACKOFF_MAX))

    def est_word(self) -> int:
        """Header word 3 carrying this path's RTprop (µs) and BtlBw (bytes/s); 0 in a field is "unknown".

        RTprop goes out from the first RTT sample: a receiver sizes its stall window and its LT margin by it,
        and without it took a sender waiting one round trip for its ACKs for a stalled flow (200 ms one way,
        small messages that never leave STARTUP: gradients cut to 22 % on a loss-free path). BtlBw stays
        zero until it has stopped growing (``bbr.estimates_settled``, or a full pipe): while it grows it is a
        lower bound the flow outruns, so a receiver's expected-completion time built from it would be wrong.
        """
        rt = self.bbr.rtprop
        if not rt:
            return 0
        settled = self.bbr.filled_pipe or self.bbr.estimates_settled
        return wire.estimates_word(max(1, int(rt * 1e6)), int(self.bbr.btlbw) if settled else 0)

    def allocate_flow_id(self) -> int:
        """Next flow id for this peer (16 bits, wrapping)."""
        fid = self.next_flow_id
        self.next_flow_id = (fid + 1) & 0xFFFF
        return fid

    # -- rate caps (ltp/link_share.py) -----------------------------------------
    def pacing_rate(self, now: float) -> float:
        """The rate the pacer runs at: BBR's, capped by the receiver's grant and this host's egress share."""
        rate = self.bbr.pacing_rate
        if self.grant is not None:
            if now - self.grant_at > (PROVISIONAL_GRANT_S if self._grant_provisional else GRANT_TTL_S):
                self.grant = None
            elif self.grant < rate:
                rate = self.grant
        if self.egress_share is not None and self.egress_share < rate:
            rate = self.egress_share
        return rate

    def _pace(self, now: float) -> None:
        """Set the pacer's rate, and its smallest burst: a path paced by a receiver's grant shares that
        receiver's queue with every other granted sender, so it sends bursts of
        :data:`~ltp.link_share.GRANTED_MIN_BURST_PACKETS` (or what the rate gives a timer tick), not the
        configured minimum."""
        rate = self.pacing_rate(now)
        self.pacer.set_rate(rate)
        granted = self.grant is not None and self.grant <= rate
        self.granted = granted
        packets = GRANTED_MIN_BURST_PACKETS if granted else self.config.min_burst_packets
        self.pacer.min_burst_bytes = min(packets, self.config.min_burst_packets) * self.mss

    def on_grant(self, rate: float, now: float) -> None:
        """Take the receiver's rate grant (datagram bytes/s) from an ACK."""
        self.grant = float(rate)
        self.grant_at = now
        self._grant_provisional = False
        if self._grant_floor is None or rate < self._grant_floor:
            self._grant_floor = self.grant
        self._pace(now)

    def begin_busy(self, now: float) -> None:
        """A message starts on this path while it had none: until a fresh grant arrives, pace at the smallest
        grant of the last busy period, however long ago it ended. The grant it ended with reflects a receiver
        whose other senders had finished; the next round brings them all back at once (the incast's start),
        and the smallest grant is the share the receiver gave under full contention. This provisional grant
        lapses after :data:`PROVISIONAL_GRANT_S` if the receiver sends none (it no longer grants)."""
        if self._grant_floor is not None:
            # provisional: it stands in for the receiver's answer, due within a round trip
            self.grant, self.grant_at, self._grant_provisional = self._grant_floor, now, True
            self._pace(now)
            # and start with at most one minimum burst (a random part of one: the senders' first bursts fall
            # at random phases), not the bucket the idle time filled: every sender of the incast restarts at
            # once, and N full buckets would overflow the receiver's queue together
            self.pacer.restart(now, self._rng.random())
        self._grant_floor = None

    def set_egress_share(self, rate: float | None, now: float) -> None:
        """Cap this path at ``rate`` (None: no cap), this host's link split among its active paths."""
        if rate != self.egress_share:
            self.egress_share = rate
            self._pace(now)

    # -- sending -------------------------------------------------------------
    def _active(self):
        for f in self.flows:
            if f.has_sendable():
                return f
        return None

    def poll(self, now: float, *, fresh: bool = False, spread: bool = True):
        """Build the next batch of DATA datagrams allowed now, from the first flow with something to send;
        ``None`` when blocked or idle. ``budget_left`` is then True when that flow ran out of segments before
        the window and the pacer did: call again for the next flow's batch, with ``fresh`` (a new buffer:
        the batch before still points into the path's). ``spread``: a large gather batch may be built in lanes
        (:attr:`spread_lanes`; the engine says no while its sends go to several peers, which leave in order)."""
        self.budget_left = False
        flow = self._active()
        if flow is None:
            if self.inflight_bytes() == 0:
                self.bbr.on_idle(now)
            return None
        stride = wire.HEADER_SIZE + flow.seg_size
        inflight = self.inflight_bytes()
        room = self.bbr.cwnd(self.pacer.burst_bytes) - inflight
        budget = min(room, self.pacer.available(now))
        n = budget // stride
        if n <= 0:
            return None
        seqs = flow.take(int(n))
        if seqs.shape[0] == 0:
            return None
        if inflight == 0:
            self.first_sent_time = now
            self.delivered_time = now
        gather = self.gather_send
        need = seqs.shape[0] * (wire.HEADER_SIZE if gather else stride)
        if fresh or len(self._out) < need:
            self._out = bytearray(need)
        parts = spread_parts(seqs.shape[0], self.spread_lanes) if spread and gather and not self.granted else 1
        nbytes = flow.window.build(seqs, now, self.delivered, self.delivered_time, self.first_sent_time,
                                   self.est_word(), self._out, gather, parts)
        self.pacer.consume(now, nbytes)
        self.budget_left = seqs.shape[0] < n
        if self._active() is None:
            # nothing more queued: samples until this data is delivered are app-limited
            self.app_limited_until = self.delivered + self.inflight_bytes()
        if gather:
            return SegmentTransmit(self.peer, memoryview(self._out)[:need], flow.payload, seqs, flow.seg_size,
                                   flow.total, nbytes, 0.0 if self.granted else self.pacer.rate, parts)
        return Transmit(self.peer, memoryview(self._out)[:nbytes], stride)

    def next_send_time(self, now: float) -> float | None:
        """When the pacer next allows a packet of the active flow (None if idle or window-limited)."""
        flow = self._active()
        if flow is None:
            return None
        stride = wire.HEADER_SIZE + flow.seg_size
        if self.bbr.cwnd(self.pacer.burst_bytes) - self.inflight_bytes() < stride:
            return None  # window-limited: an ACK or the PTO will wake us
        # wake for a worthwhile burst (the minimum burst), not for every packet
        want = max(stride, min(self.pacer.min_burst_bytes, flow.queued_segments() * stride))
        t = self.pacer.next_time(now, want)
        return t if t > now else None

    def reorder_window(self, flow) -> float:
        """RACK's reordering window for ``flow``: :data:`~ltp.reordering.REORDER_WINDOW_RTPROPS` x RTprop (x its own latest
        RTT sample before RTprop is known), widened where this path reordered and ``Config.learn_reordering`` is on
        (:class:`~ltp.reordering.Reordering`)."""
        base = self.bbr.rtprop if self.bbr.rtprop is not None else flow.rack_rtt
        return self.reordering.window(base or 0.0, self.srtt)

    def reorder_deadline(self, flow) -> float | None:
        """When RACK declares ``flow``'s oldest in-flight transmission lost if nothing else arrives: its send
        time + the newest acknowledged transmission's RTT + the reordering window; None unless a later
        transmission of its lane was acknowledged (``SendWindow.rack_candidate_time``)."""
        w = flow.window
        if flow.rack_rtt is None or not w.inflight_count or not w.acked_in_window:
            return None
        oldest = w.rack_candidate_time()
        return oldest + flow.rack_rtt + self.reorder_window(flow) if oldest >= 0 else None

    def reordered(self, flow, now: float):
        """RACK: declare lost ``flow``'s in-flight transmissions that a later one overtook and that are due by
        ``now`` (:meth:`reorder_deadline`; a nanosecond of slack so the one the timer was armed for is included);
        returns their segments (empty unless a later transmission was acknowledged)."""
        w = flow.window
        if flow.rack_rtt is None or not w.acked_in_window:
            return _NONE
        return w.detect_reordered(now - flow.rack_rtt - self.reorder_window(flow) + 1e-9)

    # -- ACK processing ------------------------------------------------------
    def on_ack(self, flow, entries, now: float, timing_floor: float = float("-inf")):
        """Feed ACK entries of ``flow`` to its window and the model; returns newly lost segments.

        ``timing_floor``: when this process last resumed from a pause (the own-pause rule, :mod:`ltp.liveness`);
        a transmission sent before it and acknowledged after it gives no RTT or rate sample."""
        w = flow.window
        learn = self.config.learn_reordering
        if learn:  # what the path's reordering taught (ltp/reordering.py)
            w.reorder_threshold = self.reordering.packet_threshold
            spurious = w.spurious_reorder_losses
        (newly, newly_bytes, self.delivered, self.delivered_time, rtt, prior_delivered, prior_time, first_sent,
         sample_sent, lost) = w.on_ack(entries, now, self.delivered, self.delivered_time)
        rate = None
        # samples that span a pause of this process time the pause, not the path (timing_floor): a start-up BBR
        # took a 3 s "RTT" and paced a loopback send at kB/s after it, and the send missed its window (CI, stop 47)
        if rtt >= 0 and now - rtt < timing_floor:  # the batch's smallest sample, so every one, spans the stall
            rtt = -1.0
        timed = prior_delivered >= 0 and sample_sent >= timing_floor  # the newest transmission acknowledged is a sample
        if prior_delivered >= 0:
            self.first_sent_time = sample_sent
        if timed and prior_time >= timing_floor and first_sent >= timing_floor:
            interval = max(sample_sent - first_sent, now - prior_time)
            # as Linux's rate sampler: an interval shorter than the minimum RTT comes from
            # ACK compression or a send burst and would overestimate the bottleneck
            min_rtt = self.bbr.rtprop if self.bbr.rtprop is not None else (rtt if rtt >= 0 else 0.0)
            if interval > 0 and interval >= min_rtt:
                rate = (self.delivered - prior_delivered) / interval
        # srtt follows the freshest sample (the newest transmission acknowledged), so it sees queueing; RTprop
        # below takes the smallest sample of the batch. With none (every entry echoed an older attempt), a first
        # transmission's exact RTT (SendWindow.first_tx_time) still counts: without it, a long path whose first
        # messages all fit in one flight never learned its RTT, and its 8 ms start-up probe timeout resent every
        # such message two or three times.
        fresh = now - sample_sent if timed else (rtt if rtt >= 0 else None)
        if fresh is not None:
            if self.srtt is None:
                self.srtt, self.rttvar = fresh, fresh / 2
            else:
                self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - fresh)
                self.srtt = 0.875 * self.srtt + 0.125 * fresh
        if timed:  # RACK: the newest transmission acknowledged times the ones it overtook
            flow.rack_rtt = now - sample_sent
        late = self.reordered(flow, now)
        if late.shape[0]:
            lost = np.concatenate((lost, late)) if lost.shape[0] else late
        if learn:
            spurious = w.spurious_reorder_losses - spurious
            if spurious:  # verdicts proved wrong: the path reorders
                self.reordering.on_spurious(spurious, now, self.srtt)
            elif lost.shape[0]:
                self.reordering.on_loss_episode()
        if lost.shape[0]:
            self.note_loss()
        elif newly:
            self.clean_packets += newly
        if newly:
            self.pto_count = 0
            self.bbr.on_ack(now, delivered=self.delivered, prior_delivered=prior_delivered,
                            rate_bps=rate, rtt_s=rtt if rtt >= 0 else None,
                            inflight=self.inflight_bytes(),
                            app_limited=0 <= prior_delivered < self.app_limited_until, acked=newly_bytes)
            self._pace(now)
        return lost
