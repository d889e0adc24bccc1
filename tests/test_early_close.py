"""Early Close must not cut flows that are still advancing without evidence of loss (issues 7, 8, 10).

Deterministic: the pure policy (:func:`ltp.early_close.decide`), the bitmap
evidence (:class:`ltp.early_close.FlowProgress`) and the engine on the
simulated network with a virtual clock. A sender that runs below the rate the
receiver learned its LT threshold from (a CPU-starved host, or a slower path)
is modelled by lowering the link rate after the threshold was measured; the
queue in front of it is unbounded, so nothing is lost.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp.config import Config
from ltp.early_close import (COMPLETE, DEADLINE, EARLY, HARD_STRETCH, STALL_GAPS, STALL_MIN_S, STALL_RTPROPS,
                             FlowProgress, decide, stall_window)

GBIT = 125e6  # bytes/s

BASE = dict(start=0.0, lt=0.010, deadline=0.040, critical_ok=True, lt_fraction=0.8, reliable=False, complete=False)


# ---------------------------------------------------------------- the policy
def test_paper_rule_is_unchanged_without_progress_evidence():
    assert decide(0.011, fraction=0.85, **BASE) == (EARLY, None)
    assert decide(0.005, fraction=0.85, **BASE) == (None, 0.010)
    assert decide(0.011, fraction=0.5, **BASE) == (None, 0.040)
    assert decide(0.040, fraction=0.5, **BASE) == (DEADLINE, None)
    assert decide(0.5, fraction=0.5, complete=True, **{k: v for k, v in BASE.items() if k != "complete"}) == \
        (COMPLETE, None)


def test_flow_still_in_its_first_pass_is_not_cut_at_the_lt_threshold():
    # 85% in, still arriving, first pass not over: a slow sender, not a long tail -- with or without
    # a few losses (they will cost their own bytes once the first pass ends, not a round trip)
    regime, wake = decide(0.011, fraction=0.85, lossy=False, first_pass_done=False, stall_at=0.016,
                          hard_deadline=0.120, **BASE)
    assert regime is None and wake == 0.016
    # heavy loss (a congested path): the paper's rule
    assert decide(0.011, fraction=0.85, lossy=True, first_pass_done=False, stall_at=0.016,
                  hard_deadline=0.120, **BASE)[0] == EARLY


def test_long_tail_is_cut_early_first_pass_done_or_stalled():
    assert decide(0.011, fraction=0.85, lossy=False, first_pass_done=True, stall_at=0.016,
                  hard_deadline=0.120, **BASE)[0] == EARLY
    assert decide(0.017, fraction=0.85, lossy=False, first_pass_done=False, stall_at=0.016,
                  hard_deadline=0.120, **BASE)[0] == EARLY
    # critical segments missing: never early
    kw = dict(BASE, critical_ok=False)
    assert decide(0.011, fraction=0.85, lossy=True, first_pass_done=True, stall_at=0.016,
                  hard_deadline=0.120, **kw)[0] is None


def test_deadline_binds_lossy_stalled_or_tail_flows_and_stretches_first_pass_ones_to_the_hard_deadline():
    common = dict(fraction=0.5, hard_deadline=0.120, **BASE)
    assert decide(0.041, lossy=True, first_pass_done=False, stall_at=0.045, **common) == (DEADLINE, None)
    assert decide(0.046, lossy=False, first_pass_done=False, stall_at=0.045, **common) == (DEADLINE, None)
    assert decide(0.041, lossy=False, first_pass_done=True, stall_at=0.045, **common) == (DEADLINE, None)
    assert decide(0.041, lossy=False, first_pass_done=False, stall_at=0.045, **common) == (None, 0.045)
    assert decide(0.119, lossy=False, first_pass_done=False, stall_at=0.125, **common) == (None, 0.120)
    assert decide(0.120, lossy=False, first_pass_done=False, stall_at=0.125, **common) == (DEADLINE, None)
    # without a hard deadline the group deadline stays hard
    assert decide(0.041, fraction=0.5, lossy=False, first_pass_done=False, stall_at=0.045, **BASE) == \
        (DEADLINE, None)


def test_a_flow_missing_a_critical_segment_waits_past_the_deadline_for_it_up_to_the_hard_deadline():
    """Closed at the deadline without its critical segments a message is worth nothing to its receiver (a PS
    cannot use a gradient without its header): it waits for their retransmission, bounded by the hard
    deadline, whatever its progress says; the paper's rule (no hard deadline) still closes it."""
    kw = dict(BASE, critical_ok=False)
    for lossy, first, stall in [(True, False, 0.045), (False, True, 0.045), (False, False, 0.030)]:
        assert decide(0.041, fraction=0.99, lossy=lossy, first_pass_done=first, stall_at=stall,
                      hard_deadline=0.120, **kw) == (None, 0.120)
    assert decide(0.120, fraction=0.99, lossy=False, first_pass_done=True, stall_at=0.045, hard_deadline=0.120,
                  **kw) == (DEADLINE, None)
    assert decide(0.041, fraction=0.99, lossy=False, first_pass_done=True, **kw) == (DEADLINE, None)
    # the moment it arrives the flow closes (its first pass is over)
    assert decide(0.050, fraction=1 - 1e-6, lossy=False, first_pass_done=True, stall_at=0.045, hard_deadline=0.120,
                  **BASE) == (DEADLINE, None)


