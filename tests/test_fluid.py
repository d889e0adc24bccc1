"""The max-min-fair fluid simulator: analytic cases, pauses, invariants."""

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ltp_ps.schedules.fluid import (DeadlockError, Flow, FluidNetwork, RotatingPauses, StaticPauses, allocate,
                                    simulate)

GBIT = 1e9
MB = 1e6


def close(a, b, rel=0.01):
    return abs(a - b) <= rel * abs(b)


def test_one_flow():
    net = FluidNetwork.uniform([2], 10 * GBIT)
    r = simulate(net, [Flow("x", "h0", "h1", 100 * MB)])
    assert close(r.completion_s, 100 * MB * 8 / (10 * GBIT))


def test_one_flow_with_latency():
    net = FluidNetwork.uniform([2], 10 * GBIT, latency_s=125e-6)
    r = simulate(net, [Flow("x", "h0", "h1", 1 * MB)])
    assert close(r.completion_s, 8e-4 + 125e-6)


@pytest.mark.parametrize("n", [2, 3, 7])
def test_n_flows_share_a_sender_link(n):
    net = FluidNetwork.uniform([n + 1], 1 * GBIT)
    r = simulate(net, [Flow(i, "h0", f"h{i}", 10 * MB) for i in range(1, n + 1)])
    for i in range(1, n + 1):
        assert close(r.finish_s[i], n * 10 * MB * 8 / GBIT)


def test_incast_shares_receiver_link():
    net = FluidNetwork.uniform([5], 1 * GBIT)
    r = simulate(net, [Flow(i, f"h{i}", "h0", 10 * MB) for i in range(1, 5)])
    assert close(r.completion_s, 4 * 0.08)


def test_max_min_not_equal_split():
    # h0 sends to h1 and h2; h3 also sends to h2.  Max-min: h0's two flows get 1/2 each of h0's
    # up link; h3->h2 gets the rest of h2's down link (1/2).  After the short flows end, rates change.
    net = FluidNetwork.uniform([4], 8 * GBIT)  # 1 GB/s
    flows = [Flow("a", "h0", "h1", 1e9), Flow("b", "h0", "h2", 0.5e9), Flow("c", "h3", "h2", 2e9)]
    r = simulate(net, flows)
    # phase 1: all at 0.5 GB/s until b is done at t=1 (a sent 0.5, c sent 0.5)
    assert close(r.finish_s["b"], 1.0)
    # phase 2: a at 1 GB/s (0.5 left -> t=1.5); c at 1 GB/s (1.5 left -> t=2.5)
    assert close(r.finish_s["a"], 1.5)
    assert close(r.finish_s["c"], 2.5)


def test_oversubscribed_rack_uplink():
    # 4 hosts per rack at 10 Gbit/s, 4:1 -> 10 Gbit/s uplink shared by four cross-rack flows
    net = FluidNetwork.uniform([4, 4], 10 * GBIT, oversubscription=4)
    flows = [Flow(i, f"h{i}", f"h{i + 4}", 10 * MB) for i in range(4)]
    r = simulate(net, flows)
    assert close(r.completion_s, 4 * 10 * MB * 8 / (10 * GBIT))
    # inside the rack there is no oversubscription
    r2 = simulate(net, [Flow(i, f"h{i}", f"h{(i + 1) % 4}", 10 * MB) for i in range(4)])
    assert close(r2.completion_s, 10 * MB * 8 / (10 * GBIT))


@pytest.mark.parametrize("hops", [1, 3, 6])
def test_store_and_forward_chain(hops):
    L = 1e-3
    net = FluidNetwork.uniform([hops + 1], 8 * GBIT, latency_s=L)
    flows = [Flow(i, f"h{i}", f"h{i + 1}", 1e9, after=[i - 1] if i else []) for i in range(hops)]
    r = simulate(net, flows)
    assert close(r.completion_s, hops * (1.0 + L))
    for i in range(hops):
        assert close(r.finish_s[i], (i + 1) * (1.0 + L))


