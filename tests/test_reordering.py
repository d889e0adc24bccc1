"""A path's reordering state (ltp/reordering.py): what wrong loss verdicts teach loss detection, and when it forgets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ltp.reordering import (REORDER_PERSIST_RECOVERIES, REORDER_WINDOW_MULT_MAX, REORDER_WINDOW_RTPROPS,
                            Reordering)
from ltp_ext.constants import PACKET_REORDER_THRESHOLD

RTPROP = 0.001


def test_a_path_starts_in_order():
    r = Reordering()
    assert (r.seen, r.mult, r.spurious) == (False, 1, 0)
    assert r.packet_threshold == PACKET_REORDER_THRESHOLD
    assert r.window(RTPROP, 0.002) == pytest.approx(REORDER_WINDOW_RTPROPS * RTPROP)
    assert r.window(RTPROP, None) == pytest.approx(REORDER_WINDOW_RTPROPS * RTPROP)


def test_a_wrong_verdict_turns_the_packet_rule_off_and_widens_the_window_once_a_round_trip():
    r = Reordering()
    r.on_spurious(3, now=1.0, srtt=0.010)
    assert r.seen and r.packet_threshold == 0 and r.mult == 2 and r.spurious == 3
    r.on_spurious(1, now=1.005, srtt=0.010)  # the same round trip: counted, not widened again
    assert r.mult == 2 and r.spurious == 4
    r.on_spurious(1, now=1.010, srtt=0.010)
    assert r.mult == 3
    assert r.window(RTPROP, 0.010) == pytest.approx(3 * REORDER_WINDOW_RTPROPS * RTPROP)


def test_the_widened_window_stops_at_the_smoothed_rtt_and_at_its_multiple_bound():
    r = Reordering()
    for k in range(3 * REORDER_WINDOW_MULT_MAX):
        r.on_spurious(1, now=float(k), srtt=0.5)
    assert r.mult == REORDER_WINDOW_MULT_MAX
    base = REORDER_WINDOW_RTPROPS * RTPROP
    assert r.window(RTPROP, 1.0) == pytest.approx(REORDER_WINDOW_MULT_MAX * base)
    assert r.window(RTPROP, 2 * base) == pytest.approx(2 * base)  # the SRTT cap
    assert r.window(RTPROP, base / 10) == pytest.approx(base)  # never below the in-order window


def test_loss_episodes_without_a_wrong_verdict_restore_order():
    r = Reordering()
    r.on_loss_episode()  # in order: nothing to forget
    assert not r.seen
    r.on_spurious(2, now=0.0, srtt=0.001)
    for _ in range(REORDER_PERSIST_RECOVERIES - 1):
        r.on_loss_episode()
    assert r.seen and r.packet_threshold == 0
    r.on_spurious(1, now=0.5, srtt=0.001)  # a new wrong verdict: the count starts again
    for _ in range(REORDER_PERSIST_RECOVERIES - 1):
        r.on_loss_episode()
    assert r.seen
    r.on_loss_episode()
    assert not r.seen and r.mult == 1 and r.packet_threshold == PACKET_REORDER_THRESHOLD
    assert r.spurious == 3  # the total stays


@pytest.mark.parametrize("n", [0, -1])
def test_on_spurious_needs_a_wrong_verdict(n):
    with pytest.raises(ValueError, match="n > 0"):
        Reordering().on_spurious(n, now=0.0, srtt=None)


@given(st.lists(st.one_of(st.tuples(st.just("spurious"), st.integers(1, 50), st.floats(0, 10)),
                          st.tuples(st.just("episode"), st.just(0), st.just(0.0))), max_size=80),
       st.floats(1e-6, 1.0), st.one_of(st.none(), st.floats(1e-6, 1.0)))
def test_the_state_stays_within_its_bounds(events, rtprop, srtt):
    """Whatever the order of wrong verdicts and loss episodes: the window lies between the in-order window and
    the larger of it and min(REORDER_WINDOW_MULT_MAX multiples, SRTT); the packet rule is off exactly while
    reordering is seen; the count of wrong verdicts only grows."""
    r = Reordering()
    now = 0.0
    total = 0
    for kind, n, dt in events:
        if kind == "spurious":
            now += dt
            r.on_spurious(n, now=now, srtt=srtt)
            total += n
        else:
            r.on_loss_episode()
        base = REORDER_WINDOW_RTPROPS * rtprop
        w = r.window(rtprop, srtt)
        assert 1 <= r.mult <= REORDER_WINDOW_MULT_MAX
        assert w >= base - 1e-15
        assert w <= max(base, r.mult * base if srtt is None else min(r.mult * base, srtt)) + 1e-15
        assert (r.packet_threshold == 0) == r.seen
        assert r.seen or r.mult == 1
        assert r.spurious == total


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_learn_reordering_must_be_a_bool(bad):
    from ltp.config import Config
    from ltp.errors import LocalProtocolError

    assert Config().learn_reordering is False  # off by default (docs/performance.md, "Session 51")
    with pytest.raises(LocalProtocolError, match="learn_reordering=.*pass True or False"):
        Config(learn_reordering=bad)
