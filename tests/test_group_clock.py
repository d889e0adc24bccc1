"""Where a receive group's Early Close clock starts (``ltp.early_close.GroupClock``).

``FIRST`` (the paper's): the group's first registration. ``ALL``: the registration that completes the group,
so a sender that starts late (a worker still computing) is waited for instead of expiring at the deadline,
and the tail after the last registration is still cut. Simulator tier, then the loopback socket tier.
"""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ltp
from ltp.config import Config
from ltp.early_close import GroupClock
from ltp.errors import LocalProtocolError
from ltp.matching import ReceiveMatcher
from ltp.receiver import RecvGroup
from ltp.regimes import Regime

GBIT = 125e6


def _learned(harness, seed, *, loss=0.0, n_senders=2):
    """Senders 0..n-1 and a receiver (the last host), each link's history learned by two full gathers."""
    h = harness(n_hosts=n_senders + 1, seed=seed, config=Config(deadline_slack_s=0.005))
    h.links(rate=GBIT, delay_s=0.0005, loss=loss)
    rx = h.engines[-1]
    data = np.random.default_rng(seed).standard_normal(60_000).astype(np.float32)
    for tag in (1, 2):
        outs = [np.zeros_like(data) for _ in range(n_senders)]
        h.wait([(i, h.engines[i].send(h.addrs[-1], data, now=h.now, tag=tag, reliable=not loss))
                for i in range(n_senders)]
               + [(n_senders, rx.post_receive([(h.addrs[i], tag, outs[i]) for i in range(n_senders)],
                                              now=h.now))])
    lt = rx._thresholds.history(h.addrs[0], data.nbytes)
    assert lt is not None
    return h, data, lt


@pytest.mark.parametrize("clock", ["first", "all"])
def test_a_sender_that_starts_late_is_waited_for_only_under_the_all_clock(harness, clock):
    """Sender 0 pushes at once, sender 1 ten LT thresholds later (computing). Under FIRST the group's
    deadline passes first and sender 1's slot expires with nothing; under ALL the clock starts at sender 1's
    registration and both messages arrive whole."""
    h, data, lt = _learned(harness, 51)
    a, c, rx = h.engines
    outs = [np.zeros_like(data), np.zeros_like(data)]
    hr = rx.post_receive([(h.addrs[0], 3, outs[0]), (h.addrs[1], 3, outs[1])], now=h.now, timeout=5.0, clock=clock)
    group = rx._matcher.groups[hr]
    a.send(h.addrs[2], data, now=h.now, tag=3)
    h.net.run(until=h.now + 10 * lt)
    late = h.now
    hc = c.send(h.addrs[2], data, now=h.now, tag=3)
    (recv,) = h.wait([(2, hr)])
    regimes = [r.regime for r in recv.reports]
    if clock == "first":
        assert regimes[1] == Regime.TIMEOUT and recv.reports[1].received_bytes == 0
        assert "deadline" in recv.reports[1].cause
    else:
        assert regimes == [Regime.COMPLETE, Regime.COMPLETE]
        assert np.array_equal(outs[0], data) and np.array_equal(outs[1], data)
        assert group.t0 >= late  # the late sender's registration, not the first one
        h.wait([(1, hc)])


def test_under_the_all_clock_the_tail_after_the_last_registration_is_still_cut(harness):
    """ALL moves where the clock starts, not whether Early Close runs: the late sender's link loses 60 % of its
    data (above STRETCH_MAX_LOSS), and its message is closed early or at the deadline a few LT thresholds after
    it registered, not at the 30 s timeout; the early sender's message, waited for meanwhile, is whole."""
    h, data, lt = _learned(harness, 52, loss=0.3)
    a, c, rx = h.engines
    outs = [np.zeros_like(data), np.zeros_like(data)]
    hr = rx.post_receive([(h.addrs[0], 3, outs[0]), (h.addrs[1], 3, outs[1])], now=h.now, timeout=30.0,
                         clock="all")
    a.send(h.addrs[2], data, now=h.now, tag=3)
    h.net.run(until=h.now + 5 * lt)
    h.link(1, 2, rate=GBIT, delay_s=0.0005, loss=0.6)
    late = h.now
    c.send(h.addrs[2], data, now=h.now, tag=3)
    (recv,) = h.wait([(2, hr)])
    assert recv.reports[0].regime == Regime.COMPLETE
    assert recv.reports[1].regime in (Regime.EARLY, Regime.DEADLINE)
    assert h.now - late < 5 * lt  # Early Close ended it, not the 30 s timeout
    for r, out in zip(recv.reports, outs):
        assert 0 < r.delivered_fraction <= 1.0
        assert sum(b - a for a, b in r.bubbles) == r.total_bytes - r.received_bytes


