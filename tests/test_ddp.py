"""The DDP hook's round protocol: policy (pure), mean, warnings, PS and workers over the memory transport."""

from __future__ import annotations

import asyncio
import time
import warnings

import numpy as np
import pytest

from ltp_ps import ddp as D
from ltp_ps.backend import LtpBackendError
from ltp_ps.errors import ConfigError
from ltp_ps.transport import MemoryNetwork
from ltp_ps.transport.base import COMPLETE, EARLY, RecvReport, missing_report

pytestmark = pytest.mark.torch

N = 1000
TOTAL = D.HDR + D.ELEM * N


def rep(bubbles=(), critical=True, received=None):
    lost = sum(e - s for s, e in bubbles)
    got = TOTAL - lost if received is None else received
    return RecvReport(peer=("p", 1), tag=0, total_bytes=TOTAL, received_bytes=got, delivered_fraction=got / TOTAL,
                      bubbles=tuple(bubbles), critical_complete=critical, regime=EARLY if bubbles else COMPLETE)


def hdr(rank, rnd=3, n=N, loss=0.01):
    return (rank, rnd, 7, n, loss)


# --- RoundPolicy -----------------------------------------------------------------------------------------------


def test_policy_rules_in_order():
    p = D.RoundPolicy(0.8)
    hole = [(D.HDR + 400, D.HDR + 800)]  # 100 elements lost in the middle
    reps = [rep(), missing_report(("p", 1), 0, TOTAL), rep(critical=False, bubbles=hole), rep(bubbles=hole),
            rep(bubbles=[(D.HDR + 3000, TOTAL)]), rep(bubbles=[(D.HDR, D.HDR + 1600)]), rep(bubbles=hole),
            rep()]
    heads = [hdr(0), None, hdr(2), hdr(3), hdr(4), hdr(5), hdr(6, loss=0.0), hdr(7, rnd=2)]
    v = p.decide(3, N, reps, heads)
    assert [x.action for x in v] == [D.ACCEPT_FULL, D.REPAIR, D.REPAIR, D.ACCEPT_LOSSY, D.REPAIR, D.REPAIR,
                                     D.REPAIR, D.REPAIR]
    assert "nothing arrived" in v[1].reason
    assert "critical" in v[2].reason
    assert v[3].lost == ((100, 200),)
    assert "only the tail" in v[4].reason and v[4].reason.startswith("cut at")
    assert "< 80%" in v[5].reason
    assert "lost no packet" in v[6].reason  # holes, but the sender saw no loss: not a lossy link
    assert "another round" in v[7].reason


def test_policy_never_averages_an_element_over_zero_ranks():
    p = D.RoundPolicy(0.5)
    a, b = [(D.HDR + 0, D.HDR + 400)], [(D.HDR + 200, D.HDR + 600)]  # elements 50..100 lost by both
    v = p.decide(0, N, [rep(bubbles=a), rep(bubbles=b)], [hdr(0, 0), hdr(1, 0)])
    assert [x.action for x in v] == [D.REPAIR, D.REPAIR]
    assert "no accepted contribution" in v[0].reason
    c = [(D.HDR + 2000, D.HDR + 2400)]  # disjoint losses: every element has a contributor
    v = p.decide(0, N, [rep(bubbles=a), rep(bubbles=c)], [hdr(0, 0), hdr(1, 0)])
    assert [x.action for x in v] == [D.ACCEPT_LOSSY, D.ACCEPT_LOSSY]


def test_policy_min_fraction_one_means_exact_and_bad_values_raise():
    v = D.RoundPolicy(1.0).decide(3, N, [rep(bubbles=[(D.HDR + 400, D.HDR + 404)])], [hdr(0)])
    assert v[0].action == D.REPAIR
    with pytest.raises(ConfigError, match="min_fraction"):
        D.RoundPolicy(1.5)


def test_mean_of_unbiased_per_element_and_nan_propagates():
    g = [np.arange(6, dtype=np.float32), np.full(6, 10, np.float32), np.full(6, 4, np.float32)]
    out = np.empty(6, np.float32)
    D.mean_of(g, [[], [(0, 2)], []], 6, out)
    want = np.array([(0 + 4) / 2, (1 + 4) / 2, (2 + 10 + 4) / 3, (3 + 14) / 3, (4 + 14) / 3, (5 + 14) / 3], np.float32)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    D.mean_of(g, [[], [], []], 6, out)
    np.testing.assert_allclose(out, (g[0] + g[1] + g[2]) / 3, rtol=1e-6)
    g[1][3] = np.nan
    D.mean_of(g, [[], [], []], 6, out)
    assert np.isnan(out[3]) and np.isfinite(out[2])  # like allreduce: a NaN gradient is not hidden


def test_rate_limited_warner():
    now = [0.0]
    w = D.RateLimitedWarner(30.0, clock=lambda: now[0])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert w.warn("k", "first")
        assert not w.warn("k", "second")
        assert not w.warn("k", "third")
        assert w.warn("other", "other key")
        now[0] = 31.0
        assert w.warn("k", "fourth")
    msgs = [str(r.message) for r in rec]
    assert msgs[0] == "ltp_ps.ddp: first" and msgs[1] == "ltp_ps.ddp: other key"
    assert "fourth (2 similar warnings suppressed" in msgs[2]
    assert all(r.category is RuntimeWarning for r in rec)


# --- the exchange, PS and workers on the memory transport ----------------------------------------------------


