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


def test_clean_advancing_flow_is_not_cut_at_the_lt_threshold():
    # 85% in, no gap, still arriving, first pass not over: a slow sender, not a long tail
    regime, wake = decide(0.011, fraction=0.85, gaps=False, first_pass_done=False, stall_at=0.016,
                          hard_deadline=0.120, **BASE)
    assert regime is None and wake == 0.016
    # a gap alone is not enough either while new data is still arriving (the tail has not started)
    regime, _ = decide(0.011, fraction=0.85, gaps=True, first_pass_done=False, stall_at=0.016,
                       hard_deadline=0.120, **BASE)
    assert regime is None


def test_long_tail_is_cut_early_first_pass_done_or_stalled():
    assert decide(0.011, fraction=0.85, gaps=True, first_pass_done=True, stall_at=0.016,
                  hard_deadline=0.120, **BASE)[0] == EARLY
    assert decide(0.017, fraction=0.85, gaps=False, first_pass_done=False, stall_at=0.016,
                  hard_deadline=0.120, **BASE)[0] == EARLY
    # critical segments missing: never early
    kw = dict(BASE, critical_ok=False)
    assert decide(0.011, fraction=0.85, gaps=True, first_pass_done=True, stall_at=0.016,
                  hard_deadline=0.120, **kw)[0] is None


def test_deadline_binds_flows_with_gaps_or_stalled_but_stretches_clean_ones_to_the_hard_deadline():
    common = dict(fraction=0.5, first_pass_done=False, hard_deadline=0.120, **BASE)
    assert decide(0.041, gaps=True, stall_at=0.045, **common) == (DEADLINE, None)
    assert decide(0.046, gaps=False, stall_at=0.045, **common) == (DEADLINE, None)
    assert decide(0.041, gaps=False, stall_at=0.045, **common) == (None, 0.045)
    assert decide(0.119, gaps=False, stall_at=0.125, **common) == (None, 0.120)
    assert decide(0.120, gaps=False, stall_at=0.125, **common) == (DEADLINE, None)
    # without a hard deadline the group deadline stays hard
    assert decide(0.041, fraction=0.5, gaps=False, first_pass_done=False, stall_at=0.045, **BASE) == \
        (DEADLINE, None)


@settings(max_examples=300, deadline=None)
@given(now=st.floats(0, 0.2), fraction=st.floats(0, 0.999), gaps=st.booleans(), first=st.booleans(),
       stall=st.floats(0, 0.2), hard=st.floats(0.04, 0.2), crit=st.booleans())
def test_property_a_cleanly_advancing_flow_is_only_cut_at_the_hard_deadline(now, fraction, gaps, first, stall,
                                                                             hard, crit):
    kw = dict(BASE, critical_ok=crit)
    regime, wake = decide(now, fraction=fraction, gaps=gaps, first_pass_done=first, stall_at=stall,
                          hard_deadline=hard, **kw)
    advancing = now < stall
    if regime is not None and advancing and not gaps and not first:
        assert regime == DEADLINE and now >= hard
    if regime == EARLY:
        assert crit and fraction >= 0.8 and now >= 0.010 and (first or not advancing)
    if regime is None and wake is not None:
        assert wake > now  # the next decision point is in the future (no timer livelock)


def test_stall_window_floors_and_scales():
    assert stall_window(0.0, None) == STALL_MIN_S
    assert stall_window(0.010, None) == pytest.approx(STALL_RTPROPS * 0.010)
    assert stall_window(0.0, 0.004) == pytest.approx(STALL_GAPS * 0.004)


# ---------------------------------------------------------------- the evidence
def test_flow_progress_gaps_first_pass_and_critical_segments_left_out():
    crit = np.zeros(10, np.uint8)
    crit[[0, 9]] = 1  # header and the last segment are critical: sent first
    p = FlowProgress(10, crit)
    bm = np.zeros(10, np.uint8)
    bm[[0, 9]] = 1
    assert p.observe(bm, 2) == (False, False)  # critical tail received first is not a gap
    bm[1:5] = 1
    assert p.observe(bm, 6) == (False, False)
    bm[6] = 1  # segment 5 missing below 6: a loss
    assert p.observe(bm, 7) == (True, False)
    bm[7:9] = 1  # last normal segment in: only retransmissions can follow
    assert p.observe(bm, 9) == (True, True)
    bm[5] = 1  # the retransmission repaired the gap
    assert p.observe(bm, 10) == (False, True)
    q = FlowProgress(4, None)
    assert q.observe(np.array([1, 1, 0, 0], np.uint8), 2) == (False, False)
    assert FlowProgress(4, None).observe(np.array([1, 0, 0, 1], np.uint8), 2) == (True, True)


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
