"""Program-driven (tree) PS rounds go through the direct PS's health checks (in memory).

A tree gives the PS only partial sums, so it judges what it can see: its own
transfers with its tree children (failed sends drop a child, missing partials
are "missed" then dropped, dropped children are excluded), and every round's
update (non-finite loss, ``max_missed`` rounds in a row without an applied
update, a model at chance accuracy at the end).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from ltp_ps.errors import TrainingFailed
from ltp_ps.membership import State
from ps_helpers import rat_job, run_rat_job, workload

pytestmark = pytest.mark.timeout(120)


class _BadGradient:
    """A workload whose gradients from ``ranks`` carry a NaN while the loss stays finite (a corrupted buffer)."""

    def __init__(self, wl, bad_calls):
        self._wl, self._bad, self.calls = wl, bad_calls, 0

    def __getattr__(self, name):
        return getattr(self._wl, name)

    def compute(self, model, batch):
        grad, loss, samples = self._wl.compute(model, batch)
        self.calls += 1
        if self._bad(self.calls):
            grad = np.array(grad, np.float32)
            grad[3] = np.nan
        return grad, loss, samples


def tree_job(n_workers, **kw):
    """One shard, no board: nothing can repair the trees (``test_tree_views`` has the repair)."""
    (ps,), workers, _ = rat_job(n_workers, board=False, **kw)
    return ps, workers


async def _run(ps, workers):
    return await run_rat_job([ps], workers, crash_closes=False)


def _children(ps):
    prog = ps.planner.plan(0).program(ps.node)
    return sorted({int(s.peer.split(":")[1]) for s in prog.steps() if s.op == "send"})


async def test_rounds_whose_aggregate_is_never_finite_fail_the_job():
    # Every gradient of worker 1 carries a NaN, loss finite: the tree's sum is NaN every round, nothing is applied.
    # Without the health check the job ran all 60 rounds, applied nothing and returned a summary.
    wl = _BadGradient(workload(), lambda k: True)
    ps, workers = tree_job(3, wl=wl, iterations=60, lr=0.1, max_missed=3, evaluate=False,
                           worker_kw={"pull_timeout_s": 5.0})
    res = await asyncio.wait_for(_run(ps, workers), 60)
    assert isinstance(res[0], TrainingFailed), res[0]
    assert "no usable gradient" in str(res[0]) and "aggregate not finite" in str(res[0])
    assert ps.iteration == 3 and ps.version == 0
    assert all(isinstance(r, dict) and r["stopped"] for r in res[1:])  # told to stop, none left waiting


async def test_a_dead_tree_child_is_dropped_excluded_and_the_job_fails_instead_of_waiting():
    # no tree-view board here (the roles' default in memory): nothing can repair the tree, so the job must fail
    # rather than wait; with a board (every ltp-ps job) the trees are rebuilt without it (test_tree_views)
    ps, workers = tree_job(3, iterations=400, lr=0.1, max_missed=2, gather_timeout_s=0.3, broadcast_timeout_s=0.3,
                           join_timeout_s=0.5, worker_kw={"pull_timeout_s": 3.0})
    child = _children(ps)[0]
    workers[child].cfg.max_iterations = 4  # the PS's tree child exits after 4 rounds, its subtree starves
    t0 = time.monotonic()
    res = await asyncio.wait_for(_run(ps, workers), 60)
    assert isinstance(res[0], TrainingFailed), res[0]
    assert ps.membership.members[child].state is State.DROPPED
    drops = [r for r in ps.metrics.rows if r["event"] == "dropped"]
    assert drops and drops[0]["rank"] == child and "no partial within" in drops[0]["reason"]
    assert any(f"dropped worker {child}" in line for line in ps.logs)
    assert ps.iteration < 12 and time.monotonic() - t0 < 30


async def test_tree_job_at_chance_accuracy_fails_at_the_end():
    ps, workers = tree_job(2, epochs=3, lr=1e9)
    res = await asyncio.wait_for(_run(ps, workers), 90)
    assert isinstance(res[0], TrainingFailed) and "at chance" in str(res[0]), res[0]
    assert all(isinstance(r, dict) and r["stopped"] for r in res[1:])