def test_under_the_all_clock_a_peer_that_never_registers_ends_the_group_at_its_timeout(harness):
    """No slot expires at a deadline while the clock has not started: the silent peer's slot ends at the
    caller's timeout, saying so, and the registered message is received whole meanwhile."""
    h, data, lt = _learned(harness, 53)
    a, _, rx = h.engines
    outs = [np.zeros_like(data), np.zeros_like(data)]
    hr = rx.post_receive([(h.addrs[0], 3, outs[0]), (h.addrs[1], 3, outs[1])], now=h.now, timeout=0.5,
                         clock="all")
    posted = rx._matcher.groups[hr].posted
    a.send(h.addrs[2], data, now=h.now, tag=3)
    (recv,) = h.wait([(2, hr)])
    assert recv.reports[0].regime == Regime.COMPLETE and np.array_equal(outs[0], data)
    assert recv.reports[1].regime == Regime.TIMEOUT and recv.reports[1].received_bytes == 0
    assert "timeout" in recv.reports[1].cause
    assert h.now - posted >= 0.5 - 1e-9
    assert rx._matcher.groups.get(hr) is None or rx._matcher.groups[hr].t0 is None


def test_a_message_that_registered_before_the_gather_counts_under_the_all_clock(harness):
    """A message already buffered when the gather is posted (an unexpected one) fills its slot at once; the clock
    starts when the other peer registers, at its registration."""
    h, data, lt = _learned(harness, 54)
    a, c, rx = h.engines
    ha = a.send(h.addrs[2], data, now=h.now, tag=3)
    h.wait([(0, ha)])
    outs = [np.zeros_like(data), np.zeros_like(data)]
    hr = rx.post_receive([(h.addrs[0], 3, outs[0]), (h.addrs[1], 3, outs[1])], now=h.now, clock="all")
    group = rx._matcher.groups[hr]
    assert group.t0 is None
    h.net.run(until=h.now + 3 * lt)
    late = h.now
    c.send(h.addrs[2], data, now=h.now, tag=3)
    (recv,) = h.wait([(2, hr)])
    assert [r.regime for r in recv.reports] == [Regime.COMPLETE, Regime.COMPLETE]
    assert np.array_equal(outs[0], data) and np.array_equal(outs[1], data)
    assert group.t0 >= late


def test_a_clock_that_is_not_a_group_clock_names_the_choices(harness):
    h = harness()
    with pytest.raises(LocalProtocolError, match="'first', 'all'"):
        h.engines[1].post_receive([(h.addrs[0], 1, np.zeros(10, np.uint8))], now=0.0, clock="last")
    assert GroupClock("all") is GroupClock.ALL and GroupClock.FIRST == "first"


def _slot(group, flow_start=None, report=False):
    s = types.SimpleNamespace(group=group, flow=None, report=None)
    if flow_start is not None:
        s.flow = types.SimpleNamespace(start=flow_start)
    if report:
        s.report = object()
    group.slots.append(s)
    return s


@settings(max_examples=300, deadline=None)
@given(posted=st.floats(0, 10), slots=st.lists(st.tuples(st.sampled_from(["waiting", "flow", "ended"]),
                                                          st.floats(0, 10)), min_size=1, max_size=6),
       now=st.one_of(st.none(), st.floats(0, 20)))
def test_the_all_clock_starts_once_no_slot_waits_at_the_latest_registration(posted, slots, now):
    """``ReceiveMatcher.start_clock``: started exactly when no slot waits for a message; then at the latest
    registration among the slots (or the caller's ``now``, when a slot ended unfilled), never before the
    posting, and only once."""
    group = RecvGroup(1, posted, None, GroupClock.ALL)
    for kind, start in slots:
        _slot(group, start if kind == "flow" else None, report=kind == "ended")
    waiting = any(kind == "waiting" for kind, _ in slots)
    started = ReceiveMatcher.start_clock(group, now)
    assert started is (not waiting)
    if waiting:
        assert group.t0 is None
    else:
        assert group.t0 == max([posted] + [s for kind, s in slots if kind == "flow"] + ([] if now is None else [now]))
        assert ReceiveMatcher.start_clock(group, now) is False  # once
    first = RecvGroup(2, posted, None)  # FIRST groups start in bind(), never here
    _slot(first, 1.0)
    assert ReceiveMatcher.start_clock(first) is False and first.t0 is None


