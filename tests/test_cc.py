"""BBR model, pacer and Early Close policy: pure objects, no network."""

from __future__ import annotations

import random

import pytest

from ltp.bbr import BBR, DRAIN, PROBE_BW, PROBE_RTT, STARTUP
from ltp.early_close import LinkThresholds, decide
from ltp.pacing import LATE_CREDIT_BURSTS, Pacer

MSS = 1472


def _drive(bbr, *, rate, rtt, rounds, start=0.0, inflight=None, delivered0=0):
    """Feed one ACK per round with a constant delivery rate and RTT."""
    now = start
    delivered = delivered0
    for _ in range(rounds):
        prior = delivered
        now += rtt
        delivered += int(rate * rtt)
        bbr.on_ack(now, delivered=delivered, prior_delivered=prior, rate_bps=rate, rtt_s=rtt,
                   inflight=inflight if inflight is not None else int(rate * rtt))
    return now, delivered


def test_startup_fills_pipe_drains_and_probes_bandwidth():
    bbr = BBR(mss=MSS, rng=random.Random(1))
    assert bbr.state == STARTUP and bbr.pacing_gain == pytest.approx(2.885, rel=1e-3)
    now, d = _drive(bbr, rate=1e6, rtt=0.01, rounds=2)
    assert bbr.state == STARTUP
    now, d = _drive(bbr, rate=1e6, rtt=0.01, rounds=4, start=now, delivered0=d, inflight=10**9)
    assert bbr.filled_pipe and bbr.state == DRAIN
    now, d = _drive(bbr, rate=1e6, rtt=0.01, rounds=1, start=now, delivered0=d, inflight=0)
    assert bbr.state == PROBE_BW
    assert bbr.btlbw == 1e6 and bbr.rtprop == 0.01
    assert bbr.bdp() == pytest.approx(1e4)
    gains = set()
    for _ in range(20):
        now, d = _drive(bbr, rate=1e6, rtt=0.01, rounds=1, start=now + 0.001, delivered0=d)
        gains.add(bbr.pacing_gain)
    assert {1.25, 0.75, 1.0} <= gains
    assert bbr.pacing_rate in (1.25e6, 0.75e6, 1e6)


def test_app_limited_rounds_do_not_end_startup():
    """As Linux's BBR: a round whose sample was app-limited says nothing about a full pipe. A path that only
    carries one-flight messages stays in STARTUP (gain 2.89) instead of cruising at a BtlBw it never tested."""
    bbr = BBR(mss=MSS, rng=random.Random(1))
    now, delivered = 0.0, 0
    for _ in range(20):  # flat samples, every one app-limited
        prior, now = delivered, now + 0.08
        delivered += 150_000
        bbr.on_ack(now, delivered=delivered, prior_delivered=prior, rate_bps=1.5e6, rtt_s=0.08, inflight=0,
                   app_limited=True)
    assert bbr.state == STARTUP and not bbr.filled_pipe and bbr.btlbw == 1.5e6
    # ...but BtlBw stopped growing, so receivers may plan with the estimates (the header's word 3): Early Close's
    # first threshold on a link comes from them
    assert bbr.estimates_settled
    _drive(bbr, rate=1.5e6, rtt=0.08, rounds=5, start=now, delivered0=delivered, inflight=10**9)
    assert bbr.filled_pipe  # the same flat samples, not app-limited: the pipe is full