@pytest.mark.parametrize("n", [2, 4, 9])
def test_pipelined_chain_is_hoplite_t1d(n):
    """Hoplite App. A: a streamed chain of n objects costs S/B + (n-1) L."""
    S, B, L = 1 * MB, 10 * GBIT, 125e-6
    net = FluidNetwork.uniform([n], B, latency_s=L)
    flows = [Flow(i, f"h{i}", f"h{i + 1}", S, stream_from=(i - 1) if i else None) for i in range(n - 1)]
    r = simulate(net, flows)
    assert close(r.completion_s, S * 8 / B + (n - 1) * L)


def test_stream_capped_by_slow_upstream():
    # upstream h0->h1 shares h0 with another flow (half rate); the streamed hop h1->h2 cannot go faster
    net = FluidNetwork.uniform([4], 8 * GBIT)
    flows = [Flow("up", "h0", "h1", 1e9), Flow("other", "h0", "h3", 1e9),
             Flow("down", "h1", "h2", 1e9, stream_from="up")]
    r = simulate(net, flows)
    assert close(r.finish_s["up"], 2.0)
    assert close(r.finish_s["down"], 2.0)


def test_tree_reduce_then_broadcast():
    # 3 leaves send to an aggregator (incast), which then sends to the root; root broadcasts back
    net = FluidNetwork.uniform([5], 8 * GBIT)
    S = 1e9
    red = [Flow(("r", i), f"h{i}", "h0", S) for i in (1, 2, 3)]
    up = Flow("agg", "h0", "h4", S, after=[("r", i) for i in (1, 2, 3)])
    down = Flow("bc", "h4", "h0", S, after=["agg"])
    bc = [Flow(("b", i), "h0", f"h{i}", S, after=["bc"]) for i in (1, 2, 3)]
    r = simulate(net, red + [up, down] + bc)
    assert close(r.finish_s["agg"], 3 + 1)
    assert close(r.completion_s, 3 + 1 + 1 + 3)


def test_same_host_flow_is_free_and_dependencies_hold():
    net = FluidNetwork.uniform([2], GBIT, latency_s=1e-3)
    flows = [Flow("local", "h0", "h0", 1e12), Flow("x", "h0", "h1", 1e6, after=["local"])]
    r = simulate(net, flows)
    assert r.finish_s["local"] == 0.0
    assert close(r.completion_s, 8e-3 + 1e-3)


def test_static_pause_delays_exactly():
    net = FluidNetwork.uniform([2], 8 * GBIT)
    r = simulate(net, [Flow("x", "h0", "h1", 1e9)], pauses=StaticPauses([(0.25, 0.75, "h0")]))
    assert close(r.completion_s, 1.5)
    # pausing the receiver's host only stops what it sends
    r = simulate(net, [Flow("x", "h0", "h1", 1e9)], pauses=StaticPauses([(0.25, 0.75, "h1")]))
    assert close(r.completion_s, 1.0)


def test_rotating_pauses_are_seeded():
    hosts = [f"h{i}" for i in range(8)]
    a = RotatingPauses(hosts, 2, 0.1, random.Random(7))
    b = RotatingPauses(hosts, 2, 0.1, random.Random(7))
    seq_a = [a.paused(0.1 * i + 0.05) for i in range(20)]
    assert seq_a == [b.paused(0.1 * i + 0.05) for i in range(20)]
    assert all(len(s) == 2 for s in seq_a) and len(set(seq_a)) > 3
    assert close(a.next_change(0.05), 0.1)
    net = FluidNetwork.uniform([8], 8 * GBIT)
    flows = [Flow(i, f"h{i}", f"h{(i + 1) % 8}", 1e9) for i in range(8)]
    r1 = simulate(net, flows, pauses=RotatingPauses(hosts, 2, 0.1, random.Random(3)))
    r2 = simulate(net, flows, pauses=RotatingPauses(hosts, 2, 0.1, random.Random(3)))
    assert r1.finish_s == r2.finish_s
    # each host is paused 1/4 of the time on average: completion well above 1 s, below a total stall
    assert 1.05 < r1.completion_s < 3.0
    assert r1.peak_link_util <= 1 + 1e-9