async def test_gather_with_the_all_clock_over_loopback_waits_for_a_late_worker():
    """Real sockets: with a short slack, a worker that sends 0.3 s after the others is received whole under
    ``clock="all"``; the reports come back in peer order and the misuse error names the choices."""
    ps = await ltp.open_endpoint(("127.0.0.1", 0), config=Config(deadline_slack_s=0.002))
    workers = [await ltp.open_endpoint(("127.0.0.1", 0)) for _ in range(3)]
    try:
        data = [np.full(100_000, i + 1, np.float32) for i in range(3)]
        for it in range(2):  # the second round runs on learned link histories (short LT thresholds)
            outs = [np.zeros(100_000, np.float32) for _ in range(3)]

            async def late(w, d, tag=it):
                await asyncio.sleep(0.3)
                return await w.send(ps.local_addr, d, tag=tag)

            reps, *_ = await asyncio.gather(
                ps.gather([w.local_addr for w in workers], outs, tag=it, timeout=10, clock="all"),
                workers[0].send(ps.local_addr, data[0], tag=it), workers[1].send(ps.local_addr, data[1], tag=it),
                late(workers[2], data[2]))
            assert [r.regime for r in reps] == ["complete"] * 3
            assert all(np.array_equal(o, d) for o, d in zip(outs, data))
        with pytest.raises(LocalProtocolError, match="clock="):
            await ps.gather([workers[0].local_addr], [np.zeros(4, np.uint8)], tag=9, clock="last")
    finally:
        for e in [ps, *workers]:
            await e.close()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 4),
       starts=st.lists(st.floats(0.0, 0.05), min_size=4, max_size=4),
       losses=st.lists(st.sampled_from([0.0, 0.01, 0.1, 0.3]), min_size=4, max_size=4),
       sizes=st.lists(st.integers(1_000, 150_000), min_size=4, max_size=4),
       silent=st.sampled_from([None, 0, 1]))
def test_under_the_all_clock_nothing_is_cut_before_the_last_registration(seed, n, starts, losses, sizes, silent):
    """Senders that start at random times over links with random loss, one perhaps never sending: the gather
    always ends (by its timeout at the latest); no flow is closed early or at a deadline before the group's
    clock started, which is at the last registration; every byte reported received is the sender's."""
    from conftest import SimHarness

    h = SimHarness(n_hosts=n + 1, seed=seed, config=Config(deadline_slack_s=0.005))
    rx = h.engines[-1]
    for i in range(n):
        h.link(i, n, rate=GBIT, delay_s=0.0005, loss=losses[i])
        h.link(n, i, rate=GBIT, delay_s=0.0005)
    closes = []
    real = rx._close_rx

    def spy(flow, now, regime, *a, **kw):
        closes.append((regime, now, flow.slot.group.t0 if flow.slot is not None else None))
        return real(flow, now, regime, *a, **kw)

    rx._close_rx = spy
    data = [np.random.default_rng(seed + i).integers(1, 255, sizes[i], dtype=np.uint8) for i in range(n)]
    outs = [np.zeros(sizes[i], np.uint8) for i in range(n)]
    timeout = 2.0
    hr = rx.post_receive([(h.addrs[i], 7, outs[i]) for i in range(n)], now=h.now, timeout=timeout, clock="all")
    group = rx._matcher.groups[hr]
    posted = h.now
    for i in sorted(range(n), key=lambda k: starts[k]):
        if i == silent:
            continue
        h.net.run(until=posted + starts[i])
        h.engines[i].send(h.addrs[n], data[i], now=h.now, tag=7)
    (recv,) = h.wait([(n, hr)], timeout=timeout + 1.0)
    assert h.now <= posted + timeout + 0.01  # ended, at the timeout at the latest (one timer turn)
    for regime, at, t0 in closes:
        if regime in (Regime.EARLY, Regime.DEADLINE):
            assert t0 is not None and at >= t0
    if silent is None:
        assert group.t0 is not None and group.t0 >= posted + max(starts[:n]) - 1e-9
    else:
        assert group.t0 is None or group.t0 >= posted + timeout - 1e-9  # not before the silent slot ended
        assert recv.reports[silent].regime == Regime.TIMEOUT and recv.reports[silent].received_bytes == 0
    for i, r in enumerate(recv.reports):
        got = np.ones(sizes[i], bool)
        for a, b in r.bubbles:
            got[a:b] = False
        assert np.array_equal(outs[i][got], data[i][got])
        assert int(got.sum()) == r.received_bytes