def test_startup_never_paces_below_one_initial_window_per_round_trip():
    """As Linux's BBR, which only raises the pacing rate until the pipe is full: a path whose only samples came from
    tiny messages (a barrier, a 144-byte broadcast: BtlBw a few kB/s) must not pace the next large message at 2.89x
    that. In STARTUP the rate is at least what the initial window per RTprop gives at STARTUP's gain; once the pipe
    is full BtlBw alone decides."""
    bbr = BBR(mss=MSS, initial_cwnd_packets=10, rng=random.Random(1))
    floor_before = bbr.pacing_rate  # no sample: 2.89 x 10 packets per the initial RTT guess
    assert floor_before == pytest.approx(2.885 * 10 * MSS / 0.001, rel=1e-3)
    now, delivered = 0.0, 0
    for _ in range(4):  # 144-byte messages, app-limited, 2 ms round trips
        prior, now = delivered, now + 0.002
        delivered += 144
        bbr.on_ack(now, delivered=delivered, prior_delivered=prior, rate_bps=144 / 0.002, rtt_s=0.002, inflight=0,
                   app_limited=True)
    assert bbr.state == STARTUP and bbr.btlbw == pytest.approx(72_000)
    assert bbr.pacing_rate == pytest.approx(2.885 * 10 * MSS / 0.002, rel=1e-3)  # not 2.89 x 72 kB/s
    assert bbr.cwnd(0) >= 10 * MSS
    # a measured rate above the floor paces as before
    bbr.on_ack(now + 0.002, delivered=delivered + 10**6, prior_delivered=delivered, rate_bps=5e8, rtt_s=0.002,
               inflight=0)
    assert bbr.pacing_rate == pytest.approx(2.885 * 5e8, rel=1e-3)
    # a full pipe: no floor, BtlBw decides (here a slow path that a large message filled)
    slow = BBR(mss=MSS, initial_cwnd_packets=10, rng=random.Random(1))
    _drive(slow, rate=2e5, rtt=0.002, rounds=8, inflight=10**9)
    assert slow.filled_pipe
    assert slow.pacing_rate <= 2.885 * 2e5


def test_estimates_are_unsettled_while_btlbw_grows():
    bbr = BBR(mss=MSS, rng=random.Random(1))
    now, d = 0.0, 0
    for k in range(8):  # doubling every round, app-limited or not
        now, d = _drive(bbr, rate=1e6 * 2 ** k, rtt=0.01, rounds=1, start=now, delivered0=d)
        assert not bbr.estimates_settled


def test_btlbw_is_windowed_max_and_expires_after_ten_rounds():
    bbr = BBR(mss=MSS)
    now, d = _drive(bbr, rate=5e6, rtt=0.01, rounds=1)
    now, d = _drive(bbr, rate=1e6, rtt=0.01, rounds=5, start=now, delivered0=d)
    assert bbr.btlbw == 5e6
    now, d = _drive(bbr, rate=1e6, rtt=0.01, rounds=10, start=now, delivered0=d)
    assert bbr.btlbw == 1e6


def test_loss_is_not_a_signal_window_depends_only_on_bdp():
    """Two models fed the same delivery samples end with the same window, whatever was lost."""
    a, b = BBR(mss=MSS, rng=random.Random(3)), BBR(mss=MSS, rng=random.Random(3))
    _drive(a, rate=2e6, rtt=0.02, rounds=30)
    _drive(b, rate=2e6, rtt=0.02, rounds=30)
    assert a.cwnd(30_000) == b.cwnd(30_000) >= 2 * 2e6 * 0.02


def test_probe_rtt_after_rtprop_goes_stale():
    bbr = BBR(mss=MSS, probe_rtt_interval_s=1.0, probe_rtt_duration_s=0.2, rng=random.Random(0))
    now, d = _drive(bbr, rate=1e6, rtt=0.01, rounds=10)
    # RTT rises (queue) so RTprop is not refreshed; after 1 s PROBE_RTT starts
    now, d = _drive(bbr, rate=1e6, rtt=0.05, rounds=30, start=now, delivered0=d)
    assert bbr.state == PROBE_RTT and bbr.cwnd(10_000) == 4 * MSS
    now, d = _drive(bbr, rate=1e6, rtt=0.011, rounds=30, start=now, delivered0=d, inflight=MSS)
    assert bbr.state != PROBE_RTT and bbr.rtprop == pytest.approx(0.011)


def test_pacer_bursts_and_next_time():
    p = Pacer(granularity_s=0.001, min_burst_bytes=10 * MSS, rate=125e6)  # 1 Gbit/s
    assert p.burst_bytes == 125_000
    assert p.available(0.0) == 10 * MSS  # a new path starts with one minimum burst
    assert p.available(0.001) == 10 * MSS + 125_000
    p.consume(0.001, 10 * MSS + 125_000)
    assert p.available(0.001) == 0
    p = Pacer(granularity_s=0.001, min_burst_bytes=10 * MSS, rate=125e6)
    p.available(0.0)
    p.consume(0.0, 10 * MSS)
    assert p.available(0.0) == 0
    t = p.next_time(0.0, MSS)
    assert t == pytest.approx(MSS / 125e6, rel=0.01)
    assert p.available(t) >= MSS
    assert p.available(10.0) == 250_000  # capped at two bursts (absorbs a late timer)
    slow = Pacer(granularity_s=0.001, min_burst_bytes=10 * MSS, rate=1e5)
    assert slow.burst_bytes == 10 * MSS  # never below the minimum burst