def test_errors_name_the_problem():
    net = FluidNetwork.uniform([2], GBIT)
    with pytest.raises(DeadlockError, match="cycle"):
        simulate(net, [Flow("a", "h0", "h1", 1, after=["b"]), Flow("b", "h1", "h0", 1, after=["a"])])
    with pytest.raises(DeadlockError, match="unknown flow"):
        simulate(net, [Flow("a", "h0", "h1", 1, after=["zz"])])
    with pytest.raises(DeadlockError, match="progress"):
        simulate(net, [Flow("a", "h0", "h1", 1e6)], pauses=StaticPauses([(0, math.inf, "h0")]))
    with pytest.raises(ValueError, match="unknown host"):
        simulate(net, [Flow("a", "h0", "h9", 1)])
    with pytest.raises(ValueError, match="different size"):
        simulate(net, [Flow("a", "h0", "h1", 1), Flow("b", "h1", "h0", 2, stream_from="a")])


# --------------------------------------------------------------------------- properties

@st.composite
def allocation_problem(draw):
    L = draw(st.integers(1, 8))
    caps = draw(st.lists(st.floats(0.0, 100.0), min_size=L, max_size=L))
    F = draw(st.integers(1, 12))
    rows = []
    for _ in range(F):
        k = draw(st.integers(1, min(4, L)))
        rows.append(draw(st.lists(st.integers(0, L - 1), min_size=k, max_size=k, unique=True)) + [-1] * (4 - k))
    return np.array(caps), np.array(rows, dtype=np.int64)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(allocation_problem())
def test_allocation_is_feasible_and_max_min(problem):
    caps, fl = problem
    rates = allocate(caps, fl)
    load = np.zeros(len(caps))
    for i, row in enumerate(fl):
        for li in row[row >= 0]:
            load[li] += rates[i]
    assert (rates >= -1e-12).all()
    assert (load <= caps * (1 + 1e-9) + 1e-9).all(), "a link over capacity"
    # every flow has a bottleneck: a saturated link on its path where it has the largest rate
    for i, row in enumerate(fl):
        path = row[row >= 0]
        ok = False
        for li in path:
            if load[li] >= caps[li] * (1 - 1e-9) - 1e-9:
                users = [j for j, r in enumerate(fl) if li in r]
                if rates[i] >= max(rates[j] for j in users) - 1e-9:
                    ok = True
        assert ok, f"flow {i} (rate {rates[i]}) has no bottleneck: not work conserving / not max-min"


@st.composite
def flow_dag(draw):
    n_hosts = draw(st.integers(2, 6))
    racks = draw(st.sampled_from([[n_hosts], [1, n_hosts - 1] if n_hosts > 1 else [n_hosts]]))
    n = draw(st.integers(1, 10))
    flows = []
    for i in range(n):
        s = draw(st.integers(0, n_hosts - 1))
        d = draw(st.integers(0, n_hosts - 1))
        after = draw(st.lists(st.integers(0, i - 1), max_size=2, unique=True)) if i else []
        size = draw(st.floats(0.0, 1e6))
        flows.append(Flow(i, f"h{s}", f"h{d}", size, after=after))
    over = draw(st.sampled_from([1.0, 2.0, 4.0]))
    return FluidNetwork.uniform(racks, 8e6, oversubscription=over, latency_s=draw(st.sampled_from([0.0, 1e-3]))), flows


@settings(max_examples=150, deadline=None, derandomize=True)
@given(flow_dag())
def test_simulation_respects_dependencies_and_capacity(problem):
    net, flows = problem
    r = simulate(net, flows)
    assert r.peak_link_util <= 1 + 1e-6
    for f in flows:
        for d in f.after:
            assert r.start_s[f.name] >= r.finish_s[d] - 1e-12
        # no flow beats its own line rate
        if f.src != f.dst and f.nbytes > 1:  # below 1e-6 B a flow counts as empty
            assert r.finish_s[f.name] - r.start_s[f.name] >= f.nbytes * 8 / 8e6 * (1 - 1e-6)
    assert r.completion_s == max(r.finish_s.values())
