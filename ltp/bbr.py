"""BDP congestion control in the style of BBR (v1), for one sender→receiver path.

Theory of operation. The model has two numbers: **BtlBw**, the windowed maximum
of delivery-rate samples over the last 10 round trips, and **RTprop**, the
windowed minimum RTT over the last ``probe_rtt_interval_s`` seconds. Their
product is the BDP. The sender paces at ``pacing_gain × BtlBw`` and keeps at
most ``cwnd_gain × BDP + extra_acked + burst`` bytes in flight. The burst
allowance covers user-space pacing; ``extra_acked`` is BBR's ACK-aggregation
estimate (the windowed maximum, over 10 rounds, of data acknowledged beyond
what BtlBw predicts since an aggregation epoch began), which covers ACKs that
arrive in batches and timers that fire a millisecond late — both are normal
for a user-space transport — capped at two timer periods of BtlBw. **Loss is not a
congestion signal**: nothing here looks at losses, so random (non-congestion)
loss does not shrink the window — the property LTP needs (§III-D).

States, as in BBR:

* STARTUP: gains 2/ln 2 (2.89) until BtlBw stops growing by 25% for 3 rounds
  (rounds whose sample was app-limited do not count, as in Linux). Until the pipe is full the
  pacing rate never falls below the gain times one initial window per RTprop
  (``startup_floor_rate``): as Linux, which only raises it in STARTUP. The estimates count as
  *settled* for receivers (``estimates_settled``, header word 3) once BtlBw stops growing for 3
  rounds of either kind, or the pipe filled.
* DRAIN: pacing gain 1/2.89 until in-flight ≤ BDP.
* PROBE_BW: pacing gain cycles 1.25, 0.75, 1 ×6, one phase per RTprop
  (starting phase drawn from the injected ``random.Random``); cwnd gain 2.
* PROBE_RTT: when RTprop has not been refreshed for ``probe_rtt_interval_s``,
  in-flight is held at 4 packets for ``probe_rtt_duration_s`` and one round.

Round trips are counted with the delivered counter: a round ends when a packet
sent after the previous round ended is acknowledged. Every input carries
``now``; the object never reads a clock.
"""

from __future__ import annotations

import math
import random
from collections import deque

__all__ = ["BBR", "STARTUP", "DRAIN", "PROBE_BW", "PROBE_RTT"]

STARTUP = "startup"
DRAIN = "drain"
PROBE_BW = "probe_bw"
PROBE_RTT = "probe_rtt"

HIGH_GAIN = 2.0 / math.log(2.0)
CYCLE = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
BTLBW_ROUNDS = 10
FULL_BW_THRESH = 1.25
FULL_BW_ROUNDS = 3


