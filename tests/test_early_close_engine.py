"""Early Close maths lives in ltp.early_close only, and the engine runs that code.

The unit tests of ``LinkThresholds.threshold`` (tests/test_cc.py) and of
``decide`` (tests/test_early_close.py) cover the production path because the
engine computes every LT threshold with ``LinkThresholds.flow_threshold`` (which
``threshold`` shares) and every decision with :class:`EarlyClose`; these tests
pin that down and check the deadline helpers.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ltp.engine
from ltp.config import Config
from ltp.early_close import (HARD_STRETCH, EarlyClose, LinkThresholds, group_deadline, hard_deadline,
                             projected_full_duration)
from ltp.regimes import Regime

GBIT = 125e6
LINK = ("10.0.0.1", 7447)


def test_engine_has_no_early_close_maths_of_its_own():
    src = inspect.getsource(ltp.engine)
    for name in ("_lt_for", "_deadline_for", "_progress_for", "HARD_STRETCH", "STRETCH_MAX_LOSS", "record_full",
                 "initial(", "stall_window", "FlowProgress", "decide("):
        assert name not in src, f"ltp/engine.py still has {name}: Early Close belongs in ltp/early_close.py"


@settings(max_examples=200, deadline=None)
@given(hist=st.lists(st.floats(1e-4, 1.0), max_size=4), rt=st.sampled_from([0.0, 1e-4, 2e-3]),
       bw=st.sampled_from([0.0, 1e6, 1.25e8]), size=st.integers(1, 10**7))
def test_threshold_is_flow_threshold_of_a_fresh_flow(hist, rt, bw, size):
    t = LinkThresholds(window=8)
    for d in hist:
        t.record_full(LINK, size, d)
    lt, anchor = t.flow_threshold(LINK, size, rt, bw)
    assert t.threshold(LINK, size, rt, bw) == lt
    if hist:
        assert lt == min(hist) + 0.5 * rt and anchor is None
    elif rt > 0 and bw > 0:
        assert lt == anchor == pytest.approx(1.5 * rt + size / bw)
    else:
        assert lt is None and anchor is None


def test_initial_threshold_is_anchored_once_and_counts_only_what_is_left():
    t = LinkThresholds()
    lt, anchor = t.flow_threshold(LINK, 1_000_000, 0.001, 1e8, elapsed_s=0.004, remaining=600_000)
    assert lt == anchor == pytest.approx(0.004 + 1.5e-3 + 0.006)
    # later calls keep the anchor whatever the estimates do, until the link has a history
    assert t.flow_threshold(LINK, 1_000_000, 0.5, 1e3, elapsed_s=9.0, remaining=1, anchor=anchor) == (anchor, anchor)
    t.record_full(LINK, 1_000_000, 0.02)
    assert t.flow_threshold(LINK, 1_000_000, 0.002, 1e8, anchor=anchor) == (pytest.approx(0.021), anchor)


def test_deadline_helpers():
    assert group_deadline(1.0, 0.0, 0.03) == pytest.approx(1.03)
    assert group_deadline(1.0, 0.5, 0.03) == pytest.approx(1.53)
    assert group_deadline(1.0, None, 0.03) is None
    assert hard_deadline(1.0, 1.5) == pytest.approx(1.0 + HARD_STRETCH * 0.5)
    assert hard_deadline(1.0, 1.5, timeout_at=1.2) == 1.2
    assert hard_deadline(1.0, 0.5) == 1.0  # a deadline before the start stretches nothing
    assert projected_full_duration(0.01, 0.08, 0.8) == pytest.approx(0.11)


def test_record_closed_by_regime():
    t = LinkThresholds()
    kw = dict(anchor=1.0, start=1.01, last_arrival=1.09)
    t.record_closed(LINK, 1000, Regime.COMPLETE, received_bytes=1000, **kw)
    assert t.history(LINK, 1000) == pytest.approx(0.09)
    t.record_closed(LINK, 2000, Regime.EARLY, received_bytes=1600, **kw)
    assert t.history(LINK, 2000) == pytest.approx(0.01 + 0.08 / 0.8)
    for regime in (Regime.TIMEOUT, Regime.CANCELLED):
        t.record_closed(LINK, 3000, regime, received_bytes=3000, **kw)
    t.record_closed(LINK, 3000, Regime.DEADLINE, received_bytes=0, **kw)
    assert t.history(LINK, 3000) is None


def test_engine_thresholds_come_from_flow_threshold(harness, floats, monkeypatch):
    calls = []
    real = LinkThresholds.flow_threshold

    def spy(self, *a, **kw):
        out = real(self, *a, **kw)
        calls.append(out)
        return out

    monkeypatch.setattr(LinkThresholds, "flow_threshold", spy)
    h = harness(seed=31, config=Config(deadline_slack_s=0.01))
    h.links(rate=GBIT, delay_s=0.0005)
    a, b = h.engines
    assert isinstance(b._early, EarlyClose) and b._thresholds is b._early.thresholds
    data = floats(200_000)
    reps = []
    for tag in range(3):
        out = np.zeros_like(data)
        hs = a.send(h.addrs[1], data, now=h.now, tag=tag)
        hr = b.post_receive([(h.addrs[0], tag, out)], now=h.now)
        _, recv = h.wait([(0, hs), (1, hr)])
        reps.append(recv.reports[0])
    assert calls, "the engine never asked LinkThresholds.flow_threshold"
    last = reps[-1]
    assert last.regime == Regime.COMPLETE and last.lt_threshold_s is not None
    # the last flow's threshold is what LinkThresholds says for this link now (measured history + margin),
    # i.e. exactly what the unit-tested threshold() returns
    history = b._thresholds.history(h.addrs[0], data.nbytes)
    assert history is not None
    assert last.deadline_s == pytest.approx(last.lt_threshold_s + 0.01)
    assert any(lt == last.lt_threshold_s for lt, _ in calls)


def test_record_closed_times_a_flow_that_started_before_its_groups_clock_from_its_own_start():
    """A message that registered before its receive was posted (its group's clock starts at the posting) teaches
    its link its own transfer time, not the shorter span from the clock's start."""
    t = LinkThresholds()
    t.record_closed(LINK, 1000, Regime.COMPLETE, anchor=2.0, start=1.5, last_arrival=2.1, received_bytes=1000)
    assert t.history(LINK, 1000) == pytest.approx(0.6)


def _lossy_pair(harness, seed):
    h = harness(seed=seed, config=Config(deadline_slack_s=0.005))
    h.links(rate=GBIT, delay_s=0.0005, loss=0.3)  # above STRETCH_MAX_LOSS: Early Close cuts a posted receive
    return h


def test_an_unexpected_message_is_never_closed_early_its_clock_starts_when_a_receive_claims_it(harness, floats):
    """No receive is posted while a lossy link carries a message: nobody waits for it, so Early Close has no
    tail to cut and the message is received whole (the sender retransmits). Before, it ran on its own clock
    and was cut at its link's LT threshold; the gather that claimed it later (a PS still broadcasting when
    its workers pushed) found a quarter to all of each gradient missing at 0 % network loss."""
    h = _lossy_pair(harness, 41)
    a, b = h.engines
    data = floats(200_000)
    # the link's history first: posted receives, until Early Close has cut one (whether the first message of a
    # path completes within its threshold is the draw's; the fourth here is cut, as most on this link are)
    regimes = []
    for tag in range(1, 6):
        out = np.zeros_like(data)
        _, first = h.wait([(0, a.send(h.addrs[1], data, now=h.now, tag=tag)),
                           (1, b.post_receive([(h.addrs[0], tag, out)], now=h.now))])
        regimes.append(first.reports[0].regime)
        if regimes[-1] in (Regime.EARLY, Regime.DEADLINE):
            break
    assert regimes[-1] in (Regime.EARLY, Regime.DEADLINE), regimes
    assert b._thresholds.history(h.addrs[0], data.nbytes) is not None
    # the same message again, nobody receiving: it is not cut, it is all buffered
    (sent,) = h.wait([(0, a.send(h.addrs[1], data, now=h.now, tag=10))])
    assert sent.report.close_reason in ("acked", "complete") and sent.report.delivered_fraction == 1.0
    out = np.zeros_like(data)
    (recv,) = h.wait([(1, b.post_receive([(h.addrs[0], 10, out)], now=h.now))])
    assert recv.reports[0].regime == Regime.COMPLETE and np.array_equal(out, data)


def test_a_receive_posted_mid_message_starts_the_groups_clock_at_its_posting(harness, floats):
    """A gather posted after one worker's push began (the PS was busy) and before another's: the clock starts at
    the posting, so the later worker gets its link's whole LT threshold, not what is left of the earlier one's."""
    h = harness(n_hosts=3, seed=42, config=Config(deadline_slack_s=0.005))
    h.links(rate=GBIT, delay_s=0.0005)
    a, c, rx = h.engines
    data = floats(250_000)
    for tag in (1, 2):  # both links' history: full deliveries
        outs = [np.zeros_like(data), np.zeros_like(data)]
        h.wait([(0, a.send(h.addrs[2], data, now=h.now, tag=tag)), (1, c.send(h.addrs[2], data, now=h.now, tag=tag)),
                (2, rx.post_receive([(h.addrs[0], tag, outs[0]), (h.addrs[1], tag, outs[1])], now=h.now))])
    lt = rx._thresholds.history(h.addrs[0], data.nbytes)
    assert lt is not None
    a.send(h.addrs[2], data, now=h.now, tag=3)  # worker A pushes at once...
    h.net.run(until=h.now + 3 * lt)  # ...and the PS posts its gather three LT thresholds later
    outs = [np.zeros_like(data), np.zeros_like(data)]
    hr = rx.post_receive([(h.addrs[0], 3, outs[0]), (h.addrs[1], 3, outs[1])], now=h.now)
    group = rx._matcher.groups[hr]
    assert group.t0 == group.posted  # not A's registration, long before
    hc = c.send(h.addrs[2], data, now=h.now, tag=3)  # worker B pushes right after the posting
    _, recv = h.wait([(1, hc), (2, hr)])
    assert [r.regime for r in recv.reports] == [Regime.COMPLETE, Regime.COMPLETE]
    assert np.array_equal(outs[1], data)


@pytest.mark.parametrize("reliable", [True, False])
def test_new_data_checks_a_reliable_receive_once_per_interval_and_every_other_one_each_time(
        harness, floats, monkeypatch, reliable):
    """``decide`` never closes a reliable flow before it is complete, so new data runs its Early Close check at
    most once per ``RELIABLE_CHECK_INTERVAL_S`` (a bulk receive ran it on every ``recvmmsg`` batch); an
    unreliable flow is checked on every arrival, and either completes on the datagram that completes it."""
    checks = []
    real = EarlyClose.check

    def spy(self, flow, now):
        checks.append((flow.reliable, now))
        return real(self, flow, now)

    monkeypatch.setattr(EarlyClose, "check", spy)
    h = harness(seed=5)
    h.links(rate=GBIT, delay_s=0.0005)
    a, b = h.engines
    data = floats(300_000)  # 1.2 MB: about 9.6 ms at 1 Gbit/s, 825 segments
    out = np.zeros_like(data)
    hr = b.post_receive([(h.addrs[0], 0, out)], now=h.now)
    hs = a.send(h.addrs[1], data, now=h.now, reliable=reliable)
    sent, recv = h.wait([(0, hs), (1, hr)])
    rep = recv.reports[0]
    assert rep.regime == Regime.COMPLETE and np.array_equal(out, data)
    assert rep.rtprop_s > 0  # the newest estimates the sender advertised, whenever the last check ran
    ours = [t for r, t in checks if r == reliable]
    segments = sent.report.packets_sent - sent.report.retransmitted_packets
    span = max(ours) - min(ours)
    if reliable:
        assert len(ours) <= span / ltp.engine.RELIABLE_CHECK_INTERVAL_S + 2 < segments / 20, (len(ours), span)
        assert all(t2 - t1 >= ltp.engine.RELIABLE_CHECK_INTERVAL_S for t1, t2 in zip(ours, ours[1:]))
    else:
        assert len(ours) >= segments - 1, (len(ours), segments)  # the completing datagram closes it unchecked