def run_rounds(world, grads_per_round, *, loss=0.0, min_fraction=D.MIN_FRACTION, timeout_s=2.0, seed=0,
               silent_rank=None, sizes=None, segment_size=256):
    """Run rounds of the hook protocol; returns (per-rank results or exceptions per round, states, server)."""

    async def main():
        net = MemoryNetwork(loss=loss, seed=seed, segment_size=segment_size)
        ps_t = net.endpoint()
        eps = [net.endpoint() for _ in range(world)]
        n_max = max(len(g[0]) for g in grads_per_round)
        server = D.BucketServer(ps_t, [e.local_addr for e in eps], n_max, min_fraction=min_fraction,
                                gather_timeout_s=timeout_s)
        task = asyncio.ensure_future(server.serve_forever())
        states = [D.LtpHookState(r, world, "memory", n_max, timeout_s, transport=eps[r], ps_addr=ps_t.local_addr)
                  for r in range(world)]
        results = []
        for rnd, grads in enumerate(grads_per_round):
            async def one(r):
                if r == silent_rank:
                    return None
                g = grads[r] if sizes is None else grads[r][:sizes[r]]
                crit = [(0, D.HDR), (D.HDR, D.HDR + 4)]
                return await states[r].exchange(rnd, 0, g, crit)

            results.append(await asyncio.gather(*(one(r) for r in range(world)), return_exceptions=True))
        task.cancel()
        return results, states, server

    return asyncio.run(main())


def test_no_loss_every_round_full_and_exact():
    rng = np.random.default_rng(0)
    rounds = [[rng.standard_normal(500).astype(np.float32) for _ in range(3)] for _ in range(4)]
    res, states, server = run_rounds(3, rounds)
    for grads, got in zip(rounds, res):
        want = (grads[0] + grads[1] + grads[2]) / np.float32(3)
        for g in got:
            np.testing.assert_array_equal(g, want)
    for s in states:
        assert s.stats.rounds == 4 and s.stats.full_rounds == 4 and s.stats.repaired_rounds == 0
    assert server.delivered == [[1.0] * 3] * 4


def test_lossy_path_accepts_partial_buckets_and_warns():
    rng = np.random.default_rng(1)
    rounds = [[rng.standard_normal(4000).astype(np.float32) for _ in range(2)] for _ in range(6)]
    with pytest.warns(RuntimeWarning, match="partially delivered|reliable resend"):
        res, states, server = run_rounds(2, rounds, loss=0.01, seed=3)
    s = states[0].stats
    assert s.rounds == 6 and s.lossy_rounds + s.repaired_rounds >= 1
    assert s.lossy_rounds >= 1, s  # after the first loss, the senders' loss evidence lets holes through
    for grads, got in zip(rounds, res):
        np.testing.assert_array_equal(got[0], got[1])  # every rank applies the same bucket
        full = (grads[0] + grads[1]) / np.float32(2)
        close = np.isclose(got[0], full, rtol=1e-6)
        assert close.mean() > 0.9  # where one rank's element was lost, the other rank's value is the estimate
        assert not np.any(got[0][~close] == 0) or np.all(full[~close] == 0)


def test_min_fraction_one_gives_exact_buckets_under_loss():
    rng = np.random.default_rng(2)
    rounds = [[rng.standard_normal(4000).astype(np.float32) for _ in range(3)] for _ in range(3)]
    res, states, _ = run_rounds(3, rounds, loss=0.02, min_fraction=1.0, seed=5)
    for grads, got in zip(rounds, res):
        want = (grads[0] + grads[1] + grads[2]) / np.float32(3)
        for g in got:
            np.testing.assert_array_equal(g, want)
    assert states[0].stats.repaired_rounds == 3 and states[0].stats.lossy_rounds == 0
    assert sum(s.stats.resent_by_me for s in states) >= 3


def test_total_loss_of_a_bucket_is_repaired_not_zeroed():
    """Every non-critical segment lost: the bucket is resent reliably, never averaged as zeros."""
    grads = [[np.full(2000, 1.0 + r, np.float32) for r in range(2)]]
    res, states, _ = run_rounds(2, grads, loss=1.0)
    for g in res[0]:
        np.testing.assert_array_equal(g, np.full(2000, 1.5, np.float32))
    assert states[0].stats.repaired_contributions == 2


def test_silent_rank_ends_the_round_with_a_named_error_for_everyone():
    grads = [[np.ones(100, np.float32) for _ in range(3)]]
    t0 = time.monotonic()
    res, states, _ = run_rounds(3, grads, timeout_s=0.5, silent_rank=2)
    took = time.monotonic() - t0
    assert took < 0.5 * D.REPLY_WAIT_TIMEOUTS + 1.0
    for r in (0, 1):
        err = res[0][r]
        assert isinstance(err, LtpBackendError), err
        msg = str(err)
        assert f"rank {r}: bucket 0 round 0" in msg and "[2]" in msg and "dead or stuck" in msg
        assert states[r].stats.errors == 1


def test_layout_disagreement_is_an_error_not_a_hang():
    grads = [[np.ones(100, np.float32), np.ones(100, np.float32)]]
    res, _, _ = run_rounds(2, grads, sizes=[100, 60], timeout_s=1.0)
    for r in (0, 1):
        assert isinstance(res[0][r], LtpBackendError)
        assert "disagree on the bucket layout" in str(res[0][r])
