"""Training with partial gradients must never diverge (issue 7): aggregation, optimizer and guard.

Deterministic and in-memory: the aggregator and optimizer on hand-made
contributions, properties of error feedback over random bubbles, and a whole
in-memory job (``tests/ps_helpers``) with a worker that sends NaN.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp_ps.aggregate import Aggregator, feedback_ranges, intersect_ranges, merge_ranges
from ltp_ps.optim import FlatOptimizer, NormGuard

from ps_helpers import make_job, run_job


# ---------------------------------------------------------------- aggregation
def test_elements_nobody_delivered_are_not_applied_and_keep_their_momentum():
    n = 40
    rng = np.random.default_rng(0)
    params = rng.standard_normal(n).astype(np.float32)
    ref = torch.nn.Parameter(torch.from_numpy(params.copy()))
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01)
    opt = FlatOptimizer(params, "sgd", lr=0.1, momentum=0.9, weight_decay=0.01)
    agg = Aggregator(n, "unbiased")
    # round 1: everything delivered; round 2: [10, 20) lost by both workers, [20, 25) by one
    for rnd, lost in enumerate(([], [(10, 20)]), start=1):
        g1, g2 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        agg.reset()
        agg.add(g1.copy(), lost)
        agg.add(g2.copy(), lost + ([(20, 25)] if lost else []))
        grad = agg.result()
        mask = agg.applied_mask()
        before_p = params.copy()
        before_m = None if rnd == 1 else opt.opt.state[opt.param]["momentum_buffer"].clone()
        opt.step(grad, mask=mask)
        if rnd == 1:
            assert mask is None
            ref.grad = torch.from_numpy((g1 + g2) / 2)
            ref_opt.step()
            np.testing.assert_allclose(params, ref.detach().numpy(), rtol=1e-6)
        else:
            assert agg.uncovered() == [(10, 20)]
            np.testing.assert_array_equal(params[10:20], before_p[10:20])  # not applied
            buf = opt.opt.state[opt.param]["momentum_buffer"]
            assert torch.equal(buf[10:20], before_m[10:20])  # momentum not decayed towards 0
            np.testing.assert_allclose(grad[20:25], g1[20:25], rtol=1e-6)  # one contributor: its own value
            assert not np.array_equal(params[:10], before_p[:10])


def test_adam_state_untouched_outside_the_mask():
    params = np.ones(8, np.float32)
    opt = FlatOptimizer(params, "adam", lr=0.01)
    mask = np.array([1, 1, 1, 1, 0, 0, 0, 0], bool)
    opt.step(np.ones(8, np.float32), mask=mask)
    st_ = opt.opt.state[opt.param]
    assert torch.all(st_["exp_avg"][4:] == 0) and torch.all(st_["exp_avg_sq"][4:] == 0)
    np.testing.assert_array_equal(params[4:], 1.0)
    assert np.all(params[:4] < 1.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_contribution_is_refused_whole(bad):
    agg = Aggregator(10, "unbiased")
    good = np.arange(10, dtype=np.float32)
    poisoned = np.ones(10, np.float32)
    poisoned[3] = bad
    assert agg.add(good.copy()) is True
    assert agg.add(poisoned) is False
    assert agg.rejected == 1 and agg.contributors == 1
    np.testing.assert_array_equal(agg.result(), good)
    # garbage inside a range the worker did not deliver is ignored (it is zero-filled anyway)
    agg.reset()
    poisoned2 = np.ones(10, np.float32)
    poisoned2[3] = bad
    assert agg.add(poisoned2, [(2, 5)]) is True and agg.rejected == 0
    assert np.isfinite(agg.result()).all()


def test_unbiased_mean_needs_a_contributor_and_zero_fill_counts_lost_as_zero():
    a = Aggregator(6, "zero_fill")
    a.add(np.full(6, 2.0, np.float32), [(0, 3)])
    a.add(np.full(6, 4.0, np.float32), [(0, 2)])
    np.testing.assert_allclose(a.result(), [0, 0, 2, 3, 3, 3])
    assert a.uncovered() == [(0, 2)]
    u = Aggregator(6, "unbiased")
    u.add(np.full(6, 2.0, np.float32), [(0, 3)])
    u.add(np.full(6, 4.0, np.float32), [(0, 2)])
    np.testing.assert_allclose(u.result(), [0, 0, 4, 3, 3, 3])


# ---------------------------------------------------------------- error feedback
def test_feedback_ranges_by_mode():
    assert feedback_ranges("zero_fill", [(5, 9), (0, 2)], []) == [(0, 2), (5, 9)]
    assert feedback_ranges("unbiased", [(0, 10)], [(3, 4), (8, 20)]) == [(3, 4), (8, 10)]
    assert feedback_ranges("unbiased", [(0, 10)], []) == []
    assert intersect_ranges([(0, 5), (7, 9)], [(4, 8)]) == [(4, 5), (7, 8)]


ranges_st = st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)).map(lambda t: (min(t), max(t))),
                     max_size=4)


@settings(max_examples=200, deadline=None)
@given(mode=st.sampled_from(["unbiased", "zero_fill"]),
       lost=st.lists(ranges_st, min_size=3, max_size=3), seed=st.integers(0, 2 ** 16))
def test_property_error_feedback_never_double_counts(mode, lost, seed):
    """Two rounds, plain SGD with lr 1 and no momentum, workers use error feedback; the second round is
    delivered whole. The total applied per element must equal the mean of all gradients: with the
    zero-filled mean exactly; with the unbiased mean exactly where somebody delivered round 1, and the
    worker-mean of what was re-sent where nobody did (never a gradient counted twice)."""
    n, W = 30, 3
    rng = np.random.default_rng(seed)
    g1 = rng.standard_normal((W, n)).astype(np.float64)
    g2 = rng.standard_normal((W, n)).astype(np.float64)
    agg = Aggregator(n, mode)
    for w in range(W):
        agg.add(g1[w].astype(np.float32), merge_ranges(lost[w]))
    r1 = agg.result().astype(np.float64)
    mask = agg.applied_mask()
    applied1 = r1 if mask is None else np.where(mask, r1, 0.0)
    uncovered = agg.uncovered()
    resid = np.zeros((W, n))
    for w in range(W):
        for s, e in feedback_ranges(mode, merge_ranges(lost[w]), uncovered):
            resid[w, s:e] = g1[w, s:e]
    agg.reset()
    for w in range(W):
        agg.add((g2[w] + resid[w]).astype(np.float32))
    total = applied1 + agg.result().astype(np.float64)
    counts_lost = np.zeros(n, int)
    for w in range(W):
        for s, e in merge_ranges(lost[w]):
            counts_lost[s:e] += 1
    exact = g1.mean(0) + g2.mean(0)
    if mode == "zero_fill":
        np.testing.assert_allclose(total, exact, atol=1e-4)
    else:
        nobody = counts_lost == W
        np.testing.assert_allclose(total[nobody], exact[nobody], atol=1e-4)
        some = ~nobody
        delivered = np.ones((W, n), bool)
        for w in range(W):
            for s, e in merge_ranges(lost[w]):
                delivered[w, s:e] = False
        est = (g1 * delivered).sum(0)[some] / delivered.sum(0)[some]
        np.testing.assert_allclose(total[some], est + g2.mean(0)[some], atol=1e-4)


# ---------------------------------------------------------------- guard
def test_norm_guard_clips_spikes_to_factor_times_running_norm():
    g = NormGuard(factor=2.0, ema=0.5)
    x = np.ones(4, np.float32)
    assert g.apply(x) == 1.0 and g.avg == pytest.approx(2.0)
    spike = np.full(4, 10.0, np.float32)  # norm 20 > 2 x 2
    scale = g.apply(spike)
    assert scale == pytest.approx(0.2) and np.linalg.norm(spike) == pytest.approx(4.0)
    assert g.avg == pytest.approx(3.0) and g.clipped == 1  # the clipped norm enters the average
    off = NormGuard(factor=0)
    y = np.full(4, 1e6, np.float32)
    assert off.apply(y) == 1.0 and y[0] == 1e6
    m = np.array([1, 1, 0, 0], bool)
    h = NormGuard(2.0)
    h.apply(np.array([1, 1, 1e9, 1e9], np.float32), m)
    assert h.avg == pytest.approx(np.sqrt(2))


# ---------------------------------------------------------------- a whole job
class _PoisonOne:
    """Wrap a workload: worker ``rank`` returns a NaN gradient at its ``at``-th step."""

    def __init__(self, wl, rank, at):
        self._wl, self.rank, self.at, self.calls = wl, rank, at, {}

    def __getattr__(self, name):
        return getattr(self._wl, name)

    def compute(self, model, batch):
        grad, loss, n = self._wl.compute(model, batch)
        key = id(model)
        self.calls[key] = self.calls.get(key, 0) + 1
        if self.calls[key] == self.at and key == self._target:
            grad = grad.copy()
            grad[5] = np.nan
        return grad, loss, n


def test_job_survives_a_worker_that_sends_nan_and_lossy_rounds(tmp_path):
    from ps_helpers import workload

    wl = _PoisonOne(workload(), rank=0, at=3)
    job = make_job(4, loss=0.05, epochs=3, lr=0.1, wl=wl, metrics_path=str(tmp_path / "m.jsonl"))
    wl._target = id(job.workers[0].model)
    summary, *_ = asyncio.run(run_job(job))
    ps = job.servers[0]
    assert np.isfinite(ps.params).all()
    rows = [r for r in ps.metrics.rows if r.get("event") == "iteration"]
    assert sum(r["rejected"] for r in rows) == 1
    assert summary["best_accuracy"] > 0.5  # it learned (chance is 0.1); 3 epochs are mid-training