def test_a_late_wake_up_keeps_its_lateness_once_and_an_idle_pacer_banks_two_bursts():
    """A flow held by the pacer asks :meth:`Pacer.next_time` when to wake; a loop that wakes it later keeps the
    tokens of the lateness (up to LATE_CREDIT_BURSTS bursts beyond the depth) for that wake-up only."""
    burst = 125_000  # 1 Gbit/s, 1 ms granularity
    p = Pacer(granularity_s=0.001, min_burst_bytes=10 * MSS, rate=125e6)
    p.consume(0.0, p.available(0.0))
    due = p.next_time(0.0, burst)
    assert due == pytest.approx(0.001, rel=0.01)
    late = due + 0.0015  # woken 1.5 ms late: 2.5 ms of rate is owed, the depth holds 2
    assert p.available(late) == pytest.approx(125e6 * late, abs=2)
    p.consume(late, burst)  # the wake-up sent one burst only: the rest is clipped at the next refill
    assert p.available(late + 1e-6) <= p.depth_bytes
    q = Pacer(granularity_s=0.001, min_burst_bytes=10 * MSS, rate=125e6)
    q.consume(0.0, q.available(0.0))
    q.next_time(0.0, burst)
    assert q.available(1.0) == p.depth_bytes + LATE_CREDIT_BURSTS * burst  # very late: the credit is bounded
    idle = Pacer(granularity_s=0.001, min_burst_bytes=10 * MSS, rate=125e6)
    idle.consume(0.0, idle.available(0.0))
    assert idle.available(1.0) == idle.depth_bytes == 2 * burst  # not waiting on the pacer: two bursts


def test_decide_regimes():
    kw = dict(start=0.0, lt=0.1, deadline=0.2, critical_ok=True, lt_fraction=0.8, reliable=False)
    assert decide(0.05, fraction=0.99, complete=False, **kw) == (None, 0.1)  # before LT: wait for all
    assert decide(0.05, fraction=1.0, complete=True, **kw)[0] == "complete"
    assert decide(0.15, fraction=0.85, complete=False, **kw)[0] == "early"
    assert decide(0.15, fraction=0.75, complete=False, **kw) == (None, 0.2)
    assert decide(0.15, fraction=0.9, complete=False, **{**kw, "critical_ok": False}) == (None, 0.2)
    assert decide(0.2, fraction=0.1, complete=False, **kw)[0] == "deadline"
    assert decide(5.0, fraction=0.1, complete=False, **{**kw, "reliable": True}) == (None, None)
    assert decide(5.0, fraction=0.9, complete=False, **{**kw, "lt": None, "deadline": None}) == (None, None)


def test_lt_threshold_initial_formula_then_shortest_full_delivery():
    t = LinkThresholds(window=3)
    link = ("10.0.0.1", 1)
    assert t.threshold(link, 1000) is None
    assert t.threshold(link, 10_000_000, 0.001, 1e9) == pytest.approx(1.5e-3 + 0.01)
    for d in (0.05, 0.03, 0.04):
        t.record_full(link, 10_000_000, d)
    assert t.threshold(link, 10_000_000, 0.002, 1e9) == pytest.approx(0.03 + 0.001)
    for d in (0.06, 0.07, 0.08):  # the window forgets the old best: the link got slower
        t.record_full(link, 10_000_000, d)
    assert t.history(link, 10_000_000) == 0.06
    assert t.threshold(("10.0.0.2", 1), 10_000_000) is None  # per link


def test_idle_path_leaves_probe_rtt():
    bbr = BBR(mss=MSS, probe_rtt_interval_s=1.0, rng=random.Random(0))
    now, d = _drive(bbr, rate=1e6, rtt=0.01, rounds=10)
    now, d = _drive(bbr, rate=1e6, rtt=0.05, rounds=30, start=now, delivered0=d)
    assert bbr.state == PROBE_RTT
    bbr.on_idle(now + 0.001)  # nothing in flight: the queue is drained already
    assert bbr.state in (PROBE_BW, STARTUP) and bbr.cwnd(10_000) > 4 * MSS