@settings(max_examples=300, deadline=None)
@given(now=st.floats(0, 0.2), fraction=st.floats(0, 0.999), lossy=st.booleans(), first=st.booleans(),
       stall=st.floats(0, 0.2), hard=st.floats(0.04, 0.2), crit=st.booleans())
def test_property_a_flow_advancing_in_its_first_pass_is_only_cut_at_the_hard_deadline(now, fraction, lossy, first,
                                                                                       stall, hard, crit):
    kw = dict(BASE, critical_ok=crit)
    regime, wake = decide(now, fraction=fraction, lossy=lossy, first_pass_done=first, stall_at=stall,
                          hard_deadline=hard, **kw)
    advancing = now < stall
    if regime is not None and advancing and not lossy and not first:
        assert regime == DEADLINE and now >= hard
    if regime == EARLY:
        assert crit and fraction >= 0.8 and now >= 0.010 and (first or not advancing or lossy)
    if regime is not None and not crit:  # never closed without its critical segments before the hard deadline
        assert regime == DEADLINE and now >= hard
    if regime is None and wake is not None:
        assert wake > now  # the next decision point is in the future (no timer livelock)


def test_stall_window_floors_and_scales():
    assert stall_window(0.0, None) == STALL_MIN_S
    assert stall_window(0.050, None) == pytest.approx(STALL_RTPROPS * 0.050)
    assert stall_window(0.0, 0.004) == pytest.approx(STALL_GAPS * 0.004)
    assert STALL_MIN_S < STALL_GAPS * 0.004
    assert stall_window(0.0, None, 0.030) == 0.030 and stall_window(0.0, 0.001, 0.100) == 0.100