class _MaxFilter:
    """Windowed maximum over the last ``window`` rounds (monotonic deque)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._q: deque = deque()  # (round, value), values decreasing

    def update(self, rnd: int, value: float) -> None:
        q = self._q
        while q and q[-1][1] <= value:
            q.pop()
        q.append((rnd, value))
        while q[0][0] <= rnd - self.window:
            q.popleft()

    def expire(self, rnd: int) -> None:
        q = self._q
        while len(q) > 1 and q[0][0] <= rnd - self.window:
            q.popleft()

    @property
    def value(self) -> float:
        return self._q[0][1] if self._q else 0.0


class _Plateau:
    """Whether a growing bandwidth has stopped growing: below ``FULL_BW_THRESH`` × the last baseline for
    ``FULL_BW_ROUNDS`` rounds in a row (fed once per round; ``reached`` never goes back)."""

    def __init__(self) -> None:
        self._base = 0.0
        self._count = 0
        self.reached = False

    def update(self, bw: float) -> None:
        if self.reached:
            return
        if bw >= self._base * FULL_BW_THRESH:
            self._base = bw
            self._count = 0
            return
        self._count += 1
        if self._count >= FULL_BW_ROUNDS:
            self.reached = True


class BBR:
    """BBR-style model of one path. Rates are bytes/s, times seconds."""

    def __init__(self, *, mss: int, initial_cwnd_packets: int = 64, initial_rtt_s: float = 0.001,
                 probe_rtt_interval_s: float = 10.0, probe_rtt_duration_s: float = 0.2,
                 aggregation_cap_s: float = 0.002, rng: random.Random | None = None) -> None:
        self.mss = mss
        self.initial_cwnd = initial_cwnd_packets * mss
        self.initial_rtt_s = initial_rtt_s
        self.probe_rtt_interval_s = probe_rtt_interval_s
        self.probe_rtt_duration_s = probe_rtt_duration_s
        self.rng = rng or random.Random(0)
        self.aggregation_cap_s = aggregation_cap_s
        self.state = STARTUP
        self.pacing_gain = HIGH_GAIN
        self.cwnd_gain = HIGH_GAIN
        self._btlbw = _MaxFilter(BTLBW_ROUNDS)
        self.rtprop: float | None = None
        self._rtprop_stamp = 0.0
        self.round_count = 0
        self._next_round_delivered = 0
        self._full_pipe = _Plateau()  # rounds the sender did not limit: the STARTUP exit
        # rounds of either kind: the estimates a receiver may plan with (Path.est_word). Not the STARTUP exit: a
        # path of one-flight messages settles without a full pipe
        self._settled = _Plateau()
        self._cycle_index = 0
        self._cycle_stamp = 0.0
        self._probe_rtt_done: float | None = None
        self._probe_rtt_round_done = False
        self._prior_state = PROBE_BW
        self._extra_acked = _MaxFilter(BTLBW_ROUNDS)
        self._ack_epoch_start: float | None = None
        self._ack_epoch_acked = 0

    # -- model outputs -------------------------------------------------
    @property
    def btlbw(self) -> float:
        """Bottleneck bandwidth estimate (bytes/s), 0 before the first sample."""
        return self._btlbw.value

    def bdp(self) -> float:
        """Bandwidth-delay product (bytes) or the initial window before any sample."""
        if self.btlbw <= 0 or self.rtprop is None:
            return float(self.initial_cwnd)
        return self.btlbw * self.rtprop

    @property
    def pacing_rate(self) -> float:
        """Current pacing rate (bytes/s): ``pacing_gain`` x BtlBw, and until the pipe is full at least
        :meth:`startup_floor_rate`."""
        rate = self.pacing_gain * self.btlbw
        if not self.filled_pipe:
            rate = max(rate, self.startup_floor_rate())
        return rate

    def startup_floor_rate(self) -> float:
        """The least STARTUP paces at (bytes/s): its gain times one initial window per RTprop (the initial RTT
        guess before a sample). Linux's BBR only raises the pacing rate until the pipe is full; without this
        floor a path whose samples all came from tiny messages (a barrier, a 144-byte broadcast: BtlBw a few
        kB/s, every sample app-limited, so STARTUP never ends) paced the next large message at 2.89x that.
        Measured (session 55): the ``ltp`` torch backend's first 400 kB parameter broadcast after DDP's
        144-byte one took 0.2-2.4 s on loopback, 20 STARTUP rounds at a crawl, where TCP took milliseconds."""
        rtt = self.rtprop or self.initial_rtt_s
        return HIGH_GAIN * self.initial_cwnd / max(rtt, 1e-6)

    def cwnd(self, burst_bytes: int) -> int:
        """Bytes allowed in flight, given the pacer's burst size."""
        if self.state == PROBE_RTT:
            return 4 * self.mss
        target = self.cwnd_gain * self.bdp() + self.extra_acked + burst_bytes
        return int(max(target, 4 * self.mss, self.initial_cwnd if not self.filled_pipe else 0))

    @property
    def extra_acked(self) -> float:
        """ACK-aggregation allowance (bytes), capped at ``aggregation_cap_s`` of BtlBw.

        Linux caps it at 100 ms; we cap it at the host-side timing slop it exists
        to absorb (two pacing-timer periods by default). A larger allowance lets N
        senders that share a shallow FIFO (the parameter server's incast) keep N
        times the queue in flight: measured in the simulator, that tripled losses.
        """
        return min(self._extra_acked.value, self.btlbw * self.aggregation_cap_s)

    def _update_ack_aggregation(self, now: float, acked: int) -> None:
        bw = self.btlbw
        if bw <= 0 or acked <= 0:
            return
        if self._ack_epoch_start is None:
            self._ack_epoch_start, self._ack_epoch_acked = now, 0
        expected = bw * (now - self._ack_epoch_start)
        if self._ack_epoch_acked <= expected:
            self._ack_epoch_start, self._ack_epoch_acked = now, 0
            expected = 0.0
        self._ack_epoch_acked += acked
        self._extra_acked.update(self.round_count, self._ack_epoch_acked - expected)

    # -- inputs --------------------------------------------------------
    def on_ack(self, now: float, *, delivered: int, prior_delivered: int, rate_bps: float | None,
               rtt_s: float | None, inflight: int, app_limited: bool = False, acked: int = 0) -> None:
        """Feed one ACK's worth of samples.

        ``delivered`` is the path's delivered-bytes counter after this ACK,
        ``prior_delivered`` the counter when the sampled packet was sent,
        ``rate_bps`` the delivery-rate sample (None when there is none),
        ``rtt_s`` the newest RTT sample, ``inflight`` bytes still in flight,
        ``acked`` the bytes this ACK newly acknowledged.
        """
        round_start = False
        if prior_delivered >= self._next_round_delivered:
            self._next_round_delivered = delivered
            self.round_count += 1
            round_start = True
            self._btlbw.expire(self.round_count)
        if rate_bps is not None and rate_bps > 0 and (not app_limited or rate_bps >= self.btlbw):
            self._btlbw.update(self.round_count, rate_bps)
        # the filter can only expire once it holds a sample (the clock's origin is arbitrary)
        expired = self.rtprop is not None and now - self._rtprop_stamp > self.probe_rtt_interval_s
        if rtt_s is not None and rtt_s > 0 and (self.rtprop is None or rtt_s <= self.rtprop or expired):
            self.rtprop = rtt_s
            self._rtprop_stamp = now
        self._update_ack_aggregation(now, acked)
        if round_start:
            self._settled.update(self.btlbw)
        if round_start and not app_limited:
            # as Linux's BBR: a round whose sample the sender limited (it had nothing more to send) says nothing
            # about whether the pipe is full. Counting them took a path that only ever carries messages of one
            # flight out of STARTUP after three such rounds, to a pacing gain of 1 at a BtlBw no larger than
            # those messages' bytes per round trip: each message was then paced out over 1-2 round trips more.
            self._full_pipe.update(self.btlbw)
        self._update_state(now, inflight, expired, round_start)

    @property
    def filled_pipe(self) -> bool:
        """STARTUP found the pipe full (BtlBw flat for 3 rounds the sender did not limit)."""
        return self._full_pipe.reached

    @property
    def estimates_settled(self) -> bool:
        """BtlBw flat for 3 rounds of either kind: receivers may plan with RTprop/BtlBw."""
        return self._settled.reached

    def _enter_probe_bw(self, now: float) -> None:
        self.state = PROBE_BW
        self.cwnd_gain = 2.0
        # never start on the drain phase (index 1), as in BBR
        self._cycle_index = self.rng.choice([0, 2, 3, 4, 5, 6, 7])
        self.pacing_gain = CYCLE[self._cycle_index]
        self._cycle_stamp = now

    def _update_state(self, now: float, inflight: int, rtprop_expired: bool, round_start: bool) -> None:
        if self.state == STARTUP and self.filled_pipe:
            self.state = DRAIN
            self.pacing_gain = 1.0 / HIGH_GAIN
            self.cwnd_gain = HIGH_GAIN
        if self.state == DRAIN and inflight <= self.bdp():
            self._enter_probe_bw(now)
        if self.state == PROBE_BW:
            rtprop = self.rtprop or self.initial_rtt_s
            if now - self._cycle_stamp > rtprop:
                gain = CYCLE[self._cycle_index]
                advance = True
                if gain > 1.0 and inflight < gain * self.bdp():
                    advance = now - self._cycle_stamp > 2 * rtprop
                if gain < 1.0 and inflight > self.bdp():
                    advance = now - self._cycle_stamp > 2 * rtprop
                if advance:
                    self._cycle_index = (self._cycle_index + 1) % len(CYCLE)
                    self._cycle_stamp = now
                    self.pacing_gain = CYCLE[self._cycle_index]
        if self.state != PROBE_RTT and rtprop_expired and self.rtprop is not None:
            self._prior_state = self.state
            self.state = PROBE_RTT
            self.pacing_gain = 1.0
            self.cwnd_gain = 1.0
            self._probe_rtt_done = None
            self._probe_rtt_round_done = False
        if self.state == PROBE_RTT:
            if self._probe_rtt_done is None and inflight <= 4 * self.mss:
                self._probe_rtt_done = now + self.probe_rtt_duration_s
                self._probe_rtt_round_done = False
                self._next_round_delivered = 0  # next ACK starts a round
            elif self._probe_rtt_done is not None:
                if round_start:
                    self._probe_rtt_round_done = True
                if self._probe_rtt_round_done and now >= self._probe_rtt_done:
                    self._exit_probe_rtt(now)

    def _exit_probe_rtt(self, now: float) -> None:
        self._rtprop_stamp = now
        if self.filled_pipe:
            self._enter_probe_bw(now)
        else:
            self.state = STARTUP
            self.pacing_gain = self.cwnd_gain = HIGH_GAIN

    def on_idle(self, now: float) -> None:
        """The path has nothing in flight and nothing to send.

        An idle path has drained its queue, which is all PROBE_RTT exists to
        do: leave it, so the next message (the next training iteration) does
        not start at four packets in flight.
        """
        if self.state == PROBE_RTT:
            self._exit_probe_rtt(now)
