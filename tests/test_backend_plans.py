"""The collective algorithms of ltp_ps.collectives, executed on plain numpy arrays (no sockets, no torch)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp_ps import collectives as C


def simulate(plans: list, bufs: list, op=np.add) -> list:
    """Run per-rank step lists in lockstep; checks the matching invariant on the way."""
    world = len(plans)
    n_steps = {len(p) for p in plans}
    assert len(n_steps) == 1, f"ranks disagree on the number of steps: {n_steps}"
    bufs = [b.copy() for b in bufs]
    for s in range(n_steps.pop()):
        sent = {}
        for r in range(world):
            for t in plans[r][s].sends:
                key = (r, t.peer)
                assert key not in sent, f"step {s}: rank {r} sends twice to {t.peer} (tags would collide)"
                sent[key] = (t.lo, t.hi, bufs[r][t.lo:t.hi].copy())
        new = [b.copy() for b in bufs]
        for r in range(world):
            step = plans[r][s]
            got = {}
            for t in step.recvs:
                lo, hi, data = sent.pop((t.peer, r))
                assert (lo, hi) == (t.lo, t.hi), f"step {s}: {t.peer}->{r} sends {lo, hi}, receiver expects {t.lo, t.hi}"
                got.setdefault((t.lo, t.hi), []).append((t.peer, data))
            for (lo, hi), parts in got.items():
                if step.combine == C.COPY:
                    new[r][lo:hi] = parts[0][1]
                else:
                    parts.append((r, bufs[r][lo:hi].copy()))
                    parts.sort(key=lambda x: x[0])
                    acc = parts[0][1]
                    for _, d in parts[1:]:
                        acc = op(acc, d)
                    new[r][lo:hi] = acc
        assert not sent, f"step {s}: messages nobody receives: {sorted(sent)}"
        bufs = new
    return bufs


@pytest.mark.parametrize("algo", C.ALGORITHMS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [0, 1, 5, 64, 1001])
def test_allreduce_plans_sum_and_agree(algo, world, n):
    rng = np.random.default_rng(world * 1000 + n)
    bufs = [rng.integers(-50, 50, n).astype(np.float64) for _ in range(world)]
    out = simulate([C.allreduce_plan(algo, r, world, n) for r in range(world)], bufs)
    want = np.sum(bufs, axis=0) if n else np.zeros(0)
    for r in range(world):
        np.testing.assert_array_equal(out[r], want)


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 9), n=st.integers(0, 300), algo=st.sampled_from(C.ALGORITHMS), seed=st.integers(0, 9))
def test_allreduce_float_replicas_bit_identical(world, n, algo, seed):
    """Invariant 2: whatever the rounding, every rank ends with the same bits."""
    rng = np.random.default_rng(seed)
    bufs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    out = simulate([C.allreduce_plan(algo, r, world, n) for r in range(world)], bufs)
    for r in range(1, world):
        assert out[r].tobytes() == out[0].tobytes()
    if n:
        np.testing.assert_allclose(out[0], np.sum(np.array(bufs, np.float64), axis=0), rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 20), min_size=1, max_size=8), algo=st.sampled_from(C.ALGORITHMS))
def test_reduce_scatter_and_allgather_uneven_chunks(sizes, algo):
    world = len(sizes)
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    n = bounds[-1]
    bufs = [np.arange(n, dtype=np.int64) * (r + 1) for r in range(world)]
    rs = simulate([C.reduce_scatter_plan(algo, r, world, bounds) for r in range(world)], bufs)
    total = np.sum(bufs, axis=0)
    for r in range(world):
        np.testing.assert_array_equal(rs[r][bounds[r]:bounds[r + 1]], total[bounds[r]:bounds[r + 1]])
    start = [np.where((np.arange(n) >= bounds[r]) & (np.arange(n) < bounds[r + 1]), total, -1) for r in range(world)]
    ag = simulate([C.allgather_plan(algo, r, world, bounds) for r in range(world)], start)
    for r in range(world):
        np.testing.assert_array_equal(ag[r], total)


def test_max_and_min_fold():
    bufs = [np.array([3.0, -1.0, 7.0]), np.array([5.0, -4.0, 0.0]), np.array([1.0, 2.0, 9.0])]
    for algo in C.ALGORITHMS:
        out = simulate([C.allreduce_plan(algo, r, 3, 3) for r in range(3)], bufs, op=np.maximum)
        for o in out:
            np.testing.assert_array_equal(o, [5.0, 2.0, 9.0])


def test_chunk_bounds_and_default_algorithm():
    assert C.chunk_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert C.chunk_bounds(2, 4) == [0, 1, 2, 2, 2]
    with pytest.raises(ValueError):
        C.chunk_bounds(5, 0)
    assert C.default_algorithm(1, 10 ** 9) == "direct"
    assert C.default_algorithm(4, C.RING_MIN_BYTES - 1) == "direct"
    assert C.default_algorithm(4, C.RING_MIN_BYTES) == "ring"


def test_ring_link_load_is_bandwidth_optimal():
    """Each rank sends 2 (w-1)/w of the buffer in the ring, (w-1) x it at the direct root."""
    world, n = 4, 1000
    ring = sum(t.hi - t.lo for s in C.ring_allreduce(1, world, n) for t in s.sends)
    assert ring == 2 * (world - 1) * n // world
    root = sum(t.hi - t.lo for s in C.direct_allreduce(0, world, n) for t in s.sends)
    assert root == (world - 1) * n


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="rank 4 out of range"):
        C.ring_allreduce(4, 4, 10)
    with pytest.raises(ValueError, match="unknown all-reduce algorithm"):
        C.allreduce_plan("tree", 0, 2, 10)
    with pytest.raises(ValueError, match="chunk bounds"):
        C.ring_reduce_scatter(0, 3, [0, 1, 2])