# ---------------------------------------------------------------- the evidence
def test_flow_progress_gaps_first_pass_and_critical_segments_left_out():
    crit = np.zeros(10, np.uint8)
    crit[[0, 9]] = 1  # header and the last segment are critical: sent first
    p = FlowProgress(10, crit)
    p._stride = 1  # rescan on every new segment (the default rescans every 1/64 of the message)
    bm = np.zeros(10, np.uint8)
    bm[[0, 9]] = 1
    assert p.observe(bm, 2) == (0.0, False)  # critical tail received first is not a gap
    bm[1:5] = 1
    assert p.observe(bm, 6) == (0.0, False)
    bm[6] = 1  # segment 5 missing below 6: a loss
    assert p.observe(bm, 7) == (pytest.approx(1 / 6), False) and p.gaps
    bm[7:9] = 1  # last normal segment in: only retransmissions can follow
    assert p.observe(bm, 9) == (pytest.approx(1 / 8), True)
    bm[5] = 1  # the retransmission repaired the gap
    assert p.observe(bm, 10) == (0.0, True) and not p.gaps
    q = FlowProgress(4, None)
    assert q._stride == 1 and q.observe(np.array([1, 1, 0, 0], np.uint8), 2) == (0.0, False)
    assert FlowProgress(4, None).observe(np.array([1, 0, 0, 1], np.uint8), 2) == (0.5, True)
    # large flows: the first pass is seen at once, the gap scan is rate-limited to ~GAP_SCANS per message
    big = FlowProgress(6400, None)
    bm = np.zeros(6400, np.uint8)
    bm[:50] = 1
    bm[51:60] = 1
    assert big.observe(bm, 59)[0] == pytest.approx(1 / 60)
    bm[50] = 1
    assert big.observe(bm, 60)[0] > 0  # within one stride (100 segments): the old answer stands
    bm[60:200] = 1
    assert big.observe(bm, 200) == (0.0, False)
    bm[6399] = 1
    assert big.observe(bm, 201)[1] and big.gaps  # the last segment ends the first pass at once (and rescans)


# ---------------------------------------------------------------- the engine
def _transfer(h, data, out, *, tag):
    a, b = h.engines
    hs = a.send(h.addrs[1], data, now=h.now, reliable=False, tag=tag)
    hr = b.post_receive([(h.addrs[0], tag, out)], now=h.now)
    _, recv = h.wait([(0, hs), (1, hr)], timeout=60.0)
    return recv.reports[0]


def _learn_fast_link(h, data, out, n=4):
    h.links(rate=GBIT, delay_s=0.0005)
    for tag in range(n):
        rep = _transfer(h, data, out, tag=tag)
        assert rep.regime == "complete"
    return n


@pytest.mark.parametrize("slowdown", [0.85, 0.6, 0.3])
def test_sender_slower_than_learned_rate_without_loss_is_delivered_whole(harness, floats, slowdown):
    """Regression (issues 7/8/10): a loss-free flow that arrives slower than the LT history was cut
    at the LT threshold (slowdown 0.85: ~85% in at LT -> 'early') or at the group deadline (0.3)."""
    h = harness(seed=21, config=Config(deadline_slack_s=0.002, lt_fraction=0.8))
    data = floats(400_000)
    out = np.zeros_like(data)
    tag = _learn_fast_link(h, data, out)
    h.links(rate=GBIT * slowdown, delay_s=0.0005)  # same path, the sender now delivers below its old pace
    for t in range(tag, tag + 3):
        out[:] = np.nan
        rep = _transfer(h, data, out, tag=t)
        assert rep.regime == "complete", (slowdown, rep.regime, rep.delivered_fraction)
        assert rep.delivered_fraction == 1.0 and np.array_equal(out, data)


def test_hard_deadline_bounds_a_very_slow_clean_flow(harness, floats):
    h = harness(seed=22, config=Config(deadline_slack_s=0.002, lt_fraction=0.8))
    data = floats(400_000)
    out = np.zeros_like(data)
    tag = _learn_fast_link(h, data, out)
    h.links(rate=GBIT * 0.05, delay_s=0.0005)  # 20x slower: cannot finish within HARD_STRETCH x the span
    rep = _transfer(h, data, out, tag=tag)
    assert rep.regime == "deadline" and 0 < rep.delivered_fraction < 1
    assert rep.duration_s == pytest.approx(HARD_STRETCH * rep.deadline_s, rel=0.05)


