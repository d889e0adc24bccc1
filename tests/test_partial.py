"""Mergeable partial aggregates: exact unbiased mean through any merge order, wire codec."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ltp_ps.aggregate import Aggregator, merge_ranges
from ltp_ps.schedules.partial import (MAX_DEFICIT_RUNS, PARTIAL_HEADER_BYTES, Partial, PartialDecodeError,
                                      message_capacity)


def ranges_strategy(n):
    return st.lists(st.tuples(st.integers(0, n), st.integers(0, n)).map(lambda t: (min(t), max(t))), max_size=4)


def direct_mean(grads, losts, mode="unbiased"):
    agg = Aggregator(grads[0].size, mode)
    for g, l in zip(grads, losts):
        agg.add(g, merge_ranges(l))  # transports report disjoint ranges (bubbles_to_elements merges)
    return agg.result()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.data())
def test_any_merge_order_equals_direct_mean(workers, n, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 31)))
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(workers)]
    losts = [data.draw(ranges_strategy(n)) for _ in range(workers)]
    parts = [Partial.of_gradient(g, l) for g, l in zip(grads, losts)]
    order = data.draw(st.permutations(range(workers)))
    # a random binary tree of merges
    pool = [parts[i] for i in order]
    while len(pool) > 1:
        i = data.draw(st.integers(0, len(pool) - 2))
        a = pool.pop(i)
        b = pool.pop(i)
        a = a.copy()
        a.merge(b)
        pool.insert(i, a)
    for mode in ("unbiased", "zero_fill"):
        np.testing.assert_allclose(pool[0].mean(mode), direct_mean(grads, losts, mode), rtol=1e-5, atol=1e-6)
    assert pool[0].contributors == workers


def test_lost_in_transit_counts_like_a_lost_push():
    g = [np.arange(8, dtype=np.float32) + k for k in range(3)]
    a = Partial.of_gradient(g[0])
    b = Partial.of_gradient(g[1])
    b.merge(Partial.of_gradient(g[2]))
    a.merge(b, lost=[(2, 5)])  # the partial of workers 1+2 lost elements 2..4 on the way
    expect = direct_mean(g, [[], [(2, 5)], [(2, 5)]])
    np.testing.assert_allclose(a.mean(), expect)
    assert list(a.counts()) == [3, 3, 1, 1, 1, 3, 3, 3]


def test_element_nobody_delivered_is_zero():
    p = Partial.of_gradient(np.ones(4, np.float32), [(0, 2)])
    assert list(p.mean()) == [0, 0, 1, 1]
    assert list(Partial(3).mean()) == [0, 0, 0]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 50), st.data())
def test_wire_round_trip(workers, n, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 31)))
    p = Partial(n, lo=data.draw(st.integers(0, 1000)))
    for _ in range(workers):
        p.add_gradient(rng.standard_normal(n).astype(np.float32), data.draw(ranges_strategy(n)), samples=3, loss=0.5)
    buf = np.zeros(message_capacity(n), np.uint8)
    view = p.encode_into(buf, kind=5, origin=2, iteration=7)
    q = Partial.decode(bytes(view))
    assert (q.lo, q.n, q.contributors, q.samples) == (p.lo, p.n, p.contributors, p.samples)
    np.testing.assert_array_equal(q.sum, p.sum)
    np.testing.assert_array_equal(q.counts(), p.counts())


def test_decode_with_lost_payload_bytes_drops_those_elements():
    p = Partial.of_gradient(np.ones(10, np.float32))
    p.add_gradient(np.ones(10, np.float32))
    buf = np.zeros(message_capacity(10), np.uint8)
    view = bytearray(p.encode_into(buf, kind=5, origin=0, iteration=0))
    lo = PARTIAL_HEADER_BYTES + 4 * 3
    view[lo:lo + 8] = bytes(8)  # transport zero-fills elements 3, 4
    q = Partial.decode(view, lost_bytes=[(lo, lo + 8)])
    assert list(q.counts()) == [2, 2, 2, 0, 0, 2, 2, 2, 2, 2]
    assert list(q.mean()) == [1, 1, 1, 0, 0, 1, 1, 1, 1, 1]


def test_decode_refuses_lost_header_or_table():
    p = Partial.of_gradient(np.ones(4, np.float32), [(1, 2)])
    buf = np.zeros(message_capacity(4), np.uint8)
    view = bytes(p.encode_into(buf, kind=5, origin=0, iteration=0))
    with pytest.raises(PartialDecodeError):
        Partial.decode(view, lost_bytes=[(0, 8)])
    with pytest.raises(PartialDecodeError):
        Partial.decode(view, lost_bytes=[(len(view) - 8, len(view))])
    with pytest.raises(PartialDecodeError):
        Partial.decode(bytes(len(view)))
    assert Partial.critical_bytes(4, 1) == ((0, PARTIAL_HEADER_BYTES), (PARTIAL_HEADER_BYTES + 16, len(view)))


def test_table_overflow_coarsens_without_bias():
    n = 40
    g = np.arange(n, dtype=np.float32)
    p = Partial.of_gradient(g)
    p.add_gradient(g, [(i, i + 1) for i in range(0, n, 2)])  # 20 runs
    buf = np.zeros(message_capacity(n, 5), np.uint8)
    q = Partial.decode(bytes(p.encode_into(buf, kind=5, origin=0, iteration=0, max_runs=5)))
    c = q.counts()
    m = q.mean()
    # wherever anything is counted, the mean is exact; merged spans count 0 contributions
    ok = c > 0
    np.testing.assert_allclose(m[ok], g[ok])
    assert (m[~ok] == 0).all()
    assert len(q.deficit_runs()) <= 5
    assert MAX_DEFICIT_RUNS >= 1024


def test_merge_refuses_other_ranges():
    with pytest.raises(ValueError, match="slice first"):
        Partial(4).merge(Partial(4, lo=4))
    p = Partial.of_gradient(np.arange(8, dtype=np.float32), [(1, 3)])
    s = p.slice(2, 6)
    assert s.lo == 2 and list(s.counts()) == [0, 1, 1, 1]
