"""The alpha-beta cost model: RSGCM's Table 4, eq 17-18, and the generic ring pricer with shared NICs."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp_ps.schedules import costmodel as cm
from ltp_ps.schedules.costmodel import Link, Network, schedule_seconds, step_seconds

# The paper's simulation setting (section 4.1): NVLink-like tau_L = 9 us, tau_B = 39 us/MB, D = 32 MB.
TL, TB, D = 9.0, 39.0, 32.0  # us, us/MB, MB


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-12)


# ---------------------------------------------------------------- Table 4

@pytest.mark.parametrize("N", [3, 4, 8, 9, 16, 25])
def test_ring_allreduce_is_table4(N):
    c = cm.ring_allreduce(D, N, TL, TB)
    assert c.latency == approx(2 * TL * (N - 1))
    assert c.bandwidth == approx(2 * TB * (N - 1) * D / N)
    # Total column: F1(D, N) - 2 F3(D)
    assert c.total == approx(cm.F1(D, N, TL, TB) - 2 * cm.F3(D, TL, TB))


def test_ring_allreduce_by_hand():
    # N = 9: latency 2*9us*8 = 144 us; bandwidth 2*39*8*32/9 = 2218.666.. us
    c = cm.ring_allreduce(32.0, 9, 9.0, 39.0)
    assert c.latency == approx(144.0)
    assert c.bandwidth == approx(2 * 39 * 8 * 32 / 9)
    assert c.total == approx(144.0 + 19968 / 9)


@pytest.mark.parametrize("i,j", [(3, 3), (2, 4), (4, 4), (3, 5), (5, 5)])
def test_torus_and_mesh_are_table4(i, j):
    t = cm.torus_2d(D, i, j, TL, TB)
    assert t.latency == approx(cm.ring_allreduce(D, i, TL, TB).latency + cm.ring_allreduce(D, j, TL, TB).latency)
    assert t.total == approx(cm.F1(D, i, TL, TB) + cm.F1(D, j, TL, TB) - 4 * cm.F3(D, TL, TB))
    m = cm.mesh_2d(D, i, j, TL, TB)
    assert m.latency == approx(2 * max(2 * TL * (k - 1) for k in (i, j)))
    assert m.bandwidth == approx(2 * max(2 * TB * (k - 1) * (D / 2) / k for k in (i, j)))
    assert m.total == approx(2 * cm.F1(D / 2, max(i, j), TL, TB) - 4 * cm.F3(D / 2, TL, TB))


@pytest.mark.parametrize("N", [2, 5, 8, 9, 16])
def test_other_table4_rows(N):
    lg = math.ceil(math.log2(N))
    assert cm.butterfly(D, N, TL, TB).total == approx(cm.F2(D, TL, TB) * lg)
    assert cm.recursive_tree(D, N, TL, TB).total == approx(2 * cm.F2(D, TL, TB) * lg)
    for u in [u for u in range(1, N + 1) if N % u == 0]:
        h = cm.hybrid(D, N, u, TL, TB)
        assert h.total == approx(sum(cm.F1(D, k, TL, TB) for k in (u, N // u)) - 4 * cm.F3(D, TL, TB)
                                 + cm.F2(D, TL, TB))
    # 2D-HRA follows the table's latency and bandwidth columns
    h = cm.hra_2d(D, 3, 3, 2, TL, TB)
    assert h.latency == approx(sum(2 * TL * (k - 1) + TL for k in (3, 3, 2)))
    assert h.bandwidth == approx(sum(2 * TB * (k - 1) * D / k + TB * D for k in (3, 3, 2)))


def test_closed_forms_reject_misuse():
    with pytest.raises(ValueError, match="positive device count"):
        cm.ring_allreduce(D, 0, TL, TB)
    with pytest.raises(ValueError, match="u to divide N"):
        cm.hybrid(D, 9, 2, TL, TB)


# ---------------------------------------------------------------- eq 17-18: 2D-mesh vs double ring

def test_double_ring_is_eq17():
    N = 9
    expected = 2 * TL * N - 2 * TB * (D / 2) / N - 2 * (TL - TB * D / 2)
    assert cm.double_ring(D, N, TL, TB).total == approx(expected)


def test_eq16_mesh_on_square():
    r = 3
    expected = 2 * (2 * TL * r - 2 * TB * (D / 2) / r) - 4 * (TL - TB * D / 2)
    assert cm.mesh_2d(D, r, r, TL, TB).total == approx(expected)


@pytest.mark.parametrize("side", [3, 4, 5])
def test_eq18_crossover(side):
    """D = 32 MB on a side x side matrix: 2D-mesh wins iff tau_L / tau_B > D / (2N)."""
    N = side * side
    # tau_L/tau_B = 0.1/0.01 = 10 MB: above D/(2N) for N = 9, 16, 25 -> 2D-mesh is faster
    assert cm.mesh_2d(D, side, side, 0.1, 0.01).total < cm.double_ring(D, N, 0.1, 0.01).total
    # tau_L/tau_B = 0.01/0.1 = 0.1 MB: below the boundary -> double ring is faster
    assert cm.double_ring(D, N, 0.01, 0.1).total < cm.mesh_2d(D, side, side, 0.01, 0.1).total
    # exactly at the boundary they tie
    tb = 0.05
    tl = tb * D / (2 * N)
    assert cm.mesh_2d(D, side, side, tl, tb).total == pytest.approx(cm.double_ring(D, N, tl, tb).total, rel=1e-9)


# ---------------------------------------------------------------- the generic pricer reproduces Table 4

def _rows(i, j):
    return [tuple(r * j + c for c in range(j)) for r in range(i)]


def _cols(i, j):
    return [tuple(r * j + c for r in range(i)) for c in range(j)]


@pytest.mark.parametrize("i,j", [(3, 3), (3, 4), (4, 4), (3, 5)])
def test_generic_pricer_matches_table4_on_torus(i, j):
    net = Network.torus(i, j, TL, TB)
    rows, cols = _rows(i, j), _cols(i, j)
    # 2D-torus (S=1): all rows on all of D, then all columns on all of D
    torus = schedule_seconds(net, [[(r, D) for r in rows], [(c, D) for c in cols]])
    assert torus == approx(cm.torus_2d(D, j, i, TL, TB).total)
    # 2D-mesh (S=2): rows on block 0 with columns on block 1, then swapped
    step = [(r, D / 2) for r in rows] + [(c, D / 2) for c in cols]
    assert schedule_seconds(net, [step, step]) == approx(cm.mesh_2d(D, i, j, TL, TB).total)


def test_generic_pricer_double_ring_and_plain_ring():
    net = Network.torus(3, 3, TL, TB)
    ham1 = (0, 1, 2, 5, 4, 7, 8, 6, 3)
    ham2 = (0, 6, 7, 1, 4, 3, 5, 8, 2)
    assert not ({frozenset(p) for p in zip(ham1, ham1[1:] + ham1[:1])}
                & {frozenset(p) for p in zip(ham2, ham2[1:] + ham2[:1])})
    assert step_seconds(net, [(ham1, D / 2), (ham2, D / 2)]) == approx(cm.double_ring(D, 9, TL, TB).total)
    assert cm.ring_seconds(net, ham1, D) == approx(cm.ring_allreduce(D, 9, TL, TB).total)


def test_ring_over_missing_link_is_an_error():
    net = Network.torus(3, 3, TL, TB)
    with pytest.raises(ValueError, match="does not connect"):
        cm.ring_seconds(net, (0, 4, 8), D)
    with pytest.raises(ValueError, match="twice"):
        cm.ring_seconds(net, (0, 1, 0), D)


# ---------------------------------------------------------------- shared NICs and uplinks

MBIT = 1e6


def test_rings_sharing_a_nic_split_its_rate():
    net = Network.switched([100 * MBIT] * 6)
    a, b = (0, 1, 2), (3, 4, 5)
    alone = cm.ring_seconds(net, a, 6e6)
    # 2 rounds * 2 chunk transfers of 2 MB at 12.5 MB/s
    assert alone == approx(2 * 2 * (2e6 / 12.5e6))
    # device-disjoint rings do not share anything
    assert step_seconds(net, [(a, 6e6), (b, 6e6)]) == approx(alone)
    # two rings through the same three hosts (S = 2) each get half of every NIC
    assert step_seconds(net, [(a, 6e6), ((0, 2, 1), 6e6)]) == approx(2 * alone)


def test_uplinks_shared_by_rack_crossing_hops():
    rack_of = [0, 0, 0, 1, 1, 1]
    net = Network.switched([100 * MBIT] * 6, rack_of=rack_of, uplink_bps={0: 100 * MBIT, 1: 100 * MBIT})
    interleaved = (0, 3, 1, 4, 2, 5)  # every hop crosses: 3 hops share each uplink direction
    rack_aware = (0, 1, 2, 3, 4, 5)  # two crossings, one per direction
    t_i = cm.ring_seconds(net, interleaved, 6e6)
    t_a = cm.ring_seconds(net, rack_aware, 6e6)
    assert t_i == approx(3 * t_a)


def test_switched_latency_and_failed_pairs():
    net = Network.switched([1e9] * 3, latency_s=0.01, failed=[(0, 2)])
    assert not net.connected(2, 0)
    assert net.connected(0, 1)
    # latency-bound: 2 rounds * (10 ms + tiny)
    assert cm.ring_seconds(net, (0, 1), 0) == approx(2 * 0.01)


def test_network_validation():
    with pytest.raises(ValueError, match="distinct devices"):
        Network(2, {(0, 0): Link(0, 0)})
    with pytest.raises(ValueError, match="undeclared resources"):
        Network(2, {(0, 1): Link(0, 0)}, {}, {(0, 1): ("nic",)})
    with pytest.raises(ValueError, match="positive rate"):
        Network(2, {(0, 1): Link(0, 0)}, {"nic": 0.0})
    with pytest.raises(ValueError, match="finite"):
        Link(-1.0, 0.0)
    with pytest.raises(ValueError, match="at least one block"):
        cm.block_sizes(10, 0)


def test_block_sizes_cover_the_data():
    assert cm.block_sizes(10, 3) == [4, 3, 3]
    assert sum(cm.block_sizes(123457, 7)) == 123457


def test_network_helpers():
    net = Network.torus(2, 4, 1.0, 0.0)
    assert net.max_degree() == 3
    assert net.neighbours(1) == [0, 2, 5]
    cut = net.without(links=[(1, 5)], devices=[7])
    assert not cut.connected(1, 5) and not cut.connected(6, 7) and cut.connected(1, 2)


# ---------------------------------------------------------------- properties

rings = st.lists(st.integers(0, 7), min_size=2, max_size=8, unique=True)


@settings(max_examples=60, deadline=None)
@given(ring=rings, nbytes=st.floats(0, 1e9), extra=st.floats(0, 1e9), alpha=st.floats(0, 1), beta=st.floats(0, 1e-6))
def test_ring_time_grows_with_bytes_and_is_alpha_beta(ring, nbytes, extra, alpha, beta):
    net = Network.full_mesh(8, alpha, beta)
    t = cm.ring_seconds(net, ring, nbytes)
    assert t <= cm.ring_seconds(net, ring, nbytes + extra) * (1 + 1e-12) + 1e-300
    f = len(ring)
    assert t == pytest.approx(2 * (f - 1) * (alpha + beta * nbytes / f), rel=1e-9, abs=1e-300)


@settings(max_examples=60, deadline=None)
@given(a=rings, b=rings, nbytes=st.floats(1, 1e9), rates=st.lists(st.floats(1e6, 1e10), min_size=8, max_size=8))
def test_sharing_never_speeds_a_ring_up(a, b, nbytes, rates):
    net = Network.switched(rates)
    together = step_seconds(net, [(a, nbytes), (b, nbytes)])
    assert together >= cm.ring_seconds(net, a, nbytes) * (1 - 1e-12)
    assert together >= cm.ring_seconds(net, b, nbytes) * (1 - 1e-12)
    # at most twice as slow: every resource is shared by at most two hops
    assert together <= 2 * max(cm.ring_seconds(net, a, nbytes), cm.ring_seconds(net, b, nbytes)) * (1 + 1e-12)