@pytest.mark.parametrize("loss", [0.02, 0.30])
def test_loss_tolerance_is_kept_when_packets_are_really_lost(harness, floats, loss):
    """With real loss the paper's behaviour stays: the flow closes early (or at the soft deadline),
    long before retransmissions could complete it, and never later than the soft deadline."""
    h = harness(seed=23, config=Config(deadline_slack_s=0.002, lt_fraction=0.8))
    data = floats(400_000)
    out = np.zeros_like(data)
    tag = _learn_fast_link(h, data, out)
    h.links(rate=GBIT, delay_s=0.0005, loss=loss, loss_min_size=200)
    cut = 0
    for t in range(tag, tag + 4):
        rep = _transfer(h, data, out, tag=t)
        assert rep.regime in ("complete", "early", "deadline")
        assert rep.duration_s <= rep.deadline_s + 1e-6 or rep.regime == "complete"
        cut += rep.regime != "complete"
        if rep.regime != "complete":
            assert rep.delivered_fraction >= 0.8 or rep.regime == "deadline"
    assert cut >= 1


def test_slow_sender_with_random_loss_loses_only_the_lost_packets(harness, floats):
    """A sender below its learned pace on a path with 2% random loss: the flow runs past the group
    deadline while its first pass goes on, and closes as soon as that pass ends (regime 'deadline')
    missing about the lost packets only -- not cut at the soft deadline, and no retransmission wait."""
    h = harness(seed=24, config=Config(deadline_slack_s=0.002, lt_fraction=0.8))
    data = floats(400_000)
    out = np.zeros_like(data)
    tag = _learn_fast_link(h, data, out)
    h.links(rate=GBIT * 0.5, delay_s=0.0005, loss=0.02, loss_min_size=200)
    fractions = []
    for t in range(tag, tag + 3):
        rep = _transfer(h, data, out, tag=t)
        fractions.append(rep.delivered_fraction)
        assert rep.regime in ("deadline", "early", "complete")
        assert rep.delivered_fraction >= 0.9, rep
        assert rep.duration_s <= HARD_STRETCH * rep.deadline_s + 1e-6
    assert min(fractions) < 1.0  # packets really were lost and not waited for


@pytest.mark.parametrize("late_s", [0.02, 0.04])
def test_a_late_senders_lost_header_is_waited_for_at_the_deadline(harness, floats, late_s):
    """A gather of four 160 kB messages whose first 64 bytes are critical (a PS's header). In the last round one
    sender starts ``late_s`` late and its header packet is lost: the group deadline passes before the header's
    retransmission, a round trip later. The flow stays open for it and the gather delivers all four, headers
    included (before: that flow was cut at 99.1 % without its header, which a PS cannot use at all)."""
    from ltp import wire
    n, one_way = 4, 0.025
    h = harness(n_hosts=n + 1, seed=1, config=Config())
    drop_next_header = []

    def drop(d) -> bool:  # the first DATA of segment 0 once armed
        if drop_next_header and d[0] & 0x0F == wire.T_DATA and wire.unpack_header(memoryview(d))[4] >> 8 == 0:
            drop_next_header.clear()
            return True
        return False
    for i in range(1, n + 1):
        h.link(i, 0, rate=GBIT, delay_s=one_way, drop_if=drop if i == n else None)
        h.link(0, i, rate=GBIT, delay_s=0.0002)
    data = floats(40_000)
    for rnd in range(6):  # five rounds teach the link's thresholds, the sixth has the late sender
        t0 = h.now
        bufs = [np.zeros_like(data) for _ in range(n)]
        g = h.engines[0].post_receive([(h.addrs[i], rnd, bufs[i - 1]) for i in range(1, n + 1)], now=t0)
        sends = []
        for i in range(1, n + 1):
            late = rnd == 5 and i == n
            h.net.run(until=t0 + (late_s if late else 0.001 * i))
            if late:
                drop_next_header.append(True)
            sends.append((i, h.engines[i].send(h.addrs[0], data, now=h.now, tag=rnd, critical=[(0, 64)])))
        (ev,) = h.wait([(0, g)], timeout=10)
        h.wait(sends, timeout=10)
        assert ev.error is None
        assert all(r.critical_complete for r in ev.reports), [(r.regime, r.delivered_fraction) for r in ev.reports]
    late = ev.reports[-1]
    assert late.regime == COMPLETE and np.array_equal(bufs[-1], data)
